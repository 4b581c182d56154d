"""The attention prologue of a target layer in one launch: q/k RMSNorm (where the model has q_norm and
k_norm, as Qwen3), RoPE on q and k, and the write of k and v into the static KV cache.

Without it a layer's prologue is several kernels between the q/k/v matmul and the attention (norms,
RoPE, two cache writes; with cuBLAS's split-K reductions a measurable share of each layer of a
Qwen3-8B-shaped decode step, each kernel paying its launch latency over a few KB of data: docs/benchmarks.md,
`decode`).

Input: the output of the fused q/k/v projection (`dflash_train/runtime/fused_layer.py`, bias included),
qkv [n, T, (Hq + 2·Hkv)·D], query heads first, then key heads, then value heads. Token (i, t) belongs to
cache row rows[i] and sits at position positions[i, t]:

    q[i, t, h]                             = rope(norm_q(qkv[i, t, query head h]), cos[i, t], sin[i, t])
    cache_k[rows[i], g, positions[i, t]]   = rope(norm_k(qkv[i, t, key head g]), cos[i, t], sin[i, t])
    cache_v[rows[i], g, positions[i, t]]   = qkv[i, t, value head g]

norm(x) = w · round(x / sqrt(mean(x²) + eps)) as transformers' Qwen3RMSNorm (no norm for Llama, Mistral,
Qwen2); rope(x) = x·cos + rotate_half(x)·sin with rotate_half(x) = [-x₂, x₁].

RoPE arrives as the cos/sin [n, T, D] that the model's own rotary embedding computes once per forward
for the tokens' positions, so every RoPE type that embedding implements (default, linear, dynamic, YaRN,
Llama 3, LongRoPE, with their attention scaling folded into cos/sin) is the kernel's too, with no table
of its own to keep in step. Only a cos/sin narrower than the head (partial rotary) is not handled: the
caller keeps the PyTorch path for it (`supports_rope`).

Rounding: the kernel computes in fp32 but rounds to the input dtype where the model's eager code does
(the normalised vector before the weight, the product with the weight, each RoPE product and their sum),
so in bf16 it equals the PyTorch path up to the order of the fp32 sum of squares, and in fp32 up to fp32
rounding.

One program per (token, head) over the Hq query heads and the Hkv key heads; a key program also copies
its value head (Qwen3-8B at decode, batch 1: 40 programs). The kernel has no branches: a program's
stores are masked by its kind, so that torch.compile's analysis of which arguments a kernel writes finds
exactly q and the two caches (it would otherwise assume every input written, and copy them).
"""

# Deliberately no postponed annotations (PEP 563): Triton reads the `tl.constexpr` annotations of kernels.
import torch
from torch.library import triton_op, wrap_triton

from dflash_train.kernels._triton import interpreting, jit, next_power_of_2, tl
from dflash_train.kernels.device import head_norm, head_norm_weights, rotate_half


def supports_rope(cos: torch.Tensor, head_dim: int) -> bool:
    """Whether the kernel applies this RoPE: rotate-half over the whole head (cos/sin [n, T, head_dim])."""
    return cos.dim() == 3 and cos.shape[-1] == head_dim and head_dim % 2 == 0


