"""Variable-length attention for the target's forward over packed training rows, without compilation.

A packed row holds whole chats one after another, each with position ids from 0. Each chat attends causally
to itself only. Flex attention computes that from a block mask, but its kernel is compiled on the first step
(most of a minute of a speedrun's short training budget, docs/results.md); SDPA builds a dense [b, 1, S, S] mask
and computes every score of the row. Here the chats are cut out of the flattened rows by their cumulative
lengths and attended by PyTorch's FlashAttention varlen kernel (`torch.nn.attention.varlen.varlen_attn`):
only each chat's own causal triangle is computed, and nothing is compiled.

Use: `attention_implementation(model, VARLEN)` (target/attention.py) around the forward, inside
`packed_sequences(...)`, which holds the chats' boundaries for every layer of that forward; they are computed
once on the host from the position ids (no device sync) and copied to the device. Hugging Face builds no mask
for an attention implementation it has no mask function for. Off CUDA, or where PyTorch lacks the varlen
kernel, each chat goes through SDPA on its own: the same arithmetic, slower, and the reference of the tests.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dflash_train.features.varlen_kernel import varlen_kernel

VARLEN = "dflash_varlen"
_current = threading.local()


@dataclass(frozen=True)
class PackedSequences:
    """Boundaries of the chats in the flattened rows: cu_lengths [n + 1] int32 (on the attention's device),
    bounds (the same on the host, for the per-chat fallback) and the longest chat."""

    cu_lengths: torch.Tensor
    bounds: tuple[int, ...]
    longest: int


def sequence_bounds(position_ids: torch.Tensor) -> tuple[int, ...]:
    """Cumulative chat boundaries of host position ids [b, S] flattened row after row: a chat starts at
    position 0 and at every row's start, and the last boundary is b·S."""
    rows, length = position_ids.shape
    starts = position_ids.reshape(-1) == 0
    starts[::length] = True
    return (*starts.nonzero().flatten().tolist(), rows * length)


@contextmanager
def packed_sequences(position_ids: torch.Tensor, device: torch.device) -> Iterator[PackedSequences]:
    """Within: the varlen attention of every layer reads these chats' boundaries. `position_ids` [b, S] on the
    host, as the batch was built (reading them from the device would wait for it)."""
    bounds = sequence_bounds(position_ids.cpu())
    longest = max(end - start for start, end in zip(bounds, bounds[1:], strict=False))
    cu = torch.tensor(bounds, dtype=torch.int32).pin_memory() if device.type == "cuda" else torch.tensor(
        bounds, dtype=torch.int32)
    sequences = PackedSequences(cu.to(device, non_blocking=True), bounds, longest)
    with use_sequences(sequences):
        yield sequences


@contextmanager
def use_sequences(sequences: PackedSequences) -> Iterator[PackedSequences]:
    """Within: the varlen attention of every layer reads `sequences` (features/graphed.py passes boundaries it
    keeps in a fixed device buffer, for CUDA graphs to read at every replay)."""
    previous = getattr(_current, "sequences", None)
    _current.sequences = sequences
    try:
        yield sequences
    finally:
        _current.sequences = previous


def varlen_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                     sliding_window: int | None = None, softcap: float | None = None,
                     s_aux: torch.Tensor | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Hugging Face's attention-function contract: query [b, H, S, D], key [b, H_kv, S, D], value [b, H_kv, S,
    Dv] -> ([b, S, H, Dv], None), each chat of `packed_sequences` attending causally to itself; a layer's
    sliding window, logit soft-cap and sink logits (`s_aux` [H]) apply as in the model's own attention."""
    # The [tokens, heads, dim] layout the kernel reads is made here, inside the decoder layer's compiled graph
    # where there is one (training.compile_target): the compiler then writes the rotated queries and keys in that
    # layout directly, where the same copy made after the graph is a kernel of its own for each, in every layer
    # (docs/benchmarks.md, `train_packing`). Values arrive in it already.
    rows, heads, length, _ = query.shape
    flat = [t.transpose(1, 2).contiguous().view(rows * length, t.shape[1], t.shape[-1]) for t in (query, key, value)]
    out = _attend_chats(*flat, scaling, dropout, Extras(sliding_window, softcap, s_aux))
    return out.view(rows, length, heads, value.shape[-1]), None


