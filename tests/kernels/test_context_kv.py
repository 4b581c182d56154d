"""The fused context-materialisation kernel against its PyTorch reference, and the reference against the
drafter's own `key_values` (k_norm + RoPE) so that both stay tied to the model.

On CPU the kernels run under TRITON_INTERPRET=1; when this process imported triton without it, the file
re-runs itself in a subprocess that sets it from the start.
"""

from __future__ import annotations

import pytest
import torch

from dflash_train.kernels.context_kv import context_kv_reference, context_kv_triton
from tests.helpers.kernels import DEVICE, kernels_here, under_interpreter
from tests.helpers.tiny_drafts import tiny_draft

test_under_interpreter = under_interpreter(__file__)


def rope_tables(head_dim: int, max_len: int, theta: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    freqs = torch.arange(max_len, dtype=torch.float32)[:, None] * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def make_case(layers: int, kv_heads: int, head_dim: int, tokens: int, batch: int, max_len: int,
              dtype: torch.dtype, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    cos, sin = rope_tables(head_dim, max_len)
    positions = torch.randperm(max_len, generator=gen)[:tokens]
    return dict(
        kv=(torch.randn(tokens, layers, 2, kv_heads, head_dim, generator=gen) * 3).to(dtype),
        k_norm_weight=(1 + 0.3 * torch.randn(layers, head_dim, generator=gen)).to(dtype),
        cos=cos, sin=sin, positions=positions,
        rows=torch.randint(0, batch, (tokens,), generator=gen),
        cache_k=torch.full((layers, batch, kv_heads, max_len, head_dim), 9.0, dtype=dtype),
        cache_v=torch.full((layers, batch, kv_heads, max_len, head_dim), 9.0, dtype=dtype),
    )


@kernels_here
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("layers", "kv_heads", "head_dim", "tokens", "batch", "max_len"),
                         [(1, 1, 2, 1, 1, 3), (3, 3, 12, 5, 2, 11), (2, 2, 64, 7, 3, 40)])
def test_kernel_matches_reference(dtype: torch.dtype, layers: int, kv_heads: int, head_dim: int, tokens: int,
                                  batch: int, max_len: int) -> None:
    case = make_case(layers, kv_heads, head_dim, tokens, batch, max_len, dtype, seed=head_dim + tokens)
    ref = {k: v.clone() for k, v in case.items()}
    context_kv_reference(eps=1e-6, **ref)
    dev = {k: v.to(DEVICE) for k, v in case.items()}
    context_kv_triton(eps=1e-6, **dev)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=2e-2)
    torch.testing.assert_close(dev["cache_k"].cpu(), ref["cache_k"], **tol)
    torch.testing.assert_close(dev["cache_v"].cpu(), ref["cache_v"], atol=0, rtol=0)  # V is a plain copy
    written = torch.zeros(batch, max_len, dtype=torch.bool)
    written[case["rows"], case["positions"]] = True
    untouched = ~written[None, :, None, :, None].expand_as(ref["cache_k"])
    assert (dev["cache_k"].cpu()[untouched] == 9.0).all()  # nothing else written


def test_reference_equals_the_drafters_key_values() -> None:
    draft = tiny_draft(num_hidden_layers=3, head_dim=8).eval()
    config = draft.config
    tokens, max_len = 6, 20
    context = torch.randn(1, tokens, config.hidden_size)
    positions = torch.arange(4, 4 + tokens)[None]
    cos, sin = draft.rotary_emb(positions, torch.float32)
    table_cos, table_sin = rope_tables(config.head_dim, max_len, config.rope_theta)
    weights = [torch.cat([layer.self_attn.k_proj.weight, layer.self_attn.v_proj.weight]) for layer in draft.layers]
    kv = (context[0] @ torch.cat(weights).T).view(tokens, len(draft.layers), 2, config.num_key_value_heads, -1)
    shape = (len(draft.layers), 1, config.num_key_value_heads, max_len, config.head_dim)
    cache_k, cache_v = torch.zeros(shape), torch.zeros(shape)
    norm_w = torch.stack([layer.self_attn.k_norm.weight for layer in draft.layers])
    context_kv_reference(kv, norm_w, config.rms_norm_eps, table_cos, table_sin, positions[0],
                         torch.zeros(tokens, dtype=torch.long), cache_k, cache_v)
    for index, layer in enumerate(draft.layers):
        k, v = layer.self_attn.key_values(context, cos, sin)  # [1, kv_heads, T, D]
        torch.testing.assert_close(cache_k[index, :, :, 4 : 4 + tokens], k, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(cache_v[index, :, :, 4 : 4 + tokens], v, atol=1e-6, rtol=1e-5)
