"""Device functions the kernels share.

`rounded`: an fp32 value rounded to the activations' dtype, as PyTorch's eager code rounds between two
operations, and kept as fp32 for the next one. bf16 is rounded on the bits (to nearest, ties to even) rather
than by a cast, because the Triton interpreter truncates its bf16 casts: the CPU tests compare kernels with
PyTorch's rounding, bit for bit.

`dot`: a product accumulated with fp32 sums, in full fp32 precision for fp32 inputs and under the interpreter.

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


def rotate_half(x1, x2, c1, c2, s1, s2, BF16: tl.constexpr, FP16: tl.constexpr):
    """x * cos + rotate_half(x) * sin on the halves, rounded as the eager code rounds: each product, then
    their sum."""
    y1 = rounded(rounded(x1 * c1, BF16, FP16) - rounded(x2 * s1, BF16, FP16), BF16, FP16)
    y2 = rounded(rounded(x2 * c2, BF16, FP16) + rounded(x1 * s2, BF16, FP16), BF16, FP16)
    return y1, y2


if HAS_TRITON:  # device functions, resolved when a kernel calling them compiles (so jitted at import)
    rounded = triton.jit(rounded)
    dot = triton.jit(dot)
    head_norm_weights = triton.jit(head_norm_weights)
    head_norm = triton.jit(head_norm)
    rotate_half = triton.jit(rotate_half)
