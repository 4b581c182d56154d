"""A drafter layer in the decode loop on the runtime's kernels: the block attends to the static context
cache through the split-key attention kernel instead of SDPA over the whole cache.

Why: the drafter's own forward (`DFlashDecoderLayer` with a dense mask, the reference path) concatenates the
layer's whole context cache with the block's K/V and runs SDPA under a [b, 1, B, max_len + B] mask in every
cycle: copies of the cache, kernels that build and apply the mask, and an attention kernel whose programs
each walk every slot of the cache, a few dozen of them at batch 1 on a GPU with 132 multiprocessors. In a
Qwen3-8B-shaped cycle the attention kernels took well over twice their time in a target step, the extra
launches all the drafter's (docs/benchmarks.md, 'Not measured yet').

Here, as in the target's layers (`fused_layer.FusedLayer`): one q/k/v product (the projections fused by
`fused_layer.fused_projections`, no weight copied), one kernel for the q/k norms, RoPE and the write of the block's K/V into
the cache at the block's positions (`kernels.rope_cache`), and the split-key kernel over slots
[0, start + B - 1] (`kernels.static_attention`): the context before the block and the block itself, all
of which every block query sees, as in the reference's mask. The block's K/V sit in slots
start .. start + B - 1 only until the verify: `StaticDrafter.write_context` then writes the context K/V of
the target's features at the same positions, before any later block can see those slots.

Arithmetic: the drafter's RMSNorm and rotate-half RoPE are those of Qwen3, which the prologue kernel
reproduces when the norm weights have the activations' dtype (`supported` checks it, else the reference
path runs); attention sums in fp32 with probabilities rounded to the cache's dtype, so bf16 drafts can
differ from the reference path's in rounding, never in which keys they see (the target's verify decides
what is emitted either way).

Products: on the skinny-matmul kernel for the weights the runner puts there (`skinny_shapes`, the
runner's: with the default "auto" matmul, the shapes tuned on this GPU, so a Qwen3-8B-shaped drafter's
products run as the target's verify products do), else cuBLAS.
With `fused_products` (the runner's `skinny_fusion`), a block of few rows runs the layer as the target's
layers do (`fused_layer.FusedLayer._fused_call`): the input norm, the q/k/v product and the prologue in one
launch (`dflash_train.kernels.qkv_rope_cache`), then o_proj with the residual add, gate/up with the norm and
SwiGLU, and down with the residual add (`dflash_train.kernels.skinny_fused`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dflash_train.kernels.qkv_rope_cache import qkv_rope_cache_triton
from dflash_train.kernels.rope_cache import rope_cache_triton
from dflash_train.kernels.skinny_fused import skinny_fused_triton
from dflash_train.kernels.skinny_matmul import fits as skinny_fits
from dflash_train.kernels.static_attention import fits, static_attention_triton
from dflash_train.models.layers import DFlashDecoderLayer
from dflash_train.runtime.fused_layer import (
    Shapes,
    fused_projections,
    fusion_supported,
    linear,
    prologue_in_product,
)


def supported(layer: DFlashDecoderLayer, block_size: int, dtype: torch.dtype) -> bool:
    """Whether `DraftLayerKernels` computes this layer as its own forward does: a block fits one attention
    program, and the q/k norm weights have the activations' dtype (fp32 weights would promote q and k)."""
    attn = layer.self_attn
    norms_match = attn.q_norm.weight.dtype == attn.k_norm.weight.dtype == dtype
    return fits(attn.num_heads, attn.num_kv_heads, block_size) and norms_match and attn.head_dim % 2 == 0


