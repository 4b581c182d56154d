"""Rounding inside kernels: an fp32 value rounded to the activations' dtype, as PyTorch's eager code rounds
between two operations, and kept as fp32 for the next one.

bf16 is rounded on the bits (to nearest, ties to even) rather than by a cast, because the Triton
interpreter truncates its bf16 casts: the CPU tests compare kernels with PyTorch's rounding, bit for bit.
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


if HAS_TRITON:  # a device function, resolved when a kernel calling it compiles (so jitted at import)
    rounded = triton.jit(rounded)
