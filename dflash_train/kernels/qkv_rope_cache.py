"""A decoder layer's attention input in one launch: the RMSNorm of the hidden states, the q/k/v product, and
the attention prologue of `rope_cache` (q/k norms, RoPE, the K/V cache write) in that product's epilogue.

Why: at the few rows of a decode or verify step a small target is bound by its launches, not its weights
(`skinny_fused`'s module docstring). With `skinny_fused` a layer's attention input is two launches, the
normed q/k/v product and the prologue kernel; here it is one, and the q/k/v product never goes to memory.

Semantics: `rope_cache_reference(skinny_fused_reference(x, weight, bias, norm_weight, norm_eps), heads, ...)`
exactly, step for step in its roundings: the product rounded to x's dtype, then the q/k norms (Qwen3), each
RoPE product and their sum, as the modules round them (`device.rounded`).

How: one program per (16 token rows, head) over the query heads and then the key heads, as in `rope_cache`.
A program computes its head's two halves of the product as two accumulators, [D/2, 16] each (rotate-half
RoPE pairs element d of the first half with element d of the second), reduces the head's sum of squares
for its norm, rotates, and stores q, or writes k into the cache; a key program also computes and writes
its value head. Programs tell their kind by masks, not branches, so that torch.compile's analysis of the
kernel finds exactly q and the two caches written. Each K/V row is written at its token's cache row and
position. Batch invariance as in `skinny_matmul`: a token row's results do not depend on the other rows.

A program streams 2 or 4 rows of D/2 of the weight: few programs (Qwen3-8B: 48 at batch 1), which suits a
small target's launch-bound step rather than a large one's bandwidth-bound q/k/v product.
"""

# Deliberately no postponed annotations (PEP 563): Triton reads the `tl.constexpr` annotations of kernels.
import torch
from torch.library import triton_op, wrap_triton

from dflash_train.kernels._triton import interpreting, jit, next_power_of_2, tl
from dflash_train.kernels.device import dot, head_norm, head_norm_weights, rotate_half, rounded
from dflash_train.kernels.rope_cache import rope_cache_reference, supports_rope
from dflash_train.kernels.skinny_fused import skinny_fused_reference
from dflash_train.kernels.skinny_matmul import BLOCK_M, fits

BLOCK_K = 128  # K per pipeline step: 2 (query) or 4 (key) weight tiles of D/2 x 128


def qkv_rope_cache_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                             norm_weight: torch.Tensor, norm_eps: float, heads: int,
                             q_norm_weight: torch.Tensor | None, k_norm_weight: torch.Tensor | None, eps: float,
                             cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor,
                             cache_k: torch.Tensor, cache_v: torch.Tensor) -> torch.Tensor:
    """The two steps it fuses, in PyTorch: x [n, T, H] -> q [n, T, heads, D], the caches written in place."""
    qkv = skinny_fused_reference(x, weight, bias, norm_weight, norm_eps)
    return rope_cache_reference(qkv, heads, q_norm_weight, k_norm_weight, eps, cos, sin, positions, rows,
                                cache_k, cache_v)


