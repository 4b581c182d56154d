"""Per-row cross-entropy of the chunked head loss as a differentiable output, against autograd through
F.cross_entropy: values, gradients under weights computed from the losses themselves, soft targets, the
fused kernel (under the Triton interpreter on CPU), and what the graph keeps for backward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dflash_train.kernels._triton import HAS_TRITON
from dflash_train.objective.loss import chunked_cross_entropy_rows
from tests.helpers.kernels import DEVICE, kernels_here, under_interpreter

test_under_interpreter = under_interpreter(__file__)


def case(rows: int, hidden_size: int, vocab: int, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(rows, hidden_size, generator=gen)
    head = torch.randn(vocab, hidden_size, generator=gen)
    labels = torch.randint(0, vocab, (rows,), generator=gen)
    return hidden, head, labels


def ce_dependent_weights(ce: torch.Tensor) -> torch.Tensor:
    """Weights that depend on the (detached) losses, as D-PACE's do."""
    return torch.exp(-ce.detach()) + torch.arange(ce.numel(), dtype=ce.dtype) / ce.numel()


@pytest.mark.parametrize(("rows", "chunk"), [(23, 5), (8, 8), (1, 4)])
def test_rows_and_gradient_equal_autograd(rows: int, chunk: int) -> None:
    hidden, head, labels = case(rows, 12, 37, rows)
    got_hidden = hidden.clone().requires_grad_(True)
    row_ce, correct = chunked_cross_entropy_rows(got_hidden, head, labels, chunk_rows=chunk, fused=False)
    (row_ce * ce_dependent_weights(row_ce)).sum().backward()

    want_hidden = hidden.clone().requires_grad_(True)
    want_ce = F.cross_entropy(want_hidden @ head.T, labels, reduction="none")
    (want_ce * ce_dependent_weights(want_ce)).sum().backward()
    assert row_ce.dtype == torch.float32 and row_ce.shape == (rows,)
    torch.testing.assert_close(row_ce, want_ce.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_hidden.grad, want_hidden.grad, atol=1e-6, rtol=1e-4)
    assert torch.equal(correct, (hidden @ head.T).argmax(-1) == labels)


def test_soft_target_rows_equal_autograd() -> None:
    hidden, head, labels = case(19, 16, 41, 7)
    teacher = torch.randn(19, 16, generator=torch.Generator().manual_seed(8))
    got_hidden = hidden.clone().requires_grad_(True)
    row_ce, _ = chunked_cross_entropy_rows(got_hidden, head, labels, chunk_rows=6, teacher_hidden=teacher)
    (row_ce * torch.linspace(0.1, 2.0, 19)).sum().backward()

    want_hidden = hidden.clone().requires_grad_(True)
    soft = (teacher @ head.T).softmax(-1)
    want_ce = -(soft * (want_hidden @ head.T).log_softmax(-1)).sum(-1)
    (want_ce * torch.linspace(0.1, 2.0, 19)).sum().backward()
    torch.testing.assert_close(row_ce, want_ce.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_hidden.grad, want_hidden.grad, atol=1e-6, rtol=1e-4)


def test_bf16_rows_scale_their_unit_gradient_in_fp32() -> None:
    """In bf16, row r's gradient is its unit-weight gradient times w_r rounded once: small per-row weights
    (1 / rows of a batch) lose nothing more than that rounding."""
    hidden, head, labels = case(29, 32, 77, 2)
    grads = []
    weights = torch.rand(29, generator=torch.Generator().manual_seed(3)) * 1e-3
    for w in (torch.ones(29), weights):
        h = hidden.bfloat16().requires_grad_(True)
        row_ce, _ = chunked_cross_entropy_rows(h, head.bfloat16(), labels, chunk_rows=8, fused=False)
        (row_ce * w).sum().backward()
        grads.append(h.grad)
    unit, weighted = grads
    assert weighted.dtype == torch.bfloat16
    assert torch.equal(weighted, (unit.float() * weights[:, None]).bfloat16())
    want_hidden = hidden.bfloat16().float().requires_grad_(True)
    want_ce = F.cross_entropy(want_hidden @ head.bfloat16().float().T, labels, reduction="none")
    want_ce.sum().backward()
    torch.testing.assert_close(row_ce, want_ce.detach(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(unit.float(), want_hidden.grad, atol=5e-2, rtol=5e-2)


def test_the_graph_keeps_one_hidden_sized_tensor() -> None:
    """Backward needs only the unit-weight gradient rows [P, H]: no logits, no per-chunk state."""
    hidden, head, labels = case(40, 16, 300, 5)
    hidden.requires_grad_(True)
    saved: list[tuple[int, ...]] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved.append(tuple(tensor.shape))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        row_ce, _ = chunked_cross_entropy_rows(hidden, head, labels, chunk_rows=7, fused=False)
    assert saved == [(40, 16)]
    row_ce.sum().backward()
    assert hidden.grad.shape == (40, 16)


def test_without_grad_nothing_is_kept() -> None:
    hidden, head, labels = case(9, 8, 20, 6)
    row_ce, _ = chunked_cross_entropy_rows(hidden, head, labels, chunk_rows=4)
    assert not row_ce.requires_grad
    torch.testing.assert_close(row_ce, F.cross_entropy(hidden @ head.T, labels, reduction="none"))


@kernels_here
@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_fused_rows_equal_unfused() -> None:
    hidden, head, labels = case(37, 16, 500, 3)
    results = []
    for fused in (False, True):
        h = hidden.clone().to(DEVICE).requires_grad_(True)
        row_ce, correct = chunked_cross_entropy_rows(h, head.to(DEVICE), labels.to(DEVICE), chunk_rows=10,
                                                     fused=fused)
        (row_ce * ce_dependent_weights(row_ce.cpu()).to(DEVICE)).sum().backward()
        results.append((row_ce.detach().cpu(), correct.cpu(), h.grad.cpu()))
    (ce_a, correct_a, grad_a), (ce_b, correct_b, grad_b) = results
    torch.testing.assert_close(ce_b, ce_a)
    assert torch.equal(correct_b, correct_a)
    torch.testing.assert_close(grad_b, grad_a)
