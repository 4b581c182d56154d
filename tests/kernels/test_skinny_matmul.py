"""The skinny-matmul kernel against float64 and its PyTorch reference (shapes that are not multiples of the
tiles, with and without a bias, several row counts), and its batch invariance: a row's output is the same
bits whatever the number of rows and whatever the other rows hold.

On CPU the kernels run under TRITON_INTERPRET=1; when this process imported triton without it, the file
re-runs itself in a subprocess that sets it from the start.
"""

from __future__ import annotations

import pytest
import torch

from dflash_train.kernels import skinny_matmul
from dflash_train.kernels._triton import HAS_TRITON, interpreting
from dflash_train.kernels.skinny_matmul import (
    BLOCK_M,
    CONFIGS,
    MAX_ROWS,
    Config,
    _skinny_matmul_kernel,
    _skinny_reduce_kernel,
    config_for,
    default_config,
    fits,
    launch,
    skinny_matmul_reference,
    skinny_matmul_triton,
    swiglu_tiling,
)
from tests.helpers.kernels import (
    DEVICE,
    compile_for_h100,
    kernels_here,
    pointers_written,
    randn,
    under_interpreter,
)

test_under_interpreter = under_interpreter(__file__)


@kernels_here
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("rows", "n", "k", "bias"), [
    (1, 48, 40, False),  # decode: one row, K shorter than a step
    (16, 100, 300, True),  # verify block, N and K not multiples of the tiles
    (5, 17, 512, False),  # K a whole number of steps
    (40, 64, 272, True),  # three row tiles, the last one partial
])
def test_kernel_matches_reference(dtype: torch.dtype, rows: int, n: int, k: int, bias: bool) -> None:
    gen = torch.Generator().manual_seed(rows * n + k)
    x, w = randn(rows, k, dtype=dtype, gen=gen), randn(n, k, dtype=dtype, gen=gen) / k ** 0.5
    b = randn(n, dtype=dtype, gen=gen) if bias else None
    got = skinny_matmul_triton(x.to(DEVICE), w.to(DEVICE), b.to(DEVICE) if b is not None else None).cpu()
    assert got.shape == (rows, n) and got.dtype == dtype
    exact = x.double() @ w.double().T + (b.double() if b is not None else 0.0)
    if dtype == torch.float32:
        torch.testing.assert_close(got.double(), exact, atol=1e-5, rtol=1e-5)
    else:  # fp32 sums rounded once: the reference's up to the order of the sum (a last-place unit, rarely)
        torch.testing.assert_close(got, skinny_matmul_reference(x, w, b), atol=1e-2, rtol=1e-2)
        assert float((got.double() - exact).norm() / exact.norm()) < 5e-3


@kernels_here
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("k", [256, 320])  # whole K steps, and a partial last one
def test_rows_are_batch_invariant(dtype: torch.dtype, k: int) -> None:
    """One row alone, then among 1, 15 or 39 random others at various places: bitwise the same output."""
    gen = torch.Generator().manual_seed(k)
    n = 96
    w, b = randn(n, k, dtype=dtype, gen=gen).to(DEVICE), randn(n, dtype=dtype, gen=gen).to(DEVICE)
    row = randn(k, dtype=dtype, gen=gen).to(DEVICE)
    alone = skinny_matmul_triton(row[None], w, b)[0]
    for rows, place in [(2, 1), (16, 0), (16, 11), (40, 37)]:
        x = (randn(rows, k, dtype=dtype, gen=gen) * 3).to(DEVICE)
        x[place] = row
        assert torch.equal(skinny_matmul_triton(x, w, b)[place], alone), (rows, place)


PLAIN = dict(NORM=False, SWIGLU=False, RESIDUAL=False, HAS_BIAS=True)


