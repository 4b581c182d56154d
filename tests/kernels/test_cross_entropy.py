"""The fused cross-entropy kernel against autograd through F.cross_entropy (hard labels) and through
log_softmax (soft targets), against its PyTorch references, and the chunked loss with the kernel against
the loss without it, with hard and soft targets.

On CPU the kernels run under TRITON_INTERPRET=1; when this process imported triton without it, the file
re-runs itself in a subprocess that sets it from the start.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dflash_train.kernels._triton import HAS_TRITON
from dflash_train.kernels.cross_entropy import (
    cross_entropy_grad_reference,
    cross_entropy_grad_triton,
    soft_cross_entropy_grad_reference,
)
from dflash_train.objective.loss import chunked_weighted_cross_entropy
from tests.helpers.kernels import DEVICE, kernels_here, under_interpreter

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")


test_under_interpreter = under_interpreter(__file__)


def make_case(rows: int, vocab: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, vocab, generator=gen) * 3).to(dtype)
    labels = torch.randint(0, vocab, (rows,), generator=gen)
    weights = torch.rand(rows, generator=gen)
    labels[0] = logits[0].float().argmax()  # at least one row is right
    return logits, labels, weights


def autograd_oracle(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, ...]:
    x = logits.float().clone().requires_grad_(True)
    per_row = F.cross_entropy(x, labels, reduction="none") * weights
    per_row.sum().backward()
    return per_row.detach(), x.argmax(-1) == labels, x.grad


def soft_autograd_oracle(
    logits: torch.Tensor, teacher: torch.Tensor, weights: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    x = logits.float().clone().requires_grad_(True)
    per_row = -(teacher.float().softmax(-1) * x.log_softmax(-1)).sum(-1) * weights
    per_row.sum().backward()
    return per_row.detach(), x.grad


def test_soft_reference_equals_autograd() -> None:
    logits, labels, weights = make_case(6, 300, torch.float32, 1)
    teacher, _, _ = make_case(6, 300, torch.float32, 2)
    want_loss, want_grad = soft_autograd_oracle(logits, teacher, weights)
    buffer = logits.clone()
    loss, correct = soft_cross_entropy_grad_reference(buffer, teacher, labels, weights)
    torch.testing.assert_close(loss, want_loss)
    assert torch.equal(correct, logits.argmax(-1) == labels)
    torch.testing.assert_close(buffer, want_grad)


def test_reference_equals_autograd() -> None:
    logits, labels, weights = make_case(7, 300, torch.float32, 0)
    want_loss, want_correct, want_grad = autograd_oracle(logits, labels, weights)
    buffer = logits.clone()
    loss, correct = cross_entropy_grad_reference(buffer, labels, weights)
    torch.testing.assert_close(loss, want_loss)
    assert torch.equal(correct, want_correct)
    torch.testing.assert_close(buffer, want_grad)


@kernels_here
@pytest.mark.parametrize(("rows", "vocab", "block_v"), [(5, 1000, 64), (3, 257, None), (9, 4096, 1024)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_equals_reference(rows: int, vocab: int, block_v: int | None, dtype: torch.dtype) -> None:
    logits, labels, weights = make_case(rows, vocab, dtype, rows)
    want_buffer, got_buffer = logits.clone(), logits.clone().to(DEVICE)
    want_loss, want_correct = cross_entropy_grad_reference(want_buffer, labels, weights)
    loss, correct = cross_entropy_grad_triton(got_buffer, labels.to(DEVICE), weights.to(DEVICE), block_v=block_v)
    torch.testing.assert_close(loss.cpu(), want_loss, rtol=1e-5, atol=1e-5)
    assert torch.equal(correct.cpu(), want_correct)
    tolerance = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got_buffer.cpu().float(), want_buffer.float(), rtol=tolerance, atol=tolerance)


@kernels_here
@pytest.mark.parametrize(("rows", "vocab", "block_v"), [(5, 1000, 64), (3, 257, None)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_soft_kernel_equals_reference(rows: int, vocab: int, block_v: int | None, dtype: torch.dtype) -> None:
    """Soft targets: the teacher's maximum moves between chunks (online rescaling) and the last chunk is
    partly masked (257 = 4 x 64 + 1)."""
    logits, labels, weights = make_case(rows, vocab, dtype, rows)
    teacher, _, _ = make_case(rows, vocab, dtype, rows + 100)
    teacher[0, -1] = 30.0  # the teacher's maximum in the masked last chunk of row 0
    want_buffer, got_buffer = logits.clone(), logits.clone().to(DEVICE)
    want_loss, want_correct = soft_cross_entropy_grad_reference(want_buffer, teacher, labels, weights)
    loss, correct = cross_entropy_grad_triton(got_buffer, labels.to(DEVICE), weights.to(DEVICE), block_v=block_v,
                                              teacher_logits=teacher.to(DEVICE))
    torch.testing.assert_close(loss.cpu(), want_loss, rtol=1e-5, atol=1e-5)
    assert torch.equal(correct.cpu(), want_correct)
    tolerance = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got_buffer.cpu().float(), want_buffer.float(), rtol=tolerance, atol=tolerance)


@kernels_here
def test_kernel_ties_take_the_first_index_and_no_grad_leaves_logits() -> None:
    logits = torch.zeros(3, 200)
    logits[:, [10, 70, 150]] = 5.0  # equal maxima inside one 64-wide chunk and across chunks
    labels = torch.tensor([10, 70, 150])
    buffer = logits.clone().to(DEVICE)
    _, correct = cross_entropy_grad_triton(buffer, labels.to(DEVICE), torch.ones(3, device=DEVICE),
                                           compute_grad=False, block_v=64)
    assert correct.cpu().tolist() == [True, False, False]
    assert torch.equal(buffer.cpu(), logits)


@kernels_here
@pytest.mark.parametrize("soft", [False, True])
def test_chunked_loss_with_the_kernel_equals_the_loss_without(soft: bool) -> None:
    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(37, 16, generator=gen)
    head = torch.randn(500, 16, generator=gen)
    labels = torch.randint(0, 500, (37,), generator=gen)
    weights = torch.rand(37, generator=gen)
    teacher = torch.randn(37, 16, generator=gen).to(DEVICE) if soft else None
    results = []
    for fused in (False, True):
        h = hidden.clone().to(DEVICE).requires_grad_(True)
        loss, correct = chunked_weighted_cross_entropy(h, head.to(DEVICE), labels.to(DEVICE), weights.to(DEVICE),
                                                       chunk_rows=10, teacher_hidden=teacher, fused=fused)
        loss.backward()
        results.append((loss.detach().cpu(), correct.cpu(), h.grad.cpu()))
    (loss_a, correct_a, grad_a), (loss_b, correct_b, grad_b) = results
    torch.testing.assert_close(loss_b, loss_a)
    assert torch.equal(correct_b, correct_a)
    torch.testing.assert_close(grad_b, grad_a)
