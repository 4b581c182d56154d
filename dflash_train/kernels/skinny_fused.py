"""The skinny-matmul product with the small operations around it folded in: an RMSNorm of x before the
product, and after it the SwiGLU of a gate/up pair or the residual add. One launch instead of two or three.

Why: a small target at batch 1 is bound by kernel launches, not by its weights. SmolLM2-135M's decoder layer
reads 7 MB of weights, which the memory streams in less time than one kernel's latency, but runs about 14
kernels: norms, products, split-K reductions, SiLU, adds, each paying that latency (docs/benchmarks.md,
`decode`: the fused decode path). A Llama-family layer on these products is

    qkv  = rmsnorm(h) @ W_qkv^T             (norm prologue)
    ...    q/k norms, RoPE, cache write, attention (their own kernels)
    h    = h + attn @ W_o^T                 (residual epilogue)
    act  = silu(g) * u, [g; u] = rmsnorm(h) @ W_gate_up^T   (norm prologue, SwiGLU epilogue)
    h    = h + act @ W_down^T               (residual epilogue)

four launches where the unfused layer runs about ten for the same work.

How: the kernel of `skinny_matmul` (the product transposed, one program per 16 rows and BLOCK_N outputs
walking the whole of K), whose three compile-time options do it:
- NORM: a first pass over the program's rows of x sums their squares (fp32, K ascending); the main loop then
  normalises each x tile as the model's RMSNorm does before it meets the weight.
- SWIGLU: the weight is [gate; up] (2I rows); a program keeps two accumulators, gate rows c.. and up rows
  I + c.., and writes silu(gate) * up for its I-columns.
- RESIDUAL: the rounded product is added to a residual of the output's shape.

Rounding follows the PyTorch modules step by step (`skinny_fused_reference` spells it out): the norm as
Llama's and Qwen's RMSNorm (fp32 statistics, x * rsqrt(mean(x^2) + eps) rounded to x's dtype, times the
weight, rounded); the product summed in fp32 and rounded once (bias added before); SiLU of the rounded gate
in fp32, rounded, times the rounded up, rounded; the residual added to the rounded product, rounded. The
sums run in the kernel's own order, so a value can differ from the modules' in a last place, rarely; what
the runtime relies on is batch invariance, as in `skinny_matmul`: a row's output is bitwise the same
whatever the other rows are and however many there are, since the tiling depends on (N, K) only and every
reduction of a row (its squares, its products) runs over that row alone in a fixed order.
"""

import torch
import torch.nn.functional as F
from torch.library import triton_op

from dflash_train.kernels.skinny_matmul import fits, launch, stats_width


def skinny_fused_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                           norm_weight: torch.Tensor | None = None, norm_eps: float = 0.0, swiglu: bool = False,
                           residual: torch.Tensor | None = None) -> torch.Tensor:
    """PyTorch version, in the modules' rounding steps: [rmsnorm(x)] @ weight^T + bias, then [silu(g) * u] or
    [+ residual]. With `swiglu` the weight is [gate; up] and the output has half its rows' width."""
    dtype = x.dtype
    if norm_weight is not None:
        xf = x.float()
        x = norm_weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + norm_eps)).to(dtype)
    y = x.float() @ weight.float().T
    if bias is not None:
        y = y + bias.float()
    y = y.to(dtype)
    if swiglu:
        gate, up = y.chunk(2, dim=-1)
        y = F.silu(gate) * up
    if residual is not None:
        y = residual + y
    return y


@triton_op("dflash_train::skinny_fused", mutates_args=())
def _skinny_fused_op(x: torch.Tensor, norm_weight: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                     residual: torch.Tensor, eps: float, n: int, norm: bool, swiglu: bool, has_residual: bool,
                     has_bias: bool) -> torch.Tensor:
    flags = dict(NORM=norm, SWIGLU=swiglu, RESIDUAL=has_residual, HAS_BIAS=has_bias)
    return launch(x, norm_weight, weight, bias, residual, eps, n, flags)


