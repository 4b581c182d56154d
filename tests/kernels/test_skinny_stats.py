"""The skinny kernel's norm statistics carried from one product to the next: a product writes, per output tile,
each row's sum of squares of what it stored (`stats_out`), and a NORM product takes the rows' mean squares
from those shares (`stats_in`) instead of its own pass over x. Checked against sums taken by PyTorch over the
stored output, against the model's RMSNorm composed by hand, and for batch invariance, under the interpreter
on CPU; the compiled kernel for sm_90, and what torch.compile's analysis finds it writes.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dflash_train.kernels import skinny_matmul
from dflash_train.kernels._triton import HAS_TRITON, interpreting
from dflash_train.kernels.skinny_matmul import (
    BLOCK_M,
    Config,
    _skinny_matmul_kernel,
    _skinny_reduce_kernel,
    launch,
)
from dflash_train.models.layers import RMSNorm
from tests.helpers.kernels import (
    DEVICE,
    compile_for_h100,
    kernels_here,
    pointers_written,
    randn,
    under_interpreter,
)

test_under_interpreter = under_interpreter(__file__)

PLAIN = dict(NORM=False, SWIGLU=False, RESIDUAL=False, HAS_BIAS=False)


def shares_by_torch(y: torch.Tensor, block_n: int) -> torch.Tensor:
    """Each row's sum of squares of y's stored values per tile of `block_n` columns: [rows, tiles]."""
    tiles = -(-y.shape[1] // block_n)
    padded = F.pad(y.float(), (0, tiles * block_n - y.shape[1]))
    return padded.pow(2).view(y.shape[0], tiles, block_n).sum(-1)


@kernels_here
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("residual", "split_k"), [(False, 1), (True, 1), (True, 3)])
def test_a_product_writes_its_rows_squares_by_output_tile(dtype: torch.dtype, residual: bool, split_k: int) -> None:
    """The shares are the squares of the values stored (after the residual add, rounded), summed over each
    output tile's columns; the output itself is bitwise what the product gives without them. With K split,
    the kernel that adds the slices writes them."""
    gen = torch.Generator().manual_seed(5)
    rows, n, k = 5, 72, 192  # 72 outputs in tiles of 16: the last tile half empty
    x = (randn(rows, k, dtype=dtype, gen=gen) * 2).to(DEVICE)
    w = (randn(n, k, dtype=dtype, gen=gen) / k ** 0.5).to(DEVICE)
    r = randn(rows, n, dtype=dtype, gen=gen).to(DEVICE)
    flags = {**PLAIN, "RESIDUAL": residual}
    config = Config(16, 64, split_k=split_k)
    shares = torch.full((rows, 5), float("nan"), device=DEVICE)
    y = launch(x, w, w, w, r, 0.0, n, flags, config, stats_out=shares)
    assert torch.equal(y, launch(x, w, w, w, r, 0.0, n, flags, config))
    torch.testing.assert_close(shares.cpu(), shares_by_torch(y.cpu(), 16), rtol=1e-6, atol=1e-6)


def layer_half(dtype: torch.dtype, rows: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """o_proj (with its residual add) then gate/up (with the RMSNorm before it and SwiGLU after), small."""
    d, inner, heads = 96, 40, 64
    return {"attn": (randn(rows, heads, dtype=dtype, gen=gen) * 2).to(DEVICE),
            "hidden": (randn(rows, d, dtype=dtype, gen=gen) * 3).to(DEVICE),
            "o_proj": (randn(d, heads, dtype=dtype, gen=gen) / heads ** 0.5).to(DEVICE),
            "gate_up": (randn(2 * inner, d, dtype=dtype, gen=gen) / d ** 0.5).to(DEVICE),
            "gamma": (1 + randn(d, dtype=dtype, gen=gen) / 4).to(DEVICE)}


def run_layer_half(t: dict[str, torch.Tensor], carried: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(h, act) through the kernel, the norm's statistics carried from o_proj to gate/up or taken by its pass."""
    rows, d = t["hidden"].shape
    inner = t["gate_up"].shape[0] // 2
    o_config, gate_up_config = Config(16, 64), Config(32, 32)
    shares = torch.empty(rows, -(-d // o_config.block_n), device=DEVICE) if carried else None
    h = launch(t["attn"], t["o_proj"], t["o_proj"], t["o_proj"], t["hidden"], 0.0, d,
               {**PLAIN, "RESIDUAL": True}, o_config, stats_out=shares)
    act = launch(h, t["gamma"], t["gate_up"], t["gate_up"], h, 1e-6, inner, {**PLAIN, "NORM": True, "SWIGLU": True},
                 gate_up_config, stats_in=shares)
    return h, act


@kernels_here
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_norm_from_carried_statistics_is_the_models_rmsnorm(dtype: torch.dtype) -> None:
    """gate/up normalising with o_proj's shares gives what the modules give (an RMSNorm, F.linear, SiLU), and
    what the kernel's own pass gives but for a sum whose order tips a rounding."""
    t = layer_half(dtype, 7, torch.Generator().manual_seed(6))
    h, act = run_layer_half(t, carried=True)
    _, by_pass = run_layer_half(t, carried=False)
    norm = RMSNorm(t["gamma"].shape[0], eps=1e-6).to(dtype)
    norm.weight.data = t["gamma"].cpu()
    with torch.no_grad():
        gate, up = F.linear(norm(h.cpu()), t["gate_up"].cpu()).chunk(2, dim=-1)
        expected = F.silu(gate) * up
    if dtype == torch.float32:
        torch.testing.assert_close(act.cpu(), expected, atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(act, by_pass, atol=2e-6, rtol=2e-6)
    else:
        assert float((act.cpu() != expected).float().mean()) < 0.03
        torch.testing.assert_close(act.cpu(), expected, atol=2e-2, rtol=1.6e-2)
        assert float((act != by_pass).float().mean()) < 0.02


@kernels_here
def test_carried_statistics_keep_rows_batch_invariant() -> None:
    """One row alone, then among others at other places: its shares and its normalised product are bitwise
    the same."""
    gen = torch.Generator().manual_seed(8)
    alone = layer_half(torch.bfloat16, 1, gen)
    h_alone, act_alone = run_layer_half(alone, carried=True)
    for rows, place in [(3, 2), (16, 9), (33, 32)]:
        many = layer_half(torch.bfloat16, rows, gen)
        many["attn"][place], many["hidden"][place] = alone["attn"][0], alone["hidden"][0]
        for name in ("o_proj", "gate_up", "gamma"):
            many[name] = alone[name]
        h, act = run_layer_half(many, carried=True)
        assert torch.equal(h[place], h_alone[0]) and torch.equal(act[place], act_alone[0]), (rows, place)


def test_stats_width_counts_the_output_tiles(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(skinny_matmul, "interpreting", lambda: False)
    assert skinny_matmul.stats_width(4096, 4096) == 4096 // skinny_matmul.CONFIGS[(4096, 4096)].block_n
    assert skinny_matmul.stats_width(1000, 64) == -(-1000 // skinny_matmul.default_config(1000, 64).block_n)


def test_arguments_checked() -> None:
    x, w = torch.zeros(2, 8), torch.zeros(6, 8)
    with pytest.raises(AssertionError, match="for a NORM product"):
        launch(x, w, w, w, x, 0.0, 6, PLAIN, Config(16, 16), stats_in=torch.zeros(2, 3))
    with pytest.raises(AssertionError, match=r"stats_out: \[M, 1\] fp32"):
        launch(x, w, w, w, x, 0.0, 6, PLAIN, Config(16, 16), stats_out=torch.zeros(2, 2))


@pytest.mark.skipif(not HAS_TRITON or interpreting(), reason="needs triton's compiler")
@pytest.mark.parametrize(("stats_in", "stats_out", "flags"), [
    (True, False, dict(NORM=True, SWIGLU=False, RESIDUAL=False, HAS_BIAS=False)),
    (True, False, dict(NORM=True, SWIGLU=True, RESIDUAL=False, HAS_BIAS=False)),
    (False, True, dict(NORM=False, SWIGLU=False, RESIDUAL=True, HAS_BIAS=False)),
])
def test_kernel_compiles_for_the_gpu(stats_in: bool, stats_out: bool, flags: dict[str, bool]) -> None:
    """Both sides compile for sm_90 (and the kernel that adds a split product's slices, writing shares), with
    no 16-bit FMA in the PTX (`compile_for_h100`)."""
    constants = dict(**flags, EPS=1e-6, BLOCK_M=BLOCK_M, BLOCK_N=16, BLOCK_K=512, EVEN_K=True, SPLIT_K=1,
                     IEEE=False, UPCAST=False, ROUND_BITS=False, OPAQUE=True, GDC=False, PREFETCH_K=2048,
                     PREFETCH_STEP=64, NORM_K=512, NORM_STAGES=4, STATS_IN=stats_in, STATS_OUT=stats_out,
                     STATS_BLOCK=256)
    pointers = {name: "*bf16" for name in ("x_ptr", "g_ptr", "w_ptr", "b_ptr", "r_ptr", "y_ptr")}
    shares = {"p_ptr": "*fp32", "s_in_ptr": "*fp32", "s_out_ptr": "*fp32"}
    compile_for_h100(_skinny_matmul_kernel, constants, {**pointers, **shares}, "fp32")
    if stats_out:
        compile_for_h100(_skinny_reduce_kernel, dict(SWIGLU=False, RESIDUAL=True, HAS_BIAS=False, BLOCK_M=BLOCK_M,
                                                     BLOCK_N=16, SPLIT_K=2, ROUND_BITS=False, OPAQUE=True,
                                                     STATS_OUT=True), {**pointers, **shares}, "fp32")


@pytest.mark.skipif(not HAS_TRITON or interpreting() or torch.cuda.is_available(), reason="CPU check of the compiler")
def test_torch_compile_sees_the_shares_written_and_nothing_else(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under torch.compile only what the kernel writes may count as written (else it is copied every call):
    the output, and the shares when it writes them; never the weight, x, the residual or the shares it reads."""
    bf16 = dict(dtype=torch.bfloat16)
    kwargs = dict(x_ptr=torch.empty(16, 256, **bf16), g_ptr=torch.empty(256, **bf16), w_ptr=torch.empty(128, 256, **bf16),
                  b_ptr=torch.empty(128, **bf16), r_ptr=torch.empty(16, 64, **bf16), y_ptr=torch.empty(16, 64, **bf16),
                  p_ptr=torch.empty(16, 64, **bf16), s_in_ptr=torch.empty(16, 16), s_out_ptr=torch.empty(16, 2),
                  M=16, N=64, K=256, K_SPLIT=256, P_IN=16, P_OUT=2, stride_xm=256, stride_wn=256, stride_rm=64,
                  stride_ym=64)
    norm = {**PLAIN, "NORM": True, "SWIGLU": True}
    reading = skinny_matmul.kernel_constants(torch.bfloat16, 256, 1e-6, norm, Config(32, 128), stats_in_width=16)
    assert pointers_written(_skinny_matmul_kernel, {**kwargs, **reading}, monkeypatch) == ["y_ptr"]
    residual = {**PLAIN, "RESIDUAL": True}
    writing = skinny_matmul.kernel_constants(torch.bfloat16, 256, 0.0, residual, Config(32, 128), stats_out=True)
    assert pointers_written(_skinny_matmul_kernel, {**kwargs, **writing}, monkeypatch) == ["s_out_ptr", "y_ptr"]
