"""The training loop: load → build → (resume) → steps with validation and checkpoints → save.

Runs identically under `python -m dflash_train.train`, `dflash-train train` and `accelerate launch`.
"""

from __future__ import annotations

import dataclasses
import math
import os
import shutil
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.utils import AutocastKwargs
from torch.profiler import record_function

from dflash_train.checkpoint.io import save_draft
from dflash_train.data.prepared import check_tokenizer
from dflash_train.features.online import OnlineFeatures
from dflash_train.features.packed_attention import packed_target_attention
from dflash_train.features.packed_rows import chat_layout, collate_packed
from dflash_train.models import DFlashDraftModel
from dflash_train.objective import DEFAULT_FLEX_TILE, Blocks, DFlashObjective, Distillation, ObjectiveOutput
from dflash_train.target import target_fingerprint, target_identity
from dflash_train.training import resume as ckpt
from dflash_train.training.budget import TimeBudget
from dflash_train.training.compile_report import compile_seconds, first_step_line
from dflash_train.training.config import TrainConfig
from dflash_train.training.data import (
    StepPlan,
    TrainingSamples,
    chat_weights,
    collate,
    draws_per_epoch,
    split_indices,
    weighted_draws,
    weights_summary,
)
from dflash_train.training.flops import (
    TargetPassCost,
    peak_flops,
    target_pass_cost,
    training_step_flops,
    visible_pairs,
)
from dflash_train.training.packing import (
    PackedStepPlan,
    chat_stats,
    check_anchors_per_row,
    derive_anchors_per_row,
    pack_rows,
)
from dflash_train.training.progress import TrainProgress
from dflash_train.training.run_files import read_trainer_state
from dflash_train.training.setup import (
    build_draft,
    build_optimizer,
    build_schedule,
    build_target,
    check_packed_features,
    check_packing_fits_target,
)
from dflash_train.training.source_metrics import SourceTotals, slot_summary, source_line, source_names
from dflash_train.training.step_graph import GraphedDrafterStep, StepInputs, padded_blocks
from dflash_train.training.tracking import MetricsLogger, plot_metrics

HOST_ONLY = ("chats", "blocks")  # CPU batch entries that stay on the host (or travel on their own)


@dataclass
class TrainResult:
    output_dir: Path
    final_checkpoint: Path
    steps: int
    last_metrics: dict[str, Any]
    total_steps: int | None = None  # the run's length; more than `steps` when it stopped early

    @property
    def finished(self) -> bool:
        return self.total_steps is None or self.steps >= self.total_steps


def _supervised_rows(blocks: Blocks) -> int:
    return blocks.supervised_index().numel() if blocks.num_real_rows is None else blocks.num_real_rows


def anchor_seed(seed: int, step: int, sample: int, repeat: int = 0) -> int:
    """One seed per (run, step, sample): anchors are re-drawn every step, reproducibly. `repeat` counts the
    sample's earlier copies in the step (source weights above 1 may draw a chat twice): each copy gets anchors
    of its own."""
    return (seed * 1_000_003 + step * 7_919 + sample * 104_729 + repeat * 1_299_709) % (2**62)


def anchor_seeds(seed: int, step: int, samples: Sequence[int]) -> list[int]:
    """`anchor_seed` of each sample of a step's micro-batch, in order, copies counted."""
    copies: dict[int, int] = {}
    seeds = []
    for sample in samples:
        seeds.append(anchor_seed(seed, step, sample, copies.get(sample, 0)))
        copies[sample] = copies.get(sample, 0) + 1
    return seeds


def padding_multiple(config: TrainConfig, device: torch.device) -> int:
    """Compiled flex attention specialises on the sequence length: one padded shape means one compile (a new
    length per batch would recompile every step until dynamo gives up and runs flex attention eagerly)."""
    if config.data.pad_to_multiple is not None:
        return config.data.pad_to_multiple
    flex = device.type == "cuda" and config.training.attention in ("auto", "flex")
    return config.data.max_length if flex else 1


def check_deepspeed_accumulation(deepspeed_config: dict[str, Any], steps: int) -> None:
    """DeepSpeed accumulates by its own count: one that differs from the run's would silently change the
    effective batch (and the schedule's step count)."""
    configured = deepspeed_config.get("gradient_accumulation_steps", "auto")
    if configured != "auto" and int(configured) != steps:
        raise ValueError(
            f"the DeepSpeed launch sets gradient_accumulation_steps: {configured} but "
            f"training.gradient_accumulation_steps={steps}: make them equal (`accelerate launch "
            f"--gradient_accumulation_steps {steps}`, or auto in the launch config)")


def refuse_fsdp_without_cuda() -> None:
    """accelerate quietly runs plain DDP when an FSDP launch config meets CPU processes: say so instead."""
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true" and not torch.cuda.is_available():
        raise ValueError("FSDP needs CUDA devices (on CPU processes accelerate would run plain DDP instead): "
                         "launch CPU processes with recipes/accelerate/cpu_2proc.yaml")


