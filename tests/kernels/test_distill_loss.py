"""The fused distillation kernel (KL or TV at a temperature, mixed with the label's CE) against autograd through
the definitions, against its PyTorch reference, and the chunked loss with the kernel against the loss without.

On CPU the kernels run under TRITON_INTERPRET=1; when this process imported triton without it, the file
re-runs itself in a subprocess that sets it from the start.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from dflash_train.kernels._triton import HAS_TRITON, interpreting
from dflash_train.kernels.distill_loss import _distill_kernel, distill_grad_reference, distill_grad_triton
from dflash_train.objective.distill import Distillation, chunked_distillation_rows
from tests.helpers.kernels import DEVICE, compile_for_h100, kernels_here, under_interpreter

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")

test_under_interpreter = under_interpreter(__file__)

SETTINGS = [("kl", 1.0, 1.0), ("kl", 0.6, 0.5), ("tv", 0.7, 1.0), ("tv", 1.3, 0.25)]


def make_case(rows: int, vocab: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, vocab, generator=gen) * 3).to(dtype)
    teacher = (torch.randn(rows, vocab, generator=gen) * 3).to(dtype)
    labels = torch.randint(0, vocab, (rows,), generator=gen)
    labels[0] = logits[0].float().argmax()  # at least one row is right
    return logits, teacher, labels


def autograd_oracle(logits: torch.Tensor, teacher: torch.Tensor, labels: torch.Tensor, kind: str,
                    temperature: float, weight: float) -> tuple[torch.Tensor, torch.Tensor]:
    x = logits.float().clone().requires_grad_(True)
    p, q = (x / temperature).softmax(-1), (teacher.float() / temperature).softmax(-1)
    kl, tv = (q * (q.log() - p.log())).sum(-1), 1 - torch.minimum(p, q).sum(-1)
    per_row = (1 - weight) * F.cross_entropy(x, labels, reduction="none") + weight * (kl if kind == "kl" else tv)
    per_row.sum().backward()
    return per_row.detach(), x.grad


@pytest.mark.parametrize(("kind", "temperature", "weight"), SETTINGS)
def test_reference_equals_autograd(kind: str, temperature: float, weight: float) -> None:
    logits, teacher, labels = make_case(7, 300, torch.float32, 0)
    want_loss, want_grad = autograd_oracle(logits, teacher, labels, kind, temperature, weight)
    buffer, teacher_before = logits.clone(), teacher.clone()
    loss, label_ce, correct = distill_grad_reference(buffer, teacher, labels, kind, temperature, weight)
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(label_ce, F.cross_entropy(logits, labels, reduction="none"))
    assert torch.equal(correct, logits.argmax(-1) == labels) and torch.equal(teacher, teacher_before)
    torch.testing.assert_close(buffer, want_grad, rtol=1e-4, atol=1e-6)


def test_reference_without_gradient_leaves_the_logits() -> None:
    logits, teacher, labels = make_case(4, 100, torch.float32, 1)
    buffer = logits.clone()
    distill_grad_reference(buffer, teacher, labels, "kl", 0.7, 0.5, compute_grad=False)
    assert torch.equal(buffer, logits)


@kernels_here
@pytest.mark.parametrize(("rows", "vocab", "block_v"), [(5, 1000, 64), (3, 257, 64), (9, 4096, 1024)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("kind", "temperature", "weight"), SETTINGS)
def test_kernel_equals_reference(rows: int, vocab: int, block_v: int, dtype: torch.dtype, kind: str,
                                 temperature: float, weight: float) -> None:
    """The teacher's maximum moves between chunks (online rescaling), and in row 0 it sits in the partly masked
    last chunk (257 = 4 x 64 + 1)."""
    logits, teacher, labels = make_case(rows, vocab, dtype, rows)
    teacher[0, -1] = 30.0
    want_buffer, got_buffer = logits.clone(), logits.clone().to(DEVICE)
    want = distill_grad_reference(want_buffer, teacher, labels, kind, temperature, weight)
    got = distill_grad_triton(got_buffer, teacher.to(DEVICE), labels.to(DEVICE), kind, temperature, weight,
                              block_v=block_v)
    for name, a, b in zip(("loss", "label_ce"), got[:2], want[:2], strict=True):
        torch.testing.assert_close(a.cpu(), b, rtol=1e-5, atol=1e-5, msg=name)
    assert torch.equal(got[2].cpu(), want[2])
    tolerance = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got_buffer.cpu().float(), want_buffer.float(), rtol=tolerance, atol=tolerance)


@kernels_here
def test_the_launch_benchmark_checks_every_launch_against_the_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`benchmarks.distill_loss --tiny`: each launch configuration's loss agrees with the default's, and each is
    reported against the copy of the same bytes measured in the run."""
    import json

    from benchmarks import distill_loss as bench

    monkeypatch.setenv("DFLASH_BENCH_RESULTS", str(tmp_path))
    bench.main(["--tiny"])
    found = json.loads((tmp_path / "distill_loss.json").read_text())
    assert {row["config"] for row in found["results"]} >= {"torch reference", "BLOCK_V=128 num_warps=4"}
    assert all(row["loss_max_rel_diff"] < 1e-5 and row["of_copy"] > 0 for row in found["results"])


