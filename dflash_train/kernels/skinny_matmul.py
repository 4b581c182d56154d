"""y[M, N] = x[M, K] @ W[N, K]^T (+ bias) for the few rows of a decode or verify step, streaming W once,
with every row's result independent of how many rows there are and of what they hold.

Why: at batch 1 a decode step is a string of matrix-vector products bound by reading the weights, and
cuBLAS runs the small ones (q/k/v, o_proj, down) well below the memory bandwidth, with a split-K reduction
kernel after several of them: its kernels are built for large M (docs/benchmarks.md, `decode`). A DFlash
verify step runs the same products at M = 16.

Design: the product is computed transposed, y^T = W · x^T, so that the weight tile [BLOCK_N, BLOCK_K] is
the tensor cores' wide operand, loaded along K in wide vectors, and the rows of x are the narrow one
(BLOCK_M = 16, the smallest tile a Triton dot takes). One program per (16 rows, BLOCK_N outputs) walks the
whole of K, software-pipelined `num_stages` deep where Triton pipelines it; or, with `split_k` > 1, one
program per K slice writes its fp32 sums and a second kernel adds the slices in slice order and finishes
(more programs in flight for an output too narrow to keep every multiprocessor streaming; no atomics). The
tiling per (N, K) comes from a small table (`CONFIGS`, filled from `python -m benchmarks.skinny_matmul
--sweep` on the GPU) or else `default_config`, whose BLOCK_N leaves even N = 4096 a program or two per
multiprocessor of an H100/H200. With those default tilings it is slower than cuBLAS; with the swept
tilings of `CONFIGS` every Qwen3-8B product is level with cuBLAS or faster, and so is the step
(docs/benchmarks.md, `decode`: 'The skinny kernel's tilings swept'). So the runtime runs on it by default
the shapes of `CONFIGS`, on the architecture they were swept on (`tuned_shapes`), and every product only
when asked (`StaticTarget(skinny_matmul="all")`); `benchmarks.decode --variants skinny_matmul,cublas_matmul`
measures both against the default.

Batch invariance: a row's output is bitwise the same whatever M is (1, 16 or 40) and whatever the other
rows hold. The tiling is chosen from (N, K) only, never from M; rows are processed 16 at a time by
identical programs (padding rows read as zeros), and a split product's slices are added in one fixed
order; M only masks loads and stores (a run-time argument that eager launches do not specialise on;
torch.compile may compile M = 1 apart, which changes which rows are loaded, not a row's arithmetic); and in
a tensor-core product each output element is the sum over K of its own row's products, accumulated in the
same order (K ascending, fp32) whatever the other rows hold.
So a target-only step at M = 1 and a verify block at M = 16 round every logit identically, which the
runtime's bf16 lossless check relies on (`dflash_train.runtime.engine`).

Rounding: bf16/fp16 inputs multiplied exactly and summed in fp32 (tensor cores), bias added in fp32, one
rounding to x's dtype at the end; fp32 inputs multiplied in full fp32 (`input_precision="ieee"`, not tf32).

The kernel has three compile-time options, off for the plain product, which `skinny_fused` uses to fold the
operations around a decoder layer's products into them: an RMSNorm of x before the product (NORM), SwiGLU
over a [gate; up] weight (SWIGLU) and a residual add (RESIDUAL) after it. A fourth, GDC (`launch(pdl=True)`),
launches it as a programmatic dependent launch: it starts while the kernel before it ends, asks L2 for its
first weight tiles, then waits for x; measured by `benchmarks.skinny_matmul --pdl`, not used by the runtime,
since it gained nothing over the plain launch (docs/benchmarks.md, 'Programmatic dependent launch gains
nothing'). Its inline assembly has side effects, which torch.compile's analysis of a kernel cannot follow: it
would take every tensor the kernel is given as written and copy the weight at each call, so no launch the
runtime makes may turn it on (`kernel_constants`; the same L2 request before a NORM product's norm pass made
it slower as well).

NORM's pass over x is what made the fused path slow: every program sums its rows' squares over the whole of
K before its weight stream starts (docs/benchmarks.md, 'What each folded-in operation costs'). So the
norm's statistics can be carried instead (experimental, `launch`'s `stats_out` and `stats_in`): the product
that writes x with its residual add (o_proj, down) also writes each row's sum of squares of what it stored,
one share per output tile, and the NORM product reads those shares (256 floats a row at those tilings) in
one load and adds them in a fixed tree. A row's shares depend on that row alone and on the tiling, which
(N, K) fixes, so batch invariance holds; against the pass, only the order of the fp32 sum of squares changes.
"""