# Outside any compiled graph: the chats' boundaries change every step, and a graph guarding on them would be
# compiled again for each new set.
@torch.compiler.disable
def _attend_chats(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float | None,
                  dropout: float, extras: Extras) -> torch.Tensor:
    """[T, H, D] queries, [T, H_kv, D] keys and values of the flattened rows -> [T, H, Dv]."""
    sequences: PackedSequences | None = getattr(_current, "sequences", None)
    if sequences is None:
        raise RuntimeError(f"the {VARLEN} attention runs inside dflash_train.features.varlen.packed_sequences(...)")
    if dropout:
        raise ValueError(f"the {VARLEN} attention has no dropout: run the target in eval mode")
    dim = query.shape[-1]
    scale = dim ** -0.5 if scaling is None else scaling
    kernel = None if extras.softcap or extras.sinks is not None else varlen_kernel(query.device, scale, dim,
                                                                                    query.dtype, extras.window)
    if kernel is None:
        return _per_sequence(query, key, value, sequences, scale, extras)
    return kernel(query, key, value, sequences.cu_lengths, sequences.longest, scale)


@dataclass(frozen=True)
class Extras:
    """What some layers add to plain causal attention: a window (a query sees keys less than `window` tokens
    back, transformers' convention), tanh soft-capping of the logits, one learned sink logit per head."""

    window: int | None = None
    softcap: float | None = None
    sinks: torch.Tensor | None = None


def _per_sequence(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, sequences: PackedSequences,
                  scale: float, extras: Extras = Extras()) -> torch.Tensor:
    """Each chat on its own ([T, h, D] -> [T, H, Dv]): the fallback, and the tests' reference."""
    out = query.new_empty(query.shape[0], query.shape[1], value.shape[-1])
    groups = query.shape[1] // key.shape[1]
    for start, end in zip(sequences.bounds, sequences.bounds[1:], strict=False):
        if end == start:  # an empty chat: the unused capacity of features/graphed.py's boundaries
            continue
        q, k, v = (t[start:end].transpose(0, 1) for t in (query, key, value))  # [h, n, D]
        k, v = k.repeat_interleave(groups, dim=0), v.repeat_interleave(groups, dim=0)
        if extras == Extras():
            chat = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        else:
            chat = _eager(q, k, v, scale, extras)
        out[start:end] = chat.transpose(0, 1)
    return out


def _eager(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, extras: Extras) -> torch.Tensor:
    """One chat's attention [h, n, D] with a window, soft-cap or sinks, as transformers' eager attention."""
    logits = (q @ k.transpose(-1, -2)).float() * scale  # [h, n, n]
    if extras.softcap:
        logits = torch.tanh(logits / extras.softcap) * extras.softcap
    n = q.shape[1]
    query_at, key_at = torch.arange(n, device=q.device)[:, None], torch.arange(n, device=q.device)[None]
    visible = key_at <= query_at
    if extras.window:
        visible = visible & (key_at > query_at - extras.window)
    logits = logits.masked_fill(~visible, float("-inf"))
    if extras.sinks is None:
        return (logits.softmax(-1) @ v.float()).to(v.dtype)
    sink = extras.sinks.float().reshape(-1, 1, 1).expand(-1, n, 1)  # [h, n, 1]: a logit no value goes with
    weights = torch.cat([logits, sink], dim=-1).softmax(-1)[..., :-1]
    return (weights @ v.float()).to(v.dtype)


def register() -> None:
    """Make `VARLEN` an attention implementation Hugging Face models accept (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(VARLEN, varlen_attention)