class DraftLayerKernels:
    """Forward of one drafter layer over its static context cache (module docstring)."""

    def __init__(self, layer: DFlashDecoderLayer, fused_products: bool = False,
                 skinny_shapes: Shapes = frozenset()) -> None:
        """`skinny_shapes`: the weights [N, K] whose plain products run on the skinny-matmul kernel (the
        runner's `skinny_shapes`; None: every one, empty: none)."""
        attn, mlp = layer.self_attn, layer.mlp
        self.shapes = skinny_shapes
        self.layer, self.attn, self.mlp = layer, attn, mlp
        # The drafter's layer names its projections as the target's do: the same fused views, kept on the layer.
        fused = fused_projections(layer)
        self.qkv, self.qkv_bias, self.gate_up = fused["qkv"], fused["qkv_bias"], fused["gate_up"]
        self.heads, self.scale = attn.num_heads, attn.head_dim ** -0.5
        self.fused_products = fused_products and fusion_supported(layer)

    def __call__(self, h: torch.Tensor, pending: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor,
                 bounds: torch.Tensor, counters: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Block rows h + pending [n, B, H] at positions [n, B] of cache rows [n]; keys/values
        [b, kv, max_len, D] (the block's K/V are written into them); bounds [n, 2, B]: the slots each query
        sees; counters: the attention's (`static_attention.counters_for`) -> (h', pending'), the layer's output
        being h' + pending'. The MLP's residual add is left to
        the next layer (`pending`: zeros for the first), whose input norm takes it in the same kernel: one
        launch fewer a layer when layers are compiled one at a time. The fused products add it in their
        epilogue instead, so there pending stays zero."""
        n, t, _ = h.shape
        attn, before_attention, before_mlp = self.attn, self.layer.input_layernorm, self.layer.post_attention_layernorm
        fuse = self.fused_products and skinny_fits(n * t) and all(
            norm.weight.dtype == h.dtype for norm in (before_attention, before_mlp))  # static under compile
        if not fuse:
            h = h + pending
        q = self._queries(h, fuse, cos, sin, keys, values, positions, rows)  # [n, B, heads, D], K/V written
        out = static_attention_triton(q.transpose(1, 2), keys, values, bounds, self.scale,
                                      counters=counters)  # [n, B, heads, D]
        out = out.reshape(n, t, -1)
        if fuse:
            h = skinny_fused_triton(out, attn.o_proj.weight, attn.o_proj.bias, residual=h)
            act = skinny_fused_triton(h, self.gate_up, None, norm_weight=before_mlp.weight, norm_eps=before_mlp.eps,
                                      swiglu=True)
            return skinny_fused_triton(act, self.mlp.down_proj.weight, self.mlp.down_proj.bias, residual=h), pending
        h = h + linear(out, attn.o_proj.weight, attn.o_proj.bias, self.shapes)
        gate, up = linear(before_mlp(h), self.gate_up, None, self.shapes).chunk(2, dim=-1)
        down = self.mlp.down_proj
        return h, linear(F.silu(gate) * up, down.weight, down.bias, self.shapes)

    def _queries(self, h: torch.Tensor, fuse: bool, cos: torch.Tensor, sin: torch.Tensor, keys: torch.Tensor,
                 values: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """The block's queries [n, B, heads, D] after the input norm, the q/k/v product and the prologue (q/k
        norms, RoPE), its K/V written into the cache: fused, in one launch where `prologue_in_product`, else
        the product (on the fused kernel or torch's) and the prologue kernel."""
        attn, before_attention = self.attn, self.layer.input_layernorm
        prologue = (attn.q_norm.weight, attn.k_norm.weight, attn.q_norm.eps, cos, sin, positions, rows, keys, values)
        if fuse and prologue_in_product(self.qkv):
            return qkv_rope_cache_triton(h, self.qkv, self.qkv_bias, before_attention.weight, before_attention.eps,
                                         self.heads, *prologue, k_eps=attn.k_norm.eps)
        if fuse:
            qkv = skinny_fused_triton(h, self.qkv, self.qkv_bias, norm_weight=before_attention.weight,
                                      norm_eps=before_attention.eps)
        else:
            qkv = linear(before_attention(h), self.qkv, self.qkv_bias, self.shapes)
        return rope_cache_triton(qkv, self.heads, *prologue, k_eps=attn.k_norm.eps)
