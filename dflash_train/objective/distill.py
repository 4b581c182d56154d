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
and the row weights are applied outside. A chunk holds up to five fp32 [rows, V] buffers at once (the two
logits, the gradient, the target's probabilities and a temporary), so the default chunk has 2/5 of the CE
path's rows: the same fp32 memory at its peak.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from dflash_train.objective.loss import default_chunk_rows, rows_gradient, scale_rows

DistillKind = Literal["kl", "tv"]
DISTILL_KINDS: tuple[str, ...] = ("kl", "tv")
CHUNK_BUFFERS = 5  # fp32 [rows, V] buffers a chunk holds at its peak; the CE path's chunk budget counts 2


@dataclass(frozen=True)
class Distillation:
    """Per-row loss (1 - weight) * CE(label) + weight * D_T, D_T the `kind` divergence at `temperature`."""

    kind: DistillKind
    temperature: float = 1.0
    weight: float = 1.0

    def __post_init__(self) -> None:
        if self.kind not in DISTILL_KINDS:
            raise ValueError(f"distillation kind {self.kind!r} is not one of {list(DISTILL_KINDS)}")
        if not 0 < self.temperature < math.inf:
            raise ValueError(f"distillation temperature must be a finite number > 0, got {self.temperature} "
                             "(temperature 0 is greedy decoding: the label's cross-entropy, loss ce)")
        if not 0 <= self.weight <= 1:
            raise ValueError(f"distillation weight must be in [0, 1], got {self.weight} (0: the label's "
                             "cross-entropy alone)")


def _log_softmax_(logits: torch.Tensor) -> torch.Tensor:
    """log softmax over the last axis, in place."""
    return logits.sub_(torch.logsumexp(logits, dim=-1, keepdim=True))


def distill_rows(
    logits: torch.Tensor, teacher_logits: torch.Tensor, labels: torch.Tensor, distill: Distillation, needs_grad: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One chunk: (loss [R], the label's CE [R], top-1 correct [R], d loss / d logits [R, V] or None), all fp32.

    logits (the drafter's) and teacher_logits (the target's) are fp32 [R, V] buffers that this overwrites.
    """
    temperature, hard = distill.temperature, 1.0 - distill.weight
    correct = logits.argmax(dim=-1) == labels
    lse = torch.logsumexp(logits, dim=-1)
    label_ce = lse - logits.gather(1, labels[:, None]).squeeze(1)
    # The CE's part of the gradient, softmax(x) (the label's -1 is added last), before x is tempered in place.
    grad = logits.sub(lse[:, None]).exp_().mul_(hard) if needs_grad and hard > 0 else None
    log_p = _log_softmax_(logits.div_(temperature))
    log_q = _log_softmax_(teacher_logits.div_(temperature))
    if distill.kind == "kl":
        q = log_q.exp()
        divergence = (q * log_q.sub_(log_p)).sum(dim=-1)
        d_logits = log_p.exp_().sub_(q)  # (p_T - q_T), times 1/T below
    else:
        p, q = log_p.exp_(), log_q.exp_()
        below = p < q
        share = torch.where(below, p, 0.0).sum(dim=-1, keepdim=True)  # S
        divergence = 1.0 - torch.minimum(p, q).sum(dim=-1)
        d_logits = p.mul_(share - below.to(p.dtype))  # p_j * (S - [p_j < q_j]), times 1/T below
    loss = hard * label_ce + distill.weight * divergence
    if not needs_grad:
        return loss, label_ce, correct, None
    d_logits.mul_(distill.weight / temperature)
    grad = d_logits if grad is None else grad.add_(d_logits)
    if hard > 0:
        grad.scatter_add_(1, labels[:, None], torch.full_like(lse[:, None], -hard))
    return loss, label_ce, correct, grad


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
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # hidden, teacher_hidden [P, H]; head_weight [V, H] (frozen); labels [P].
        needs_grad = ctx.needs_input_grad[0]
        row_loss = torch.empty(hidden.shape[0], device=hidden.device, dtype=torch.float32)
        label_ce = torch.empty_like(row_loss)
        correct = torch.empty_like(labels, dtype=torch.bool)

        def chunk(rows: slice) -> torch.Tensor | None:
            # Matmuls in the head's dtype, as the CE path: an fp32 head would be a copy of the whole head.
            logits = (hidden[rows].to(head_weight.dtype) @ head_weight.T).float()  # [chunk, V]
            teacher = (teacher_hidden[rows].to(head_weight.dtype) @ head_weight.T).float()
            row_loss[rows], label_ce[rows], correct[rows], grad = distill_rows(
                logits, teacher, labels[rows], distill, needs_grad)
            return None if grad is None else grad.to(head_weight.dtype) @ head_weight

        ctx.save_for_backward(rows_gradient(hidden, chunk_rows, needs_grad, chunk))
        ctx.mark_non_differentiable(label_ce, correct)
        return row_loss, label_ce, correct

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx, grad_loss: torch.Tensor, _ce: torch.Tensor, _correct: torch.Tensor
    ) -> tuple[torch.Tensor | None, None, None, None, None, None]:
        (grad_hidden,) = ctx.saved_tensors
        return scale_rows(grad_hidden, grad_loss), None, None, None, None, None


def distill_chunk_rows(vocab_size: int) -> int:
    """Rows per chunk that hold the CE path's fp32 bytes at the distillation's peak (CHUNK_BUFFERS buffers)."""
    return max(16, default_chunk_rows(vocab_size) * 2 // CHUNK_BUFFERS)


def chunked_distillation_rows(
    hidden: torch.Tensor,
    head_weight: torch.Tensor,
    labels: torch.Tensor,
    teacher_hidden: torch.Tensor,
    distill: Distillation,
    chunk_rows: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss [P] fp32, differentiable w.r.t. hidden; the label's CE [P]; top-1 correct [P]) of the supervised
    rows hidden [P, H] against the target's final states teacher_hidden [P, H] (the state that predicts each
    row's label), through the frozen head_weight [V, H], which gets no gradient. Weight the rows outside."""
    chunk_rows = chunk_rows or distill_chunk_rows(head_weight.shape[0])
    return _ChunkedDistillation.apply(hidden, head_weight.detach(), labels, teacher_hidden.detach(), distill,
                                      chunk_rows)
