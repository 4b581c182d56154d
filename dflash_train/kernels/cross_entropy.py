"""Weighted cross-entropy of one chunk of logits and its gradient, fused, in place.

For row r of logits x [R, V] (the drafter's hidden rows times the frozen head), label y_r, weight w_r:

    lse_r     = log sum_v exp(x_rv)
    loss_r    = w_r * (lse_r - x_{r y_r})
    correct_r = argmax_v x_rv == y_r            (first index among equal maxima, as torch.argmax)
    x_rv     <- w_r * (exp(x_rv - lse_r) - [v == y_r])      (d loss / d x, written over the logits)

The unfused version reads and writes the [R, V] buffer about ten times (an fp32 copy, logsumexp, argmax,
gather, subtract, exp, scatter, scale, cast); this kernel reads it twice and writes it once, in its own
dtype (bf16 for a bf16 head), with fp32 arithmetic. One program per row: an online max/sum/argmax pass
over the vocabulary, then the gradient pass.
"""

# Deliberately no postponed annotations (PEP 563): Triton reads the `tl.constexpr` annotations of kernels.
import torch

from dflash_train.kernels._triton import jit, next_power_of_2, tl


def cross_entropy_grad_reference(
    logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor, compute_grad: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch version: returns (loss per row [R] fp32, correct [R] bool); the gradient replaces `logits`."""
    x = logits.float()
    lse = torch.logsumexp(x, dim=-1)
    loss = weights.float() * (lse - x.gather(1, labels[:, None]).squeeze(1))
    correct = x.argmax(dim=-1) == labels
    if compute_grad:
        grad = (x - lse[:, None]).exp_()
        grad.scatter_add_(1, labels[:, None], -torch.ones_like(lse[:, None]))
        logits.copy_(grad.mul_(weights.float()[:, None]))
    return loss, correct


def _cross_entropy_kernel(
    logits_ptr, labels_ptr, weights_ptr, loss_ptr, correct_ptr, V, stride,
    BLOCK_V: tl.constexpr, COMPUTE_GRAD: tl.constexpr,
):
    row = tl.program_id(0)
    base = logits_ptr + row.to(tl.int64) * stride
    label = tl.load(labels_ptr + row)
    weight = tl.load(weights_ptr + row).to(tl.float32)
    offs = tl.arange(0, BLOCK_V)
    running_max = tl.full((), float("-inf"), tl.float32)
    running_sum = tl.zeros((), tl.float32)
    best_index = tl.zeros((), tl.int64)
    for start in range(0, V, BLOCK_V):
        x = tl.load(base + start + offs, mask=start + offs < V, other=float("-inf")).to(tl.float32)
        chunk_max = tl.max(x, axis=0)
        # The first chunk holding a strictly larger maximum wins, so ties keep the earliest index.
        chunk_first = tl.min(tl.where(x == chunk_max, start + offs, 2147483647), axis=0).to(tl.int64)
        best_index = tl.where(chunk_max > running_max, chunk_first, best_index)
        new_max = tl.maximum(running_max, chunk_max)
        running_sum = running_sum * tl.exp(running_max - new_max) + tl.sum(tl.exp(x - new_max), axis=0)
        running_max = new_max
    lse = running_max + tl.log(running_sum)
    label_logit = tl.load(base + label).to(tl.float32)
    tl.store(loss_ptr + row, weight * (lse - label_logit))
    tl.store(correct_ptr + row, (best_index == label).to(tl.int8))
    if COMPUTE_GRAD:
        for start in range(0, V, BLOCK_V):
            mask = start + offs < V
            x = tl.load(base + start + offs, mask=mask, other=float("-inf")).to(tl.float32)
            grad = tl.exp(x - lse) - tl.where(start + offs == label, 1.0, 0.0)
            tl.store(base + start + offs, (weight * grad).to(logits_ptr.dtype.element_ty), mask=mask)


def cross_entropy_grad_triton(
    logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor, compute_grad: bool = True,
    block_v: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `cross_entropy_grad_reference`; logits [R, V] (rows contiguous) fp32/bf16/fp16."""
    rows, vocab = logits.shape
    assert logits.stride(1) == 1 and labels.shape == (rows,) and weights.shape == (rows,)
    loss = torch.empty(rows, device=logits.device, dtype=torch.float32)
    correct = torch.empty(rows, device=logits.device, dtype=torch.int8)
    if rows:
        block_v = block_v or min(4096, next_power_of_2(vocab))
        jit(_cross_entropy_kernel)[(rows,)](
            logits, labels.contiguous(), weights.float().contiguous(), loss, correct, vocab, logits.stride(0),
            BLOCK_V=block_v, COMPUTE_GRAD=compute_grad,
        )
    return loss, correct.bool()
