"""The runtime's decode loop: static caches, decisions on the device, CUDA graphs, rows refilled as they finish.

Regeneration is this loop without a drafter; evaluation runs it with one, without one for the speed
baseline, and with every draft refused for the lossless check's baseline (below). One cycle (all rows at
once, shapes fixed; see `dflash_train.runtime.reference_loop` for the semantics it reproduces):

    positions = start + [0 .. B-1]                               [b, B]
    block     = [last_token, MASK x (B-1)] -> drafter -> [last_token, d_1 .. d_{B-1}]
    target    = static verify forward on the block (writes its K/V at `positions`)
    a, bonus  = greedy: fused argmax/compare/commit; sampling: seeded draw (no drafter, B = 1) or
                speculative rejection sampling
    drafter context K/V <- target features of the B block positions (only the first a+1 become visible)
    state     : out += committed tokens, start += a + 1, stop/length checks -> done

Nothing in a cycle reads a value back to the host. On CUDA the whole cycle is captured once as a CUDA
graph and replayed (`cycle_graph.py`); the host learns which rows finished through a copy of `done` that it
reads `lookahead` cycles later, so the GPU never waits for it (`scheduling.py`, which also cuts requests into
prefill waves and refills rows as they finish).

This module owns the engine's construction and its work on the device: the cycle and a wave's prefill.

Exact lossless baseline (`refuse_drafts=True`): the target alone through a drafted run's verify pass. Each
cycle runs the same forward as a drafted cycle (block `[last_token, MASK x (B-1)]`, [batch_size, B] tokens,
the drafter's feature layers captured: the same compiled graph and kernels), and the verify compares slots 1..
against -1, so it accepts no draft and commits only t_0. Every token it commits is then the argmax of one row
of a B-token verify forward of that launch shape, and so is every token a drafted run commits (d_1 .. d_a are
its t_0 .. t_{a-1}, the bonus its t_a). The two runs' logits at every committed position are equal bit for bit
in any dtype, by induction over positions, given one guarantee: in a forward of a fixed launch shape (the same
batch size, block size and static cache length), a row's result depends only on that row's inputs, not on its
index (its slot in the block, its row in the batch) nor on the other rows' values. That holds because the
kernel is chosen by shape and reduces every output element in the same order wherever it sits (GEMMs over K;
norms, RoPE and the argmax per row), and attention runs per query over its own row's visible cache slots, key
tiles at fixed cache positions (`kernels.static_attention`), masked keys adding exact zeros. A token's hidden
states and K/V then depend only on the token, its position and the K/V before it, identical in both runs
(prompts: the same waves, so the same prefill shapes; rows idle, finished or refilled elsewhere in the batch
change nothing). Nothing carries across shapes: a one-token step ([batch, 1]) or another batch size may pick
other kernels and round a near-tie the other way, so this baseline runs at the drafted run's batch and block
size, and the one-token loop serves only as the speed baseline.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import replace

import torch

from dflash_train.compiling import compile_fixed_shapes
from dflash_train.kernels.greedy_verify import (
    block_argmax_triton,
    commit_tokens,
    greedy_verify_reference,
    greedy_verify_triton,
)
from dflash_train.models import DFlashDraftModel
from dflash_train.runtime.config import SKINNY_FOR_MATMUL, EngineConfig, resolve_kernels
from dflash_train.runtime.cycle_graph import CycleGraphMixin
from dflash_train.runtime.experts import use_decode_experts
from dflash_train.runtime.hf_target import HFCacheTarget
from dflash_train.runtime.loop_stop import LoopDetector
from dflash_train.runtime.sampling import (
    block_verify_sample,
    probabilities,
    request_seed,
    sample,
    seed_keys,
    seeded_sample,
    speculative_sample,
    top_p_filter,
)
from dflash_train.runtime.scheduling import Group, RunStats, SchedulingMixin, _Request
from dflash_train.runtime.state import DecodeState, RequestOutput
from dflash_train.runtime.static_draft import StaticDrafter
from dflash_train.runtime.static_target import StaticTarget, model_type, supports
from dflash_train.target import TargetModel

logger = logging.getLogger(__name__)

# The engine's names as other modules, tests and benchmarks import them, wherever they now live.
__all__ = ["DecodeEngine", "EngineConfig", "Group", "RequestOutput", "RunStats", "resolve_kernels"]


_announced: set[str] = set()


def make_runner(target: TargetModel, config: EngineConfig, kernels: str) -> StaticTarget | HFCacheTarget:
    """The static runner where it covers the architecture, else the target's own forward and caches (said once
    per architecture: that path is exact but much slower)."""
    if supports(target):
        return StaticTarget(target, config.batch_size, config.max_length, kernels=kernels,
                            skinny_matmul=SKINNY_FOR_MATMUL[config.matmul], skinny_fusion=config.matmul == "fused",
                            decode_experts=config.experts == "kernel", absorb_latent=config.latent == "absorbed",
                            step_tokens=config.runner_step_tokens or max(config.block_size, 1))
    if model_type(target) not in _announced:
        _announced.add(model_type(target))
        logger.warning("The static-cache runtime does not run %r targets: decoding through the model's own forward "
                       "and caches (exact, slower; docs/architectures.md).", model_type(target))
    # Its own forward too runs a MoE target's experts on the decode kernel where the static runner would.
    use_decode_experts(target.model, enabled=kernels == "triton" and config.experts == "kernel")
    return HFCacheTarget(target, config.batch_size, config.max_length)


class DecodeEngine(CycleGraphMixin, SchedulingMixin):
    """The decode loop of the module docstring: built here, with its cycle and a wave's prefill; its warm-up and
    CUDA graph are `CycleGraphMixin`'s, its requests and the loop over them `SchedulingMixin`'s."""

    def __init__(self, target: TargetModel, draft: DFlashDraftModel | None, config: EngineConfig,
                 runner: StaticTarget | HFCacheTarget | None = None, refuse_drafts: bool = False) -> None:
        """`draft`: None for the target alone (one token per step). `refuse_drafts`: the target alone through
        the verify pass of a run with `draft` (the exact lossless baseline, module docstring; greedy only):
        the drafter's block size, mask token and feature layers are used, the drafter itself never runs."""
        if refuse_drafts and (draft is None or config.temperature > 0):
            raise ValueError("refuse_drafts is the greedy baseline of a drafted run: it needs the drafter and "
                             "temperature 0")
        self.target, self.config = target, config
        self.device = target.device
        self.block_size = config.block_size if draft is not None else 1
        self.kernels = resolve_kernels(config.kernels, self.device)
        uses_draft = draft is not None and self.block_size > 1
        self.refuse_drafts = refuse_drafts and uses_draft
        # A refusing engine captures the drafter's features too and discards them: the target forward must be
        # the drafted run's own call (same arguments, same compiled graph), or the compiler may fuse it apart.
        self.layer_ids = list(draft.config.target_layer_ids) if uses_draft else []
        if runner is None or runner.batch_size != config.batch_size or runner.max_length < config.max_length:
            # the rings keep as many states a row as this engine verifies tokens (one without a drafter)
            runner = make_runner(target, replace(config, runner_step_tokens=config.runner_step_tokens or self.block_size),
                                 self.kernels)
        if getattr(runner, "step_tokens", self.block_size) < self.block_size:  # a shared runner's state rings
            raise ValueError(f"the runner's linear-attention states take back steps of {runner.step_tokens} tokens, "
                             f"this engine verifies blocks of {self.block_size}: build the runner's engine with "
                             f"EngineConfig(runner_step_tokens={self.block_size})")
        self.runner = runner
        self.drafter = StaticDrafter(draft, config.batch_size, self.block_size, runner.max_length, self.kernels,
                                     config.draft_attention, fused_products=runner.matmul == "fused",
                                     skinny_shapes=runner.skinny_shapes,
                                     ) if uses_draft and not self.refuse_drafts else None
        loops = LoopDetector(self.device) if config.stop_loops else None
        self.state = DecodeState(config.batch_size, self.block_size, config.max_new_tokens,
                                 list(config.stop_token_ids), self.device, loops,
                                 fused=self.kernels == "triton" and config.fuse_state_update)
        self.offsets = torch.arange(self.block_size, device=self.device)[None]
        self.first_slot = self.offsets == 0  # [1, B]
        mask_id = draft.config.mask_token_id if uses_draft else 0
        self.mask_block = torch.full((config.batch_size, self.block_size), mask_id, device=self.device)
        self._graph: torch.cuda.CUDAGraph | None = None
        self._prepared = False
        self.graph_error: str | None = None
        self.compile_error: str | None = None
        self._flag_ring: list[torch.Tensor] | None = None
        wants_compile = config.compile if config.compile is not None else self.device.type == "cuda"
        self._compile = bool(wants_compile) and getattr(runner, "graphable", True)
        self._compiled_embed: Callable[[torch.Tensor], torch.Tensor] | None = None
        self._requests: dict[int, _Request] = {}
        self._waves: deque[list[int]] = deque()
        self._row_request: list[int | None] = [None] * config.batch_size
        self._next_id = 0

    # ------------------------------------------------------------------ one cycle (no host sync inside)

    @property
    def draft_argmax(self) -> str:
        """What picks greedy drafts: "kernel" (`block_argmax_triton`) or "torch" (torch.argmax)."""
        return "kernel" if self.kernels == "triton" and self.config.fuse_draft_argmax else "torch"

    def _pick(self, logits: torch.Tensor) -> torch.Tensor:
        """Drafts from the drafter's logits [b, B-1, V]: sampled, or greedy (torch.argmax's ties either way).
        The argmax kernel writes them straight into the block's slots 1.. and returns that view, which saves
        the cycle a copy kernel."""
        if self.draft_temperature > 0:
            return sample(probabilities(logits, self.draft_temperature))
        if self.draft_argmax == "kernel":
            return block_argmax_triton(logits, out=self.state.block[:, 1:])
        return logits.argmax(dim=-1)

    def _cycle(self) -> None:
        s = self.state
        positions = s.start[:, None] + self.offsets  # [b, B]
        # [last token, mask, ..., mask] in one kernel (a copy then a write would be two, the copy a memcpy node)
        torch.where(self.first_slot, s.last_token[:, None], self.mask_block, out=s.block)
        draft_logits = None
        if self.drafter is not None:
            drafts, draft_logits = self._propose(positions)
            if drafts.data_ptr() != s.block[:, 1:].data_ptr():  # the argmax kernel writes them in place
                s.block[:, 1:] = drafts
        out = self.runner.forward(s.block, positions, feature_layer_ids=self.layer_ids, compiled=self._compile,
                                  compile_options=self.config.compile_options, compile_scope=self.config.compile_scope)
        if self.config.temperature > 0:
            accepted, bonus = self._sample(out.logits, draft_logits)
            commit_tokens(s.out, s.n_out, s.block, accepted, bonus, s.done)
            accept_len = accepted + 1
        else:
            # Refused drafts: slots 1.. compared as -1, which no token equals, so a = 0 and t_0 is committed.
            verified = torch.where(self.offsets == 0, s.block, -1) if self.refuse_drafts else s.block
            accept_len, bonus = self._verify(out.logits, verified, s.out, s.n_out, s.done)
        if self.drafter is not None:
            self.drafter.write_context(out.features, positions, compiled=self._compile,
                                       compile_options=self.config.compile_options)
        s.advance(accept_len, bonus)

    def _sample(self, logits: torch.Tensor, draft_logits: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(accepted drafts [b], token emitted after them [b]) at temperature > 0."""
        c, s = self.config, self.state
        if self.drafter is None:  # plain decoding: token n_out of each request, from its own seeded stream
            token = seeded_sample(logits[:, 0], c.temperature, c.top_p, s.keys, s.n_out)
            return torch.zeros_like(token), token
        verify = block_verify_sample if c.verification == "block" else speculative_sample
        return verify(top_p_filter(logits, c.temperature, c.top_p), draft_logits, s.block[:, 1:], c.temperature,
                      self.draft_temperature)

    def _propose(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Drafts [b, B-1] for the block in `state.block` at positions [b, B] (the block's own slots 1.. where
        `_pick` writes them there), and their logits [b, B-1, V]."""
        embeds = self._embed(self.state.block)
        hidden = self.drafter.hidden(embeds, positions, self.state.start, compiled=self._compile,
                                     compile_options=self.config.compile_options,
                                     compile_scope=self.config.compile_scope)  # [b, B, H]
        draft_logits = self.runner.lm_head(hidden[:, 1:].to(self.target.dtype))  # [b, B-1, V]
        if self.draft_temperature > 0:
            draft_logits = top_p_filter(draft_logits, self.draft_temperature, self.config.top_p)
        return self._pick(draft_logits), draft_logits

    @property
    def draft_temperature(self) -> float:
        """The temperature drafts are sampled at: the decode's, scaled (`EngineConfig.draft_temperature_scale`);
        0 at greedy decoding, and for argmax drafts at any temperature."""
        return self.config.temperature * self.config.draft_temperature_scale

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """The target's embeddings of the block's tokens; compiled, a gather of one generated kernel, several
        times faster at a 16-token block than the eager embedding's index kernel (docs/benchmarks.md, 'Figures
        behind code choices')."""
        if not self._compile:
            return self.target.embed_tokens(tokens)
        if self._compiled_embed is None:
            self._compiled_embed = compile_fixed_shapes(self.target.embed_tokens, self.config.compile_options)
        return self._compiled_embed(tokens)

    def _verify(self, *args: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.kernels == "triton":
            return greedy_verify_triton(*args)
        return greedy_verify_reference(*args)

    # ------------------------------------------------------------------ prefill

    @torch.no_grad()
    def prefill(self, rows: Sequence[int], prompts: Sequence[Sequence[int]], seeds: Sequence[int] | None = None) -> None:
        """Start `prompts` in cache rows `rows`: one batched forward, right-padded (padding sits after each
        prompt, so no prompt token sees it; its cache slots are overwritten before anything reads them).
        `seeds`: of the requests' seeded draws (default: from the rows)."""
        lengths = [len(p) for p in prompts]
        ids = torch.zeros(len(prompts), max(lengths), dtype=torch.long)
        for i, prompt in enumerate(prompts):
            ids[i, : len(prompt)] = torch.tensor(prompt, dtype=torch.long)
        ids = ids.to(self.device, non_blocking=True)
        positions = torch.arange(ids.shape[1], device=self.device).expand_as(ids)
        row_index = torch.tensor(list(rows), device=self.device)
        length_t = torch.tensor(lengths, device=self.device)
        out = self.runner.forward(ids, positions, row_index=row_index, kv_len=ids.shape[1], logit_index=length_t - 1,
                                  feature_layer_ids=self.layer_ids)
        seeds = list(seeds) if seeds is not None else [request_seed(self.config.seed, row) for row in rows]
        keys = seed_keys(seeds).to(self.device)
        first = self._first_token(out.logits[:, 0], keys)
        if self.drafter is not None:
            self.drafter.write_context(out.features, positions, row_index)
        self.state.reset_rows(row_index, first, length_t, keys)

    def _first_token(self, logits: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        c = self.config
        if c.temperature > 0:
            return seeded_sample(logits, c.temperature, c.top_p, keys, torch.zeros_like(keys[:, 0]))
        return logits.argmax(dim=-1)
