"""Distillation toward the target's distribution at a sampling temperature, per row, in chunks against the
frozen head (docs/design.md §6.7).

Speculative sampling at temperature T draws a draft from the drafter's p_T = softmax(x / T) and accepts it
with probability sum_v min(p_T(v), q_T(v)), q_T = softmax(t / T) the target's (x, t: the two models' logits
for one position; `runtime/sampling.py` tempers both). A drafter trained on the target's greedy tokens with
hard labels learns where the target's argmax lies, not how its probability spreads, and that spread is what
sampling pays for. Per supervised row, with label y and mix weight w:

    loss = (1 - w) * CE(x, y) + w * D_T(q_T, p_T)
    kl:  D_T = KL(q_T || p_T) = sum_v q_T log(q_T / p_T)      dD/dx = (p_T - q_T) / T
    tv:  D_T = 1 - sum_v min(p_T, q_T)                          dD/dx_j = p_j / T * (S - [p_j < q_j]),
                                                                S = sum_v p_v [p_v < q_v]

TV is one minus the acceptance probability itself. Both divergences temper the drafter as the runtime does, so
both are least at x = t + c whatever T is; T decides which mismatches weigh (a low T, only those among the
target's likely tokens). KL's gradient is never zero while p_T != q_T; TV's is proportional to p, so it fades
where the drafter gives the target's likely tokens no mass (a drafter trained from scratch): mix it with the
CE (w < 1) or start from a trained drafter.

As in the CE path (objective/loss.py), only supervised rows reach the head, their logits (the drafter's and the
target's) exist one chunk at a time, each row's gradient w.r.t. its hidden row is computed in the forward pass,
and the row weights are applied outside. On CUDA with Triton one kernel per chunk computes loss, CE, top-1 and
gradient over the logits in their own dtype (kernels/distill_loss.py), in chunks of the CE path's rows. The
PyTorch path holds up to CHUNK_BUFFERS fp32 [rows, V] buffers at once, so its default chunk has 2/6 of the CE
path's rows: the same fp32 memory at its peak.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from dflash_train.kernels._triton import HAS_TRITON
from dflash_train.kernels.distill_loss import KINDS, distill_grad_reference, distill_grad_triton
from dflash_train.objective.loss import default_chunk_rows, rows_gradient, scale_rows

DistillKind = Literal["kl", "tv"]
# fp32 [rows, V] buffers a chunk of the PyTorch path holds at its peak (the CE path's chunk budget counts 2): the
# two logits, the working copy of the target's, the CE's softmax, the target's probabilities and a product.
CHUNK_BUFFERS = 6


@dataclass(frozen=True)
class Distillation:
    """Per-row loss (1 - weight) * CE(label) + weight * D_T, D_T the `kind` divergence at `temperature`."""

    kind: DistillKind
    temperature: float = 1.0
    weight: float = 1.0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"distillation kind {self.kind!r} is not one of {list(KINDS)}")
        if not 0 < self.temperature < math.inf:
            raise ValueError(f"distillation temperature must be a finite number > 0, got {self.temperature} "
                             "(temperature 0 is greedy decoding: the label's cross-entropy, loss ce)")
        if not 0 <= self.weight <= 1:
            raise ValueError(f"distillation weight must be in [0, 1], got {self.weight} (0: the label's "
                             "cross-entropy alone)")


class _ChunkedDistillation(torch.autograd.Function):
    """Per-row loss [P] (differentiable w.r.t. the hidden rows), the label's CE [P] and top-1 correctness [P]."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx,
        hidden: torch.Tensor,
        head_weight: torch.Tensor,
        labels: torch.Tensor,
        teacher_hidden: torch.Tensor,
        distill: Distillation,
        chunk_rows: int,
        fused: bool,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # hidden, teacher_hidden [P, H]; head_weight [V, H] (frozen); labels [P].
        needs_grad = ctx.needs_input_grad[0]
        row_loss = torch.empty(hidden.shape[0], device=hidden.device, dtype=torch.float32)
        label_ce = torch.empty_like(row_loss)
        correct = torch.empty_like(labels, dtype=torch.bool)
        run = distill_grad_triton if fused else distill_grad_reference

        def chunk(rows: slice) -> torch.Tensor | None:
            # Matmuls in the head's dtype, as the CE path: an fp32 head would be a copy of the whole head. The
            # gradient w.r.t. the logits is written over them.
            logits = hidden[rows].to(head_weight.dtype) @ head_weight.T  # [chunk, V]
            teacher = teacher_hidden[rows].to(head_weight.dtype) @ head_weight.T
            row_loss[rows], label_ce[rows], correct[rows] = run(logits, teacher, labels[rows], distill.kind,
                                                                distill.temperature, distill.weight, needs_grad)
            return logits @ head_weight if needs_grad else None

        ctx.save_for_backward(rows_gradient(hidden, chunk_rows, needs_grad, chunk))
        ctx.mark_non_differentiable(label_ce, correct)
        return row_loss, label_ce, correct

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx, grad_loss: torch.Tensor, _ce: torch.Tensor, _correct: torch.Tensor
    ) -> tuple[torch.Tensor | None, None, None, None, None, None, None]:
        (grad_hidden,) = ctx.saved_tensors
        return scale_rows(grad_hidden, grad_loss), None, None, None, None, None, None


def distill_chunk_rows(vocab_size: int, fused: bool) -> int:
    """Rows per chunk: the CE path's on the fused path (two logits in the head's dtype); on the PyTorch path,
    as many as hold the CE path's fp32 bytes at its peak (CHUNK_BUFFERS buffers)."""
    if fused:
        return default_chunk_rows(vocab_size)
    return max(16, default_chunk_rows(vocab_size) * 2 // CHUNK_BUFFERS)


def chunked_distillation_rows(
    hidden: torch.Tensor,
    head_weight: torch.Tensor,
    labels: torch.Tensor,
    teacher_hidden: torch.Tensor,
    distill: Distillation,
    chunk_rows: int | None = None,
    fused: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss [P] fp32, differentiable w.r.t. hidden; the label's CE [P]; top-1 correct [P]) of the supervised
    rows hidden [P, H] against the target's final states teacher_hidden [P, H] (the state that predicts each
    row's label), through the frozen head_weight [V, H], which gets no gradient. Weight the rows outside.
    `fused` (None: on CUDA with triton) runs each chunk through one Triton kernel (kernels/distill_loss.py)."""
    if fused is None:
        fused = hidden.is_cuda and HAS_TRITON
    chunk_rows = chunk_rows or distill_chunk_rows(head_weight.shape[0], fused)
    return _ChunkedDistillation.apply(hidden, head_weight.detach(), labels, teacher_hidden.detach(), distill,
                                      chunk_rows, fused)
