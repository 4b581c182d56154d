"""Micro-benchmarks of the decode loop's fused kernels at Qwen3-8B's heads, each against its PyTorch reference:
one layer's split-key attention (1 and 16 queries), its attention prologue, the greedy verify and the
drafter's context K/V write."""

from __future__ import annotations

import functools

import torch

from benchmarks.decode_timing import time_ms
from dflash_train.models import DFlashDraftModel


def kernel_timings(device: torch.device, vocab: int, draft: DFlashDraftModel, iters: int) -> dict[str, float]:
    """Fused kernels against their PyTorch references, at the section's shapes (one block of 16)."""
    from dflash_train.kernels.context_kv import context_kv_reference, context_kv_triton
    from dflash_train.kernels.greedy_verify import greedy_verify_reference, greedy_verify_triton

    block = 16
    logits = torch.randn(1, block, vocab, device=device, dtype=torch.bfloat16)
    tokens = torch.randint(0, vocab, (1, block), device=device)
    out = torch.zeros(1, 64, dtype=torch.long, device=device)
    n_out = torch.zeros(1, dtype=torch.long, device=device)
    done = torch.zeros(1, dtype=torch.bool, device=device)
    config, cache = draft.config, draft.new_cache(1, 2048)
    rope = rope_cache_timings(device, iters)
    kv = torch.randn(block, config.num_hidden_layers, 2, config.num_key_value_heads, config.head_dim, device=device,
                     dtype=torch.bfloat16)
    norm = torch.ones(config.num_hidden_layers, config.head_dim, device=device, dtype=torch.bfloat16)
    cos = torch.randn(2048, config.head_dim, device=device)
    positions, rows = torch.arange(1000, 1000 + block, device=device), torch.zeros(block, dtype=torch.long, device=device)
    args = (kv, norm, 1e-6, cos, cos, positions, rows, cache.keys, cache.values)
    verify = (logits, tokens, out, n_out, done)
    return attention_timings(device, iters) | rope | {
        "greedy_verify_triton_ms": time_ms(lambda: greedy_verify_triton(*verify), device, 5, iters),
        "greedy_verify_torch_ms": time_ms(lambda: greedy_verify_reference(*verify), device, 5, iters),
        "context_kv_triton_ms": time_ms(lambda: context_kv_triton(*args), device, 5, iters),
        "context_kv_torch_ms": time_ms(lambda: context_kv_reference(*args), device, 5, iters),
    }


def attention_timings(device: torch.device, iters: int, context: int = 1024, length: int = 1280) -> dict[str, float]:
    """One layer's attention over the static cache, Qwen3-8B heads (32 query, 8 KV, D 128), for a decode step
    (1 token) and a verify block (16): the split-key kernel against SDPA with the boolean mask."""
    from dflash_train.kernels.static_attention import bounds_from_positions, static_attention_triton
    from dflash_train.runtime.static_target import static_attention

    k = torch.randn(1, 8, length, 128, device=device, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    result, scale = {}, 128 ** -0.5
    for tokens in (1, 16):
        q = torch.randn(1, tokens, 32, 128, device=device, dtype=torch.bfloat16).transpose(1, 2)
        positions = torch.arange(context, context + tokens, device=device)[None]
        bounds = bounds_from_positions(positions, None)
        visible = (torch.arange(length, device=device)[None, None] <= positions[..., None])[:, None]
        ours = functools.partial(static_attention_triton, q, k, v, bounds, scale)
        sdpa = functools.partial(static_attention, None, q, k, v, visible, scaling=scale)
        result[f"attention_t{tokens}_max_diff"] = float((ours().float() - sdpa()[0].float()).abs().max())
        result[f"attention_t{tokens}_triton_ms"] = time_ms(ours, device, 5, iters)
        result[f"attention_t{tokens}_sdpa_ms"] = time_ms(sdpa, device, 5, iters)
    return result


def rope_cache_timings(device: torch.device, iters: int, context: int = 1024) -> dict[str, float]:
    """One layer's attention prologue at Qwen3-8B heads (32 query, 8 KV, D 128, q/k norms), for a decode
    step (1 token) and a verify block (16): the fused kernel against its PyTorch reference (eager)."""
    from dflash_train.kernels.rope_cache import rope_cache_reference, rope_cache_triton

    heads, kv_heads, dim, length = 32, 8, 128, 2048
    cache_k = torch.zeros(1, kv_heads, length, dim, device=device, dtype=torch.bfloat16)
    cache_v = torch.zeros_like(cache_k)
    norms = torch.ones(dim, device=device, dtype=torch.bfloat16)
    result = {}
    for tokens in (1, 16):
        qkv = torch.randn(1, tokens, (heads + 2 * kv_heads) * dim, device=device, dtype=torch.bfloat16)
        positions = torch.arange(context, context + tokens, device=device)[None]
        cos = torch.randn(1, tokens, dim, device=device, dtype=torch.bfloat16)
        args = (qkv, heads, norms, norms, 1e-6, cos, cos, positions, torch.zeros(1, dtype=torch.long, device=device),
                cache_k, cache_v)
        result[f"rope_cache_t{tokens}_max_diff"] = float((rope_cache_triton(*args).float()
                                                          - rope_cache_reference(*args).float()).abs().max())
        result[f"rope_cache_t{tokens}_triton_ms"] = time_ms(lambda a=args: rope_cache_triton(*a), device, 5, iters)
        result[f"rope_cache_t{tokens}_torch_ms"] = time_ms(lambda a=args: rope_cache_reference(*a), device, 5, iters)
    return result