# Deliberately no postponed annotations (PEP 563): Triton reads the `tl.constexpr` annotations of kernels.
from typing import NamedTuple

import torch
from torch.library import triton_op, wrap_triton

from dflash_train.kernels._triton import HAS_TRITON, interpreting, jit, next_power_of_2, tl, triton
from dflash_train.kernels.device import dot, grid_release, grid_wait, kept, prefetch_l2, rounded

BLOCK_M = 16  # rows per program: the smallest dot tile, and the unit that keeps rows independent of M
MAX_ROWS = 64  # rows the kernel takes (4 programs per weight tile, the weight re-read from L2); more: cuBLAS
# Rows up to which the tuned shapes run on the kernel by default: CONFIGS was swept at 1 and 16 rows, and at 64
# rows (a batch-64 decode step, a batch-4 verify) Qwen3-8B's step is much slower on it than on cuBLAS
# (docs/benchmarks.md, 'Products of 64 rows').
TUNED_ROWS = 16


class Config(NamedTuple):
    """How one weight shape is tiled: outputs and reduction width per step, warps, pipeline depth."""

    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 4
    split_k: int = 1  # K slices run as programs of their own, their fp32 sums added by a second kernel
    # NORM's pass over x before the product (the rows' squares): its tile width along K (0: block_k) and the
    # tiles in flight. Its time is about one memory round trip per (K / norm_k / norm_stages), paid by every
    # program before its weight stream starts (`benchmarks.skinny_matmul --options` times the choices).
    norm_k: int = 0
    norm_stages: int = 4


# (N, K) -> Config, measured on the GPU in bf16 (`python -m benchmarks.skinny_matmul --sweep` prints the
# rows). Only (N, K) picks the row (module docstring); a shape not here gets `default_config`. Each is the
# fastest tiling of the sweep at 1 and 16 rows, Qwen3-8B's products on an H200; the times against cuBLAS's are
# in docs/benchmarks.md (`decode`: 'The skinny kernel's tilings swept').
CONFIGS: dict[tuple[int, int], Config] = {
    (6144, 4096): Config(64, 256, 4, 4),  # Qwen3-8B q/k/v
    (4096, 4096): Config(16, 512, 2, 3),  # o_proj
    (24576, 4096): Config(64, 128, 4, 3),  # gate/up
    (4096, 12288): Config(16, 512, 2, 3),  # down
    # lm_head. Its norm pass (the fused path's NORM) in wide tiles, 4 in flight: far cheaper than in the
    # product's own tiles of 128 (docs/benchmarks.md, 'The norm pass's own tiling').
    (151936, 4096): Config(128, 128, 8, 4, norm_k=1024, norm_stages=4),
    # Qwen3-30B-A3B's attention products (its experts run on kernels/decode_experts.py), swept on an H100.
    (5120, 2048): Config(64, 256, 4, 4),  # q/k/v
    (2048, 4096): Config(16, 512, 2, 4),  # o_proj
}
# The GPU architecture CONFIGS was swept on (sm_90: H100, H200). There its shapes run on this kernel by
# default (`tuned_shapes`); elsewhere, and for other shapes, cuBLAS does unless the kernel is asked for.
TUNED_ON = (9, 0)


