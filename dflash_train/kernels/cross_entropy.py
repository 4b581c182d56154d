"""Weighted cross-entropy of one chunk of logits and its gradient, fused, in place.

For row r of logits x [R, V] (the drafter's hidden rows times the frozen head), label y_r, weight w_r:

    lse_r     = log sum_v exp(x_rv)
    loss_r    = w_r * (lse_r - x_{r y_r})
    correct_r = argmax_v x_rv == y_r            (first index among equal maxima, as torch.argmax)
    x_rv     <- w_r * (exp(x_rv - lse_r) - [v == y_r])      (d loss / d x, written over the logits)

With soft targets (distillation), the target's own logits t [R, V] give q_r = softmax(t_r) in place of
the one-hot label (accuracy stays against the label):

    loss_r    = w_r * (lse_r - sum_v q_rv x_rv)
    x_rv     <- w_r * (exp(x_rv - lse_r) - q_rv)

The unfused version reads and writes the [R, V] buffer about ten times (an fp32 copy, logsumexp, argmax,
gather, subtract, exp, scatter, scale, cast; soft targets add a softmax, a product and a sum); this kernel
reads it twice (and the teacher's logits twice) and writes it once, in its own dtype (bf16 for a bf16
head), with fp32 arithmetic. One program per row: an online max/sum/argmax pass over the vocabulary, then
the gradient pass.
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


def soft_cross_entropy_grad_reference(
    logits: torch.Tensor, teacher_logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor,
    compute_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch version with soft targets softmax(teacher_logits): (loss per row [R] fp32, correct [R] bool);
    the gradient replaces `logits`."""
    x = logits.float()
    lse = torch.logsumexp(x, dim=-1)
    soft = teacher_logits.float().softmax(dim=-1)
    loss = weights.float() * (lse - (soft * x).sum(dim=-1))
    correct = x.argmax(dim=-1) == labels
    if compute_grad:
        logits.copy_((x - lse[:, None]).exp_().sub_(soft).mul_(weights.float()[:, None]))
    return loss, correct


def _cross_entropy_kernel(
    logits_ptr, teacher_ptr, labels_ptr, weights_ptr, loss_ptr, correct_ptr, V, stride, teacher_stride,
    BLOCK_V: tl.constexpr, COMPUTE_GRAD: tl.constexpr, SOFT: tl.constexpr,
):
    row = tl.program_id(0)
    base = logits_ptr + row.to(tl.int64) * stride
    teacher_base = teacher_ptr + row.to(tl.int64) * teacher_stride
    label = tl.load(labels_ptr + row)
    weight = tl.load(weights_ptr + row).to(tl.float32)
    offs = tl.arange(0, BLOCK_V)
    running_max = tl.full((), float("-inf"), tl.float32)
    running_sum = tl.zeros((), tl.float32)
    best_index = tl.zeros((), tl.int64)
    # Soft targets: the teacher's running max and sum, and sum_v exp(t_v - max) * x_v on the same scale.
    teacher_max = tl.full((), float("-inf"), tl.float32)
    teacher_sum = tl.zeros((), tl.float32)
    teacher_dot = tl.zeros((), tl.float32)
    for start in range(0, V, BLOCK_V):
        mask = start + offs < V
        x = tl.load(base + start + offs, mask=mask, other=float("-inf")).to(tl.float32)
        chunk_max = tl.max(x, axis=0)
        # The first chunk holding a strictly larger maximum wins, so ties keep the earliest index.
        chunk_first = tl.min(tl.where(x == chunk_max, start + offs, 2147483647), axis=0).to(tl.int64)
        best_index = tl.where(chunk_max > running_max, chunk_first, best_index)
        new_max = tl.maximum(running_max, chunk_max)
        running_sum = running_sum * tl.exp(running_max - new_max) + tl.sum(tl.exp(x - new_max), axis=0)
        running_max = new_max
        if SOFT:
            t = tl.load(teacher_base + start + offs, mask=mask, other=float("-inf")).to(tl.float32)
            new_teacher_max = tl.maximum(teacher_max, tl.max(t, axis=0))
            rescale = tl.exp(teacher_max - new_teacher_max)
            p = tl.exp(t - new_teacher_max)  # 0 where masked
            teacher_sum = teacher_sum * rescale + tl.sum(p, axis=0)
            teacher_dot = teacher_dot * rescale + tl.sum(p * tl.where(mask, x, 0.0), axis=0)
            teacher_max = new_teacher_max
    lse = running_max + tl.log(running_sum)
    if SOFT:
        target_logit = teacher_dot / teacher_sum
        teacher_lse = teacher_max + tl.log(teacher_sum)
    else:
        target_logit = tl.load(base + label).to(tl.float32)
    tl.store(loss_ptr + row, weight * (lse - target_logit))
    tl.store(correct_ptr + row, (best_index == label).to(tl.int8))
    if COMPUTE_GRAD:
        for start in range(0, V, BLOCK_V):
            mask = start + offs < V
            x = tl.load(base + start + offs, mask=mask, other=float("-inf")).to(tl.float32)
            if SOFT:
                t = tl.load(teacher_base + start + offs, mask=mask, other=float("-inf")).to(tl.float32)
                grad = tl.exp(x - lse) - tl.exp(t - teacher_lse)
            else:
                grad = tl.exp(x - lse) - tl.where(start + offs == label, 1.0, 0.0)
            tl.store(base + start + offs, (weight * grad).to(logits_ptr.dtype.element_ty), mask=mask)


def cross_entropy_grad_triton(
    logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor, compute_grad: bool = True,
    block_v: int | None = None, teacher_logits: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`cross_entropy_grad_reference`'s contract, or with `teacher_logits` [R, V] (soft targets)
    `soft_cross_entropy_grad_reference`'s; logits [R, V] (rows contiguous) fp32/bf16/fp16."""
    rows, vocab = logits.shape
    assert logits.stride(1) == 1 and labels.shape == (rows,) and weights.shape == (rows,)
    soft = teacher_logits is not None
    teacher = teacher_logits if soft else logits  # not read without soft targets
    assert teacher.shape == logits.shape and teacher.stride(1) == 1
    loss = torch.empty(rows, device=logits.device, dtype=torch.float32)
    correct = torch.empty(rows, device=logits.device, dtype=torch.int8)
    if rows:
        block_v = block_v or min(4096, next_power_of_2(vocab))
        jit(_cross_entropy_kernel)[(rows,)](
            logits, teacher, labels.contiguous(), weights.float().contiguous(), loss, correct, vocab,
            logits.stride(0), teacher.stride(0), BLOCK_V=block_v, COMPUTE_GRAD=compute_grad, SOFT=soft,
        )
    return loss, correct.bool()
