"""One optimizer step: the target's pass, the drafter's loss (captured in CUDA graphs where it can be), the
backward and optimizer update of each micro-batch, and the step's metrics from a single device sync.

The phases are marked with this module's `record_function`: benchmarks/train_packing.py times them by
replacing it here.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.profiler import record_function

from dflash_train.features.packed_rows import chat_layout
from dflash_train.objective import DEFAULT_FLEX_TILE, Blocks, ObjectiveOutput
from dflash_train.training.batch_loading import HOST_ONLY, anchor_seeds
from dflash_train.training.flops import training_step_flops, visible_pairs
from dflash_train.training.grad_sync import average_gradients
from dflash_train.training.source_metrics import slot_summary
from dflash_train.training.step_graph import StepInputs


def _supervised_rows(blocks: Blocks) -> int:
    return blocks.supervised_index().numel() if blocks.num_real_rows is None else blocks.num_real_rows


class TrainStepMixin:
    """The Trainer's step and what it counts (tokens, model FLOPs, the loss shares of packed micro-batches).
    Relies on the Trainer's `config`, `accelerator`, `model`, `optimizer`, `schedule`, `objective`, `target`,
    `features`, `draft_config`, `target_cost`, `step_graph`, `optimizer_graph`, `sync_by_hand`, `share`, `packed`,
    `plan` and `step`, and on `BatchLoadingMixin` for the micro-batches (`_load`, `_load_step`, `_host_blocks`)."""

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
        the step). Small flex tiles (training.flex_tile=64) ask the flex kernel for tiles of their own, which a
        compiler may fail to build, in the forward or in the backward: until they have been through both once,
        such a failure costs the run its speed-up, not the run (the default 128-token tiles from then on: the
        same loss, more masked-out scores computed)."""
        if self.flex_tile_built or self.objective.flex_tile == DEFAULT_FLEX_TILE:
            return self._run_micro_step(indices, seeds, cpu_batch, accumulate)
        try:
            result = self._run_micro_step(indices, seeds, cpu_batch, accumulate)
        except Exception as error:
            reason = (str(error).strip().splitlines() or [""])[0][:200]
            self.accelerator.print(
                f"training.flex_tile={self.objective.flex_tile} failed in the drafter ({type(error).__name__}: "
                f"{reason}); {DEFAULT_FLEX_TILE}-token tiles from now on (training.flex_tile={DEFAULT_FLEX_TILE} "
                "skips the try)")
            self.objective.flex_tile = DEFAULT_FLEX_TILE
            self.model.zero_grad(set_to_none=False)  # nothing of the failed attempt reaches the step
            return self._run_micro_step(indices, seeds, cpu_batch, accumulate)
        self.flex_tile_built = True
        return result

    def _run_micro_step(self, indices: list[int], seeds: list[int], cpu_batch: dict[str, Any] | None,
                        accumulate: bool) -> tuple[ObjectiveOutput, dict[str, float], torch.Tensor]:
        """`_micro_step` on the flex tiles of the moment. From the captured step where there is one; a failure
        there turns it off for the run (unless it may be the small tiles', which `_micro_step` tries first)."""
        share = self._loss_share(indices)
        if self.step_graph is not None:
            try:
                step = self._target_pass(indices, seeds, cpu_batch)
                # accelerate's backward divides the loss by the accumulation steps: so do the graphs' gradients
                accumulation = self.accelerator.gradient_accumulation_steps
                step.share.fill_((1.0 if share is None else share) / accumulation)
                with record_function("train/drafter_step_graph"):
                    out = self.step_graph(step, accumulate)
            except Exception as error:  # a capture or compiler failure costs speed, not the run
                if not self.flex_tile_built and self.objective.flex_tile != DEFAULT_FLEX_TILE:
                    raise  # the small tiles are dropped first, and the graphs tried again with the default ones
                self.step_graph = None
                if not accumulate:  # the last step's gradients, which captured steps never set to None
                    self.model.zero_grad(set_to_none=True)
                reason = (str(error).strip().splitlines() or [""])[0][:200]
                self.accelerator.print(f"CUDA graphs of the drafter's step failed ({type(error).__name__}: {reason}); "
                                       "it runs uncaptured from now on (training.step_cuda_graphs=false)")
            else:
                self._sync_by_hand()
                return out, self._stats(step), out.loss * accumulation
        out, stats = self._forward(indices, seeds, cpu_batch)
        loss = out.loss if share is None else out.loss * share
        with record_function("train/backward"):
            self.accelerator.backward(loss)
        self._sync_by_hand()
        return out, stats, loss

    def _update(self, max_grad_norm: float) -> torch.Tensor:
        """The gradients clipped and the optimizer's update: from its CUDA graph while the drafter's step is
        captured (training/optimizer_graph.py); a failure there turns that graph off for the run. -> the
        gradient norm before clipping."""
        if self.optimizer_graph is not None and self.step_graph is not None:
            try:
                return self.optimizer_graph()
            except Exception as error:  # the graph puts back what it touched: the update runs uncaptured
                self.optimizer_graph = None
                reason = (str(error).strip().splitlines() or [""])[0][:200]
                self.accelerator.print(f"the CUDA graph of the optimizer's update failed ({type(error).__name__}: "
                                       f"{reason}); it runs uncaptured from now on")
        grad_norm = self.accelerator.clip_grad_norm_(self.model.parameters(), max_grad_norm)
        self.optimizer.step()
        return grad_norm

    def _sync_by_hand(self) -> None:
        """After a step's last micro-batch, in a run whose gradients bypass DDP's hooks: every process's mean."""
        if self.sync_by_hand and self.accelerator.sync_gradients:
            with record_function("train/gradient_all_reduce"):
                average_gradients([p for p in self.model.parameters() if p.requires_grad],
                                  self.accelerator.num_processes)

    def _drafter(self) -> torch.nn.Module:
        """The drafter the objective runs: unwrapped where gradients are averaged by hand (DDP's forward would
        arm its hooks, which a captured step cannot hold), else as prepared."""
        return self.accelerator.unwrap_model(self.model) if self.sync_by_hand else self.model

    def _drafter_loss(self, batch: dict[str, torch.Tensor], features: torch.Tensor, blocks: Blocks,
                      teacher_states: torch.Tensor | None) -> Any:
        """The objective on the drafter."""
        return self.objective(self._drafter(), self.target.embed_tokens, self.target.lm_head.weight,
                              batch["input_ids"], batch["loss_mask"], features, blocks=blocks,
                              teacher_states=teacher_states, context_positions=batch.get("position_ids"))

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
                        grad_norm = self._update(t.max_grad_norm)
                    else:
                        self.optimizer.step()  # accelerate's wrapper skips it until the gradients are synced
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
        # every rank's chats so far, from the plan: the chats a window of queued steps trained on is a difference
        metrics["chats_seen"] = self._sequences_seen()
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
