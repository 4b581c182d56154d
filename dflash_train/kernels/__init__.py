"""Fused Triton kernels for the eval loop, each file holding the kernel, its launcher and a PyTorch reference.

Importing this package does not import triton; each kernel module imports it on first use, so the
PyTorch references work on machines without triton. Set ``TRITON_INTERPRET=1`` to run the kernels on
CPU tensors (slow; for tests).
"""

from __future__ import annotations

__all__ = ["context_kv", "greedy_verify"]
