"""Per-row cross-entropy against the target's frozen lm_head, in chunks, and the slot decay weights.

Only valid slots reach the head, and their logits exist one chunk at a time: the forward pass of
each chunk also computes the gradient of each row's cross-entropy w.r.t. its hidden row (softmax -
onehot, times the head), so neither `[positions, vocab]` logits nor a graph through them is ever
kept, and the frozen head gets no gradient. The row weights (slot decay, D-PACE, per-chat
normalisation) are applied to the returned per-row losses outside, in plain PyTorch. With soft
targets (distillation), the target's own next-token distribution at each row replaces the one-hot
label: the loss is the cross-entropy -sum_v q_v log p_v and its gradient softmax - q.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from dflash_train.kernels._triton import HAS_TRITON
from dflash_train.kernels.cross_entropy import cross_entropy_grad_triton

DEFAULT_DECAY_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}


def decay_gamma(block_size: int, gamma: float | None = None) -> float:
    if gamma is not None:
        return float(gamma)
    if block_size not in DEFAULT_DECAY_GAMMA:
        raise ValueError(
            f"no default loss-decay gamma for block_size={block_size} "
            f"(defaults: {DEFAULT_DECAY_GAMMA}); set loss_decay_gamma explicitly"
        )
    return DEFAULT_DECAY_GAMMA[block_size]


def slot_weights(block_size: int, gamma: float | None) -> torch.Tensor:
    """w_k = exp(-(k-1)/gamma) for slots k = 1..B-1; slot 0 weighs 0. gamma=inf gives no decay."""
    slots = torch.arange(block_size, dtype=torch.float32)
    if gamma is not None and math.isinf(gamma):
        weights = torch.ones(block_size)
    else:
        weights = torch.exp(-(slots - 1) / decay_gamma(block_size, gamma))
    weights[0] = 0.0
    return weights


def default_chunk_rows(vocab_size: int, budget_bytes: int = 1 << 30) -> int:
    """Rows per chunk so one chunk's fp32 logits (and their gradient) fit in `budget_bytes`."""
    return max(16, budget_bytes // (vocab_size * 4 * 2))


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Per-row cross-entropy [P] (fp32) against the frozen head, with its gradient computed in the forward.

    The saved [P, H] rows are the gradient of each row's unit-weight CE w.r.t. its hidden row, so any
    weighting of the rows (which may itself depend on the returned CE) is applied outside, in plain
    PyTorch on [P] vectors: backward scales row r by d(loss)/d(ce_r).
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx,
        hidden: torch.Tensor,
        head_weight: torch.Tensor,
        labels: torch.Tensor,
        chunk_rows: int,
        teacher_hidden: torch.Tensor | None = None,
        fused: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # hidden [P, H], head_weight [V, H] (frozen), labels [P]; teacher_hidden [P, H]: the target's final
        # states whose logits give the soft targets.
        needs_grad = ctx.needs_input_grad[0]
        row_ce = torch.empty(hidden.shape[0], device=hidden.device, dtype=torch.float32)
        correct = torch.empty_like(labels, dtype=torch.bool)

        def chunk(rows: slice) -> torch.Tensor | None:
            teacher = None if teacher_hidden is None else teacher_hidden[rows]
            return _chunk(hidden[rows], head_weight, labels[rows], teacher, fused, needs_grad, row_ce[rows],
                          correct[rows])

        ctx.save_for_backward(rows_gradient(hidden, chunk_rows, needs_grad, chunk))
        ctx.mark_non_differentiable(correct)
        return row_ce, correct

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx, grad_ce: torch.Tensor, _grad_correct: torch.Tensor
    ) -> tuple[torch.Tensor | None, None, None, None, None, None]:
        (grad_hidden,) = ctx.saved_tensors
        return scale_rows(grad_hidden, grad_ce), None, None, None, None, None


def rows_gradient(hidden: torch.Tensor, chunk_rows: int, needs_grad: bool,
                  chunk: Callable[[slice], torch.Tensor | None]) -> torch.Tensor | None:
    """The [P, H] gradient of each row's own loss w.r.t. its hidden row, assembled chunk by chunk: `chunk(rows)`
    computes a chunk's losses (into outputs it owns) and returns that chunk's gradient (None without grad)."""
    grad_hidden = torch.empty_like(hidden) if needs_grad else None
    for start in range(0, hidden.shape[0], chunk_rows):
        rows = slice(start, start + chunk_rows)
        chunk_grad = chunk(rows)
        if grad_hidden is not None:
            grad_hidden[rows] = chunk_grad.to(hidden.dtype)
    return grad_hidden


