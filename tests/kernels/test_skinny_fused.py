"""The fused skinny-matmul kernel (norm prologue, SwiGLU and residual epilogues) against its reference, which is
checked against the PyTorch modules it replaces composed by hand (an RMSNorm module, F.linear, F.silu, an add),
and its batch invariance. Under the interpreter bf16 roundings are done on the bits (the interpreter truncates
its casts), so bf16 results are compared with the reference exactly but for rare sums whose order tips one.

On CPU the kernels run under TRITON_INTERPRET=1; when this process imported triton without it, the file
re-runs itself in a subprocess that sets it from the start.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dflash_train.kernels._triton import HAS_TRITON, interpreting
from dflash_train.kernels.skinny_fused import skinny_fused_reference, skinny_fused_triton
from dflash_train.kernels.skinny_matmul import BLOCK_M, Config, _skinny_matmul_kernel, launch
from dflash_train.models.layers import RMSNorm
from tests.helpers.kernels import DEVICE, compile_for_h100, kernels_here, randn, under_interpreter

test_under_interpreter = under_interpreter(__file__)


def modules(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, norm: RMSNorm | None,
            swiglu: bool, residual: torch.Tensor | None) -> torch.Tensor:
    """What a decoder layer computes with the model's own modules (independent of the kernel's reference)."""
    if norm is not None:
        x = norm(x)
    y = F.linear(x, weight, bias)
    if swiglu:
        gate, up = y.chunk(2, dim=-1)
        y = F.silu(gate) * up
    return y if residual is None else residual + y


CASES = [  # rows, outputs, K, bias, norm, swiglu, residual
    (1, 48, 40, False, True, False, False),  # qkv at decode: norm prologue, K shorter than a step
    (16, 100, 300, True, True, False, False),  # a verify block, sizes off the tiles, with a bias
    (5, 40, 96, False, True, True, False),  # gate/up: norm and SwiGLU
    (3, 24, 272, True, False, True, False),  # SwiGLU alone, bias on both halves
    (16, 72, 130, False, False, False, True),  # o_proj / down: residual epilogue
    (40, 64, 64, True, True, True, True),  # everything, three row tiles
]


@kernels_here
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "n", "k", "bias", "norm", "swiglu", "residual"), CASES)
def test_kernel_matches_the_modules(dtype: torch.dtype, rows: int, n: int, k: int, bias: bool, norm: bool,
                                    swiglu: bool, residual: bool) -> None:
    gen = torch.Generator().manual_seed(rows * n + k)
    width = 2 * n if swiglu else n
    x = randn(rows, k, dtype=dtype, gen=gen) * 2
    w = randn(width, k, dtype=dtype, gen=gen) / k ** 0.5
    b = randn(width, dtype=dtype, gen=gen) if bias else None
    r = randn(rows, n, dtype=dtype, gen=gen) if residual else None
    rms = None
    if norm:
        rms = RMSNorm(k, eps=1e-5).to(dtype)
        rms.weight.data = (1 + randn(k, dtype=dtype, gen=gen) / 4).to(dtype)
    on = [t.to(DEVICE) if t is not None else None for t in (x, w, b, r)]
    got = skinny_fused_triton(on[0], on[1], on[2], norm_weight=rms.weight.to(DEVICE) if rms else None,
                              norm_eps=1e-5, swiglu=swiglu, residual=on[3]).cpu()
    assert got.shape == (rows, n) and got.dtype == dtype
    with torch.no_grad():
        expected = modules(x, w, b, rms, swiglu, r)
    spelled = skinny_fused_reference(x, w, b, rms.weight.detach() if rms else None, 1e-5, swiglu, r)
    # The reference is the modules step for step (up to the order of fp32 sums and where a bias is added).
    torch.testing.assert_close(spelled, expected)
    if dtype == torch.float32:
        torch.testing.assert_close(got, spelled, atol=2e-5, rtol=2e-5)
    else:  # the same rounding steps: equal, but for a sum whose order tips a rounding (rare, one unit)
        assert float((got != spelled).float().mean()) < 0.02
        torch.testing.assert_close(got, spelled, atol=1e-2, rtol=8e-3)


@kernels_here
def test_rows_are_batch_invariant() -> None:
    """One row alone, then among others at various places: bitwise the same output, norm and epilogues on."""
    gen = torch.Generator().manual_seed(3)
    k, n, dtype = 192, 40, torch.bfloat16
    w = (randn(2 * n, k, dtype=dtype, gen=gen) / k ** 0.5).to(DEVICE)
    gamma = (1 + randn(k, dtype=dtype, gen=gen) / 4).to(DEVICE)
    row, res = randn(k, dtype=dtype, gen=gen).to(DEVICE), randn(n, dtype=dtype, gen=gen).to(DEVICE)
    alone = skinny_fused_triton(row[None], w, norm_weight=gamma, norm_eps=1e-6, swiglu=True, residual=res[None])[0]
    for rows, place in [(2, 1), (16, 9), (33, 32)]:
        x = (randn(rows, k, dtype=dtype, gen=gen) * 5).to(DEVICE)
        r = randn(rows, n, dtype=dtype, gen=gen).to(DEVICE)
        x[place], r[place] = row, res
        got = skinny_fused_triton(x, w, norm_weight=gamma, norm_eps=1e-6, swiglu=True, residual=r)
        assert torch.equal(got[place], alone), (rows, place)


@kernels_here
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_k_with_norm_swiglu_and_residual(dtype: torch.dtype) -> None:
    """K in three slices: every slice normalises x with the whole row's mean square, the slices' gate and up
    sums are added in order, then SwiGLU and the residual add: the reference's result (fp32 sums in another
    order), and a row's output bitwise the same alone and among others."""
    gen = torch.Generator().manual_seed(11)
    rows, n, k = 16, 24, 320
    x = (randn(rows, k, dtype=dtype, gen=gen) * 2).to(DEVICE)
    w = (randn(2 * n, k, dtype=dtype, gen=gen) / k ** 0.5).to(DEVICE)
    b = randn(2 * n, dtype=dtype, gen=gen).to(DEVICE)
    gamma = (1 + randn(k, dtype=dtype, gen=gen) / 4).to(DEVICE)
    r = randn(rows, n, dtype=dtype, gen=gen).to(DEVICE)
    flags = dict(NORM=True, SWIGLU=True, RESIDUAL=True, HAS_BIAS=True)
    config = Config(16, 64, split_k=3)
    got = launch(x, gamma, w, b, r, 1e-5, n, flags, config).cpu()
    spelled = skinny_fused_reference(x.cpu(), w.cpu(), b.cpu(), gamma.cpu(), 1e-5, True, r.cpu())
    if dtype == torch.float32:
        torch.testing.assert_close(got, spelled, atol=2e-5, rtol=2e-5)
    else:
        assert float((got != spelled).float().mean()) < 0.02
        torch.testing.assert_close(got, spelled, atol=1e-2, rtol=8e-3)
    alone = launch(x[7:8].contiguous(), gamma, w, b, r[7:8].contiguous(), 1e-5, n, flags, config)[0].cpu()
    assert torch.equal(got[7], alone)