def _qkv_rope_cache_kernel(
    x_ptr, g_ptr, w_ptr, b_ptr, q_norm_ptr, k_norm_ptr, cos_ptr, sin_ptr, pos_ptr, row_ptr, q_ptr, cache_k_ptr,
    cache_v_ptr, M, K, T, stride_xm, stride_wn, sc_row, sc_head, sc_slot,
    EPS: tl.constexpr, EPS_Q: tl.constexpr, EPS_K: tl.constexpr, HEADS: tl.constexpr, KV_HEADS: tl.constexpr,
    HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_QK_NORM: tl.constexpr, BF16: tl.constexpr, FP16: tl.constexpr,
    IEEE: tl.constexpr, UPCAST: tl.constexpr, OPAQUE: tl.constexpr,
):
    pid_m = tl.program_id(0)
    head = tl.program_id(1)  # query heads 0..HEADS-1, then key heads (each with its value head)
    kv_head = tl.maximum(head - HEADS, 0)
    dim = 2 * HALF
    tokens = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # the rows of x: token i * T + t
    token_ok = tokens < M
    d = tl.arange(0, BLOCK_HALF)
    d_ok = d < HALF
    is_q = (d * 0 + head) < HEADS  # the program's kind, as a vector: it masks loads and stores
    is_k = d_ok & ~is_q
    ks = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + tokens[None, :] * stride_xm + ks[:, None]  # x^T tile [BLOCK_K, BLOCK_M]
    squares = tl.zeros([BLOCK_M], dtype=tl.float32)  # the input RMSNorm's statistics, over the whole of K
    # Pipelined, 4 tiles in flight: the pass's loads are otherwise issued one tile at a time, each waiting out
    # the memory latency before the weight stream starts (16 tiles at K = 4,096).
    for k0 in tl.range(0, K, BLOCK_K, num_stages=4):
        xt = tl.load(x_ptrs + k0, mask=((k0 + ks) < K)[:, None] & token_ok[None, :], other=0.0).to(tl.float32)
        squares += tl.sum(xt * xt, axis=0)
    inv_rms = tl.rsqrt(squares / K + EPS)
    # This head's rows of the weight (a key head's index is HEADS + kv_head, so `head * dim` serves both
    # kinds), and for a key program its value head's.
    w_lo = w_ptr + (head * dim + d).to(tl.int64)[:, None] * stride_wn + ks[None, :]
    w_hi = w_lo + HALF * stride_wn
    v_lo = w_ptr + ((HEADS + KV_HEADS + kv_head) * dim + d).to(tl.int64)[:, None] * stride_wn + ks[None, :]
    v_hi = v_lo + HALF * stride_wn
    lo = tl.zeros([BLOCK_HALF, BLOCK_M], dtype=tl.float32)
    hi = tl.zeros([BLOCK_HALF, BLOCK_M], dtype=tl.float32)
    vlo = tl.zeros([BLOCK_HALF, BLOCK_M], dtype=tl.float32)
    vhi = tl.zeros([BLOCK_HALF, BLOCK_M], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + ks) < K
        xt = tl.load(x_ptrs + k0, mask=k_ok[:, None] & token_ok[None, :], other=0.0)
        gamma = tl.load(g_ptr + k0 + ks, mask=k_ok, other=0.0).to(tl.float32)
        normed = rounded(xt.to(tl.float32) * inv_rms[None, :], BF16, FP16)  # rmsnorm's two roundings
        xt = rounded(gamma[:, None] * normed, BF16, FP16).to(x_ptr.dtype.element_ty)
        w_mask = d_ok[:, None] & k_ok[None, :]
        lo = dot(tl.load(w_lo + k0, mask=w_mask, other=0.0), xt, lo, IEEE, UPCAST)
        hi = dot(tl.load(w_hi + k0, mask=w_mask, other=0.0), xt, hi, IEEE, UPCAST)
        v_mask = is_k[:, None] & k_ok[None, :]  # a query program reads no value weights
        vlo = dot(tl.load(v_lo + k0, mask=v_mask, other=0.0), xt, vlo, IEEE, UPCAST)
        vhi = dot(tl.load(v_hi + k0, mask=v_mask, other=0.0), xt, vhi, IEEE, UPCAST)
    if HAS_BIAS:
        lo += tl.load(b_ptr + head * dim + d, mask=d_ok, other=0.0).to(tl.float32)[:, None]
        hi += tl.load(b_ptr + head * dim + HALF + d, mask=d_ok, other=0.0).to(tl.float32)[:, None]
        v_bias = b_ptr + (HEADS + KV_HEADS + kv_head) * dim
        vlo += tl.load(v_bias + d, mask=is_k, other=0.0).to(tl.float32)[:, None]
        vhi += tl.load(v_bias + HALF + d, mask=is_k, other=0.0).to(tl.float32)[:, None]
    # The product rounded to the activations' dtype, as the q/k/v projection's output.
    x1, x2 = rounded(lo, BF16, FP16), rounded(hi, BF16, FP16)
    if HAS_QK_NORM:  # the head's RMSNorm (Qwen3): statistics over both halves, per token
        eps = tl.where(head < HEADS, EPS_Q, EPS_K)
        head_rms = tl.rsqrt((tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / dim + eps)
        w1, w2 = head_norm_weights(q_norm_ptr, k_norm_ptr, d, d_ok, is_q, HALF)
        x1, x2 = head_norm(x1, x2, w1[:, None], w2[:, None], head_rms[None, :], BF16, FP16)
    rope = tokens.to(tl.int64)[None, :] * dim + d[:, None]  # cos/sin [M, D]: [BLOCK_HALF, BLOCK_M] tiles
    rope_mask = d_ok[:, None] & token_ok[None, :]
    c1 = tl.load(cos_ptr + rope, mask=rope_mask, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + rope + HALF, mask=rope_mask, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + rope, mask=rope_mask, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + rope + HALF, mask=rope_mask, other=0.0).to(tl.float32)
    y1, y2 = rotate_half(x1, x2, c1, c2, s1, s2, BF16, FP16, OPAQUE)
    q_dst = q_ptr + (tokens.to(tl.int64)[None, :] * HEADS + head) * dim + d[:, None]
    q_mask = (d_ok & is_q)[:, None] & token_ok[None, :]
    tl.store(q_dst, y1.to(q_ptr.dtype.element_ty), mask=q_mask)  # exact: y is already rounded
    tl.store(q_dst + HALF, y2.to(q_ptr.dtype.element_ty), mask=q_mask)
    cache_row = tl.load(row_ptr + tokens // T, mask=token_ok, other=0)
    position = tl.load(pos_ptr + tokens, mask=token_ok, other=0)
    slot = (cache_row * sc_row + kv_head * sc_head + position * sc_slot)[None, :] + d[:, None]
    k_mask = is_k[:, None] & token_ok[None, :]
    cache_type = cache_k_ptr.dtype.element_ty
    tl.store(cache_k_ptr + slot, y1.to(cache_type), mask=k_mask)
    tl.store(cache_k_ptr + slot + HALF, y2.to(cache_type), mask=k_mask)
    tl.store(cache_v_ptr + slot, rounded(vlo, BF16, FP16).to(cache_type), mask=k_mask)
    tl.store(cache_v_ptr + slot + HALF, rounded(vhi, BF16, FP16).to(cache_type), mask=k_mask)


@triton_op("dflash_train::qkv_rope_cache", mutates_args={"cache_k", "cache_v"})
def _qkv_rope_cache_op(x: torch.Tensor, norm_weight: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                       q_norm_weight: torch.Tensor, k_norm_weight: torch.Tensor, cos: torch.Tensor,
                       sin: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor, cache_k: torch.Tensor,
                       cache_v: torch.Tensor, t: int, heads: int, norm_eps: float, eps_q: float, eps_k: float,
                       has_bias: bool, has_qk_norm: bool) -> torch.Tensor:
    m, k = x.shape
    kv_heads, dim = cache_k.shape[1], cos.shape[-1]
    q = torch.empty((m, heads, dim), device=x.device, dtype=x.dtype)
    kernel = jit(_qkv_rope_cache_kernel, do_not_specialize=("M",))  # batch invariance: see skinny_matmul
    if not interpreting():  # traced by torch.compile as part of the graph (interpreted kernels cannot be)
        kernel = wrap_triton(kernel)
    kernel[(-(-m // BLOCK_M), heads + kv_heads)](
        x, norm_weight, weight, bias, q_norm_weight, k_norm_weight, cos, sin, positions, rows, q, cache_k, cache_v,
        m, k, t, x.stride(0), weight.stride(0), cache_k.stride(0), cache_k.stride(1), cache_k.stride(2),
        EPS=norm_eps, EPS_Q=eps_q, EPS_K=eps_k, HEADS=heads, KV_HEADS=kv_heads, HALF=dim // 2,
        BLOCK_HALF=max(16, next_power_of_2(dim // 2)), BLOCK_M=BLOCK_M, BLOCK_K=min(BLOCK_K, max(16, next_power_of_2(k))),
        HAS_BIAS=has_bias, HAS_QK_NORM=has_qk_norm, BF16=x.dtype == torch.bfloat16, FP16=x.dtype == torch.float16,
        IEEE=x.dtype == torch.float32, UPCAST=interpreting() and x.dtype != torch.float32, OPAQUE=not interpreting(), num_warps=4,
        # Four weight tiles of D/2 x BLOCK_K a stage: 16 KB each at D = 128 in bf16, so two stages there.
        num_stages=3 if dim <= 64 else 2,
    )
    return q


def qkv_rope_cache_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                          norm_weight: torch.Tensor, norm_eps: float, heads: int,
                          q_norm_weight: torch.Tensor | None, k_norm_weight: torch.Tensor | None, eps: float,
                          cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor,
                          cache_k: torch.Tensor, cache_v: torch.Tensor, k_eps: float | None = None) -> torch.Tensor:
    """`qkv_rope_cache_reference`'s contract for at most `skinny_matmul.MAX_ROWS` token rows (`k_eps`: k_norm's
    epsilon where it differs from q_norm's); a custom op, so torch.compile keeps it in its graph."""
    n, t, hidden = x.shape
    kv_heads, dim = cache_k.shape[1], cos.shape[-1]
    assert fits(n * t), f"{n * t} rows: the kernel takes 1..64"
    assert supports_rope(cos, dim) and cos.shape == sin.shape == (n, t, dim), "cos/sin must be [n, T, head_dim]"
    assert weight.shape == ((heads + 2 * kv_heads) * dim, hidden) and weight.stride(1) == 1, "weight [q+k+v, H]"
    assert weight.dtype == norm_weight.dtype == x.dtype and norm_weight.shape == (hidden,)
    assert cache_k.shape == cache_v.shape and cache_k.stride() == cache_v.stride() and cache_k.stride(3) == 1
    assert positions.shape == (n, t) and rows.shape == (n,), "positions [n, T], rows [n]"
    assert (q_norm_weight is None) == (k_norm_weight is None), "both norms or neither"
    stand_in = norm_weight  # never read where its flag is off
    q = _qkv_rope_cache_op(
        x.reshape(n * t, hidden).contiguous(), norm_weight, weight, bias if bias is not None else stand_in,
        q_norm_weight if q_norm_weight is not None else stand_in, k_norm_weight if k_norm_weight is not None else stand_in,
        cos.contiguous(), sin.contiguous(), positions.to(torch.int64).contiguous(), rows.to(torch.int64).contiguous(),
        cache_k, cache_v, t, heads, float(norm_eps), float(eps), float(eps if k_eps is None else k_eps),
        bias is not None, q_norm_weight is not None)
    return q.view(n, t, heads, dim)
