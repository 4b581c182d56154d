"""Decay-weighted cross-entropy against the target's frozen lm_head, in chunks.

Only valid slots reach the head, and their logits exist one chunk at a time: the forward pass of
each chunk also computes the gradient w.r.t. the hidden rows (softmax - onehot, times the head), so
neither `[positions, vocab]` logits nor a graph through them is ever kept, and the frozen head gets
no gradient. With soft targets (distillation), the target's own next-token distribution at each row
replaces the one-hot label: the loss is the cross-entropy -sum_v q_v log p_v and its gradient softmax - q.
"""

from __future__ import annotations

import math

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
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx,
        hidden: torch.Tensor,
        head_weight: torch.Tensor,
        labels: torch.Tensor,
        row_weights: torch.Tensor,
        chunk_rows: int,
        teacher_hidden: torch.Tensor | None = None,
        fused: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # hidden [P, H], head_weight [V, H] (frozen), labels [P], row_weights [P] summing to 1;
        # teacher_hidden [P, H]: the target's final states whose logits give the soft targets.
        needs_grad = ctx.needs_input_grad[0]
        # Matmuls run in the head's dtype (bf16 for a bf16 target), whatever precision the drafter's
        # final norm returned: casting the [V, H] head up to fp32 instead would cost a copy of the
        # head and fp32 matmuls every step.
        weight = head_weight
        loss = hidden.new_zeros((), dtype=torch.float32)
        correct = torch.empty_like(labels, dtype=torch.bool)
        grad_hidden = torch.empty_like(hidden) if needs_grad else None
        for start in range(0, hidden.shape[0], chunk_rows):
            rows = slice(start, start + chunk_rows)
            if fused and teacher_hidden is None:
                # One kernel: loss, top-1 and the gradient written over the logits in their own dtype.
                logits = hidden[rows].to(weight.dtype) @ weight.T
                row_loss, correct[rows] = cross_entropy_grad_triton(logits, labels[rows], row_weights[rows], needs_grad)
                loss += row_loss.sum()
                if needs_grad:
                    grad_hidden[rows] = (logits @ weight).to(hidden.dtype)
                continue
            logits = (hidden[rows].to(weight.dtype) @ weight.T).float()  # [chunk, V]
            chunk_labels = labels[rows]
            log_norm = torch.logsumexp(logits, dim=-1)
            correct[rows] = logits.argmax(dim=-1) == chunk_labels
            if teacher_hidden is None:
                target_logit = logits.gather(1, chunk_labels[:, None]).squeeze(1)
            else:
                soft = (teacher_hidden[rows].to(weight.dtype) @ weight.T).float().softmax(dim=-1)
                target_logit = (soft * logits).sum(dim=-1)
            loss += ((log_norm - target_logit) * row_weights[rows]).sum()
            if needs_grad:
                # d(loss)/d(logits) = w * (softmax - target), computed in place on the logits buffer.
                grad_logits = logits.sub_(log_norm[:, None]).exp_()
                if teacher_hidden is None:
                    grad_logits.scatter_add_(1, chunk_labels[:, None], -torch.ones_like(target_logit[:, None]))
                else:
                    grad_logits.sub_(soft)
                grad_logits.mul_(row_weights[rows, None])
                grad_hidden[rows] = (grad_logits.to(weight.dtype) @ weight).to(hidden.dtype)
        ctx.save_for_backward(grad_hidden if needs_grad else None)
        ctx.mark_non_differentiable(correct)
        return loss, correct

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx, grad_loss: torch.Tensor, _grad_correct: torch.Tensor
    ) -> tuple[torch.Tensor | None, None, None, None, None, None, None]:
        (grad_hidden,) = ctx.saved_tensors
        return grad_hidden * grad_loss.to(grad_hidden.dtype), None, None, None, None, None, None


def chunked_weighted_cross_entropy(
    hidden: torch.Tensor,
    head_weight: torch.Tensor,
    labels: torch.Tensor,
    weights: torch.Tensor,
    chunk_rows: int | None = None,
    teacher_hidden: torch.Tensor | None = None,
    fused: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """sum_i w_i * CE(hidden_i @ W^T, label_i) / sum_i w_i, and per-row top-1 correctness (against labels).

    hidden [P, H] (valid rows only), head_weight [V, H], labels [P], weights [P] (>= 0). With
    teacher_hidden [P, H], the targets are softmax(teacher_hidden_i @ W^T) instead of the labels.
    `fused` (None: on CUDA with triton) computes each chunk's loss and gradient in one Triton kernel
    (kernels/cross_entropy.py) instead of PyTorch's separate passes; soft targets always take the latter.
    """
    chunk_rows = chunk_rows or default_chunk_rows(head_weight.shape[0])
    if fused is None:
        fused = hidden.is_cuda and HAS_TRITON
    row_weights = weights.float() / weights.float().sum().clamp_min(1e-12)
    teacher = None if teacher_hidden is None else teacher_hidden.detach()
    return _ChunkedLinearCrossEntropy.apply(hidden, head_weight.detach(), labels, row_weights, chunk_rows, teacher,
                                            fused)
