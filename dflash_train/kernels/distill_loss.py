"""Distillation at a temperature of one chunk of logits and its gradient, fused, in place.

For row r, the drafter's logits x [V] (its hidden row times the frozen head), the target's t [V], the label y,
temperature T and mix weight w (objective/distill.py says why):

    p_T = softmax(x / T),  q_T = softmax(t / T)
    ce_r      = logsumexp(x) - x_y
    kl:  D_r  = sum_v q_T (log q_T - log p_T)          dD/dx = (p_T - q_T) / T
    tv:  D_r  = 1 - sum_v min(p_T, q_T)                 dD/dx_v = p_v / T * (S - [p_v < q_v]),  S = sum_v p_v [p_v < q_v]
    loss_r    = (1 - w) * ce_r + w * D_r
    correct_r = argmax_v x_v == y                       (first index among equal maxima, as torch.argmax)
    x_v      <- (1 - w) * (softmax(x)_v - [v == y]) + w * dD/dx_v      (d loss / d x, written over the logits)

The PyTorch version reads and writes a row's vocabulary some fifteen times in fp32; the kernel reads the two
logits once for the statistics (online maxima and sums of x, x/T and t/T, the argmax, and for KL the
q-weighted sum of t/T - x/T on the running scale), once more for TV's overlap, and once for the gradient,
which it writes in the logits' own dtype (bf16 for a bf16 head), with fp32 arithmetic. One program per row.
"""

# Deliberately no postponed annotations (PEP 563): Triton reads the `tl.constexpr` annotations of kernels.
import torch

from dflash_train.kernels._triton import jit, next_power_of_2, tl

KINDS = ("kl", "tv")
# The launch: a row's vocabulary in tiles of BLOCK_V by NUM_WARPS warps. The kernel streams five row-lengths of
# logits (two reads of each input, one write), so it is bound by memory; of the tiles and warps
# `benchmarks.distill_loss` measured against the device's copy bandwidth, these came closest to it
# (docs/benchmarks.md, `distill_loss`).
BLOCK_V = 2048
NUM_WARPS = 4


def _log_softmax_(logits: torch.Tensor) -> torch.Tensor:
    """log softmax over the last axis, in place."""
    return logits.sub_(torch.logsumexp(logits, dim=-1, keepdim=True))


