"""The training loop: load → build → (resume) → steps with validation and checkpoints → save.

Runs identically under `python -m dflash_train.train`, `dflash-train train` and `accelerate launch`.

`Trainer` builds the run and drives it (`fit`) here; its parts live beside it, each a mixin of its own: a
step's micro-batches (batch_loading.py), the optimizer step (step.py), the validation pass (validation.py)
and saving and resuming checkpoints (checkpointing.py).
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.utils import AutocastKwargs

from dflash_train.data.prepared import check_tokenizer
from dflash_train.features.online import OnlineFeatures
from dflash_train.features.packed_attention import packed_target_attention
from dflash_train.features.varlen_kernel import grouped_heads_report
from dflash_train.objective import DFlashObjective, Distillation
from dflash_train.target import target_fingerprint, target_identity
from dflash_train.training import resume as ckpt
from dflash_train.training.batch_loading import (
    HOST_ONLY,
    BatchLoadingMixin,
    anchor_seed,
    anchor_seeds,
    padding_multiple,
)
from dflash_train.training.budget import TimeBudget
from dflash_train.training.checkpointing import CheckpointMixin, device_name
from dflash_train.training.compile_report import compile_seconds, first_step_line
from dflash_train.training.config import TrainConfig
from dflash_train.training.data import (
    StepPlan,
    TrainingSamples,
    chat_weights,
    draws_per_epoch,
    split_indices,
    weighted_draws,
    weights_summary,
)
from dflash_train.training.flops import TargetPassCost, peak_flops, target_pass_cost
from dflash_train.training.launch import (
    autocast_cache_off,
    check_deepspeed_accumulation,
    refuse_fsdp_without_cuda,
)
from dflash_train.training.optimizer_graph import GraphedOptimizerStep, capturable
from dflash_train.training.packing import (
    PackedStepPlan,
    chat_stats,
    check_anchors_per_row,
    derive_anchors_per_row,
    pack_rows,
)
from dflash_train.training.progress import TrainProgress
from dflash_train.training.setup import (
    build_draft,
    build_optimizer,
    build_schedule,
    build_target,
    check_packed_features,
    check_packing_fits_target,
)
from dflash_train.training.source_metrics import source_line
from dflash_train.training.step import TrainStepMixin
from dflash_train.training.step_graph import GraphedDrafterStep
from dflash_train.training.tracking import MetricsLogger, plot_metrics
from dflash_train.training.validation import ValidationMixin, detached

# The trainer's names as other modules, tests and benchmarks import them, wherever they now live.
__all__ = [
    "HOST_ONLY", "TrainResult", "Trainer", "anchor_seed", "anchor_seeds", "check_deepspeed_accumulation",
    "detached", "device_name", "padding_multiple", "refuse_fsdp_without_cuda", "run_training",
]


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


class Trainer(BatchLoadingMixin, TrainStepMixin, ValidationMixin, CheckpointMixin):
    """A training run: built from its config in `__init__`, run by `fit`."""

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
        self.optimizer_graph = self._build_optimizer_graph()
        self.flex_tile_built = False  # small flex tiles (training.flex_tile) not yet through a forward and backward
        # captured steps bypass DDP's hooks: their gradients are averaged by hand, and so are the steps after a
        # fallback to uncaptured ones, which keeps every process on the same collectives (training/grad_sync.py)
        self.sync_by_hand = self.step_graph is not None and self.accelerator.num_processes > 1
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
        handlers = [AutocastKwargs(cache_enabled=False)] if autocast_cache_off(t.step_cuda_graphs) else []
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
        applies: packed rows on CUDA, in one process or under DDP, bf16 or fp32; elsewhere a note and none."""
        t = self.config.training
        if not t.step_cuda_graphs:
            return None
        if (self.packed is None or self.accelerator.device.type != "cuda"
                or self._distributed_type() not in ("NO", "MULTI_GPU") or t.mixed_precision == "fp16"):
            # fp16's loss scaling happens in accelerate's backward, which a captured step does not call; FSDP and
            # DeepSpeed shard the gradients in hooks of their own
            self.accelerator.print("training.step_cuda_graphs applies to packed rows on CUDA, in one process or "
                                   "under DDP, not in fp16: the drafter's step runs uncaptured")
            return None
        params = [param for param in self.model.parameters() if param.requires_grad]
        return GraphedDrafterStep(lambda inputs: self._drafter_loss(inputs.batch, inputs.features, inputs.blocks,
                                                                    inputs.teacher), params, self.accelerator.device)

    def _build_optimizer_graph(self) -> GraphedOptimizerStep | None:
        """The gradient clipping and the optimizer's update replayed from a CUDA graph (training/optimizer_graph.py)
        wherever the drafter's step is captured and the optimizer takes its learning rate as a device tensor."""
        inner = getattr(self.optimizer, "optimizer", self.optimizer)  # accelerate's wrapper holds the optimizer
        if self.step_graph is None or not capturable(inner, self.accelerator.device):
            return None
        params = [param for param in self.model.parameters() if param.requires_grad]
        return GraphedOptimizerStep(inner, params, self.config.training.max_grad_norm, self.accelerator.device)

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

    # -- the ranks, the time budget, what each step is followed by --------------------------------
    def _distributed_type(self) -> str:
        return str(getattr(self.accelerator.distributed_type, "value", self.accelerator.distributed_type))

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
                if first:  # which path the target's varlen attention took for grouped heads, where it asked
                    for line in grouped_heads_report():
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


def run_training(config: TrainConfig) -> TrainResult:
    return Trainer(config).fit()