@kernels_here
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("split", "block_k", "k"), [
    (2, 64, 256),  # two slices of whole steps
    (3, 64, 320),  # three slices, the last one shorter
    (4, 128, 256),  # more slices than K has steps: the last two are empty
    (2, 64, 200),  # K not a whole number of steps
])
def test_split_k_is_the_same_product_and_keeps_rows_batch_invariant(dtype: torch.dtype, split: int, block_k: int,
                                                                   k: int) -> None:
    """K cut into slices whose fp32 sums a second kernel adds in order: the product of float64 (fp32) or of
    the reference (bf16), and a row's output bitwise the same alone and among 16 others."""
    gen = torch.Generator().manual_seed(split * k)
    n = 40
    x = randn(16, k, dtype=dtype, gen=gen).to(DEVICE)
    w = (randn(n, k, dtype=dtype, gen=gen) / k ** 0.5).to(DEVICE)
    b = randn(n, dtype=dtype, gen=gen).to(DEVICE)
    config = Config(16, block_k, split_k=split)
    got = launch(x, w, w, b, x, 0.0, n, PLAIN, config).cpu()
    exact = x.cpu().double() @ w.cpu().double().T + b.cpu().double()
    if dtype == torch.float32:
        torch.testing.assert_close(got.double(), exact, atol=1e-5, rtol=1e-5)
    else:
        torch.testing.assert_close(got, skinny_matmul_reference(x.cpu(), w.cpu(), b.cpu()), atol=1e-2, rtol=1e-2)
    alone = launch(x[5:6].contiguous(), w, w, b, x, 0.0, n, PLAIN, config)[0].cpu()
    assert torch.equal(got[5], alone)


@kernels_here
def test_leading_dimensions_strided_inputs_and_a_row_slice_of_a_weight() -> None:
    """x [n, T, K] as the layers hand it over, here a transposed (non-contiguous) view; the weight a slice of
    a wider one's columns (rows strided, K contiguous: read in place); a weight strided along K refused."""
    gen = torch.Generator().manual_seed(1)
    x = randn(3, 2, 40, dtype=torch.float32, gen=gen).transpose(0, 1)  # [2, 3, 40]
    wide = randn(24, 56, dtype=torch.float32, gen=gen)
    w = wide[:, 8:48]  # [24, 40], row stride 56
    got = skinny_matmul_triton(x.to(DEVICE), wide.to(DEVICE)[:, 8:48]).cpu()
    assert got.shape == (2, 3, 24)
    torch.testing.assert_close(got, x @ w.T, atol=1e-5, rtol=1e-5)
    with pytest.raises(AssertionError, match="contiguous along K"):
        skinny_matmul_triton(x.to(DEVICE), randn(40, 24, dtype=torch.float32, gen=gen).to(DEVICE).T)


def test_rows_that_go_to_the_kernel() -> None:
    assert fits(1) and fits(16) and fits(MAX_ROWS) and not fits(MAX_ROWS + 1) and not fits(0)
    assert MAX_ROWS % BLOCK_M == 0


