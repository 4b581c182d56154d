"""A mixture of experts for the few tokens of a decode or verify step: each chosen expert's weights streamed
once, straight from the model's [experts, ...] tensors, with no sort, histogram or gather before.

Why: at batch 1 a MoE layer runs 8 experts of 128 (Qwen3-30B-A3B) on one token, so its cost is reading those
8 experts' weights. The grouped-GEMM path of transformers sorts the (token, expert) pairs, counts them per
expert, gathers the tokens and unsorts the output around two grouped products built for many rows per
expert: a dozen small kernels per layer whose latency, at decode, is most of the layer's time
(docs/benchmarks.md, `decode_experts`).

How: one program per (expert, BLOCK_N outputs): over the step's distinct experts for a step of up to
`COMPACT_PAIRS` pairs, else over every expert. A program reads the step's expert ids (the router's top-k, [S]
pairs of token and expert), and finds the pairs routed to its expert: none, and it ends at once; else it
gathers them BLOCK_M at a time (their rank among its expert's pairs, by a cumulative
sum) and streams its rows of the expert's weight through the tensor cores against those pairs' rows of x,
the same product as `skinny_matmul`'s with the gather in its loads. Two launches make a layer's experts:

    up:   h[s] = gate(x[token(s)] @ W_gate_up[e(s)]^T + b)    (SiLU-gated or gpt-oss's clamped gate in
                                                              the kernel; else raw, for the model's own)
    down: y[s] = (h[s] @ W_down[e(s)]^T + b) * weight[s]      (fp32, per pair)

and a third adds each token's top-k rows of y in slot order. Weights may be stored [E, out, in] or transposed
[E, in, out] (gpt-oss): strides say which.

Batch invariance: a pair's output depends on its own row of x alone (each output column of a tensor-core
product sums its own row's products in K order), on a tiling fixed by the weight's shape, and its top-k
rows are added in one order; so a token's output is bitwise the same whatever else the step holds, which
the runtime's lossless check relies on (as `skinny_matmul`'s module docstring explains).

Rounding: fp32 sums, the bias added in fp32, one rounding to x's dtype; SiLU of the rounded gate rounded, times
the rounded up, rounded (the modules' steps); the routing weight multiplies the rounded down product in fp32.
"""

# Deliberately no postponed annotations (PEP 563): Triton reads the `tl.constexpr` annotations of kernels.
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch.library import triton_op, wrap_triton

from dflash_train.kernels._triton import HAS_TRITON, interpreting, jit, next_power_of_2, tl, triton
from dflash_train.kernels.device import dot, rounded

BLOCK_M = 16  # pairs per tile: the smallest dot tile
# Pairs (tokens × top-k) the kernel takes: every program scans all of a step's expert ids, and at this many the
# grouped products of transformers have enough rows per expert to be efficient (docs/benchmarks.md,
# `decode_experts`).
MAX_PAIRS = 1024


# Pairs up to which a launch has one program row per distinct expert of the step rather than per expert: at
# decode sizes most experts are not reached, and their programs, which only find that out, are most of the
# launch. Each program then finds its expert among the pairs by an S × S comparison, cheap this small.
COMPACT_PAIRS = 128


class Tiling(NamedTuple):
    """How one product is tiled: outputs and reduction width per step, warps, pipeline depth."""

    block_n: int = 32
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 3


GATE_SILU = 1  # SiLU(gate) * up over [gate; up] halves (Qwen3-MoE, Mixtral, DeepSeek-V3, ...)
GATE_CLAMPED = 2  # gpt-oss's: interleaved gate/up columns, clamped, (up + 1) * gate * sigmoid(alpha * gate)


class ClampedGate(NamedTuple):
    """gpt-oss's gate, folded into the up product: its `alpha` and clamp `limit`."""

    alpha: float
    limit: float