def _rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Qwen3RMSNorm: statistics in fp32, rounded to the input dtype before the weight."""
    normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def _rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' apply_rotary_pos_emb on [n, T, heads, D] with cos/sin [n, T, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, :, None] + rotated * sin[:, :, None]


def rope_cache_reference(
    qkv: torch.Tensor,
    heads: int,
    q_norm_weight: torch.Tensor | None,
    k_norm_weight: torch.Tensor | None,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    rows: torch.Tensor,
    cache_k: torch.Tensor,
    cache_v: torch.Tensor,
) -> torch.Tensor:
    """PyTorch version, the arithmetic of the runtime's PyTorch path (`FusedLayer` without the kernel).

    qkv [n, T, (heads + 2·kv_heads)·D]; q_norm_weight/k_norm_weight [D] or both None; cos/sin [n, T, D];
    positions [n, T] int64; rows [n] int64; cache_k/cache_v [b, kv_heads, max_len, D], written in place.
    Returns q [n, T, heads, D].
    """
    n, t, _ = qkv.shape
    kv_heads, dim = cache_k.shape[1], cos.shape[-1]
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q, k, v = (p.reshape(n, t, -1, dim) for p in (q, k, v))
    if q_norm_weight is not None and k_norm_weight is not None:
        q, k = _rms_norm_reference(q, q_norm_weight, eps), _rms_norm_reference(k, k_norm_weight, eps)
    q, k = _rope_reference(q, cos, sin), _rope_reference(k, cos, sin)
    cache_k[rows[:, None], :, positions] = k.to(cache_k.dtype)  # [n, T, kv_heads, D] at (row, position)
    cache_v[rows[:, None], :, positions] = v.to(cache_v.dtype)
    return q


def _rope_cache_kernel(
    qkv_ptr, q_norm_ptr, k_norm_ptr, cos_ptr, sin_ptr, pos_ptr, row_ptr, q_ptr, cache_k_ptr, cache_v_ptr,
    T, sc_row, sc_head, sc_slot,
    EPS_Q: tl.constexpr, EPS_K: tl.constexpr, HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr, HAS_NORM: tl.constexpr, BF16: tl.constexpr, FP16: tl.constexpr,
    OPAQUE: tl.constexpr,
):
    token = tl.program_id(0)  # i * T + t
    head = tl.program_id(1)  # query heads 0..HEADS-1, then key heads
    kv_head = tl.maximum(head - HEADS, 0)
    dim = 2 * HALF
    width = (HEADS + 2 * KV_HEADS) * dim
    d = tl.arange(0, BLOCK_HALF)
    dmask = d < HALF
    is_q = (d * 0 + head) < HEADS  # the program's kind, as a vector: it masks the stores
    src = qkv_ptr + token.to(tl.int64) * width + head * dim  # query head `head` or key head `kv_head`
    x1 = tl.load(src + d, mask=dmask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF + d, mask=dmask, other=0.0).to(tl.float32)
    if HAS_NORM:
        # Epsilons as constants: torch.compile passes float arguments as fp64.
        eps = tl.where(head < HEADS, EPS_Q, EPS_K)
        inv_rms = tl.rsqrt((tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / dim + eps)
        w1, w2 = head_norm_weights(q_norm_ptr, k_norm_ptr, d, dmask, is_q, HALF)
        x1, x2 = head_norm(x1, x2, w1, w2, inv_rms, BF16, FP16)
    cs = cos_ptr + token.to(tl.int64) * dim
    sn = sin_ptr + token.to(tl.int64) * dim
    c1 = tl.load(cs + d, mask=dmask, other=0.0).to(tl.float32)
    c2 = tl.load(cs + HALF + d, mask=dmask, other=0.0).to(tl.float32)
    s1 = tl.load(sn + d, mask=dmask, other=0.0).to(tl.float32)
    s2 = tl.load(sn + HALF + d, mask=dmask, other=0.0).to(tl.float32)
    y1, y2 = rotate_half(x1, x2, c1, c2, s1, s2, BF16, FP16, OPAQUE)
    q_dst = q_ptr + (token.to(tl.int64) * HEADS + head) * dim
    is_k = dmask & ~is_q
    tl.store(q_dst + d, y1.to(q_ptr.dtype.element_ty), mask=dmask & is_q)  # exact: y is already rounded
    tl.store(q_dst + HALF + d, y2.to(q_ptr.dtype.element_ty), mask=dmask & is_q)
    row = tl.load(row_ptr + token // T)
    pos = tl.load(pos_ptr + token)
    slot = row * sc_row + kv_head * sc_head + pos * sc_slot
    cache_elem = cache_k_ptr.dtype.element_ty
    tl.store(cache_k_ptr + slot + d, y1.to(cache_elem), mask=is_k)
    tl.store(cache_k_ptr + slot + HALF + d, y2.to(cache_elem), mask=is_k)
    v_src = qkv_ptr + token.to(tl.int64) * width + (HEADS + KV_HEADS + kv_head) * dim
    v1 = tl.load(v_src + d, mask=is_k, other=0.0)
    v2 = tl.load(v_src + HALF + d, mask=is_k, other=0.0)
    tl.store(cache_v_ptr + slot + d, v1.to(cache_elem), mask=is_k)
    tl.store(cache_v_ptr + slot + HALF + d, v2.to(cache_elem), mask=is_k)


@triton_op("dflash_train::rope_cache", mutates_args={"cache_k", "cache_v"})
def _rope_cache_op(qkv: torch.Tensor, q_norm_weight: torch.Tensor, k_norm_weight: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor, cache_k: torch.Tensor,
                   cache_v: torch.Tensor, heads: int, eps_q: float, eps_k: float, has_norm: bool) -> torch.Tensor:
    n, t, _ = qkv.shape
    kv_heads, dim = cache_k.shape[1], cos.shape[-1]
    q = torch.empty((n, t, heads, dim), device=qkv.device, dtype=qkv.dtype)
    kernel = jit(_rope_cache_kernel)
    if not interpreting():  # traced by torch.compile as part of the graph (interpreted kernels cannot be)
        kernel = wrap_triton(kernel)
    kernel[(n * t, heads + kv_heads)](
        qkv, q_norm_weight, k_norm_weight, cos, sin, positions, rows, q, cache_k, cache_v,
        t, cache_k.stride(0), cache_k.stride(1), cache_k.stride(2),
        EPS_Q=eps_q, EPS_K=eps_k, HEADS=heads, KV_HEADS=kv_heads, HALF=dim // 2, BLOCK_HALF=next_power_of_2(dim // 2),
        HAS_NORM=has_norm, BF16=qkv.dtype == torch.bfloat16, FP16=qkv.dtype == torch.float16, OPAQUE=not interpreting(),
        num_warps=1 if dim <= 128 else 2,
    )
    return q


def rope_cache_triton(
    qkv: torch.Tensor,
    heads: int,
    q_norm_weight: torch.Tensor | None,
    k_norm_weight: torch.Tensor | None,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    rows: torch.Tensor,
    cache_k: torch.Tensor,
    cache_v: torch.Tensor,
    k_eps: float | None = None,
) -> torch.Tensor:
    """Same contract as `rope_cache_reference` (`k_eps`: k_norm's epsilon where it differs from q_norm's);
    a custom op, so torch.compile keeps it in its graph and CUDA graphs capture it."""
    n, t, width = qkv.shape
    kv_heads, dim = cache_k.shape[1], cos.shape[-1]
    assert supports_rope(cos, dim) and cos.shape == sin.shape == (n, t, dim), "cos/sin must be [n, T, head_dim]"
    assert width == (heads + 2 * kv_heads) * dim, "qkv must be [n, T, (heads + 2 kv_heads) head_dim]"
    assert cache_k.shape == cache_v.shape and cache_k.stride() == cache_v.stride() and cache_k.stride(3) == 1
    assert positions.shape == (n, t) and rows.shape == (n,), "positions [n, T], rows [n]"
    assert (q_norm_weight is None) == (k_norm_weight is None), "both norms or neither"
    has_norm = q_norm_weight is not None
    # Without norms the weight pointers are never read: any tensor stands in for them.
    q_w = q_norm_weight.contiguous() if q_norm_weight is not None else qkv
    k_w = k_norm_weight.contiguous() if k_norm_weight is not None else qkv
    return _rope_cache_op(qkv.contiguous(), q_w, k_w, cos.contiguous(), sin.contiguous(),
                          positions.to(torch.int64).contiguous(), rows.to(torch.int64).contiguous(), cache_k, cache_v,
                          heads, float(eps), float(eps if k_eps is None else k_eps), has_norm)
