"""Context materialisation for every draft layer at once: k_norm + RoPE on the projected context keys, and
the write of K and V into the draft cache.

Input layout: the context rows' K/V projections of all L draft layers come from one GEMM against the
layers' concatenated [k_proj; v_proj] weights, viewed as kv [N, L, 2, kv_heads, D] (N = tokens).
Token n goes to cache row rows[n] at position positions[n]:

    cache_k[l, rows[n], h, positions[n]] = rope(rmsnorm(kv[n, l, 0, h]) * k_norm_weight[l], positions[n])
    cache_v[l, rows[n], h, positions[n]] = kv[n, l, 1, h]

RoPE is rotate-half with cos/sin tables [max_len, D] (fp32, `cat([freqs, freqs])` as the drafter builds
them). The kernel computes in fp32 and rounds once on store; the drafter's own code rounds after the norm
and after RoPE, so bf16 results can differ from it by one unit in the last place.
"""

# Deliberately no postponed annotations (PEP 563): Triton reads the `tl.constexpr` annotations of kernels.
import torch

from dflash_train.kernels._triton import jit, next_power_of_2, tl


def context_kv_reference(
    kv: torch.Tensor,
    k_norm_weight: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    rows: torch.Tensor,
    cache_k: torch.Tensor,
    cache_v: torch.Tensor,
) -> None:
    """PyTorch version, the drafter's own arithmetic (RMSNorm in fp32, RoPE in the cache dtype).

    kv [N, L, 2, kv_heads, D]; k_norm_weight [L, D]; cos/sin [max_len, D] fp32; positions/rows [N] int64;
    cache_k/cache_v [L, b, kv_heads, max_len, D], written in place.
    """
    dtype = cache_k.dtype
    k = kv[:, :, 0].float()  # [N, L, kv_heads, D]
    k = (k * torch.rsqrt(k.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)
    k = k_norm_weight[None, :, None, :].to(dtype) * k
    c = cos[positions].to(dtype)[:, None, None, :]  # [N, 1, 1, D]
    s = sin[positions].to(dtype)[:, None, None, :]
    half = k.shape[-1] // 2
    rotated = torch.cat([-k[..., half:], k[..., :half]], dim=-1)
    k = (k * c + rotated * s).to(dtype)
    # cache[l][rows[n], :, positions[n]] <- [N, kv_heads, D] for each layer l
    for layer in range(cache_k.shape[0]):
        cache_k[layer][rows, :, positions] = k[:, layer]
        cache_v[layer][rows, :, positions] = kv[:, layer, 1].to(dtype)


def _context_kv_kernel(
    kv_ptr, weight_ptr, cos_ptr, sin_ptr, pos_ptr, row_ptr, cache_k_ptr, cache_v_ptr,
    num_layers, kv_heads, max_len, batch, eps, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    token = tl.program_id(0)
    layer = tl.program_id(1)
    head = tl.program_id(2)
    dim = 2 * HALF
    d = tl.arange(0, BLOCK_HALF)
    dmask = d < HALF
    src = kv_ptr + ((token.to(tl.int64) * num_layers + layer) * 2 * kv_heads + head) * dim
    k1 = tl.load(src + d, mask=dmask, other=0.0).to(tl.float32)
    k2 = tl.load(src + HALF + d, mask=dmask, other=0.0).to(tl.float32)
    inv_rms = tl.rsqrt((tl.sum(k1 * k1, axis=0) + tl.sum(k2 * k2, axis=0)) / dim + eps)
    w1 = tl.load(weight_ptr + layer * dim + d, mask=dmask, other=0.0).to(tl.float32)
    w2 = tl.load(weight_ptr + layer * dim + HALF + d, mask=dmask, other=0.0).to(tl.float32)
    n1 = k1 * inv_rms * w1
    n2 = k2 * inv_rms * w2
    pos = tl.load(pos_ptr + token)  # int64
    row = tl.load(row_ptr + token)
    c = tl.load(cos_ptr + pos * dim + d, mask=dmask, other=0.0)  # both halves of the table are equal
    s = tl.load(sin_ptr + pos * dim + d, mask=dmask, other=0.0)
    dst = (((layer * batch + row) * kv_heads + head) * max_len + pos) * dim
    elem = cache_k_ptr.dtype.element_ty
    tl.store(cache_k_ptr + dst + d, (n1 * c - n2 * s).to(elem), mask=dmask)
    tl.store(cache_k_ptr + dst + HALF + d, (n2 * c + n1 * s).to(elem), mask=dmask)
    v_src = src + kv_heads * dim
    v1 = tl.load(v_src + d, mask=dmask, other=0.0)
    v2 = tl.load(v_src + HALF + d, mask=dmask, other=0.0)
    tl.store(cache_v_ptr + dst + d, v1.to(elem), mask=dmask)
    tl.store(cache_v_ptr + dst + HALF + d, v2.to(elem), mask=dmask)


def context_kv_triton(
    kv: torch.Tensor,
    k_norm_weight: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    rows: torch.Tensor,
    cache_k: torch.Tensor,
    cache_v: torch.Tensor,
) -> None:
    """Same contract as `context_kv_reference`."""
    tokens, num_layers, two, kv_heads, dim = kv.shape
    assert two == 2 and dim % 2 == 0, "kv must be [N, L, 2, kv_heads, D] with an even head_dim"
    assert cache_k.is_contiguous() and cache_v.is_contiguous() and cache_k.shape == cache_v.shape
    _, batch, _, max_len, _ = cache_k.shape
    assert cos.dtype == torch.float32 and cos.shape[1] == dim and positions.dtype == torch.int64
    if tokens == 0:
        return
    jit(_context_kv_kernel)[(tokens, num_layers, kv_heads)](
        kv.contiguous(), k_norm_weight.contiguous(), cos.contiguous(), sin.contiguous(),
        positions.contiguous(), rows.to(torch.int64).contiguous(), cache_k, cache_v,
        num_layers, kv_heads, max_len, batch, float(eps), HALF=dim // 2, BLOCK_HALF=next_power_of_2(dim // 2),
    )