def experts_reference(x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                      gate_up: torch.Tensor, down: torch.Tensor, gate_up_bias: torch.Tensor | None = None,
                      down_bias: torch.Tensor | None = None, transposed: bool = False,
                      gate: ClampedGate | Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """One pair at a time in PyTorch, in the kernels' rounding steps: x [T, H], top_k_index/top_k_weights
    [T, k], gate_up [E, 2I, H] and down [E, H, I] (or [E, H, 2I] and [E, I, H] when `transposed`); `gate`
    maps the rounded [.., 2I] product to [.., I]: None for SiLU-gated [gate; up] halves, a `ClampedGate`, or
    any function. -> [T, H]."""
    dtype = x.dtype
    tokens, top_k = top_k_index.shape
    out = torch.zeros(tokens, x.shape[1], dtype=torch.float32, device=x.device)
    for t in range(tokens):
        for slot in range(top_k):
            e = int(top_k_index[t, slot])
            w_up = gate_up[e].T if transposed else gate_up[e]
            w_down = down[e].T if transposed else down[e]
            h = x[t].float() @ w_up.float().T
            if gate_up_bias is not None:
                h = h + gate_up_bias[e].float()
            h = h.to(dtype)
            h = (_silu_gate(h) if gate is None else _clamped_gate(h, gate) if isinstance(gate, ClampedGate)
                 else gate(h).to(dtype))
            y = h.float() @ w_down.float().T
            if down_bias is not None:
                y = y + down_bias[e].float()
            out[t] += y.to(dtype).float() * top_k_weights[t, slot].float()
    return out.to(dtype)


def _clamped_gate(h: torch.Tensor, gate: ClampedGate) -> torch.Tensor:
    """gpt-oss's gate in its own order of operations, each rounded to h's dtype."""
    glu, up = h[..., ::2].clamp(max=gate.limit), h[..., 1::2].clamp(-gate.limit, gate.limit)
    return (up + 1) * (glu * torch.sigmoid(glu * gate.alpha))


def _silu_gate(h: torch.Tensor) -> torch.Tensor:
    gate, up = h.chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate.float()).to(h.dtype).float() * up.float()).to(h.dtype)


