"""Device functions the kernels share.

`rounded`: an fp32 value rounded to the activations' dtype, as PyTorch's eager code rounds between two
operations, and kept as fp32 for the next one. bf16 is rounded on the bits (to nearest, ties to even) rather
than by a cast, because the Triton interpreter truncates its bf16 casts: the CPU tests compare kernels with
PyTorch's rounding, bit for bit.

`kept`: a rounded value hidden from the GPU compiler's contraction of a product and a later sum into one
fused multiply-add, which rounds once where the modules round twice.

`dot`: a product accumulated with fp32 sums, in full fp32 precision for fp32 inputs and under the interpreter.

`prefetch_l2_bulk`: large contiguous spans asked of L2 in one request each, for a weight the next kernel
reads (the attention kernel asks for the o_proj weight after it, `static_attention`).

`grid_wait`, `grid_release`, `prefetch_l2`: programmatic dependent launch (Hopper and later) for a kernel
launched with `launch_pdl=True`: such a kernel may start before the one before it has finished, so it must
wait (`grid_wait`) before it reads anything an earlier kernel wrote; until then it can ask L2 for what no
kernel writes (`prefetch_l2`: a weight); `grid_release` lets the next such kernel start while this one ends.
Compiled kernels only: the interpreter runs kernels one after another and has no inline assembly.

`head_norm_weights`, `head_norm`, `rotate_half`: the attention prologue's q/k RMSNorm over a head and its
rotate-half RoPE, on a head's two halves (element d of the first pairs with element d of the second), in
the model's rounding steps; for vectors of one token or [D/2, tokens] tiles alike (the caller shapes the
per-token factors to broadcast).
"""

# Deliberately no postponed annotations (PEP 563): Triton reads the `tl.constexpr` annotations of kernels.
from dflash_train.kernels._triton import HAS_TRITON, tl, triton


def rounded(x, BF16: tl.constexpr, FP16: tl.constexpr):
    """fp32 x rounded to bf16 (BF16) or fp16 (FP16) and back; unchanged when neither is set."""
    if BF16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        x = ((bits >> 16) << 16).to(tl.float32, bitcast=True)
    elif FP16:
        x = x.to(tl.float16).to(tl.float32)
    return x


def kept(x, OPAQUE: tl.constexpr):
    """fp32 x as it is, but opaque to the compiler (OPAQUE: compiled kernels; the interpreter, which never
    fuses, has no inline assembly). Why: given round(a * b) + c with a 16-bit rounding in between, the GPU
    compiler narrows both operations to that dtype and then fuses them into one FMA, skipping the product's
    rounding; compiled for sm_90, a split-K SwiGLU product followed by a residual add came out one unit off
    in a large share of its bf16 outputs (docs/benchmarks.md, `decode`). A value that comes out of an assembly `mov` cannot be traced back to the product."""
    if OPAQUE:
        x = tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1)
    return x


def dot(w, xt, acc, IEEE: tl.constexpr, UPCAST: tl.constexpr):
    """acc + w @ xt with fp32 sums: full fp32 products for fp32 inputs (IEEE, not tf32) and under the
    interpreter (UPCAST: its dot cannot multiply bf16, whose products are exact in fp32), else the tensor
    cores' bf16/fp16 products."""
    if UPCAST:
        w = w.to(tl.float32)
        xt = xt.to(tl.float32)
    if IEEE or UPCAST:  # noqa: SIM108 (a constexpr branch: one of the two is compiled)
        acc = tl.dot(w, xt, acc, input_precision="ieee")
    else:
        acc = tl.dot(w, xt, acc)
    return acc


def grid_wait(ENABLED: tl.constexpr):
    """Wait until the kernels this one depends on have finished and their writes are visible (ENABLED)."""
    if ENABLED:
        tl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=tl.int32, is_pure=False, pack=1)


def grid_release(ENABLED: tl.constexpr):
    """Let the next kernel launched with programmatic dependent launch start now (ENABLED)."""
    if ENABLED:
        tl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=tl.int32,
                                  is_pure=False, pack=1)