def default_config(n: int, k: int) -> Config:
    """Tiles for a shape the table lacks: K steps of 256 (16-byte loads, 8-32 KB of weight per pipeline
    stage), and BLOCK_N halved from 64 while the output has fewer than 256 tiles, so that a 4096-wide
    one still gives each of an H100/H200's 132 multiprocessors a program or two to keep streaming."""
    block_k = min(256, max(16, next_power_of_2(k)))
    block_n = 64
    while block_n > 16 and -(-n // block_n) < 256:
        block_n //= 2
    # A 16 x 16 tile has one 16-row MMA block of the weight: four warps would load it twice over (2 x 2
    # warps); two warps share it without copies. 64 rows: one Hopper warpgroup (wgmma m64n16).
    return Config(block_n, block_k, num_warps=2 if block_n == 16 else 4)


def swiglu_tiling(plain: Config) -> Config:
    """A [gate; up] product's tiling from its plain product's: half the outputs a program, since each output
    reads a gate row and an up row, so a program streams as many weight rows a step as the plain product's.
    At Qwen3-8B's gate/up this makes SwiGLU nearly free, where `default_config`'s tiling of the 12,288-wide
    output was markedly slower (docs/benchmarks.md, 'What each folded-in operation costs')."""
    return plain._replace(block_n=max(16, plain.block_n // 2))


def config_for(n: int, k: int, swiglu: bool = False) -> Config:
    """The tiling of an output N wide over K (with `swiglu`, N is the output's width: the weight has 2N rows)."""
    if interpreting():  # programs run one after another there, each at a cost per operation: few, large ones
        return Config(min(128, max(16, next_power_of_2(n))), min(256, max(16, next_power_of_2(k))))
    if swiglu and (2 * n, k) in CONFIGS:
        return swiglu_tiling(CONFIGS[(2 * n, k)])
    return CONFIGS.get((n, k)) or default_config(n, k)


def tuned_shapes(device: torch.device) -> frozenset[tuple[int, int]]:
    """The weight shapes (N, K) whose products of few rows run faster on this kernel than on cuBLAS on
    `device`, as measured: CONFIGS's on a GPU of the architecture it was swept on, else none."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device) != TUNED_ON:
        return frozenset()
    return frozenset(CONFIGS)


def fits(rows: int) -> bool:
    """Whether a product over `rows` rows of x goes to the kernel (else: torch's matmul, e.g. prefill)."""
    return 0 < rows <= MAX_ROWS


def skinny_matmul_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """PyTorch version: x [..., K] @ weight [N, K]^T + bias [N], summed in fp32, rounded once to x's dtype."""
    y = x.float() @ weight.float().T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def _skinny_matmul_kernel(
    x_ptr, g_ptr, w_ptr, b_ptr, r_ptr, y_ptr, p_ptr, s_in_ptr, s_out_ptr, M, N, K, K_SPLIT, P_IN, P_OUT, stride_xm,
    stride_wn, stride_rm, stride_ym,
    EPS: tl.constexpr, NORM: tl.constexpr, SWIGLU: tl.constexpr, RESIDUAL: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, SPLIT_K: tl.constexpr,
    IEEE: tl.constexpr, UPCAST: tl.constexpr, ROUND_BITS: tl.constexpr, OPAQUE: tl.constexpr, GDC: tl.constexpr,
    PREFETCH_K: tl.constexpr, PREFETCH_STEP: tl.constexpr, NORM_K: tl.constexpr, NORM_STAGES: tl.constexpr,
    STATS_IN: tl.constexpr, STATS_OUT: tl.constexpr, STATS_BLOCK: tl.constexpr,
):
    # N is the output's width (I with SWIGLU, whose up rows start at weight row N). Axis 0 is the row tile,
    # so that the programs sharing a weight tile run side by side and all but the first read it from L2.
    # Axis 2 is the K slice [K_SPLIT * s, K_SPLIT * (s + 1)) of a split product (SPLIT_K > 1), whose fp32 sums
    # go to p_ptr [SPLIT_K, M, width] for `_skinny_reduce_kernel` to add and finish.
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    k_first = tl.program_id(2) * K_SPLIT
    k_end = tl.minimum(K, k_first + K_SPLIT)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_ok = rows < M
    col_ok = cols < N
    x_ptrs = x_ptr + rows[None, :] * stride_xm + ks[:, None]  # x^T tile [BLOCK_K, BLOCK_M]
    if GDC:  # launched before the kernel that writes x has ended: the first weight tiles (which no kernel
        # writes) are asked of L2 meanwhile, a line per PREFETCH_STEP elements; then x is waited for
        lines = k_first + tl.arange(0, PREFETCH_K // PREFETCH_STEP) * PREFETCH_STEP
        line_ok = col_ok[:, None] & (lines < k_end)[None, :]
        rows_w = cols.to(tl.int64)[:, None] * stride_wn + lines[None, :]
        prefetch_l2(w_ptr + rows_w, line_ok, w_ptr, True)
        if SWIGLU:
            prefetch_l2(w_ptr + N * stride_wn + rows_w, line_ok, w_ptr, True)
        grid_wait(True)
    inv_rms = tl.zeros([BLOCK_M], dtype=tl.float32)
    if NORM and STATS_IN:  # the rows' sums of squares as the product that wrote x left them (STATS_OUT): its
        # P_IN output tiles' shares [M, P_IN], added in one fixed tree; one load instead of a pass over x
        shares = tl.arange(0, STATS_BLOCK)
        part = tl.load(s_in_ptr + rows[None, :] * P_IN + shares[:, None],
                       mask=(shares < P_IN)[:, None] & row_ok[None, :], other=0.0)
        inv_rms = tl.rsqrt(tl.sum(part, axis=0) / K + EPS)
    elif NORM:  # the rows' mean squares, over the whole of K (every slice's), before any product
        squares = tl.zeros([BLOCK_M], dtype=tl.float32)
        # Pipelined, NORM_STAGES tiles of NORM_K in flight: the pass's loads are otherwise issued one tile at a
        # time, each waiting out the memory latency before the weight stream starts (16 tiles at K = 4,096).
        nks = tl.arange(0, NORM_K)
        n_ptrs = x_ptr + rows[None, :] * stride_xm + nks[:, None]
        for k0 in tl.range(0, K, NORM_K, num_stages=NORM_STAGES):
            xt = tl.load(n_ptrs + k0, mask=((k0 + nks) < K)[:, None] & row_ok[None, :], other=0.0).to(tl.float32)
            squares += tl.sum(xt * xt, axis=0)
        inv_rms = tl.rsqrt(squares / K + EPS)
    x_ptrs += k_first
    w_ptrs = w_ptr + cols.to(tl.int64)[:, None] * stride_wn + (k_first + ks)[None, :]  # [BLOCK_N, BLOCK_K]
    u_ptrs = w_ptr + (cols.to(tl.int64) + N)[:, None] * stride_wn + (k_first + ks)[None, :]  # the up rows (SWIGLU)
    g_ptrs = g_ptr + k_first + ks
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k0 in range(k_first, k_end, BLOCK_K):
        k_ok = (k0 + ks) < k_end
        if EVEN_K:
            w = tl.load(w_ptrs, mask=col_ok[:, None], other=0.0)
            xt = tl.load(x_ptrs, mask=row_ok[None, :], other=0.0)
        else:
            w = tl.load(w_ptrs, mask=col_ok[:, None] & k_ok[None, :], other=0.0)
            xt = tl.load(x_ptrs, mask=k_ok[:, None] & row_ok[None, :], other=0.0)
        if NORM:  # rmsnorm's two roundings: normalised x to x's dtype, then times the weight
            gamma = tl.load(g_ptrs, mask=k_ok, other=0.0).to(tl.float32)
            normed = rounded(xt.to(tl.float32) * inv_rms[None, :], ROUND_BITS, False)
            normed = rounded(gamma[:, None] * normed.to(x_ptr.dtype.element_ty).to(tl.float32), ROUND_BITS, False)
            xt = normed.to(x_ptr.dtype.element_ty)
        acc = dot(w, xt, acc, IEEE, UPCAST)
        if SWIGLU:
            if EVEN_K:
                u = tl.load(u_ptrs, mask=col_ok[:, None], other=0.0)
            else:
                u = tl.load(u_ptrs, mask=col_ok[:, None] & k_ok[None, :], other=0.0)
            acc_up = dot(u, xt, acc_up, IEEE, UPCAST)
            u_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
    grid_release(GDC)  # the weight is streamed: the next product may start its own prefetch
    if SPLIT_K > 1:  # this slice's sums; the reduce kernel adds the slices in order and finishes
        width = 2 * N if SWIGLU else N
        partial = p_ptr + tl.program_id(2) * M * width + rows[None, :] * width + cols[:, None]
        tl.store(partial, acc, mask=row_ok[None, :] & col_ok[:, None])
        if SWIGLU:
            tl.store(partial + N, acc_up, mask=row_ok[None, :] & col_ok[:, None])
    else:
        _finish(acc, acc_up, b_ptr, r_ptr, y_ptr, s_out_ptr, rows, cols, row_ok, col_ok, N, P_OUT, stride_rm,
                stride_ym, SWIGLU, RESIDUAL, HAS_BIAS, ROUND_BITS, OPAQUE, STATS_OUT)


def _skinny_reduce_kernel(
    p_ptr, b_ptr, r_ptr, y_ptr, s_out_ptr, M, N, P_OUT, stride_rm, stride_ym, SWIGLU: tl.constexpr,
    RESIDUAL: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT_K: tl.constexpr, ROUND_BITS: tl.constexpr, OPAQUE: tl.constexpr, STATS_OUT: tl.constexpr,
):
    """A split product's slices added in slice order (the same sum for every row, whatever M), then finished
    as the unsplit kernel finishes."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    mask = row_ok[None, :] & col_ok[:, None]
    width = 2 * N if SWIGLU else N
    partial = p_ptr + rows[None, :] * width + cols[:, None]
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(partial + s * M * width, mask=mask, other=0.0)
        if SWIGLU:
            acc_up += tl.load(partial + s * M * width + N, mask=mask, other=0.0)
    _finish(acc, acc_up, b_ptr, r_ptr, y_ptr, s_out_ptr, rows, cols, row_ok, col_ok, N, P_OUT, stride_rm, stride_ym,
            SWIGLU, RESIDUAL, HAS_BIAS, ROUND_BITS, OPAQUE, STATS_OUT)


def _finish(acc, acc_up, b_ptr, r_ptr, y_ptr, s_out_ptr, rows, cols, row_ok, col_ok, N, P_OUT, stride_rm, stride_ym,
            SWIGLU: tl.constexpr, RESIDUAL: tl.constexpr, HAS_BIAS: tl.constexpr, ROUND_BITS: tl.constexpr,
            OPAQUE: tl.constexpr, STATS_OUT: tl.constexpr):
    """The product's fp32 sums [BLOCK_N, BLOCK_M] (and the up half's, SWIGLU) to y: bias, the modules'
    roundings, SwiGLU, the residual add; with STATS_OUT, this output tile's share of each row's sum of squares
    of y as stored, to s_out [M, P_OUT] (column: the tile), for the next product's norm (STATS_IN)."""
    out_ty = y_ptr.dtype.element_ty
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[:, None]
        if SWIGLU:
            acc_up += tl.load(b_ptr + N + cols, mask=col_ok, other=0.0).to(tl.float32)[:, None]
    # Every step rounds to the output's dtype (fp32 values of bf16 numbers in between), as the modules do.
    # ROUND_BITS (interpreted bf16): on the bits first, since the interpreter's casts truncate.
    y = rounded(acc, ROUND_BITS, False).to(out_ty).to(tl.float32)
    if SWIGLU:  # silu of the rounded gate, rounded, times the rounded up, rounded (and `kept` so, before a
        # residual add the compiler would otherwise fuse with this product: one rounding instead of two)
        silu = rounded(y / (1.0 + tl.exp(-y)), ROUND_BITS, False).to(out_ty).to(tl.float32)
        up = rounded(acc_up, ROUND_BITS, False).to(out_ty).to(tl.float32)
        y = kept(rounded(silu * up, ROUND_BITS, False).to(out_ty).to(tl.float32), OPAQUE)
    out_mask = row_ok[None, :] & col_ok[:, None]
    if RESIDUAL:
        residual = tl.load(r_ptr + rows[None, :] * stride_rm + cols[:, None], mask=out_mask, other=0.0)
        y = rounded(residual.to(tl.float32) + y, ROUND_BITS, False)
    tl.store(y_ptr + rows[None, :] * stride_ym + cols[:, None], y.to(out_ty), mask=out_mask)
    if STATS_OUT:  # the squares of the stored values (exact in fp32 for 16-bit ones), summed in a fixed tree
        stored = y.to(out_ty).to(tl.float32)
        share = tl.sum(tl.where(out_mask, stored * stored, 0.0), axis=0)
        tl.store(s_out_ptr + rows * P_OUT + tl.program_id(1), share, mask=row_ok)


if HAS_TRITON:  # a device function, resolved when a kernel calling it compiles
    _finish = triton.jit(_finish)


def kernel_constants(dtype: torch.dtype, k: int, eps: float, flags: dict[str, bool], config: Config,
                     pdl: bool = False, stats_in_width: int = 0, stats_out: bool = False) -> dict[str, object]:
    """The kernel's compile-time arguments for a launch (what `launch` passes; tests compile them)."""
    split = max(1, config.split_k)
    return dict(EPS=eps, **flags, BLOCK_M=BLOCK_M, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
                EVEN_K=k % config.block_k == 0, SPLIT_K=split, IEEE=dtype == torch.float32,
                UPCAST=interpreting() and dtype != torch.float32, ROUND_BITS=interpreting() and dtype == torch.bfloat16,
                OPAQUE=not interpreting(), GDC=pdl and not interpreting(), PREFETCH_K=4 * config.block_k,
                PREFETCH_STEP=128 // dtype.itemsize, NORM_K=config.norm_k or config.block_k,
                NORM_STAGES=config.norm_stages, STATS_IN=stats_in_width > 0, STATS_OUT=stats_out,
                STATS_BLOCK=next_power_of_2(max(1, stats_in_width)))


def stats_width(n: int, k: int, swiglu: bool = False) -> int:
    """How many shares of a row's sum of squares a product of output N over K writes with `stats_out`: one
    per output tile of its tiling (`launch`)."""
    return -(-n // config_for(n, k, swiglu).block_n)


def launch(x: torch.Tensor, norm_weight: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
           residual: torch.Tensor, eps: float, n: int, flags: dict[str, bool], config: Config | None = None,
           pdl: bool = False, stats_in: torch.Tensor | None = None,
           stats_out: torch.Tensor | None = None) -> torch.Tensor:
    """The kernel over x [M, K] and weight [N or 2N (SWIGLU), K] with K contiguous, residual [M, N], for the
    options in `flags` (NORM, SWIGLU, RESIDUAL, HAS_BIAS); unused tensors stand in for absent ones (never
    read); `config`: the table's for (N, K) unless given (benchmarks). -> y [M, N] in x's dtype.
    `pdl`: launched with programmatic dependent launch (sm_90 and later; experimental, for
    `benchmarks.skinny_matmul --pdl`): it may start while the kernel before it ends, prefetching its first
    weight tiles until x is ready. The result is the same; a split product's reduction launches as usual.
    `stats_out` [M, tiles along N] fp32: written with each output tile's share of each row's sum of squares of
    y (`stats_width`); `stats_in` [M, P] fp32: such shares of x, from which NORM takes the rows' mean squares
    instead of its own pass over x (the same up to the order of the fp32 sums; experimental, for
    `benchmarks.skinny_matmul --options`)."""
    m, k = x.shape
    config = config or config_for(n, k, flags["SWIGLU"])
    assert stats_in is None or (flags["NORM"] and stats_in.dtype == torch.float32 and stats_in.shape[0] == m
                                and stats_in.is_contiguous()), "stats_in: [M, P] fp32 shares, for a NORM product"
    y = torch.empty((m, n), device=x.device, dtype=x.dtype)
    split = max(1, config.split_k)
    # Slices of whole K steps, so that EVEN_K holds in every slice when it holds for K.
    k_split = -(-k // (split * config.block_k)) * config.block_k
    partials = y if split == 1 else torch.empty((split, m, 2 * n if flags["SWIGLU"] else n), device=x.device,
                                                dtype=torch.float32)
    # M not specialised: Triton would otherwise compile M == 1 (and M % 16 == 0) apart; this way an eager
    # launch runs the same binary for every M (module docstring: batch invariance).
    kernel = jit(_skinny_matmul_kernel, do_not_specialize=("M",))
    reduce = jit(_skinny_reduce_kernel, do_not_specialize=("M",))
    if not interpreting():  # traced by torch.compile as part of the graph (interpreted kernels cannot be)
        kernel, reduce = wrap_triton(kernel), wrap_triton(reduce)
    tiles = (-(-m // BLOCK_M), -(-n // config.block_n))
    assert stats_out is None or (stats_out.shape == (m, tiles[1]) and stats_out.dtype == torch.float32
                                 and stats_out.is_contiguous()), f"stats_out: [M, {tiles[1]}] fp32"
    stats_in_width = 0 if stats_in is None else stats_in.shape[1]
    shares_in = partials if stats_in is None else stats_in  # a stand-in is never read
    shares_out = partials if stats_out is None else stats_out
    constants = kernel_constants(x.dtype, k, eps, flags, config, pdl, stats_in_width, stats_out is not None)
    kernel[(*tiles, split)](
        x, norm_weight, weight, bias, residual, y, partials, shares_in, shares_out, m, n, k, k_split,
        max(1, stats_in_width), tiles[1], x.stride(0), weight.stride(0), residual.stride(0), y.stride(0),
        **constants, num_warps=config.num_warps, num_stages=config.num_stages,
        **({"launch_pdl": True} if pdl and not interpreting() else {}),
    )
    if split > 1:
        reduce[tiles](
            partials, bias, residual, y, shares_out, m, n, tiles[1], residual.stride(0), y.stride(0),
            SWIGLU=flags["SWIGLU"], RESIDUAL=flags["RESIDUAL"], HAS_BIAS=flags["HAS_BIAS"], BLOCK_M=BLOCK_M,
            BLOCK_N=config.block_n, SPLIT_K=split, ROUND_BITS=interpreting() and x.dtype == torch.bfloat16,
            OPAQUE=not interpreting(), STATS_OUT=stats_out is not None,
        )
    return y


@triton_op("dflash_train::skinny_matmul", mutates_args=())
def _skinny_matmul_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, has_bias: bool) -> torch.Tensor:
    flags = dict(NORM=False, SWIGLU=False, RESIDUAL=False, HAS_BIAS=has_bias)  # the plain product
    return launch(x, weight, weight, bias, x, 0.0, weight.shape[0], flags)


def skinny_matmul_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as `skinny_matmul_reference` for at most `MAX_ROWS` rows (x's leading dimensions
    flattened); a custom op, so torch.compile keeps it in its graph and CUDA graphs capture it."""
    *lead, k = x.shape
    n = weight.shape[0]
    assert weight.shape == (n, k) and weight.dtype == x.dtype, "weight must be [N, K] in x's dtype"
    # Never copied here: a copy would read and write the whole weight at every call. Rows may be strided.
    assert weight.stride(1) == 1, "weight must be contiguous along K"
    assert bias is None or bias.shape == (n,), "bias must be [N]"
    x2 = x.reshape(-1, k)
    assert fits(x2.shape[0]), f"{x2.shape[0]} rows: the kernel takes 1..{MAX_ROWS} (use torch's matmul)"
    # Without a bias the pointer is never read: any tensor stands in for it.
    y = _skinny_matmul_op(x2.contiguous(), weight, bias.contiguous() if bias is not None else weight,
                          bias is not None)
    return y.reshape(*lead, n)
