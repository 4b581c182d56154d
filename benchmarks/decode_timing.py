"""Timing a decode step or cycle, and the bytes it must read: what `benchmarks.decode` and
`benchmarks.decode_batch` measure a loop against."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from benchmarks.common import median, time_calls
from dflash_train.models import DFlashConfig, DFlashDraftModel
from dflash_train.runtime.engine import DecodeEngine
from dflash_train.target import TargetModel

COPY_BANDWIDTH = 4.3e12  # H200 measured copy bandwidth, bytes/s (docs/design.md §10)


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def time_ms(fn: Callable[[], Any], device: torch.device, warmup: int, iters: int) -> float:
    """Median milliseconds per call (CUDA events on GPU, wall clock on CPU)."""
    return median(time_calls(fn, device, warmup, iters))


def random_draft(target: TargetModel, layers: int, block_size: int, mask_token_id: int) -> DFlashDraftModel:
    config = DFlashConfig.from_target_config(target.config, mask_token_id=mask_token_id, num_hidden_layers=layers,
                                             block_size=block_size)
    torch.manual_seed(1)
    # Built in the target dtype directly: `.to(bfloat16)` would also round the RoPE frequencies.
    with torch.device(target.device), default_dtype(target.dtype):
        return DFlashDraftModel(config).eval()


def weight_bytes_per_step(target: TargetModel) -> int:
    """Bytes a decode step reads: every weight except the input embedding (one row of it is read)."""
    embed = target.embed_tokens.weight
    total = sum(p.numel() * p.element_size() for p in target.model.parameters())
    return total if target.embeddings_tied else total - embed.numel() * embed.element_size()


def draft_bytes_per_cycle(target: TargetModel, draft: DFlashDraftModel) -> int:
    """Bytes a DFlash cycle reads beyond a verify step's: the drafter's own weights (its layers, the context
    fusion and norms; it borrows the target's embedding and head) and the target's head again, for the drafts'
    logits. With the step's, the floor of a cycle: what a cycle costs over a step at equal bandwidth."""
    head = target.model.get_output_embeddings().weight
    return sum(p.numel() * p.element_size() for p in draft.parameters()) + head.numel() * head.element_size()


def engine_step_ms(engine: DecodeEngine, prompt: list[int], warmup: int, iters: int,
                   setup: dict[str, float] | None = None) -> float:
    """One replayed cycle of `engine` with a request in flight at the prompt's end in each of its rows;
    `setup["seconds"]` gets the wall time to the end of the first cycle (compilation and graph capture
    included)."""
    start = time.perf_counter()
    engine.prepare()
    rows = engine.config.batch_size
    engine.prefill(list(range(rows)), [prompt] * rows)
    engine.step()
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)
    if setup is not None:
        setup["seconds"] = time.perf_counter() - start
    return time_ms(engine.step, engine.device, warmup, iters)


# Cycles queued back to back in the queued timing: the decode loop keeps the GPU fed the same way, reading a
# row's finished flag `EngineConfig.lookahead` cycles late, so a replay's launch latency hides behind the work.
QUEUED = 8


def queued_step_ms(engine: DecodeEngine, warmup: int, iters: int, depth: int = QUEUED) -> float:
    """Milliseconds a cycle with `depth` cycles queued between two events: the GPU's time per cycle as the decode
    loop sees it. `engine_step_ms` waits for each cycle, so it includes the host's launch latency too."""
    def burst() -> None:
        for _ in range(depth):
            engine.step()

    return time_ms(burst, engine.device, max(1, warmup // depth), max(3, iters // depth)) / depth


def hf_step_ms(target: TargetModel, prompt: list[int], warmup: int, iters: int) -> float:
    """A Hugging Face decode step: dynamic cache, eager, cropped back after each step."""
    from transformers import DynamicCache

    from dflash_train.runtime.hf_cache import cache_kwargs, rollback

    cache = DynamicCache()
    kwargs = cache_kwargs(target.model, cache)
    with torch.inference_mode():
        target.model(torch.tensor([prompt], device=target.device), **kwargs)
        token = torch.tensor([[prompt[-1]]], device=target.device)
        position = torch.tensor([[len(prompt)]], device=target.device)

        def step() -> None:
            target.model(token, position_ids=position, **kwargs)
            rollback(cache, len(prompt))

        return time_ms(step, target.device, warmup, iters)