def prefetch_l2(ptrs, mask, fallback, ENABLED: tl.constexpr):
    """Ask L2 for the lines at `ptrs` where `mask` (elsewhere `fallback`, an address known valid), without
    waiting for them (ENABLED)."""
    if ENABLED:
        addresses = tl.where(mask, ptrs, fallback).to(tl.uint64)
        tl.inline_asm_elementwise("prefetch.global.L2 [$1]; // $0", "=r,l", [addresses], dtype=tl.int32,
                                  is_pure=False, pack=1)


def prefetch_l2_bulk(ptrs, sizes):
    """Ask L2 for `sizes` bytes at each of `ptrs` (16-byte aligned; sizes multiples of 16, 0: nothing), one
    bulk request per element (sm_90), without waiting. -> zeros of their shape, which the caller must fold
    into its work: the assembly is declared pure, because torch.compile's reading of a kernel skips pure
    inline assembly but gives up on any other (taking every tensor the kernel is given as written, and
    copying each at every call), and a result that is used keeps the compiler from dropping the requests or
    moving them after the work they should overlap."""
    return tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.u32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [ptrs.to(tl.uint64), sizes], dtype=tl.int32, is_pure=True, pack=1)


def head_norm_weights(q_norm_ptr, k_norm_ptr, d, d_ok, is_q, HALF: tl.constexpr):
    """The two halves of q_norm's weight where `is_q`, else k_norm's, as fp32 [BLOCK_HALF] vectors. Both are
    read and one is kept: a select, not a branch, so that a kernel's stores stay masked by its kind."""
    w1 = tl.where(is_q, tl.load(q_norm_ptr + d, mask=d_ok, other=0.0), tl.load(k_norm_ptr + d, mask=d_ok, other=0.0))
    w2 = tl.where(is_q, tl.load(q_norm_ptr + HALF + d, mask=d_ok, other=0.0),
                  tl.load(k_norm_ptr + HALF + d, mask=d_ok, other=0.0))
    return w1.to(tl.float32), w2.to(tl.float32)


def head_norm(x1, x2, w1, w2, inv_rms, BF16: tl.constexpr, FP16: tl.constexpr):
    """RMSNorm of a head given its 1/rms: the normalised halves rounded, then times the weight, rounded."""
    return (rounded(w1 * rounded(x1 * inv_rms, BF16, FP16), BF16, FP16),
            rounded(w2 * rounded(x2 * inv_rms, BF16, FP16), BF16, FP16))


def rotate_half(x1, x2, c1, c2, s1, s2, BF16: tl.constexpr, FP16: tl.constexpr, OPAQUE: tl.constexpr):
    """x * cos + rotate_half(x) * sin on the halves, rounded as the eager code rounds: each product, then
    their sum (the products `kept`, so that a product and the sum are not fused into one rounding)."""
    c1x1, s1x2 = kept(rounded(x1 * c1, BF16, FP16), OPAQUE), kept(rounded(x2 * s1, BF16, FP16), OPAQUE)
    c2x2, s2x1 = kept(rounded(x2 * c2, BF16, FP16), OPAQUE), kept(rounded(x1 * s2, BF16, FP16), OPAQUE)
    return rounded(c1x1 - s1x2, BF16, FP16), rounded(c2x2 + s2x1, BF16, FP16)


if HAS_TRITON:  # device functions, resolved when a kernel calling them compiles (so jitted at import)
    rounded = triton.jit(rounded)
    kept = triton.jit(kept)
    dot = triton.jit(dot)
    grid_wait = triton.jit(grid_wait)
    grid_release = triton.jit(grid_release)
    prefetch_l2 = triton.jit(prefetch_l2)
    prefetch_l2_bulk = triton.jit(prefetch_l2_bulk)
    head_norm_weights = triton.jit(head_norm_weights)
    head_norm = triton.jit(head_norm)
    rotate_half = triton.jit(rotate_half)