@kernels_here
@pytest.mark.parametrize(("norm_k", "norm_stages"), [(128, 2), (16, 8)])
def test_the_norm_pass_tiling_changes_no_result(norm_k: int, norm_stages: int) -> None:
    """The pass that sums the rows' squares in tiles of its own width (wider or narrower than the product's
    steps, K not a multiple of either): the modules' result, and a row the same alone and among others."""
    gen = torch.Generator().manual_seed(12)
    rows, n, k = 16, 40, 200
    x = (randn(rows, k, dtype=torch.float32, gen=gen) * 2).to(DEVICE)
    w = (randn(2 * n, k, dtype=torch.float32, gen=gen) / k ** 0.5).to(DEVICE)
    gamma = (1 + randn(k, dtype=torch.float32, gen=gen) / 4).to(DEVICE)
    flags = dict(NORM=True, SWIGLU=True, RESIDUAL=False, HAS_BIAS=False)
    config = Config(16, 64, norm_k=norm_k, norm_stages=norm_stages)
    got = launch(x, gamma, w, w, x, 1e-5, n, flags, config).cpu()
    norm = RMSNorm(k, eps=1e-5)
    norm.weight.data = gamma.cpu()
    torch.testing.assert_close(got, modules(x.cpu(), w.cpu(), None, norm, True, None), atol=2e-5, rtol=2e-5)
    alone = launch(x[3:4].contiguous(), gamma, w, w, x[3:4].contiguous(), 1e-5, n, flags, config)[0].cpu()
    assert torch.equal(got[3], alone)


def test_arguments_checked() -> None:
    x, w = torch.zeros(2, 8), torch.zeros(6, 8)
    with pytest.raises(AssertionError, match="even number of rows"):
        skinny_fused_triton(x, torch.zeros(5, 8), swiglu=True)
    with pytest.raises(AssertionError, match="norm weight"):
        skinny_fused_triton(x, w, norm_weight=torch.zeros(7))
    with pytest.raises(AssertionError, match="residual"):
        skinny_fused_triton(x, w, swiglu=True, residual=torch.zeros(2, 6))
    with pytest.raises(AssertionError, match="1..64"):
        skinny_fused_triton(torch.zeros(65, 8), w)


def test_registered_as_a_custom_op() -> None:
    assert hasattr(torch.ops.dflash_train, "skinny_fused")


@pytest.mark.skipif(not HAS_TRITON or interpreting(), reason="needs triton's compiler")
@pytest.mark.parametrize(("element", "flags"), [
    ("bf16", dict(NORM=True, SWIGLU=False, RESIDUAL=False, HAS_BIAS=True)),
    ("bf16", dict(NORM=True, SWIGLU=True, RESIDUAL=False, HAS_BIAS=False)),
    ("bf16", dict(NORM=False, SWIGLU=False, RESIDUAL=True, HAS_BIAS=False)),
    ("fp32", dict(NORM=True, SWIGLU=True, RESIDUAL=True, HAS_BIAS=True)),
    ("bf16", dict(NORM=True, SWIGLU=True, RESIDUAL=True, HAS_BIAS=True)),
    ("fp16", dict(NORM=True, SWIGLU=True, RESIDUAL=True, HAS_BIAS=False)),
])
def test_kernel_compiles_for_the_gpu(element: str, flags: dict[str, bool]) -> None:
    """A kernel that only fails in the GPU compiler (types the interpreter lets through) fails here, on CPU."""
    constants = dict(**flags, EPS=1e-6, BLOCK_M=BLOCK_M, BLOCK_N=32, BLOCK_K=128, EVEN_K=False, SPLIT_K=1,
                     IEEE=element == "fp32", UPCAST=False, ROUND_BITS=False, OPAQUE=True, GDC=False,
                     PREFETCH_K=512, PREFETCH_STEP=64, NORM_K=512, NORM_STAGES=4, STATS_IN=False,
                     STATS_OUT=False, STATS_BLOCK=1)
    pointers = {name: f"*{element}" for name in ("x_ptr", "g_ptr", "w_ptr", "b_ptr", "r_ptr", "y_ptr")}
    compile_for_h100(_skinny_matmul_kernel, constants, {**pointers, "p_ptr": "*fp32", "s_in_ptr": "*fp32", "s_out_ptr": "*fp32"}, "fp32")

