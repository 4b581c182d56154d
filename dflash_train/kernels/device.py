"""Device functions the kernels share.

`rounded`: an fp32 value rounded to the activations' dtype, as PyTorch's eager code rounds between two
operations, and kept as fp32 for the next one. bf16 is rounded on the bits (to nearest, ties to even) rather
than by a cast, because the Triton interpreter truncates its bf16 casts: the CPU tests compare kernels with
PyTorch's rounding, bit for bit.

`dot`: a product accumulated with fp32 sums, in full fp32 precision for fp32 inputs and under the interpreter.
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


if HAS_TRITON:  # device functions, resolved when a kernel calling them compiles (so jitted at import)
    rounded = triton.jit(rounded)
    dot = triton.jit(dot)
