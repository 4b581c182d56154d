"""The fast DFlash decode loop: static caches, decisions on the device, CUDA graphs, batched requests.

One cycle (all rows at once, shapes fixed; see `greedy.py` for the semantics it reproduces):

    positions = start + [0 .. B-1]                               [b, B]
    block     = [last_token, MASK x (B-1)] -> drafter -> [last_token, d_1 .. d_{B-1}]
    target    = static verify forward on the block (writes its K/V at `positions`)
    a, bonus  = greedy: fused argmax/compare/commit; sampling: speculative rejection sampling
    drafter context K/V <- target features of the B block positions (only the first a+1 become visible)
    state     : out += committed tokens, start += a + 1, stop/length checks -> done

Nothing in a cycle reads a value back to the host. On CUDA the whole cycle is captured once as a CUDA
graph and replayed; the host learns which rows finished through a copy of `done` that it reads
`lookahead` cycles later, so the GPU never waits for it. Finished rows are refilled with the next
prompts (batched prefill), so several requests stay in flight. Without a drafter (or with B = 1) the
same loop is plain target decoding: the baseline that lossless checks and speedups are measured against.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from dflash_train.eval.sampling import probabilities, sample, speculative_sample
from dflash_train.eval.state import DecodeState, RequestOutput
from dflash_train.eval.static_draft import StaticDrafter
from dflash_train.eval.static_target import StaticTarget
from dflash_train.kernels.greedy_verify import commit_tokens, greedy_verify_reference
from dflash_train.models import DFlashDraftModel
from dflash_train.target import TargetModel

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineConfig:
    batch_size: int = 1
    block_size: int = 16
    max_new_tokens: int = 128
    max_length: int = 2048  # positions held by the static caches: longest prompt + new tokens + block
    temperature: float = 0.0
    stop_token_ids: tuple[int, ...] = ()
    kernels: str = "auto"  # "triton", "torch", or "auto" (triton on CUDA when installed)
    cuda_graphs: bool = True  # used on CUDA only
    compile: bool | None = None  # torch.compile the cycle's target and drafter forwards; None: on CUDA only
    # inductor options for those compilations, e.g. (("freezing", True),): weights folded as constants, so
    # that inductor may concatenate the q/k/v and gate/up projections (a benchmark knob)
    compile_options: tuple[tuple[str, Any], ...] = ()
    lookahead: int = 2  # cycles queued before the host reads a finished-row flag


@dataclass
class RunStats:
    wall_s: float = 0.0
    prefill_s: float = 0.0
    cycles: int = 0
    new_tokens: int = 0

    @property
    def decode_tokens_per_s(self) -> float:
        return self.new_tokens / max(self.wall_s - self.prefill_s, 1e-9)


def resolve_kernels(kernels: str, device: torch.device) -> str:
    from dflash_train.kernels._triton import HAS_TRITON, interpreter_ready

    if kernels == "auto":
        return "triton" if device.type == "cuda" and HAS_TRITON else "torch"
    if kernels == "triton" and device.type != "cuda" and not interpreter_ready():
        raise ValueError("kernels='triton' on CPU needs TRITON_INTERPRET=1 set before start; use kernels='torch'")
    if kernels not in ("triton", "torch"):
        raise ValueError(f"kernels must be 'auto', 'triton' or 'torch', not {kernels!r}")
    return kernels


class DecodeEngine:
    def __init__(self, target: TargetModel, draft: DFlashDraftModel | None, config: EngineConfig,
                 runner: StaticTarget | None = None) -> None:
        self.target, self.config = target, config
        self.device = target.device
        self.block_size = config.block_size if draft is not None else 1
        self.kernels = resolve_kernels(config.kernels, self.device)
        uses_draft = draft is not None and self.block_size > 1
        self.layer_ids = list(draft.config.target_layer_ids) if uses_draft else []
        if runner is None or runner.batch_size != config.batch_size or runner.max_length < config.max_length:
            runner = StaticTarget(target, config.batch_size, config.max_length,
                                  attention="triton" if self.kernels == "triton" else "sdpa")
        self.runner = runner
        self.drafter = StaticDrafter(draft, config.batch_size, self.block_size, runner.max_length,
                                     self.kernels) if uses_draft else None
        self.state = DecodeState(config.batch_size, self.block_size, config.max_new_tokens,
                                 list(config.stop_token_ids), self.device)
        self.offsets = torch.arange(self.block_size, device=self.device)[None]
        mask_id = draft.config.mask_token_id if uses_draft else 0
        self.mask_block = torch.full((config.batch_size, self.block_size), mask_id, device=self.device)
        self._graph: torch.cuda.CUDAGraph | None = None
        self._prepared = False
        self.graph_error: str | None = None
        self.compile_error: str | None = None
        self._flag_ring: list[torch.Tensor] | None = None
        wants_compile = config.compile if config.compile is not None else self.device.type == "cuda"
        self._compile = bool(wants_compile)

    @property
    def uses_cuda_graph(self) -> bool:
        return self._graph is not None

    # ------------------------------------------------------------------ one cycle (no host sync inside)

    def _pick(self, logits: torch.Tensor) -> torch.Tensor:
        if self.config.temperature > 0:
            return sample(probabilities(logits, self.config.temperature))
        return logits.argmax(dim=-1)

    def _cycle(self) -> None:
        s = self.state
        positions = s.start[:, None] + self.offsets  # [b, B]
        s.block.copy_(self.mask_block)
        s.block[:, 0] = s.last_token
        draft_logits = None
        if self.drafter is not None:
            drafts, draft_logits = self._propose(positions)
            s.block[:, 1:] = drafts
        out = self.runner.forward(s.block, positions, feature_layer_ids=self.layer_ids, compiled=self._compile,
                                  compile_options=self.config.compile_options)
        if self.config.temperature > 0:
            accepted, bonus = speculative_sample(out.logits, draft_logits, s.block[:, 1:], self.config.temperature)
            commit_tokens(s.out, s.n_out, s.block, accepted, bonus, s.done)
            accept_len = accepted + 1
        else:
            accept_len, bonus = self._verify(out.logits, s.block, s.out, s.n_out, s.done)
        if self.drafter is not None:
            self.drafter.write_context(out.features, positions)
        s.advance(accept_len, bonus)

    def _propose(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Drafts [b, B-1] for the block in `state.block` at positions [b, B], and their logits [b, B-1, V]."""
        embeds = self.target.embed_tokens(self.state.block)
        hidden = self.drafter.hidden(embeds, positions, self.state.start, compiled=self._compile,
                                     compile_options=self.config.compile_options)  # [b, B, H]
        draft_logits = self.target.lm_head(hidden[:, 1:].to(self.target.dtype))  # [b, B-1, V]
        return self._pick(draft_logits), draft_logits

    def _verify(self, *args: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.kernels == "triton":
            from dflash_train.kernels.greedy_verify import greedy_verify_triton

            return greedy_verify_triton(*args)
        return greedy_verify_reference(*args)

    # ------------------------------------------------------------------ CUDA graph

    @property
    def uses_compile(self) -> bool:
        return self._compile

    @torch.no_grad()
    def prepare(self) -> None:
        """Warm up (compiles the Triton kernels and, if enabled, the torch.compile graphs) and, on CUDA,
        capture the cycle as a graph. Call before any request is in flight; `generate` calls it once."""
        self._prepared = True
        self.state.done.fill_(True)  # idle rows: the warm-up cycles change no state
        try:
            self._warm_up()
        except Exception as error:  # a compiler failure costs speed, not the evaluation
            if not self._compile:
                raise
            self.compile_error = f"{type(error).__name__}: {error}"
            self._recover_from_compile_error()
        if self.device.type == "cuda" and self.config.cuda_graphs:
            self._capture()

    def _recover_from_compile_error(self) -> None:
        """Retry compiled with SDPA in place of the split-key attention kernel, then uncompiled."""
        if self.runner.attention == "triton":
            logger.warning("torch.compile failed (%s); retrying with SDPA attention", self.compile_error)
            self.runner.attention = "sdpa"
            try:
                self._warm_up()
                return
            except Exception as error:
                self.compile_error += f"; with SDPA attention: {type(error).__name__}: {error}"
        logger.warning("torch.compile failed (%s); running the cycle uncompiled", self.compile_error)
        self._compile = False
        self._warm_up()

    def _warm_up(self) -> None:
        if self.device.type != "cuda":
            for _ in range(2 if self._compile else 1):
                self._cycle()
            return
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):
                self._cycle()
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()

    def _capture(self) -> None:
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                self._cycle()
            self._graph = graph
        except Exception as error:  # fall back to eager cycles rather than fail the evaluation
            self.graph_error = f"{type(error).__name__}: {error}"
            logger.warning("CUDA graph capture failed (%s); running eager cycles", self.graph_error)
            torch.cuda.synchronize()

    @torch.no_grad()
    def step(self) -> None:
        """One cycle for every row (a graph replay on CUDA); rows that are done stay unchanged."""
        if self._graph is not None:
            self._graph.replay()
        else:
            self._cycle()

    # ------------------------------------------------------------------ prefill and scheduling

    @torch.no_grad()
    def prefill(self, rows: Sequence[int], prompts: Sequence[Sequence[int]]) -> None:
        """Start `prompts` in cache rows `rows`: one batched forward, right-padded (padding sits after each
        prompt, so no prompt token sees it; its cache slots are overwritten before anything reads them)."""
        lengths = torch.tensor([len(p) for p in prompts], device=self.device)
        width = int(lengths.max())
        ids = torch.zeros(len(prompts), width, dtype=torch.long, device=self.device)
        for i, prompt in enumerate(prompts):
            ids[i, : len(prompt)] = torch.tensor(prompt, device=self.device)
        positions = torch.arange(width, device=self.device).expand(len(prompts), width)
        row_index = torch.tensor(list(rows), device=self.device)
        out = self.runner.forward(ids, positions, row_index=row_index, kv_len=width, logit_index=lengths - 1,
                                  feature_layer_ids=self.layer_ids)
        first = self._pick(out.logits[:, 0])
        if self.drafter is not None:
            self.drafter.write_context(out.features, positions, row_index)
        self.state.reset_rows(row_index, first, lengths)

    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]],
                 on_finish: Callable[[int, RequestOutput], None] | None = None) -> tuple[list[RequestOutput], RunStats]:
        """Decode every prompt (lists of token ids); returns outputs in prompt order and timing."""
        if any(len(p) == 0 for p in prompts):
            raise ValueError("empty prompt: every request needs at least one token")
        longest = max((len(p) for p in prompts), default=0)
        need = longest + self.config.max_new_tokens + self.block_size
        if need > self.runner.max_length:
            raise ValueError(f"a prompt of {longest} tokens + {self.config.max_new_tokens} new tokens needs "
                             f"{need} cache positions, the engine has {self.runner.max_length}; raise max_length")
        if not self._prepared:
            self.prepare()
        results: list[RequestOutput | None] = [None] * len(prompts)
        pending = deque(range(len(prompts)))
        row_request: list[int | None] = [None] * self.config.batch_size
        stats = RunStats()
        started = time.perf_counter()
        self._refill(row_request, pending, prompts, stats)
        while any(r is not None for r in row_request):
            self._run_until_a_row_finishes(row_request, stats)
            done = self.state.done.tolist()
            for row, request in enumerate(row_request):
                if request is not None and done[row]:
                    results[request] = self.state.harvest(row, len(prompts[request]))
                    stats.new_tokens += len(results[request].tokens)
                    row_request[row] = None
                    if on_finish is not None:
                        on_finish(request, results[request])
            self._refill(row_request, pending, prompts, stats)
        self._synchronize()
        stats.wall_s = time.perf_counter() - started
        return [r for r in results if r is not None], stats

    def _refill(self, row_request: list[int | None], pending: deque[int], prompts: Sequence[Sequence[int]],
                stats: RunStats) -> None:
        rows = [row for row, request in enumerate(row_request) if request is None][: len(pending)]
        if not rows:
            return
        requests = [pending.popleft() for _ in rows]
        self._synchronize()
        started = time.perf_counter()
        self.prefill(rows, [prompts[r] for r in requests])
        for row, request in zip(rows, requests, strict=True):
            row_request[row] = request
        self._synchronize()
        stats.prefill_s += time.perf_counter() - started

    def _run_until_a_row_finishes(self, row_request: list[int | None], stats: RunStats) -> None:
        watched = torch.tensor([r is not None for r in row_request])
        if self.device.type != "cuda":
            while not (self.state.done.cpu() & watched).any():
                self.step()
                stats.cycles += 1
            return
        depth = max(1, self.config.lookahead)
        if self._flag_ring is None:  # pinned host buffers, so the copies of `done` are asynchronous
            self._flag_ring = [torch.empty(len(row_request), dtype=torch.bool).pin_memory() for _ in range(depth)]
        ring = self._flag_ring
        in_flight: deque[tuple[torch.cuda.Event, torch.Tensor]] = deque()
        # Rows may already be finished right after prefill (stop token first, or max_new_tokens == 1).
        ring[0].copy_(self.state.done)
        if (ring[0] & watched).any():
            return
        while True:
            self.step()
            stats.cycles += 1
            flags = ring[stats.cycles % depth]
            flags.copy_(self.state.done, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            in_flight.append((event, flags))
            if len(in_flight) >= depth:
                event, flags = in_flight.popleft()
                event.synchronize()  # the GPU is already running the cycles queued after this one
                if (flags & watched).any():
                    return

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
