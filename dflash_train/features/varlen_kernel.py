"""PyTorch's FlashAttention varlen kernel (`torch.nn.attention.varlen.varlen_attn`) called as each PyTorch
release's signature asks: causal by flag or by window, a scale or the default one, and grouped key/value heads
passed as they are wherever the kernel takes them.

FlashAttention reads each query head's key/value group directly. Releases whose `varlen_attn` has an
`enable_gqa` flag say so; earlier ones hand grouped heads to the same kernel without saying whether it takes them.
Which kind a release is gets checked once per shape, on the device, against the same kernel given the heads
repeated: repeating them costs a copy of the keys and of the values in every layer of every forward
(docs/benchmarks.md, `train_packing`).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch

KernelCall = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, float], torch.Tensor]
_grouped_heads_taken: dict[tuple, bool] = {}


def varlen_kernel(device: torch.device, scale: float, dim: int, dtype: torch.dtype = torch.bfloat16,
                  window: int | None = None) -> KernelCall | None:
    """The kernel as `(q [T, H, D], k [T, H_kv, D], v, cu_lengths [n + 1] int32, longest, scale) -> [T, H, D]`,
    each chat causal within itself; None where it cannot run this call (off CUDA, not bf16/fp16, a PyTorch
    without it, a scale or a window its signature cannot take)."""
    if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        return None
    found = _lookup()
    if found is None:
        return None
    varlen_attn, parameters = found
    if "scale" not in parameters and abs(scale - dim ** -0.5) > 1e-12 * scale:
        return None  # an older kernel fixes the scale at 1/sqrt(D)
    if window is not None and "window_size" not in parameters:
        return None
    extra: dict[str, Any] = {"scale": scale} if "scale" in parameters else {}
    if "window_size" in parameters:  # (keys back, keys ahead): causal, within the window if any
        extra["window_size"] = (-1 if window is None else window - 1, 0)
    else:
        extra["is_causal"] = True

    def call(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_lengths: torch.Tensor, longest: int,
             scale: float) -> torch.Tensor:
        arguments = {**extra, "scale": scale} if "scale" in extra else dict(extra)
        if query.shape[1] != key.shape[1]:
            if "enable_gqa" in parameters:
                arguments["enable_gqa"] = True
            elif not grouped_heads_taken(varlen_attn, arguments, query, key):
                groups = query.shape[1] // key.shape[1]
                key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
        return varlen_attn(query, key, value, cu_lengths, cu_lengths, longest, longest, **arguments)

    return call


def grouped_heads_taken(varlen_attn: Callable[..., torch.Tensor], arguments: dict[str, Any], query: torch.Tensor,
                        key: torch.Tensor) -> bool:
    """Whether `varlen_attn` attends grouped key/value heads as they are, as it does them repeated: tried once per
    device, dtype and head shape on one random chat (never inside a CUDA graph capture, whose stream cannot wait
    for the answer: there the heads are repeated until a call outside one has asked)."""
    heads, kv_heads, dim = query.shape[1], key.shape[1], query.shape[-1]
    shape = (varlen_attn, query.device, query.dtype, heads, kv_heads, dim, tuple(sorted(arguments.items())))
    if shape in _grouped_heads_taken:
        return _grouped_heads_taken[shape]
    if _capturing(query):
        return False
    length = 16
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(length, h, dim, generator=generator).to(query.device, query.dtype)
               for h in (heads, kv_heads, kv_heads))
    cu = torch.tensor([0, length], dtype=torch.int32, device=query.device)
    groups = heads // kv_heads
    repeated = varlen_attn(q, k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1), cu, cu,
                           length, length, **arguments)
    try:
        grouped = varlen_attn(q, k, v, cu, cu, length, length, **arguments)
        taken = grouped.shape == repeated.shape and torch.allclose(grouped.float(), repeated.float(), atol=1e-2,
                                                                   rtol=1e-2)
    except (RuntimeError, ValueError):  # a kernel that checks the head counts refuses them
        taken = False
    _grouped_heads_taken[shape] = taken
    return taken


def grouped_heads_report() -> list[str]:
    """A line for the run's log per head shape tried: whether this PyTorch's kernel got the grouped key/value heads
    as they are (the fast path) or repeated, so a slow step's copies are explained rather than guessed at."""
    lines = []
    for (_, device, dtype, heads, kv_heads, dim, _), taken in _grouped_heads_taken.items():
        how = "as they are" if taken else "repeated (the kernel did not attend them grouped as it does repeated)"
        lines.append(f"varlen attention on {device}: {kv_heads} key/value heads for {heads} query heads of {dim} "
                     f"({str(dtype).removeprefix('torch.')}) passed {how}")
    return lines


def _capturing(tensor: torch.Tensor) -> bool:
    return tensor.is_cuda and torch.cuda.is_current_stream_capturing()


@functools.cache
def _lookup() -> tuple[Callable[..., torch.Tensor], frozenset[str]] | None:
    """PyTorch's varlen kernel and its parameter names, looked up once (every layer of every forward asks)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn, frozenset(inspect.signature(varlen_attn).parameters)