def scale_rows(grad_hidden: torch.Tensor, grad_rows: torch.Tensor) -> torch.Tensor:
    """Backward of a per-row loss whose unit gradients were kept: row r times d(loss)/d(loss_r). Scaled in fp32
    and rounded once into a buffer of the rows' dtype (a bf16 * fp32 product would otherwise be a whole fp32
    [P, H] copy)."""
    return torch.mul(grad_hidden, grad_rows[:, None], out=torch.empty_like(grad_hidden))


def _chunk(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, teacher: torch.Tensor | None, fused: bool,
    needs_grad: bool, row_ce: torch.Tensor, correct: torch.Tensor,
) -> torch.Tensor | None:
    """One chunk: fills `row_ce` and `correct` (views of the whole outputs) and returns d ce_r / d hidden_r.

    Matmuls run in the head's dtype (bf16 for a bf16 target), whatever precision the drafter's final norm
    returned: casting the [V, H] head up to fp32 instead would cost a copy of the head and fp32 matmuls.
    """
    if fused:
        # One kernel: CE, top-1 and the unit-weight gradient written over the logits in their own dtype.
        logits = hidden.to(weight.dtype) @ weight.T
        teacher_logits = None if teacher is None else teacher.to(weight.dtype) @ weight.T
        ones = torch.ones(labels.shape, device=labels.device, dtype=torch.float32)
        row_ce[:], correct[:] = cross_entropy_grad_triton(logits, labels, ones, needs_grad,
                                                          teacher_logits=teacher_logits)
        return logits @ weight if needs_grad else None
    logits = (hidden.to(weight.dtype) @ weight.T).float()  # [chunk, V]
    log_norm = torch.logsumexp(logits, dim=-1)
    correct[:] = logits.argmax(dim=-1) == labels
    if teacher is None:
        target_logit = logits.gather(1, labels[:, None]).squeeze(1)
    else:
        soft = (teacher.to(weight.dtype) @ weight.T).float().softmax(dim=-1)
        target_logit = (soft * logits).sum(dim=-1)
    row_ce[:] = log_norm - target_logit
    if not needs_grad:
        return None
    # d ce / d logits = softmax - target, computed in place on the logits buffer.
    grad_logits = logits.sub_(log_norm[:, None]).exp_()
    if teacher is None:
        grad_logits.scatter_add_(1, labels[:, None], -torch.ones_like(target_logit[:, None]))
    else:
        grad_logits.sub_(soft)
    return grad_logits.to(weight.dtype) @ weight


def chunked_cross_entropy_rows(
    hidden: torch.Tensor,
    head_weight: torch.Tensor,
    labels: torch.Tensor,
    chunk_rows: int | None = None,
    teacher_hidden: torch.Tensor | None = None,
    fused: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """CE(hidden_i @ W^T, label_i) per row [P] (fp32, differentiable w.r.t. hidden), and top-1 correctness.

    hidden [P, H] (valid rows only), head_weight [V, H] (frozen: it gets no gradient), labels [P]. With
    teacher_hidden [P, H], the targets are softmax(teacher_hidden_i @ W^T) instead of the labels (accuracy
    stays against the labels). Weight the rows outside: `(row_ce * weights).sum()`. `fused` (None: on CUDA
    with triton) computes each chunk's CE and gradient in one Triton kernel (kernels/cross_entropy.py)
    instead of PyTorch's separate passes, with hard or soft targets.
    """
    chunk_rows = chunk_rows or default_chunk_rows(head_weight.shape[0])
    if fused is None:
        fused = hidden.is_cuda and HAS_TRITON
    teacher = None if teacher_hidden is None else teacher_hidden.detach()
    return _ChunkedLinearCrossEntropy.apply(hidden, head_weight.detach(), labels, chunk_rows, teacher, fused)


def chunked_weighted_cross_entropy(
    hidden: torch.Tensor,
    head_weight: torch.Tensor,
    labels: torch.Tensor,
    weights: torch.Tensor,
    chunk_rows: int | None = None,
    teacher_hidden: torch.Tensor | None = None,
    fused: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """sum_i w_i * CE_i / sum_i w_i (weights [P] >= 0, no gradient through them), and per-row top-1
    correctness; the arguments are those of `chunked_cross_entropy_rows`."""
    row_ce, correct = chunked_cross_entropy_rows(hidden, head_weight, labels, chunk_rows, teacher_hidden, fused)
    row_weights = weights.detach().float() / weights.detach().float().sum().clamp_min(1e-12)
    return (row_ce * row_weights).sum(), correct