def skinny_fused_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                        norm_weight: torch.Tensor | None = None, norm_eps: float = 0.0, swiglu: bool = False,
                        residual: torch.Tensor | None = None) -> torch.Tensor:
    """`skinny_fused_reference`'s contract for at most `skinny_matmul.MAX_ROWS` rows (x's leading dimensions
    flattened), as one launch; a custom op, so torch.compile keeps it in its graph and CUDA graphs capture it."""
    x2, r2, n, lead = _checked(x, weight, bias, norm_weight, swiglu, residual)
    y = _skinny_fused_op(x2, norm_weight if norm_weight is not None else weight, weight,
                         bias.contiguous() if bias is not None else weight, r2, float(norm_eps), n,
                         norm_weight is not None, swiglu, residual is not None, bias is not None)
    return y.reshape(*lead, n)


@triton_op("dflash_train::skinny_fused_stats", mutates_args=())
def _skinny_fused_stats_op(x: torch.Tensor, norm_weight: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                           residual: torch.Tensor, stats_in: torch.Tensor, eps: float, n: int, norm: bool,
                           swiglu: bool, has_residual: bool, has_bias: bool, has_stats_in: bool,
                           stats_out: bool) -> tuple[torch.Tensor, torch.Tensor]:
    flags = dict(NORM=norm, SWIGLU=swiglu, RESIDUAL=has_residual, HAS_BIAS=has_bias)
    tiles = stats_width(n, x.shape[1], swiglu) if stats_out else 0
    shares = torch.empty((x.shape[0], tiles), device=x.device, dtype=torch.float32)
    y = launch(x, norm_weight, weight, bias, residual, eps, n, flags, stats_in=stats_in if has_stats_in else None,
               stats_out=shares if stats_out else None)
    return y, shares


def skinny_fused_stats_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                              norm_weight: torch.Tensor | None = None, norm_eps: float = 0.0, swiglu: bool = False,
                              residual: torch.Tensor | None = None, stats_in: torch.Tensor | None = None,
                              stats_out: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`skinny_fused_triton` with the norm's statistics carried between products (`skinny_matmul`'s module
    docstring): `stats_in` [rows, P] fp32, shares of the sums of squares of x's rows (flattened), which the
    norm reads in place of its own pass over x; with `stats_out`, y's shares [rows, output tiles] are made
    too, for the next product's norm. -> (y, y's shares or None)."""
    x2, r2, n, lead = _checked(x, weight, bias, norm_weight, swiglu, residual)
    assert stats_in is None or (norm_weight is not None and stats_in.dtype == torch.float32
                                and stats_in.shape[0] == x2.shape[0]), "stats_in: [rows, P] fp32, for a norm"
    stand_in = stats_in.contiguous() if stats_in is not None else x2  # never read without has_stats_in
    y, shares = _skinny_fused_stats_op(
        x2, norm_weight if norm_weight is not None else weight, weight, bias.contiguous() if bias is not None else weight,
        r2, stand_in, float(norm_eps), n, norm_weight is not None, swiglu, residual is not None, bias is not None,
        stats_in is not None, stats_out)
    return y.reshape(*lead, n), (shares if stats_out else None)


def _checked(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, norm_weight: torch.Tensor | None,
             swiglu: bool, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, int, list[int]]:
    """(x as [rows, K], the residual as [rows, N] (x standing in without one), the output width N, x's leading
    dimensions), the arguments checked."""
    *lead, k = x.shape
    rows_of_weight = weight.shape[0]
    assert weight.shape[1] == k and weight.dtype == x.dtype, "weight must be [N, K] in x's dtype"
    assert weight.stride(1) == 1, "weight must be contiguous along K"  # never copied: it is the step's traffic
    assert not swiglu or rows_of_weight % 2 == 0, "a SwiGLU weight is [gate; up]: an even number of rows"
    n = rows_of_weight // 2 if swiglu else rows_of_weight
    assert bias is None or bias.shape == (rows_of_weight,), "bias must be [N] (the weight's rows)"
    assert norm_weight is None or (norm_weight.shape == (k,) and norm_weight.dtype == x.dtype), \
        "the norm weight must be [K] in x's dtype"
    x2 = x.reshape(-1, k).contiguous()
    assert fits(x2.shape[0]), f"{x2.shape[0]} rows: the kernel takes 1..64 (use torch's matmul)"
    r2 = x2
    if residual is not None:
        assert residual.shape == (*lead, n) and residual.dtype == x.dtype, "residual must be the output's shape"
        r2 = residual.reshape(-1, n).contiguous()
    return x2, r2, n, lead
