"""Triton import with a clear error, and kernel bodies jitted at their first launch.

Kernel modules define plain functions and compile them here on first use, so that importing a kernel
module (for its PyTorch reference) never needs triton. Interpret mode (TRITON_INTERPRET=1, kernels on
CPU tensors) only works when the variable is set before triton is first imported: see
`interpreter_ready`.
"""

from __future__ import annotations

import os
import types
from collections.abc import Callable
from typing import Any

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # the PyTorch references still work; launchers raise `require_triton`'s error
    HAS_TRITON = False
    triton = None
    # Stand-in so that kernel signatures (`BLOCK: tl.constexpr`) still evaluate at import time.
    tl = types.SimpleNamespace(constexpr=object)

_compiled: dict[tuple[Callable[..., Any], bool], Any] = {}


def require_triton() -> None:
    if not HAS_TRITON:
        raise ImportError("these fused kernels need triton: `pip install triton` (or use kernels='torch')")


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def jit(fn: Callable[..., Any], do_not_specialize: tuple[str, ...] = ()) -> Any:
    """The jitted (or, under TRITON_INTERPRET=1, interpreted) version of the kernel body `fn`;
    `do_not_specialize`: integer arguments compiled as plain values (Triton otherwise compiles apart the
    values 1 and the multiples of 16)."""
    require_triton()
    key = (fn, interpreting())
    if key not in _compiled:
        _compiled[key] = triton.jit(fn, do_not_specialize=list(do_not_specialize) or None)
    return _compiled[key]


def interpreter_ready() -> bool:
    """Whether kernels can run on CPU tensors in this process.

    Triton's own library functions (`tl.max`, `tl.sum`, ...) are jitted when triton is imported, so the
    interpreter only works if TRITON_INTERPRET=1 was set before that import (torch imports triton early).
    """
    return HAS_TRITON and interpreting() and type(tl.max).__name__ == "InterpretedFunction"


def next_power_of_2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


__all__ = [
    "HAS_TRITON", "interpreter_ready", "interpreting", "jit", "next_power_of_2", "require_triton", "tl", "triton",
]
