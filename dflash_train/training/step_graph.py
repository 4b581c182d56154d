"""The drafter's forward, loss and backward over a packed micro-batch, replayed from CUDA graphs.

Why: with the target's pass replayed from its own graphs (features/graphed.py), the host still issues the
drafter's side of a packed step one kernel at a time: its layers, the flex attention and its block mask, the
loss and the whole backward, well over a thousand launches for a small drafter. A slow host then sets the
step's pace, not the GPU (docs/benchmarks.md, 'Where the packed step's time goes'). Captured, they are one
launch.

What makes the step capturable: packed rows have one shape and a fixed number of anchors per row, so every
tensor the drafter reads has one shape too, except two counts that change with the chats: the supervised rows
and the chats themselves. `Blocks.padded` pads both (to a bucket of rows, to a multiple of chats), with
padding that weighs, hits and counts nothing, so that one graph serves every step of the same buckets.

The gradients are the parameters' own `.grad` tensors, made once before the first capture: a graph for a
step's first micro-batch writes them, one for the others adds to them, so each replay leaves them where
the optimizer reads them (which must therefore not set them to None); the optimizer's update has a graph of
its own (training/optimizer_graph.py), replayed once a step rather than once a micro-batch. A new graph's first
replay is checked against the uncaptured step on the same inputs, loss and gradients, so a capture that went
wrong stops the graphs instead of training on wrong gradients.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from dflash_train.objective.blocks import Blocks
from dflash_train.objective.objective import ObjectiveOutput

ROW_BUCKETS = 16  # the supervised rows are padded to a sixteenth of the most a batch can have, rounded up
CHAT_STEP = 32  # the chats are padded to a multiple of this
CHECK_TOLERANCE = 1e-3  # relative error of a new graph's first loss and gradients against the uncaptured step


@dataclass
class StepInputs:
    """What one micro-batch's drafter step reads: the packed rows' ids, loss mask and positions, the target's
    features (and final states for a distilled loss), the blocks, and the share of the step's loss this
    micro-batch carries (a 0-d float32 tensor)."""

    batch: dict[str, Tensor]
    features: Tensor
    teacher: Tensor | None
    blocks: Blocks
    share: Tensor
    chats: list[tuple[int, int, int]] = dataclasses.field(default_factory=list)  # (row, start, length), host

    def tensors(self) -> list[Tensor]:
        """Every tensor, in a fixed order (the order the buffers are filled in)."""
        found = [self.batch[key] for key in sorted(self.batch)] + [self.features, self.share]
        found += [] if self.teacher is None else [self.teacher]
        return found + [getattr(self.blocks, f.name) for f in dataclasses.fields(self.blocks)
                        if isinstance(getattr(self.blocks, f.name), Tensor)]

    def key(self) -> tuple[object, ...]:
        """What a graph is captured for: every tensor's shape and dtype, and the chats' capacity."""
        return (*((tuple(t.shape), t.dtype) for t in self.tensors()), self.blocks.num_sequences,
                self.teacher is None)

    def on(self, device: torch.device) -> StepInputs:
        """Buffers of the same shapes on `device`, holding copies (a graph's inputs)."""
        def buffer(t: Tensor) -> Tensor:
            return torch.empty_like(t, device=device).copy_(t)

        blocks = dataclasses.replace(self.blocks, **{f.name: buffer(getattr(self.blocks, f.name))
                                                     for f in dataclasses.fields(self.blocks)
                                                     if isinstance(getattr(self.blocks, f.name), Tensor)})
        return StepInputs({k: buffer(v) for k, v in self.batch.items()}, buffer(self.features),
                          None if self.teacher is None else buffer(self.teacher), blocks, buffer(self.share))


DrafterLoss = Callable[[StepInputs], ObjectiveOutput]  # the objective on the drafter (its loss not yet scaled)


@dataclass
class _Captured:
    replay: Callable[[], None]
    inputs: StepInputs  # the buffers the graph reads
    outputs: tuple[Tensor, Tensor, Tensor]  # the scaled loss, slot hits and slot counts it writes


def padded_blocks(blocks: Blocks, buckets: int = ROW_BUCKETS) -> Blocks:
    """`blocks` padded to the row bucket and chat multiple their counts fall in (`Blocks.padded`)."""
    most = blocks.labels.numel()
    bucket = -(-most // buckets)
    rows = min(most, -(-max(1, blocks.supervised_index().numel()) // bucket) * bucket)
    chats = -(-(blocks.num_sequences or 1) // CHAT_STEP) * CHAT_STEP
    return blocks.padded(rows, chats)


class GraphedDrafterStep:
    """`drafter_loss` and its backward into the `params`' gradients, replayed from CUDA graphs keyed by the
    inputs' shapes (`StepInputs.key`). `eager=True` replays by running the step again on the same buffers
    (CPU tests of the bookkeeping: the buffers, the padding, the gradients zeroed and written in place)."""

    def __init__(self, drafter_loss: DrafterLoss, params: list[torch.nn.Parameter], device: torch.device,
                 eager: bool = False) -> None:
        if not eager and device.type != "cuda":
            raise ValueError("CUDA graphs of the drafter's step need a CUDA device")
        self.drafter_loss, self.params, self.device, self.eager = drafter_loss, params, device, eager
        self.graphs: dict[tuple[object, ...], _Captured] = {}
        self.pool = None if eager else torch.cuda.graph_pool_handle()

    def __call__(self, inputs: StepInputs, accumulate: bool = False) -> ObjectiveOutput:
        """The micro-batch's scaled loss and slot metrics (the graph's own tensors, overwritten by the next
        replay), its gradients in the parameters' `.grad`: written there, or added to what earlier micro-batches
        of the step left (`accumulate`). `inputs.blocks` on the host (pinned) or the device, padded
        (`padded_blocks`) or not."""
        if inputs.blocks.real_rows is None:  # the trainer pads on the host, in its loader thread
            inputs = dataclasses.replace(inputs, blocks=padded_blocks(inputs.blocks))
        supervised = int(inputs.blocks.num_real_rows or 0)
        key = (*inputs.key(), accumulate)
        captured = self.graphs.get(key)
        if captured is None:
            self.graphs[key] = captured = self._first_replay(inputs, accumulate)
        else:
            self._fill(captured.inputs, inputs)
            captured.replay()
        loss, slot_correct, slot_count = captured.outputs
        return ObjectiveOutput(loss, slot_correct, slot_count, supervised)

    def _first_replay(self, inputs: StepInputs, accumulate: bool) -> _Captured:
        """A new graph, captured and replayed once on `inputs`, that replay checked against the uncaptured step.
        The capture and the check run the step outside the replay: the gradients are put back before each, and
        after a failure (the uncaptured step then starts from what earlier micro-batches left)."""
        before = [grad.clone() for grad in self._grads()]
        try:
            captured = self._capture(inputs, accumulate)
            self._fill(captured.inputs, inputs)
            self._restore(before)
            expected = self._uncaptured(captured.inputs, accumulate)
            self._restore(before)
            captured.replay()
            self._check(captured.outputs[0], expected)
        except Exception:
            self._restore(before)
            raise
        return captured

    def _grads(self) -> list[Tensor]:
        for param in self.params:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
        return [param.grad for param in self.params]

    def _restore(self, grads: list[Tensor]) -> None:
        torch._foreach_copy_(self._grads(), grads)

    def _forward_backward(self, inputs: StepInputs, accumulate: bool = False) -> tuple[Tensor, Tensor, Tensor]:
        out = self.drafter_loss(inputs)
        loss = out.loss * inputs.share
        # The gradients written (or added) into `.grad` by one multi-tensor launch: `backward` into existing
        # `.grad` tensors would add each parameter's by a launch of its own, after zeroing them.
        found = torch.autograd.grad(loss, self.params, allow_unused=True)
        grads = self._grads()
        reached = [i for i, grad in enumerate(found) if grad is not None]
        targets, values = [grads[i] for i in reached], [found[i] for i in reached]
        if accumulate:
            torch._foreach_add_(targets, values)
        else:
            torch._foreach_copy_(targets, values)
            missed = [grads[i] for i, grad in enumerate(found) if grad is None]
            if missed:
                torch._foreach_zero_(missed)
        return loss.detach(), out.slot_correct, out.slot_count

    @staticmethod
    def _fill(buffers: StepInputs, inputs: StepInputs) -> None:
        for buffer, value in zip(buffers.tensors(), inputs.tensors(), strict=True):
            buffer.copy_(value, non_blocking=True)

    def _capture(self, inputs: StepInputs, accumulate: bool) -> _Captured:
        buffers = inputs.on(self.device)
        if self.eager:
            return self._eager_stand_in(buffers, accumulate)
        self._grads()
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):  # compilation and autotuning cannot run inside a capture
            for _ in range(2):
                self._forward_backward(buffers, accumulate)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: the trainer's loader thread pins the next step's host tensors meanwhile, which the
        # default (global) mode refuses as an unsafe call during any thread's capture
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            outputs = self._forward_backward(buffers, accumulate)
        return _Captured(graph.replay, buffers, outputs)

    def _eager_stand_in(self, buffers: StepInputs, accumulate: bool) -> _Captured:
        """Outputs of its own, overwritten in place by every replay, as a graph's are."""
        outputs = tuple(t.clone() for t in self._forward_backward(buffers, accumulate))

        def replay() -> None:
            for kept, new in zip(outputs, self._forward_backward(buffers, accumulate), strict=True):
                kept.copy_(new)

        return _Captured(replay, buffers, outputs)  # type: ignore[arg-type]

    def _uncaptured(self, buffers: StepInputs, accumulate: bool) -> tuple[Tensor, list[Tensor]]:
        """The step run as usual on a new graph's buffers: its loss and gradients, kept for `_check`."""
        loss = self._forward_backward(buffers, accumulate)[0].clone()
        return loss, [grad.clone() for grad in self._grads()]

    def _check(self, replayed_loss: Tensor, expected: tuple[Tensor, list[Tensor]]) -> None:
        """The loss, and the gradient as one vector (a parameter whose gradient is near 0 would make its own
        relative error rounding noise), against the uncaptured step's."""
        loss, grads = expected
        flat = torch.cat([grad.float().flatten() for grad in grads])
        replayed = torch.cat([grad.float().flatten() for grad in self._grads()])
        worst = max(relative_error(replayed_loss, loss), relative_error(replayed, flat))
        if not worst <= CHECK_TOLERANCE:
            raise RuntimeError(f"a replayed graph's loss or gradients differ from the uncaptured step (relative "
                               f"error {worst:.2e} > {CHECK_TOLERANCE:.0e})")


def relative_error(value: Tensor, expected: Tensor) -> float:
    expected = expected.float()
    return float((value.float() - expected).norm() / expected.norm().clamp_min(1e-12))