@kernels_here
def test_kernel_ties_take_the_first_index_and_no_grad_leaves_logits() -> None:
    logits = torch.zeros(3, 200)
    logits[:, [10, 70, 150]] = 5.0  # equal maxima inside one 64-wide chunk and across chunks
    labels = torch.tensor([10, 70, 150])
    buffer = logits.clone().to(DEVICE)
    _, _, correct = distill_grad_triton(buffer, torch.randn(3, 200).to(DEVICE), labels.to(DEVICE), "tv", 0.7, 0.5,
                                        compute_grad=False, block_v=64)
    assert correct.cpu().tolist() == [True, False, False]
    assert torch.equal(buffer.cpu(), logits)


@kernels_here
@pytest.mark.parametrize("distill", [Distillation("kl", 0.7, 0.5), Distillation("tv", 1.0, 1.0)])
def test_chunked_loss_with_the_kernel_equals_the_loss_without(distill: Distillation) -> None:
    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(37, 16, generator=gen)
    head = torch.randn(500, 16, generator=gen)
    teacher = torch.randn(37, 16, generator=gen)
    labels = torch.randint(0, 500, (37,), generator=gen)
    weights = torch.rand(37, generator=gen)
    results = []
    for fused in (False, True):
        h = hidden.clone().to(DEVICE).requires_grad_(True)
        loss, label_ce, correct = chunked_distillation_rows(h, head.to(DEVICE), labels.to(DEVICE), teacher.to(DEVICE),
                                                            distill, chunk_rows=10, fused=fused)
        (loss * weights.to(DEVICE)).sum().backward()
        results.append((loss.detach().cpu(), label_ce.cpu(), correct.cpu(), h.grad.cpu()))
    (loss_a, ce_a, correct_a, grad_a), (loss_b, ce_b, correct_b, grad_b) = results
    torch.testing.assert_close(loss_b, loss_a)
    torch.testing.assert_close(ce_b, ce_a)
    assert torch.equal(correct_b, correct_a)
    torch.testing.assert_close(grad_b, grad_a)




@pytest.mark.skipif(not HAS_TRITON or interpreting(), reason="needs triton's compiler")
@pytest.mark.parametrize("tv", [False, True])
def test_the_kernel_compiles_for_the_gpu(tv: bool) -> None:
    """The interpreter accepts what the compiler may not: the kernel as an H100 gets it, bf16 logits."""
    pointers = {"logits_ptr": "*bf16", "teacher_ptr": "*bf16", "labels_ptr": "*i64", "loss_ptr": "*fp32",
                "ce_ptr": "*fp32", "correct_ptr": "*i8", "inverse": "fp32", "weight": "fp32"}
    assert compile_for_h100(_distill_kernel, {"BLOCK_V": 4096, "TV": tv, "COMPUTE_GRAD": True}, pointers, "fp32")
