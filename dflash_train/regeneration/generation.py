"""Regeneration: the runtime without a drafter, and Hugging Face `generate` for targets it does not run.

`Generator.submit` queues a group of prompts (an output shard's, say) and returns a call that waits for
their completions. Groups submitted before that call are decoded together, `batch_size` rows at once, and a
row that finishes takes the next waiting prompt, so the batch stays full while a group's slowest answers
finish. Each prompt draws from its own seed, so what it generates does not depend on the group, row or batch
size it runs with. Outside the runtime's architectures the group goes through `generate` as one left-padded
batch (correct, slower; its sampled draws then depend on the group's first seed).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from dflash_train.runtime.config import EngineConfig
from dflash_train.runtime.engine import DecodeEngine, RunStats
from dflash_train.runtime.state import RequestOutput
from dflash_train.runtime.static_target import model_type, supports
from dflash_train.target import TargetModel

logger = logging.getLogger(__name__)


@dataclass
class Generated:
    token_ids: list[int]  # the response, without its stop token
    finish_reason: str  # "stop", "length" or "loop" (EngineConfig.stop_loops)


def generated(output: RequestOutput) -> Generated:
    tokens = output.tokens[:-1] if output.finish_reason == "stop" else output.tokens
    return Generated(tokens, output.finish_reason)


class Generator:
    """Generates continuations of token-id prompts with a frozen target (greedy or sampled)."""

    def __init__(self, target: TargetModel, config: EngineConfig, pad_id: int = 0) -> None:
        self.target, self.config, self.pad_id = target, config, pad_id
        self.engine = DecodeEngine(target, None, config) if supports(target) else None
        if self.engine is None:
            logger.warning("The static-cache runtime does not run %r targets: regenerating through Hugging Face "
                           "generate, one left-padded batch per group (exact, slower; docs/architectures.md).",
                           model_type(target))
        self.stats = RunStats()

    def submit(self, prompts: Sequence[Sequence[int]], seeds: Sequence[int]) -> Callable[[], list[Generated]]:
        """Queue `prompts` with one seed each; the returned call decodes until they are all done."""
        if self.engine is None:
            first_seed = seeds[0] if seeds else 0
            return lambda: hf_generate(self.target.model, prompts, self.config, first_seed, self.pad_id)
        engine, group = self.engine, self.engine.submit(prompts, seeds)
        return lambda: [generated(output) for output in engine.wait(group, self.stats)]

    def generate(self, prompts: Sequence[Sequence[int]], seeds: Sequence[int]) -> list[Generated]:
        return self.submit(prompts, seeds)()


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, prompt in enumerate(prompts):
        ids[i, width - len(prompt):] = torch.tensor(list(prompt), dtype=torch.long)
        mask[i, width - len(prompt):] = 1
    return ids.to(device), mask.to(device)


@torch.no_grad()
def hf_generate(model: nn.Module, prompts: Sequence[Sequence[int]], config: EngineConfig, seed: int = 0,
                pad_id: int = 0) -> list[Generated]:
    """The same contract through Hugging Face `generate`, one left-padded batch (the fallback, and the
    reference the runtime is tested and benchmarked against)."""
    device = next(model.parameters()).device
    ids, mask = left_pad(prompts, pad_id, device)
    generation_config = copy.deepcopy(model.generation_config)
    # An empty list, not None: no stop ids means none, not the model's own EOS that `generate` falls back to.
    settings = {"eos_token_id": list(config.stop_token_ids), "max_new_tokens": config.max_new_tokens,
                "pad_token_id": pad_id, "do_sample": False, "temperature": None, "top_k": None, "top_p": None}
    if config.temperature > 0:
        settings.update(do_sample=True, temperature=config.temperature, top_k=0, top_p=config.top_p)
    for name, value in settings.items():
        setattr(generation_config, name, value)
    torch.manual_seed(seed)
    out = model.generate(input_ids=ids, attention_mask=mask, generation_config=generation_config)[:, ids.shape[1]:]
    return [_split(row, config.stop_token_ids) for row in out.tolist()]


def _split(row: list[int], stop_ids: tuple[int, ...]) -> Generated:
    stop = next((i for i, token in enumerate(row) if token in stop_ids), None)
    return Generated(row, "length") if stop is None else Generated(row[:stop], "stop")