def _experts_kernel(
    x_ptr, ids_ptr, w_ptr, b_ptr, rw_ptr, y_ptr, S, ROWS_PER_X, N, K, stride_xm, stride_we, stride_wn, stride_wk,
    stride_be, stride_ym, ALPHA, LIMIT,
    S_PAD: tl.constexpr, COMPACT: tl.constexpr, GATE: tl.constexpr, HAS_BIAS: tl.constexpr, WEIGHTED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
    UPCAST: tl.constexpr, ROUND_BITS: tl.constexpr,
):
    # Axis 0 is the expert, axis 1 the output tile. Pair s reads row s // ROWS_PER_X of x (its token for the up
    # product, where ROWS_PER_X is top-k; its own row for the down product) and writes row s of y. N is the
    # output's width: I for a gated product (GATE > 0), whose output c reads gate row c and up row N + c of
    # [gate; up] halves (GATE_SILU), or rows 2c and 2c + 1 of interleaved ones (GATE_CLAMPED).
    pairs = tl.arange(0, S_PAD)
    ids = tl.load(ids_ptr + pairs, mask=pairs < S, other=-1)
    if COMPACT:  # noqa: SIM108 (a constexpr branch) -- axis 0: the step's distinct experts, then none
        expert = _distinct_expert(ids, pairs, S, tl.program_id(0))
    else:  # axis 0 is every expert
        expert = tl.program_id(0)
    hit = (ids == expert).to(tl.int32)
    count = tl.sum(hit, axis=0)
    rank = tl.cumsum(hit, axis=0) - 1  # each hit pair's place among this expert's pairs
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    ks = tl.arange(0, BLOCK_K)
    slots = tl.arange(0, BLOCK_M)
    w_base = w_ptr + expert.to(tl.int64) * stride_we
    for first in range(0, count, BLOCK_M):
        chosen = (hit[None, :] > 0) & (rank[None, :] == (first + slots)[:, None])  # [BLOCK_M, S_PAD]
        pair = tl.sum(tl.where(chosen, pairs[None, :], 0), axis=1)
        pair_ok = (first + slots) < count
        x_ptrs = x_ptr + (pair // ROWS_PER_X).to(tl.int64)[None, :] * stride_xm + ks[:, None]  # x^T [BLOCK_K, BLOCK_M]
        gate_rows = cols.to(tl.int64) * (2 if GATE == 2 else 1)
        w_ptrs = w_base + gate_rows[:, None] * stride_wn + ks[None, :] * stride_wk  # [BLOCK_N, BLOCK_K]
        u_ptrs = w_ptrs + (1 if GATE == 2 else N) * stride_wn  # the up rows (GATE > 0)
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_ok = (k0 + ks) < K
            xt = tl.load(x_ptrs, mask=k_ok[:, None] & pair_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=col_ok[:, None] & k_ok[None, :], other=0.0)
            acc = dot(w, xt, acc, IEEE, UPCAST)
            if GATE > 0:
                u = tl.load(u_ptrs, mask=col_ok[:, None] & k_ok[None, :], other=0.0)
                acc_up = dot(u, xt, acc_up, IEEE, UPCAST)
                u_ptrs += BLOCK_K * stride_wk
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K * stride_wk
        _finish(acc, acc_up, b_ptr + expert.to(tl.int64) * stride_be, rw_ptr, y_ptr, pair, pair_ok, gate_rows, cols,
                col_ok, N, stride_ym, ALPHA, LIMIT, x_ptr.dtype.element_ty, GATE, HAS_BIAS, WEIGHTED, ROUND_BITS)


def _distinct_expert(ids, pairs, S, slot):
    """The `slot`-th distinct expert id among the step's pairs, in order of first appearance (-2, matching no
    pair, past their count): a pair is a first appearance when no earlier pair has its id."""
    earlier_same = (ids[:, None] == ids[None, :]) & (pairs[None, :] < pairs[:, None])  # [S_PAD, S_PAD]
    first = (tl.sum(earlier_same.to(tl.int32), axis=1) == 0) & (pairs < S)
    chosen = first & ((tl.cumsum(first.to(tl.int32), axis=0) - 1) == slot)
    found = tl.sum(chosen.to(tl.int32), axis=0) > 0
    return tl.where(found, tl.sum(tl.where(chosen, ids, 0), axis=0), -2)


def _finish(acc, acc_up, b_ptr, rw_ptr, y_ptr, pair, pair_ok, gate_rows, cols, col_ok, N, stride_ym, ALPHA, LIMIT,
            out_ty, GATE: tl.constexpr, HAS_BIAS: tl.constexpr, WEIGHTED: tl.constexpr, ROUND_BITS: tl.constexpr):
    """A tile's fp32 sums [BLOCK_N, BLOCK_M] to y: bias, the modules' roundings, the gate or the routing weight.
    ROUND_BITS (interpreted bf16): rounding on the bits first, since the interpreter's casts truncate."""
    if HAS_BIAS:
        acc += tl.load(b_ptr + gate_rows, mask=col_ok, other=0.0).to(tl.float32)[:, None]
        if GATE > 0:
            up_bias = b_ptr + gate_rows + (1 if GATE == 2 else N)
            acc_up += tl.load(up_bias, mask=col_ok, other=0.0).to(tl.float32)[:, None]
    y = _round(acc, out_ty, ROUND_BITS)
    if GATE == 1:  # SiLU(gate) * up, each step rounded as the modules round
        up = _round(acc_up, out_ty, ROUND_BITS)
        y = _round(_round(y / (1.0 + tl.exp(-y)), out_ty, ROUND_BITS) * up, out_ty, ROUND_BITS)
    elif GATE == 2:  # gpt-oss: gate clamped above, up both sides, (up + 1) * gate * sigmoid(ALPHA * gate)
        gate = tl.minimum(y, LIMIT)
        up = tl.minimum(tl.maximum(_round(acc_up, out_ty, ROUND_BITS), -LIMIT), LIMIT)
        scaled = _round(gate * ALPHA, out_ty, ROUND_BITS)
        glu = _round(gate * _round(1.0 / (1.0 + tl.exp(-scaled)), out_ty, ROUND_BITS), out_ty, ROUND_BITS)
        y = _round(_round(up + 1.0, out_ty, ROUND_BITS) * glu, out_ty, ROUND_BITS)
    if WEIGHTED:  # the routing weight, in fp32: y is the fp32 per-pair output the caller adds up
        y = y * tl.load(rw_ptr + pair, mask=pair_ok, other=0.0).to(tl.float32)[None, :]
    out_mask = pair_ok[None, :] & col_ok[:, None]
    tl.store(y_ptr + pair.to(tl.int64)[None, :] * stride_ym + cols[:, None], y.to(y_ptr.dtype.element_ty),
             mask=out_mask)


def _round(x, out_ty, ROUND_BITS: tl.constexpr):
    """fp32 x rounded to the output's dtype and back (on the bits first where the interpreter truncates)."""
    return rounded(x, ROUND_BITS, False).to(out_ty).to(tl.float32)


if HAS_TRITON:  # device functions, resolved when a kernel calling them compiles
    _distinct_expert = triton.jit(_distinct_expert)
    _finish = triton.jit(_finish)
    _round = triton.jit(_round)


def _top_k_sum_kernel(y_ptr, out_ptr, H, TOP_K: tl.constexpr, BLOCK: tl.constexpr, ROUND_BITS: tl.constexpr):
    # A token's top-k rows of fp32 outputs added in slot order, then rounded once: the same order at any
    # number of tokens (a library reduction may pick its order by shape).
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < H
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for slot in range(TOP_K):
        total += tl.load(y_ptr + (token * TOP_K + slot) * H + cols, mask=ok, other=0.0)
    tl.store(out_ptr + token * H + cols, rounded(total, ROUND_BITS, False).to(out_ptr.dtype.element_ty), mask=ok)


def _launch(x: torch.Tensor, ids: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, routing: torch.Tensor,
            rows_per_x: int, n: int, k: int, transposed: bool, gate: int, has_bias: bool, weighted: bool,
            tiling: Tiling, alpha: float = 0.0, limit: float = 0.0) -> torch.Tensor:
    """y [S, n] (fp32 when `weighted`, else x's dtype) for the S pairs of `ids` over `weight` [E, n or 2n, k]
    ([E, k, ...] when `transposed`); `gate`: 0 none, GATE_SILU or GATE_CLAMPED (with `alpha`, `limit`)."""
    pairs = ids.shape[0]
    y = torch.empty((pairs, n), device=x.device, dtype=torch.float32 if weighted else x.dtype)
    stride_wn, stride_wk = (weight.stride(2), weight.stride(1)) if transposed else (weight.stride(1), weight.stride(2))
    kernel = jit(_experts_kernel, do_not_specialize=("S",))
    if not interpreting():  # traced by torch.compile as part of the graph (interpreted kernels cannot be)
        kernel = wrap_triton(kernel)
    compact = pairs <= COMPACT_PAIRS
    grid = (min(weight.shape[0], pairs) if compact else weight.shape[0], -(-n // tiling.block_n))
    kernel[grid](
        x, ids, weight, bias, routing, y, pairs, rows_per_x, n, k, x.stride(0), weight.stride(0), stride_wn,
        stride_wk, bias.stride(0) if has_bias else 0, y.stride(0), alpha, limit,
        S_PAD=max(BLOCK_M, next_power_of_2(pairs)), COMPACT=compact, GATE=gate, HAS_BIAS=has_bias, WEIGHTED=weighted,
        BLOCK_M=BLOCK_M, BLOCK_N=tiling.block_n, BLOCK_K=tiling.block_k, IEEE=x.dtype == torch.float32,
        UPCAST=interpreting() and x.dtype != torch.float32,
        ROUND_BITS=interpreting() and x.dtype == torch.bfloat16, num_warps=tiling.num_warps,
        num_stages=tiling.num_stages,
    )
    return y


@triton_op("dflash_train::decode_experts_up", mutates_args=())
def _up_op(x: torch.Tensor, ids: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, top_k: int,
           transposed: bool, gate: int, alpha: float, limit: float, has_bias: bool) -> torch.Tensor:
    rows_in, width = (weight.shape[1], weight.shape[2]) if transposed else (weight.shape[2], weight.shape[1])
    n = width // 2 if gate else width
    return _launch(x, ids, weight, bias, ids, top_k, n, rows_in, transposed, gate, has_bias, False,
                   tiling_for("up", n, rows_in), alpha, limit)


@triton_op("dflash_train::decode_experts_down", mutates_args=())
def _down_op(h: torch.Tensor, ids: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, routing: torch.Tensor,
             top_k: int, transposed: bool, has_bias: bool) -> torch.Tensor:
    k, n = (weight.shape[1], weight.shape[2]) if transposed else (weight.shape[2], weight.shape[1])
    per_pair = _launch(h, ids, weight, bias, routing, 1, n, k, transposed, 0, has_bias, True,
                       tiling_for("down", n, k))
    out = torch.empty((ids.shape[0] // top_k, n), device=h.device, dtype=h.dtype)
    kernel = jit(_top_k_sum_kernel)
    if not interpreting():
        kernel = wrap_triton(kernel)
    block = min(1024, next_power_of_2(n))
    kernel[(out.shape[0], -(-n // block))](per_pair, out, n, TOP_K=top_k, BLOCK=block,
                                             ROUND_BITS=interpreting() and h.dtype == torch.bfloat16)
    return out


# Qwen3-30B-A3B's best at both of its products; the tilings swept differ by a few percent at most there.
DEFAULT_TILING = Tiling(64, 128, 4, 3)
# (product, output width N, reduction K) -> tiling, swept on an H100 by `python -m benchmarks.decode_experts
# --sweep` (docs/benchmarks.md, `decode_experts`); other shapes take DEFAULT_TILING.
TILINGS: dict[tuple[str, int, int], Tiling] = {
    ("up", 2880, 2880): Tiling(64, 64, 4, 3),  # gpt-oss-20b
    ("down", 2880, 2880): Tiling(64, 64, 4, 4),
}


def tiling_for(product: str, n: int, k: int) -> Tiling:
    return TILINGS.get((product, n, k), DEFAULT_TILING)


# Transposed weights (gpt-oss's [E, in, out]): the kernel is ahead of the grouped products up to about two
# pairs per expert and behind them from about eight (docs/benchmarks.md, `decode_experts`); [E, out, in]
# weights stay ahead up to MAX_PAIRS.
TRANSPOSED_PAIRS_PER_EXPERT = 2


def fits(pairs: int, experts: int | None = None, transposed: bool = False) -> bool:
    """Whether the kernel takes a step of `pairs` (tokens × top-k) over `experts` experts in that layout."""
    if transposed and experts is not None and pairs > TRANSPOSED_PAIRS_PER_EXPERT * experts:
        return False
    return 1 <= pairs <= MAX_PAIRS


def decode_experts_triton(x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                          gate_up: torch.Tensor, down: torch.Tensor, gate_up_bias: torch.Tensor | None = None,
                          down_bias: torch.Tensor | None = None, transposed: bool = False,
                          gate: ClampedGate | Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """`experts_reference`'s contract in three launches, for at most `MAX_PAIRS` pairs; `gate`: None for
    SiLU-gated halves and a `ClampedGate`, both folded into the up product, or any function of the raw
    [.., 2I] product (the model's own, run between the launches). Custom ops, so torch.compile keeps them in its
    graph and CUDA graphs capture them."""
    tokens, top_k = top_k_index.shape
    assert fits(tokens * top_k), f"{tokens * top_k} pairs: the kernel takes 1..{MAX_PAIRS} (use grouped_mm)"
    assert gate_up.dtype == x.dtype == down.dtype, "expert weights must be in x's dtype"
    ids = top_k_index.reshape(-1).to(torch.int32)
    x = x.contiguous()
    mode = GATE_SILU if gate is None else GATE_CLAMPED if isinstance(gate, ClampedGate) else 0
    alpha, limit = (float(gate.alpha), float(gate.limit)) if isinstance(gate, ClampedGate) else (0.0, 0.0)
    h = _up_op(x, ids, gate_up, gate_up_bias if gate_up_bias is not None else gate_up, top_k, transposed, mode,
               alpha, limit, gate_up_bias is not None)
    if mode == 0:
        h = gate(h).to(x.dtype).contiguous()  # type: ignore[operator]
    routing = top_k_weights.reshape(-1).contiguous()
    return _down_op(h, ids, down, down_bias if down_bias is not None else down, routing, top_k, transposed,
                    down_bias is not None)