def test_configs_depend_on_the_weight_only_and_keep_the_chip_busy() -> None:
    """A config is a function of (N, K); the default one gives Qwen3-8B's 4096-wide outputs a program per
    multiprocessor of an H200 (132), and every one has tiles a dot takes."""
    if not interpreting():  # interpreted, `config_for` hands out few, large programs instead
        assert all(config_for(n, k) == config for (n, k), config in CONFIGS.items())
    assert CONFIGS and all(config.split_k == 1 for config in CONFIGS.values())  # the H200 sweep split none
    for config in [*CONFIGS.values(), default_config(4096, 4096), default_config(151936, 4096), default_config(8, 40)]:
        assert config.block_n in (16, 32, 64, 128) and config.block_k in (16, 32, 64, 128, 256, 512)
        assert config.num_warps in (2, 4, 8) and config.num_stages >= 1 and config.split_k >= 1
    assert -(-4096 // default_config(4096, 4096).block_n) >= 132
    assert default_config(8, 40) == Config(16, 64, num_warps=2)


def test_registered_as_a_custom_op() -> None:
    """torch.compile keeps the kernel in its graph through the op (as the runtime's other kernels)."""
    assert hasattr(torch.ops.dflash_train, "skinny_matmul")


# The kernel's fp32 buffers: a split product's slices, and the norm statistics' shares in and out
SHARES = {"p_ptr": "*fp32", "s_in_ptr": "*fp32", "s_out_ptr": "*fp32"}


def kernel_constants(element: str, config: Config, even_k: bool) -> dict[str, object]:
    """The plain product's constants (no norm, SwiGLU or residual: `test_skinny_fused` compiles those)."""
    return dict(EPS=0.0, NORM=False, SWIGLU=False, RESIDUAL=False, HAS_BIAS=True, BLOCK_M=BLOCK_M,
                BLOCK_N=config.block_n, BLOCK_K=config.block_k, EVEN_K=even_k, SPLIT_K=config.split_k,
                IEEE=element == "fp32", UPCAST=False, ROUND_BITS=False, OPAQUE=True, GDC=False,
                PREFETCH_K=4 * config.block_k, PREFETCH_STEP=64, NORM_K=config.block_k, NORM_STAGES=4,
                STATS_IN=False, STATS_OUT=False, STATS_BLOCK=1)


@pytest.mark.skipif(not HAS_TRITON or interpreting(), reason="needs triton's compiler")
@pytest.mark.parametrize(("element", "config", "even_k"), [
    ("bf16", Config(16, 256), True), ("bf16", Config(64, 128), False), ("fp16", Config(32, 256), True),
    ("fp32", Config(16, 64), False), ("bf16", Config(16, 256, split_k=4), True), ("fp16", Config(16, 256, split_k=2), True),
])
def test_kernel_compiles_for_the_gpu(element: str, config: Config, even_k: bool) -> None:
    """A kernel that only fails in the GPU compiler (types the interpreter lets through) fails here, on CPU;
    with K split, the kernel that adds the slices too, with every epilogue on (SwiGLU then a residual add:
    the product the compiler fused with the add on an H200 until it was `kept`)."""
    pointers = {name: f"*{element}" for name in ("x_ptr", "g_ptr", "w_ptr", "b_ptr", "r_ptr", "y_ptr")}
    compile_for_h100(_skinny_matmul_kernel, kernel_constants(element, config, even_k), {**pointers, **SHARES},
                     "fp32")
    if config.split_k > 1:
        compile_for_h100(_skinny_reduce_kernel, dict(SWIGLU=True, RESIDUAL=True, HAS_BIAS=True, BLOCK_M=BLOCK_M,
                                                     BLOCK_N=config.block_n, SPLIT_K=config.split_k, ROUND_BITS=False,
                                                     OPAQUE=True, STATS_OUT=True),
                         {**pointers, **SHARES}, "fp32")


@pytest.mark.skipif(not HAS_TRITON or interpreting(), reason="needs triton's compiler")
@pytest.mark.parametrize("swiglu", [False, True])
def test_a_dependent_launch_prefetches_its_weight_then_waits_for_x(swiglu: bool) -> None:
    """With GDC (programmatic dependent launch) the kernel asks L2 for its first weight tiles (the up rows too
    with SwiGLU), waits for the kernel before it to end, and after its product lets the next one start; without,
    none of it is in the code."""
    pointers = {name: "*bf16" for name in ("x_ptr", "g_ptr", "w_ptr", "b_ptr", "r_ptr", "y_ptr")}
    constants = {**kernel_constants("bf16", Config(16, 256), True), "SWIGLU": swiglu}
    ptx = compile_for_h100(_skinny_matmul_kernel, {**constants, "GDC": True}, {**pointers, **SHARES}, "fp32")
    wait, release = ptx.find("griddepcontrol.wait"), ptx.find("griddepcontrol.launch_dependents")
    first_prefetch, last_prefetch = ptx.find("prefetch.global.L2"), ptx.rfind("prefetch.global.L2")
    assert -1 < first_prefetch <= last_prefetch < wait < release
    if swiglu:  # gate rows and up rows: two prefetch sites
        assert ptx.count("prefetch.global.L2") >= 2
    plain = compile_for_h100(_skinny_matmul_kernel, constants, {**pointers, **SHARES}, "fp32")
    assert "griddepcontrol" not in plain and "prefetch.global" not in plain


OPTIONS_THE_RUNTIME_LAUNCHES = [  # skinny_matmul_triton's plain product, and skinny_fused's four per layer
    dict(NORM=False, SWIGLU=False, RESIDUAL=False, HAS_BIAS=False), dict(NORM=False, SWIGLU=False, RESIDUAL=False, HAS_BIAS=True),
    dict(NORM=True, SWIGLU=False, RESIDUAL=False, HAS_BIAS=True), dict(NORM=True, SWIGLU=True, RESIDUAL=False, HAS_BIAS=False),
    dict(NORM=False, SWIGLU=False, RESIDUAL=True, HAS_BIAS=False)]


@pytest.mark.skipif(not HAS_TRITON or interpreting() or torch.cuda.is_available(), reason="CPU check of the compiler")
@pytest.mark.parametrize("flags", OPTIONS_THE_RUNTIME_LAUNCHES, ids=lambda f: "+".join(k for k, v in f.items() if v) or "plain")
@pytest.mark.parametrize("even_k", [True, False])
def test_torch_compile_sees_only_the_output_written(flags: dict[str, bool], even_k: bool,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Under torch.compile, the kernel's outputs are what inductor's analysis of its code finds written: a weight
    (hundreds of MB a step) or the residual wrongly found written would be copied at every call. Each product
    the runtime launches, with the compile-time arguments `launch` gives it (`kernel_constants`); a dependent
    launch (PDL), whose inline assembly has side effects, defeats the analysis: every tensor counts as written,
    which is why the runtime never launches so."""
    bf16 = dict(dtype=torch.bfloat16)
    k = 256 if even_k else 250
    kwargs = dict(x_ptr=torch.empty(16, 256, **bf16), g_ptr=torch.empty(256, **bf16),
                  w_ptr=torch.empty(128, 256, **bf16), b_ptr=torch.empty(128, **bf16),
                  r_ptr=torch.empty(16, 64, **bf16), y_ptr=torch.empty(16, 64, **bf16),
                  p_ptr=torch.empty(16, 64, **bf16), s_in_ptr=torch.empty(16, 8), s_out_ptr=torch.empty(16, 2),
                  M=16, N=64, K=k, K_SPLIT=k, P_IN=8, P_OUT=2, stride_xm=256, stride_wn=256, stride_rm=64,
                  stride_ym=64)
    constants = skinny_matmul.kernel_constants(torch.bfloat16, k, 1e-6, flags, Config(32, 128))
    assert pointers_written(_skinny_matmul_kernel, {**kwargs, **constants}, monkeypatch) == ["y_ptr"]
    if flags["NORM"] and flags["SWIGLU"]:
        pdl = skinny_matmul.kernel_constants(torch.bfloat16, k, 1e-6, flags, Config(32, 128), pdl=True)
        assert "w_ptr" in pointers_written(_skinny_matmul_kernel, {**kwargs, **pdl}, monkeypatch)


def test_a_swiglu_product_is_tiled_from_its_plain_product(monkeypatch: pytest.MonkeyPatch) -> None:
    """A [gate; up] product with a row in the table takes that row's tiling with half the outputs a program
    (as many weight rows a step as the plain product); without one, the default for its output's width."""
    monkeypatch.setattr(skinny_matmul, "interpreting", lambda: False)
    (n2, k), plain = next(iter((shape, c) for shape, c in CONFIGS.items() if c.block_n >= 32))
    assert config_for(n2 // 2, k, swiglu=True) == plain._replace(block_n=plain.block_n // 2)
    assert config_for(n2 // 2, k) == CONFIGS.get((n2 // 2, k), default_config(n2 // 2, k))
    assert config_for(1000, 64, swiglu=True) == default_config(1000, 64)
    assert swiglu_tiling(Config(64, 128, 4, 3)) == Config(32, 128, 4, 3)
    assert swiglu_tiling(Config(16, 512, 2, 3)) == Config(16, 512, 2, 3)  # the smallest tile a dot takes