class Trainer:
    def __init__(self, config: TrainConfig) -> None:
        self.config = config
        t = config.training
        self.accelerator = self._build_accelerator()
        torch.manual_seed(t.seed)
        self.output_dir = Path(t.output_dir)
        # The data first: a missing or damaged dataset is said before the target's seconds of loading.
        self.samples = TrainingSamples(config.data.prepared, config.data.features, config.data.max_length)
        self.train_ids, self.val_ids = split_indices(
            len(self.samples), config.data.validation_fraction, config.data.validation_max_samples, t.seed,
            self.samples.prompt_keys())
        self.train_weights = self._chat_weights()
        self.target = build_target(config, self.accelerator.device)
        check_packing_fits_target(config, self.target)
        if config.data.prepared is not None:
            check_tokenizer(config.data.prepared, self.target.tokenizer, config.model.target)
        self.plan = StepPlan(t.batch_size, self.accelerator.num_processes, t.gradient_accumulation_steps)
        self.val_groups: list[list[list[int]]] = []  # packed validation micro-batches (rows of chats)
        self.packed = self._build_packing()
        self.total_steps = self._plan_total_steps()
        self.configured_steps = self.total_steps  # a time budget may shorten the run, never beyond this
        sources = self.samples.sources(self.val_ids) if self.val_ids else None
        self.val_sources = dict(zip(self.val_ids, sources, strict=True)) if sources else {}
        draft = build_draft(config, self.target)
        self.draft_config = draft.config
        # The target's attention over packed rows: flex or varlen, or None for SDPA ("auto": flex on CUDA).
        self.features = OnlineFeatures(
            self.target, self.draft_config.target_layer_ids,
            packed_target_attention(t.target_attention, self.accelerator.device), t.reads_target_distribution,
            whole_rows=t.compile_target, say=self.accelerator.print)
        check_packed_features(config, self.target, self.features)
        self._check_offline_features()
        self.target_cost = self._target_cost()
        self.model, self.optimizer, self.schedule = self._prepare_draft(draft)
        self._compile_and_capture()
        self.objective = self._build_objective()
        self.step_graph = self._build_step_graph()
        # a micro-batch's loss share on the device, filled per step (a graph copies it into its own buffer)
        self.share = torch.ones((), device=self.accelerator.device)
        self.compat = {
            "target": config.model.target, "target_fingerprint": target_fingerprint(self.target.model),
            "target_layer_ids": self.draft_config.target_layer_ids, "block_size": self.draft_config.block_size,
            "hidden_size": self.draft_config.hidden_size, "vocab_size": self.draft_config.vocab_size,
            "mask_token_id": self.draft_config.mask_token_id,
        }
        self.pad_to = padding_multiple(config, self.accelerator.device)
        self.step = 0
        self.first_step_seconds: float | None = None  # the run's cold start: step 0 -> 1, compilation included
        self.budget = TimeBudget(t.time_budget_minutes, t.stop_after_minutes, t.time_budget_excludes_warmup)

    def _chat_weights(self) -> list[float] | None:
        """`data.source_weights` as one weight per training chat (None without it), said once."""
        source_weights = self.config.data.source_weights
        if not source_weights:
            return None
        sources = self.samples.sources(self.train_ids)
        weights = chat_weights(source_weights, sources)
        self.accelerator.print(weights_summary(source_weights, sources or [], weights))
        return weights

    def _build_accelerator(self) -> Accelerator:
        t = self.config.training
        refuse_fsdp_without_cuda()
        if t.deterministic:
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True, warn_only=True)
        # Autocast's cache of cast weights cannot outlive a CUDA graph's capture: a captured step casts anew. Only
        # where the step can be captured (one CUDA process): elsewhere the recipe's setting keeps the cache.
        capturable = torch.cuda.is_available() and int(os.environ.get("WORLD_SIZE", "1")) == 1
        handlers = [AutocastKwargs(cache_enabled=False)] if t.step_cuda_graphs and capturable else []
        return Accelerator(
            mixed_precision=t.mixed_precision, gradient_accumulation_steps=t.gradient_accumulation_steps,
            step_scheduler_with_optimizer=False,
            cpu=not torch.cuda.is_available(),  # several CPU processes then meet over gloo
            kwargs_handlers=handlers,
        )

    def _plan_total_steps(self) -> int:
        """The run's optimizer steps: training.max_steps, or its epochs over the (packed) training chats."""
        t = self.config.training
        if self.packed is not None:
            return t.max_steps or self.packed.total_steps(t.epochs)
        # Whole validation batches only: a short last batch is one more shape for compiled attention.
        full = t.batch_size * self.accelerator.num_processes
        if len(self.val_ids) >= full:
            self.val_ids = self.val_ids[: len(self.val_ids) // full * full]
        steps_per_epoch = self.plan.steps_per_epoch(draws_per_epoch(self.train_ids, self.train_weights))
        return t.max_steps or max(1, int(t.epochs * steps_per_epoch))

    def _prepare_draft(self, draft: torch.nn.Module) -> tuple[Any, Any, Any]:
        """The drafter, its optimizer and schedule, as accelerate (DDP, DeepSpeed or FSDP) wraps them."""
        t = self.config.training
        deepspeed = self.accelerator.state.deepspeed_plugin
        if deepspeed is not None:  # no dataloader goes through prepare(), so DeepSpeed is told the batch
            check_deepspeed_accumulation(deepspeed.deepspeed_config, t.gradient_accumulation_steps)
            deepspeed.deepspeed_config["train_micro_batch_size_per_gpu"] = t.batch_size
        optimizer = build_optimizer(draft.to(self.accelerator.device), self.config)
        schedule = build_schedule(optimizer, lambda: self.total_steps, self.config)
        return self.accelerator.prepare(draft, optimizer, schedule)

    def _compile_and_capture(self) -> None:
        t = self.config.training
        if t.compile:
            self.accelerator.unwrap_model(self.model).compile_layers()
        if t.compile_target and not self.samples.offline:
            self.target.compile_decoder_layers()
        if t.target_cuda_graphs:
            self.features.build_graphs(not self.samples.offline and self.packed is not None, t.batch_size,
                                       self.config.data.pack_tokens or 0, self.accelerator.device)

    def _build_objective(self) -> DFlashObjective:
        t = self.config.training
        return DFlashObjective(
            block_size=self.draft_config.block_size, mask_token_id=self.draft_config.mask_token_id,
            num_anchors=t.num_anchors, loss_decay_gamma=t.loss_decay_gamma, mask_kind=t.attention,
            partition_anchors=t.anchors == "partition",
            anchors_per_row=self.packed.anchors_per_row if self.packed else None,
            position_weighting=t.position_weighting, dpace_alpha=t.dpace_alpha, flex_tile=t.flex_tile,
            distillation=None if t.loss == "ce" else Distillation(t.loss, t.loss_temperature, t.distill_weight),
        )

    def _build_step_graph(self) -> GraphedDrafterStep | None:
        """The drafter's side of a packed step replayed from CUDA graphs (training/step_graph.py), where that
        applies: packed rows, one CUDA process, bf16 or fp32; elsewhere a note and none."""
        t = self.config.training
        if not t.step_cuda_graphs:
            return None
        if (self.packed is None or self.accelerator.device.type != "cuda" or self._distributed_type() != "NO"
                or t.mixed_precision == "fp16"):
            # fp16's loss scaling happens in accelerate's backward, which a captured step does not call
            self.accelerator.print("training.step_cuda_graphs applies to packed rows in one CUDA process, not in "
                                   "fp16: the drafter's step runs uncaptured")
            return None
        params = [param for param in self.model.parameters() if param.requires_grad]
        return GraphedDrafterStep(lambda inputs: self._drafter_loss(inputs.batch, inputs.features, inputs.blocks,
                                                                    inputs.teacher), params, self.accelerator.device)

    def _build_packing(self) -> PackedStepPlan | None:
        """The packing plan of a packed run (None unpacked), from every chat's length and anchor count."""
        d, t = self.config.data, self.config.training
        if d.pack_tokens is None:
            return None
        partition = self.config.model.block_size if t.anchors == "partition" else None
        stats = chat_stats(self.samples, partition)
        lengths, anchors = stats.lengths, stats.anchors(t.num_anchors)
        drawn = self.train_ids if self.train_weights is None else weighted_draws(
            self.train_ids, self.train_weights, t.seed, 0)  # the anchors per token of what the steps draw
        train = np.asarray(drawn, dtype=np.int64)
        per_row = t.anchors_per_row or derive_anchors_per_row(lengths[train], anchors[train], d.pack_tokens)
        check_anchors_per_row(per_row, anchors)
        plan = PackedStepPlan(self.train_ids, lengths.tolist(), anchors.tolist(), d.pack_tokens, per_row,
                              t.batch_size, self.accelerator.num_processes, t.gradient_accumulation_steps, t.seed,
                              self.train_weights)
        rows = pack_rows(self.val_ids, plan.lengths, plan.anchors, d.pack_tokens, per_row)
        self.val_groups = [rows[i : i + t.batch_size] for i in range(0, len(rows), t.batch_size)]
        epoch = plan.epoch_rows(0)
        token_fill, anchor_fill = plan.fill(epoch)
        self.accelerator.print(
            f"packing: {len(drawn)} chats into {len(epoch)} rows of {d.pack_tokens} tokens and {per_row} "
            f"anchors ({plan.steps_in_epoch(0)} steps in epoch 0): {token_fill:.1%} of the tokens and "
            f"{anchor_fill:.1%} of the anchor slots are used")
        return plan

    def _check_offline_features(self) -> None:
        if not self.samples.offline:
            return
        self.samples.store.check_compatible(
            self.draft_config.target_layer_ids, self.draft_config.hidden_size, target_identity(self.target.model))

    def _target_cost(self) -> TargetPassCost | None:
        """What the target's pass costs a step (None with offline features: it does not run in the step). It
        runs to the deepest captured layer, or through every layer where the loss reads its distribution."""
        if self.samples.offline:
            return None
        reads = self.config.training.reads_target_distribution
        layers_run = self.target.num_layers if reads else max(self.draft_config.target_layer_ids) + 1
        return target_pass_cost(self.target.config.get_text_config(), self.target.decoder_layers, layers_run, reads)

    # -- one step -------------------------------------------------------------------------------
    def _load(self, indices: list[int]) -> dict[str, torch.Tensor]:
        batch = collate([self.samples[i] for i in indices], self.pad_to)
        if self.accelerator.device.type == "cuda":
            batch = {k: v.pin_memory() for k, v in batch.items()}  # lets the copy overlap compute
        return batch

    def _load_rows(self, rows: list[list[int]]) -> dict[str, torch.Tensor]:
        """A packed micro-batch: always batch_size rows (missing ones all padding), one static shape."""
        samples = [[self.samples[i] for i in row] for row in rows]
        batch = collate_packed(samples, self.config.data.pack_tokens, self.config.training.batch_size)
        if self.accelerator.device.type == "cuda":
            batch = {k: v.pin_memory() for k, v in batch.items()}
        return batch

    def _load_step(self, step: int) -> list[tuple[list[int], dict[str, Any]]]:
        """This rank's micro-batches of `step`: the chats' sample indices (in batch order) and the batch, its
        blocks built on the host (`_host_blocks`: this runs in the loader thread while the previous step computes)."""
        t = self.config.training
        rank = self.accelerator.process_index
        if self.packed is not None:
            loaded = [([i for row in rows for i in row], self._load_rows(rows))
                      for rows in self.packed.micro_batches(step, rank)]
        else:
            groups = self.plan.micro_batches(self.train_ids, t.seed, step, rank, self.train_weights)
            loaded = [(ids, self._load(ids)) for ids in groups]
        for indices, batch in loaded:
            blocks = self._host_blocks(batch, anchor_seeds(t.seed, step, indices))
            # a captured step reads blocks of fixed shapes: padded here, off the step's critical path
            batch["blocks"] = blocks if self.step_graph is None else self._pinned(padded_blocks(blocks))
        return loaded

    def _host_blocks(self, cpu_batch: dict[str, Any], seeds: list[int]) -> Blocks:
        """A CPU batch's blocks, built on the host: each chat's anchors come from a CPU generator seeded by its
        own seed (the same anchors on any device), and the dozen small ops per chat, and the count of the
        supervised rows, never reach the GPU's launch queue or make it wait."""
        return self._pinned(self.objective.seeded_blocks(cpu_batch, chat_layout(cpu_batch), seeds).with_supervised_rows())

    def _pinned(self, blocks: Blocks) -> Blocks:
        return blocks.pin_memory() if self.accelerator.device.type == "cuda" else blocks

    def _forward(
        self, indices: list[int], seeds: list[int], cpu_batch: dict[str, Any] | None = None
    ) -> tuple[Any, dict[str, float]]:
        """`seeds` place the anchors unless the loader built the blocks already (`cpu_batch["blocks"]`)."""
        step = self._target_pass(indices, seeds, cpu_batch)
        with record_function("train/drafter_and_loss"):
            out = self._drafter_loss(step.batch, step.features, step.blocks.to(self.accelerator.device,
                                                                               non_blocking=True), step.teacher)
        return out, self._stats(step)

    def _target_pass(self, indices: list[int], seeds: list[int], cpu_batch: dict[str, Any] | None) -> StepInputs:
        """A micro-batch on the device with the target's features; its blocks on the host (and its `share` 1)."""
        cpu_batch = cpu_batch if cpu_batch is not None else self._load(indices)
        host_blocks = cpu_batch.get("blocks")
        if host_blocks is None:
            host_blocks = self._host_blocks(cpu_batch, seeds)
        device = self.accelerator.device
        batch = {k: v.to(device, non_blocking=True) for k, v in cpu_batch.items() if k not in HOST_ONLY}
        chats = chat_layout(cpu_batch)
        with record_function("train/target_features"):
            features, teacher_states = self.features(batch, max(start + n for _, start, n in chats),
                                                     cpu_batch.get("position_ids"))
        read = {k: batch[k] for k in ("input_ids", "loss_mask", "position_ids") if k in batch}
        return StepInputs(read, features, teacher_states, host_blocks, self.share, chats)

    def _stats(self, step: StepInputs) -> dict[str, float]:
        return self.step_counts(step.blocks, step.chats)

    def step_counts(self, blocks: Blocks, chats: list[tuple[int, int, int]]) -> dict[str, float]:
        """A micro-batch's tokens, the drafter's model FLOPs and the whole step's (the target's pass added where
        it runs in the step), from its blocks and chats on the host."""
        tokens = sum(n for _, _, n in chats)
        flops = self._flops(blocks, tokens, chats)
        target = 0.0 if self.target_cost is None else self.target_cost.flops([n for _, _, n in chats],
                                                                              _supervised_rows(blocks))
        return {"tokens": float(tokens), "flops": flops, "step_flops": flops + target}

    def _micro_step(self, indices: list[int], seeds: list[int], cpu_batch: dict[str, Any] | None,
                    accumulate: bool = False) -> tuple[ObjectiveOutput, dict[str, float], torch.Tensor]:
        """One micro-batch's forward and backward: (its output, its tokens and FLOPs, its loss as weighted in
        the step). From the captured step where there is one; a failure there turns it off for the run."""
        share = self._loss_share(indices)
        if self.step_graph is not None:
            try:
                step = self._target_pass(indices, seeds, cpu_batch)
                # accelerate's backward divides the loss by the accumulation steps: so do the graphs' gradients
                accumulation = self.accelerator.gradient_accumulation_steps
                step.share.fill_((1.0 if share is None else share) / accumulation)
                with record_function("train/drafter_step_graph"):
                    out = self.step_graph(step, accumulate)
                return out, self._stats(step), out.loss * accumulation
            except Exception as error:  # a capture or compiler failure costs speed, not the run
                self.step_graph = None
                if not accumulate:  # the last step's gradients, which captured steps never set to None
                    self.model.zero_grad(set_to_none=True)
                reason = (str(error).strip().splitlines() or [""])[0][:200]
                self.accelerator.print(f"CUDA graphs of the drafter's step failed ({type(error).__name__}: {reason}); "
                                       "it runs uncaptured from now on (training.step_cuda_graphs=false)")
        out, stats = self._forward(indices, seeds, cpu_batch)
        loss = out.loss if share is None else out.loss * share
        with record_function("train/backward"):
            self.accelerator.backward(loss)
        return out, stats, loss

    def _drafter_loss(self, batch: dict[str, torch.Tensor], features: torch.Tensor, blocks: Blocks,
                      teacher_states: torch.Tensor | None) -> Any:
        """The objective on the drafter. Small flex tiles (training.flex_tile=64) ask the flex kernel for tiles
        of their own, which a compiler may fail to build: from such a failure on, the default 128-token
        tiles (the same loss, more masked-out scores computed), not a lost run."""
        def run() -> Any:
            return self.objective(self.model, self.target.embed_tokens, self.target.lm_head.weight,
                                  batch["input_ids"], batch["loss_mask"], features, blocks=blocks,
                                  teacher_states=teacher_states, context_positions=batch.get("position_ids"))
        if self.objective.flex_tile == DEFAULT_FLEX_TILE:
            return run()
        try:
            return run()
        except Exception as error:
            reason = (str(error).strip().splitlines() or [""])[0][:200]
            self.accelerator.print(
                f"training.flex_tile={self.objective.flex_tile} failed in the drafter ({type(error).__name__}: "
                f"{reason}); {DEFAULT_FLEX_TILE}-token tiles from now on (training.flex_tile={DEFAULT_FLEX_TILE} "
                "skips the try)")
            self.objective.flex_tile = DEFAULT_FLEX_TILE
            self.model.zero_grad(set_to_none=True)  # nothing of the failed attempt reaches the step
            return run()

    def _flops(self, blocks: Blocks, tokens: int, chats: list[tuple[int, int, int]]) -> float:
        """The step's model FLOPs, from the blocks on the host (no device sync)."""
        # An anchor sees the context of its own chat before it: a_j minus the chat's start.
        context = blocks.anchors[blocks.valid]
        if blocks.sequence is not None:
            starts = torch.tensor([start for _, start, _ in chats], dtype=torch.long)
            context = context - starts[blocks.sequence[blocks.valid]]
        valid_anchors = context.tolist()
        pairs = visible_pairs([(valid_anchors, 0)], self.objective.block_size)
        # Padded anchor slots run through the drafter too, but that work is waste, not model FLOPs.
        block_rows = len(valid_anchors) * self.objective.block_size
        return training_step_flops(self.draft_config, tokens, block_rows, _supervised_rows(blocks), pairs)

    def _loss_share(self, indices: list[int]) -> float | None:
        """Packed micro-batches hold unequal numbers of chats: each one's loss (a mean over its chats) is
        weighted by its share of the step's chats, so that the step's loss is the mean over all of them
        whatever the split into processes and accumulation steps (their mean is taken afterwards)."""
        if self.packed is None:
            return None
        total = self.packed.counted_chats(self.packed.step_rows(self.step))
        mine = self.packed.counted_chats([indices])
        return mine / max(1, total) * self.plan.num_processes * self.plan.accumulation

    def train_step(self, loaded: list[tuple[list[int], dict[str, Any]]] | None = None,
                   resolve: bool = True) -> dict[str, Any] | None:
        """One optimizer step; `loaded` is this step's micro-batches if they were prefetched. The step waits
        for the device once, at its end, for its metrics; with `resolve=False` it does not wait and returns
        None (`fit` resolves only the steps it logs, so the host can queue the next step meanwhile)."""
        self.model.train()
        loss_sum = slot_correct = slot_count = grad_norm = None
        tokens = flops = step_flops = 0.0
        t = self.config.training
        for micro, (indices, cpu_batch) in enumerate(loaded or self._load_step(self.step)):
            seeds = anchor_seeds(t.seed, self.step, indices)
            with self.accelerator.accumulate(self.model):
                out, stats, loss = self._micro_step(indices, seeds, cpu_batch, accumulate=micro > 0)
                with record_function("train/optimizer"):
                    if self.accelerator.sync_gradients:
                        grad_norm = self.accelerator.clip_grad_norm_(self.model.parameters(), t.max_grad_norm)
                    self.optimizer.step()
                    if self.step_graph is None:  # captured steps zero the gradients they write, in place
                        self.optimizer.zero_grad(set_to_none=True)
            part = loss.detach().double() / self.plan.accumulation
            loss_sum = part if loss_sum is None else loss_sum + part
            tokens, flops = tokens + stats["tokens"], flops + stats["flops"]
            step_flops += stats["step_flops"]
            slot_correct = out.slot_correct if slot_correct is None else slot_correct + out.slot_correct
            slot_count = out.slot_count if slot_count is None else slot_count + out.slot_count
            assert micro < self.plan.accumulation
        self.schedule.step()
        self.step += 1
        if not resolve:
            return None
        with record_function("train/metrics_copy"):  # the step's one wait for the device
            metrics = self._reduce(loss_sum, (tokens, flops, step_flops), slot_correct, slot_count, grad_norm)
        metrics["lr"] = self.schedule.get_last_lr()[0]
        if self.packed is not None:  # the whole step's rows, known on every rank from the plan
            metrics["pack_token_fill"], metrics["pack_anchor_fill"] = self.packed.fill(self.packed.step_rows(self.step - 1))
        if self.step_graph is not None:  # shapes captured so far; absent once the graphs have been turned off
            metrics["step_graphs"] = len(self.step_graph.graphs)
        return metrics

    def _reduce(self, loss: torch.Tensor | float, counts: tuple[float, float, float], slot_correct: torch.Tensor,
                slot_count: torch.Tensor, grad_norm: torch.Tensor | float | None = None) -> dict[str, Any]:
        """Sums over the ranks, then one copy to the host: every metric comes from a single device sync.
        `counts`: the step's tokens, the drafter's FLOPs and the whole step's (the target's pass added)."""
        device = self.accelerator.device
        scalars = torch.cat([torch.as_tensor(loss, dtype=torch.float64, device=device).reshape(1),
                             torch.tensor(counts, dtype=torch.float64, device=device)])
        sums = self.accelerator.reduce(torch.cat([scalars, slot_correct.double(), slot_count.double()]), reduction="sum")
        norm = torch.as_tensor(float("nan") if grad_norm is None else grad_norm, dtype=torch.float64, device=device)
        host = torch.cat([sums, norm.detach().reshape(1)]).cpu()
        slots = slot_correct.numel()
        return {
            "loss": float(host[0]) / self.accelerator.num_processes,
            "tokens": float(host[1]), "flops": float(host[2]), "step_flops": float(host[3]),
            **slot_summary(host[4 : 4 + slots], host[4 + slots : 4 + 2 * slots]),
            "grad_norm": float(host[-1]),
        }

    def validate(self) -> dict[str, Any] | None:
        if not self.val_ids:
            return None
        # Compiled layers, unwrapped drafter: the training graph serves validation (train mode, gradients
        # recorded, no backward); eval mode or no_grad would compile the layer once more, for inference (a
        # compilation in the first validation, docs/training.md). The drafter has no dropout, so both compute
        # the same. A drafter wrapped by DDP, FSDP or DeepSpeed expects a backward after a forward with gradients.
        on_training_graph = self.config.training.compile and self._distributed_type() == "NO"
        with torch.set_grad_enabled(on_training_graph):
            if not on_training_graph:
                self.model.eval()
            return self._validate()

    def _validate(self) -> dict[str, Any]:
        rank, world = self.accelerator.process_index, self.accelerator.num_processes
        loss_sum, correct, count = 0.0, None, None
        by_source = self._source_totals()
        for indices, cpu_batch, weight in self._validation_batches(rank, world):
            seeds = [anchor_seed(self.config.training.seed, 0, i) for i in indices]  # fixed anchors
            with self.accelerator.autocast():
                out, _ = self._forward(indices, seeds, cpu_batch)
            out = detached(out)  # nothing here may keep a batch's autograd graph (see `validate`)
            if weight is None:  # a stand-in forward
                continue
            loss_sum += float(out.loss) * weight
            correct = out.slot_correct if correct is None else correct + out.slot_correct
            count = out.slot_count if count is None else count + out.slot_count
            if by_source is not None:
                by_source.add([self.val_sources[i] for i in indices], out)
        if correct is None:  # fewer validation samples than ranks
            zeros = torch.zeros(self.objective.block_size, device=self.accelerator.device)
            correct, count = zeros, zeros.clone()
        metrics = self._reduce(loss_sum, (0.0, 0.0, 0.0), correct, count)
        metrics.pop("grad_norm")
        chats = len(self.val_ids) if self.packed is None else sum(map(self.packed.counted_chats, self.val_groups))
        metrics["loss"] = metrics["loss"] * world / max(1, chats)
        if by_source is not None:
            by_source.reduce(self.accelerator.reduce)
            metrics["by_source"] = by_source.metrics()
        return metrics

    def _source_totals(self) -> SourceTotals | None:
        """Per-source sums for a validation split of two sources or more (None: nothing to break down)."""
        names = source_names([self.val_sources[i] for i in self.val_ids] if self.val_sources else None)
        if not names:
            return None
        return SourceTotals(names, self.objective.block_size, self.accelerator.device)

    def _validation_batches(
        self, rank: int, world: int
    ) -> Iterator[tuple[list[int], dict[str, torch.Tensor] | None, int | None]]:
        """This rank's validation micro-batches: (sample indices, CPU batch or None to load them, the
        chats its loss averages over; None for a stand-in). Every rank runs as many forwards as the rank
        with the most: a DDP/FSDP forward is a collective, and a rank that stopped early would leave the
        others waiting for ever; a rank that ran out runs a stand-in forward, not counted."""
        if self.packed is not None:
            groups = self.val_groups
            for k in range(math.ceil(len(groups) / world)):
                mine = groups[k * world + rank] if k * world + rank < len(groups) else None
                rows = mine or groups[0]
                weight = self.packed.counted_chats(mine) if mine else None
                yield [i for row in rows for i in row], self._load_rows(rows), weight
            return
        mine, size = self.val_ids[rank::world], self.config.training.batch_size
        batches = math.ceil(math.ceil(len(self.val_ids) / world) / size)
        for start in range(0, batches * size, size):
            indices = mine[start : start + size]
            yield indices or self.val_ids[:1], None, len(indices) if indices else None

    # -- checkpoints ----------------------------------------------------------------------------
    def save_checkpoint(self) -> Path:
        t = self.config.training
        tmp, final = ckpt.checkpoint_root(self.output_dir) / f"step-{self.step:08d}.tmp", None
        if self.accelerator.is_main_process:
            tmp, final = ckpt.staging_dir(self.output_dir, self.step)
        self._check_disk_room()
        try:
            self.accelerator.save_state(str(tmp / "state"))
        except (OSError, RuntimeError) as error:  # torch.save reports a full disk as a RuntimeError
            shutil.rmtree(tmp, ignore_errors=True)
            problem = ckpt.space_error(self.output_dir, self.step, self._checkpoint_estimate())
            if problem is None:
                raise
            raise problem from error
        state_dict = self.accelerator.get_state_dict(self.model)
        if self.accelerator.is_main_process:
            draft = DFlashDraftModel(self.draft_config)
            draft.load_state_dict({k: v.detach().float().cpu() for k, v in state_dict.items()})
            save_draft(draft, tmp / "draft", extra_config={"dflash_train": {"step": self.step, **self.compat}})
            trainer_state = {"step": self.step, "total_steps": self.total_steps,
                             "sequences_seen": self._sequences_seen(),
                             "train_seconds": round(self.budget.elapsed(), 3), "budget_sized": self.budget.sized,
                             "first_step_seconds": self.first_step_seconds,
                             "distributed_type": self._distributed_type(), "device": device_name(self.accelerator.device),
                             "num_processes": self.accelerator.num_processes, **self.compat}
            ckpt.finalize(tmp, final, trainer_state, t.keep_last)
        self.accelerator.wait_for_everyone()
        return ckpt.checkpoint_root(self.output_dir) / f"step-{self.step:08d}"

    def _sequences_seen(self) -> int:
        if self.packed is not None:
            return self.packed.chats_seen(self.step)
        return self.step * self.plan.sequences_per_step

    def _checkpoint_estimate(self) -> int:
        """Bytes of the first checkpoint before any exists: fp32 weights twice (accelerate state and the
        drafter export) and AdamW's two fp32 moments, for this process's share of the parameters."""
        params = sum(p.numel() for p in self.model.parameters())
        return ckpt.bytes_needed(self.output_dir, 16 * params)

    def _check_disk_room(self) -> None:
        """Refuse a checkpoint the disk cannot hold before writing any of it (all ranks stop together)."""
        problem = None
        if self.accelerator.is_main_process:
            problem = ckpt.space_error(self.output_dir, self.step, self._checkpoint_estimate())
        if self._agree(int(problem is not None), "max"):
            raise problem or ckpt.CheckpointSpaceError(
                f"disk full: rank 0 cannot write checkpoint step-{self.step:08d} to {self.output_dir}")
        self.accelerator.wait_for_everyone()

    def _distributed_type(self) -> str:
        return str(getattr(self.accelerator.distributed_type, "value", self.accelerator.distributed_type))

    def maybe_resume(self) -> None:
        path = ckpt.resolve_resume(self.config.training.resume, self.output_dir)
        if path is None:
            return
        state = read_trainer_state(path)
        ckpt.check_compatible(state, self.compat, path)
        ckpt.check_launch(state, self._distributed_type(), self.accelerator.num_processes, path)
        self.accelerator.load_state(str(path / "state"))
        self.step = int(state["step"])
        self.first_step_seconds = state.get("first_step_seconds")
        self.budget.resume(float(state.get("train_seconds", 0.0)), bool(state.get("budget_sized", False)))
        if self.budget.sized:  # a budgeted run keeps the length it settled on (others follow their config)
            self.total_steps = int(state["total_steps"])
        self.accelerator.print(f"resumed from {path} at step {self.step}")

    def _agree(self, value: int, op: str) -> int:
        """One value for all ranks (a rank acting alone on its own clock would deadlock the others)."""
        if self.accelerator.num_processes == 1:
            return value
        tensor = torch.tensor([value], device=self.accelerator.device)
        reduce_op = torch.distributed.ReduceOp.MIN if op == "min" else torch.distributed.ReduceOp.MAX
        torch.distributed.all_reduce(tensor, op=reduce_op)
        return int(tensor.item())

    def _stop_requested(self) -> bool:
        return self.budget.stop_after_minutes is not None and bool(self._agree(int(self.budget.should_stop()), "max"))

    def _fit_budget(self, step_seconds: float, progress: TrainProgress) -> None:
        """Once the step time is known, fit the run (and so its schedule) to the time budget; refit it when
        the speed changes (other jobs on the same GPU finishing or starting)."""
        refit = self.budget.sized
        new_total = self.budget.observe(step_seconds, self.step, self.total_steps, self.configured_steps)
        if new_total is None:
            return
        new_total = self._agree(new_total, "min")  # every rank fits on the same step; the shortest length wins
        if refit and not self.budget.worth_refitting(new_total, self.total_steps, self.step):
            return
        if new_total != self.total_steps:
            self.accelerator.print(f"time budget {self.budget.total_minutes} min: {new_total} steps "
                                   f"(was {self.total_steps})")
            self.total_steps = new_total
            progress.set_total(new_total)

    def _resolve_due(self, step: int) -> bool:
        """Whether `fit` waits for step `step`'s metrics: steps it logs, validates, saves or ends on, and every
        step while the time budget probes the step time. The others are queued without a device sync."""
        t = self.config.training
        probing = self.budget.total_minutes is not None and not self.budget.sized
        return (step % t.log_every == 0 or step >= self.total_steps or probing
                or bool(t.eval_every and step % t.eval_every == 0) or step % t.save_every == 0)

    def _after_step(self, metrics: dict[str, Any] | None, logger: MetricsLogger | None) -> bool:
        """Log, validate and checkpoint as scheduled; True when the run stops early (a checkpoint is saved).
        `metrics` is None for a step whose metrics were not waited for (`_resolve_due`)."""
        t = self.config.training
        last = self.step == self.total_steps
        if logger and metrics is not None and (self.step % t.log_every == 0 or last):
            logger.log(self.step, "train", metrics)
        if t.eval_every and (self.step % t.eval_every == 0 or last):
            val = self.validate()
            if logger and val:
                logger.log(self.step, "validation", val)
                if "by_source" in val:
                    self.accelerator.print(source_line(val["by_source"]))
        saved = self.step % t.save_every == 0 or last
        if saved:
            self.save_checkpoint()
        if last or not self._stop_requested():
            return False
        if not saved:
            self.save_checkpoint()
        return True

    # -- the run --------------------------------------------------------------------------------
    def fit(self) -> TrainResult:
        t = self.config.training
        main = self.accelerator.is_main_process
        if main:
            self.output_dir.mkdir(parents=True, exist_ok=True)
        self.maybe_resume()
        logger = MetricsLogger(self.output_dir, self.config.tracking, self.config.to_dict()) if main else None
        peak = peak_flops(self.accelerator.device, self.accelerator.num_processes)  # None: MFU not shown
        metrics: dict[str, Any] = {}
        loader = ThreadPoolExecutor(max_workers=1)  # reads and lays out step n+1 while step n computes
        upcoming = loader.submit(self._load_step, self.step)
        self.budget.start()
        first = True
        window_started, window_steps = time.perf_counter(), 0  # the steps since the last resolved one
        with TrainProgress(self.total_steps, self.step, enabled=main, peak_flops=peak, log_every=t.log_every) as progress:
            while self.step < self.total_steps:
                loaded = upcoming.result()
                if self.step + 1 < self.total_steps:
                    upcoming = loader.submit(self._load_step, self.step + 1)
                compiled_before = compile_seconds() if first and t.compile else {}
                step_metrics = self.train_step(loaded, resolve=first or self._resolve_due(self.step + 1))
                window_steps += 1
                if step_metrics is None:  # queued, not waited for: nothing to log, validate or save at this step
                    progress.advance(self.step)
                    if self._after_step(None, logger):
                        break
                    continue
                metrics = step_metrics
                # The steps of a window ran back to back on the device and were waited for once: each took
                # the window's mean (a lone step's host time would say nothing of the device's).
                metrics["step_seconds"] = (time.perf_counter() - window_started) / window_steps
                if peak:  # model FLOPs over the device's peak rate, logged with every step (the run's summary)
                    metrics["mfu"] = metrics["flops"] / metrics["step_seconds"] / peak
                    # the whole step's: the target's forward pass counted too, where it runs in the step
                    metrics["step_mfu"] = metrics["step_flops"] / metrics["step_seconds"] / peak
                if first and t.compile:  # a slow start explained: how much of it was torch.compile
                    line = first_step_line(metrics["step_seconds"], compiled_before, compile_seconds())
                    if line:
                        self.accelerator.print(line)
                if first and self.step == 1:  # the run's own first step, not a resumed one's
                    self.first_step_seconds = round(metrics["step_seconds"], 3)
                first = False
                for _ in range(window_steps):
                    self._fit_budget(metrics["step_seconds"], progress)
                progress.update(self.step, metrics, metrics["step_seconds"])
                if self._after_step(metrics, logger):
                    break
                window_started, window_steps = time.perf_counter(), 0  # validation and saving not counted
        loader.shutdown(wait=True)
        final = ckpt.checkpoint_root(self.output_dir) / f"step-{self.step:08d}"
        if not final.exists() and self.step == self.total_steps:
            final = self.save_checkpoint()  # resumed at the very end: make sure the last one exists
        if logger:
            logger.finish()
            if logger.path.is_file():
                plot_metrics(logger.path, self.output_dir / "training_curves.png")
        return TrainResult(self.output_dir, final, self.step, metrics, self.total_steps)


def device_name(device: torch.device) -> str:
    """The device a run trained on, as its figures are quoted ("NVIDIA H100 80GB HBM3", or "cpu")."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def detached(out: ObjectiveOutput) -> ObjectiveOutput:
    """The objective's outputs without their autograd history."""
    return dataclasses.replace(out, **{field.name: value.detach() for field in dataclasses.fields(out)
                                       if isinstance(value := getattr(out, field.name), torch.Tensor)})


def run_training(config: TrainConfig) -> TrainResult:
    return Trainer(config).fit()