def distill_grad_reference(
    logits: torch.Tensor, teacher_logits: torch.Tensor, labels: torch.Tensor, kind: str, temperature: float,
    weight: float, compute_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PyTorch version: (loss [R] fp32, the label's CE [R] fp32, correct [R] bool); with `compute_grad` the
    gradient replaces `logits` (worked on in place when fp32). `teacher_logits` is only read."""
    hard, inverse = 1.0 - weight, 1.0 / temperature
    x = logits.to(torch.float32, copy=not compute_grad)
    t = teacher_logits.to(torch.float32, copy=True)
    correct = x.argmax(dim=-1) == labels
    lse = torch.logsumexp(x, dim=-1)
    label_ce = lse - x.gather(1, labels[:, None]).squeeze(1)
    # The CE's part of the gradient, softmax(x) (its label's -1 is added last), before x is tempered in place.
    softmax = x.sub(lse[:, None]).exp_().mul_(hard) if compute_grad and hard > 0 else None
    log_p = _log_softmax_(x.mul_(inverse))
    log_q = _log_softmax_(t.mul_(inverse))
    if kind == "kl":
        q = log_q.exp()
        divergence = (q * log_q.sub_(log_p)).sum(dim=-1)
        grad = log_p.exp_().sub_(q)  # p_T - q_T, in x's buffer
    else:
        p, q = log_p.exp_(), log_q.exp_()
        below = p < q
        share = torch.where(below, p, 0.0).sum(dim=-1, keepdim=True)  # S
        divergence = 1.0 - torch.minimum(p, q).sum(dim=-1)
        grad = p.mul_(share - below.to(p.dtype))  # p_v * (S - [p_v < q_v]), in x's buffer
    loss = hard * label_ce + weight * divergence
    if compute_grad:
        grad.mul_(weight * inverse)
        if softmax is not None:
            grad.add_(softmax).scatter_add_(1, labels[:, None], torch.full_like(lse[:, None], -hard))
        if grad.data_ptr() != logits.data_ptr():
            logits.copy_(grad)
    return loss, label_ce, correct


def _distill_kernel(
    logits_ptr, teacher_ptr, labels_ptr, loss_ptr, ce_ptr, correct_ptr, V, stride, teacher_stride, inverse, weight,
    BLOCK_V: tl.constexpr, TV: tl.constexpr, COMPUTE_GRAD: tl.constexpr,
):
    row = tl.program_id(0)
    base = logits_ptr + row.to(tl.int64) * stride
    teacher_base = teacher_ptr + row.to(tl.int64) * teacher_stride
    label = tl.load(labels_ptr + row)
    hard = 1.0 - weight
    offs = tl.arange(0, BLOCK_V)
    # Running maxima and sums of x (for the CE and the argmax), of x/T (p_T) and of t/T (q_T); for KL, the sum of
    # exp(t/T - max) * (t/T - x/T) on the teacher's running scale.
    x_max = tl.full((), float("-inf"), tl.float32)
    x_sum = tl.zeros((), tl.float32)
    best_index = tl.zeros((), tl.int64)
    p_max = tl.full((), float("-inf"), tl.float32)
    p_sum = tl.zeros((), tl.float32)
    q_max = tl.full((), float("-inf"), tl.float32)
    q_sum = tl.zeros((), tl.float32)
    q_dot = tl.zeros((), tl.float32)
    for start in range(0, V, BLOCK_V):
        mask = start + offs < V
        x = tl.load(base + start + offs, mask=mask, other=float("-inf")).to(tl.float32)
        t = tl.load(teacher_base + start + offs, mask=mask, other=float("-inf")).to(tl.float32) * inverse
        chunk_max = tl.max(x, axis=0)
        # The first chunk holding a strictly larger maximum wins, so ties keep the earliest index.
        chunk_first = tl.min(tl.where(x == chunk_max, start + offs, 2147483647), axis=0).to(tl.int64)
        best_index = tl.where(chunk_max > x_max, chunk_first, best_index)
        new_max = tl.maximum(x_max, chunk_max)
        x_sum = x_sum * tl.exp(x_max - new_max) + tl.sum(tl.exp(x - new_max), axis=0)
        x_max = new_max
        tempered = x * inverse
        new_p_max = tl.maximum(p_max, chunk_max * inverse)
        p_sum = p_sum * tl.exp(p_max - new_p_max) + tl.sum(tl.exp(tempered - new_p_max), axis=0)
        p_max = new_p_max
        new_q_max = tl.maximum(q_max, tl.max(t, axis=0))
        rescale = tl.exp(q_max - new_q_max)
        e = tl.exp(t - new_q_max)  # 0 where masked
        q_sum = q_sum * rescale + tl.sum(e, axis=0)
        if not TV:
            # Masked lanes hold -inf in both: zeros keep their difference from being nan (e is 0 there).
            q_dot = q_dot * rescale + tl.sum(e * (tl.where(mask, t, 0.0) - tl.where(mask, tempered, 0.0)), axis=0)
        q_max = new_q_max
    lse = x_max + tl.log(x_sum)
    p_lse = p_max + tl.log(p_sum)
    q_lse = q_max + tl.log(q_sum)
    label_ce = lse - tl.load(base + label).to(tl.float32)
    share = tl.zeros((), tl.float32)  # S of TV's gradient
    if TV:
        overlap = tl.zeros((), tl.float32)
        for start in range(0, V, BLOCK_V):
            mask = start + offs < V
            x = tl.load(base + start + offs, mask=mask, other=float("-inf")).to(tl.float32)
            t = tl.load(teacher_base + start + offs, mask=mask, other=float("-inf")).to(tl.float32)
            p = tl.exp(x * inverse - p_lse)
            q = tl.exp(t * inverse - q_lse)
            overlap += tl.sum(tl.minimum(p, q), axis=0)
            share += tl.sum(tl.where(p < q, p, 0.0), axis=0)
        divergence = 1.0 - overlap
    else:
        divergence = q_dot / q_sum - q_lse + p_lse  # sum_v q (t/T - x/T) - lse(t/T) + lse(x/T)
    tl.store(loss_ptr + row, hard * label_ce + weight * divergence)
    tl.store(ce_ptr + row, label_ce)
    tl.store(correct_ptr + row, (best_index == label).to(tl.int8))
    if COMPUTE_GRAD:
        for start in range(0, V, BLOCK_V):
            mask = start + offs < V
            x = tl.load(base + start + offs, mask=mask, other=float("-inf")).to(tl.float32)
            t = tl.load(teacher_base + start + offs, mask=mask, other=float("-inf")).to(tl.float32)
            p = tl.exp(x * inverse - p_lse)
            q = tl.exp(t * inverse - q_lse)
            grad = p * (share - tl.where(p < q, 1.0, 0.0)) if TV else p - q  # the divergence's, times T
            grad = grad * (weight * inverse) + hard * (tl.exp(x - lse) - tl.where(start + offs == label, 1.0, 0.0))
            tl.store(base + start + offs, grad.to(logits_ptr.dtype.element_ty), mask=mask)


def distill_grad_triton(
    logits: torch.Tensor, teacher_logits: torch.Tensor, labels: torch.Tensor, kind: str, temperature: float,
    weight: float, compute_grad: bool = True, block_v: int | None = None, num_warps: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`distill_grad_reference`'s contract; logits, teacher_logits [R, V] (rows contiguous) fp32/bf16/fp16.
    `block_v`, `num_warps`: the launch's vocabulary tile and warps (None: BLOCK_V, NUM_WARPS)."""
    rows, vocab = logits.shape
    assert kind in KINDS and logits.stride(1) == 1 and labels.shape == (rows,)
    assert teacher_logits.shape == logits.shape and teacher_logits.stride(1) == 1
    loss = torch.empty(rows, device=logits.device, dtype=torch.float32)
    label_ce = torch.empty_like(loss)
    correct = torch.empty(rows, device=logits.device, dtype=torch.int8)
    if rows:
        block_v = block_v or min(BLOCK_V, next_power_of_2(vocab))
        jit(_distill_kernel)[(rows,)](
            logits, teacher_logits, labels.contiguous(), loss, label_ce, correct, vocab, logits.stride(0),
            teacher_logits.stride(0), 1.0 / temperature, float(weight), BLOCK_V=block_v, TV=kind == "tv",
            COMPUTE_GRAD=compute_grad, num_warps=num_warps or NUM_WARPS,
        )
    return loss, label_ce, correct.bool()
