"""The drafter over a static context cache, for the runtime with a drafter.

Cache: the drafter's `DraftKVCache` storage, keys/values [L, b, kv_heads, max_len, D], slot == position.
Row r's valid context is slots < start[r] (committed tokens before the block's anchor); after each verify
the K/V of all B block positions are written (static shapes), and those past the accepted prefix are
overwritten by the next cycle before the mask ever shows them.

Context materialisation: `fuse_context` (fc + hidden_norm), then either the drafter's own `key_values`
per layer ("torch") or one GEMM over all layers' [k_proj; v_proj] plus the fused Triton kernel for
k_norm + RoPE + cache write ("triton"); with the fused products, fc and that GEMM on the skinny kernel with
hidden_norm folded into the second (a verify block's few rows).

The block's layers: the drafter's own forward with a dense mask over the whole cache ("torch", and
`attention="sdpa"`), or on the Triton kernels, the block's K/V written into the cache and attended with
the context by the split-key kernel (`dflash_train.runtime.draft_layer`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from dflash_train.compiling import compile_fixed_shapes
from dflash_train.kernels.context_kv import context_kv_triton
from dflash_train.kernels.skinny_fused import skinny_fused_triton
from dflash_train.kernels.skinny_matmul import fits as skinny_fits
from dflash_train.kernels.skinny_matmul import skinny_matmul_triton
from dflash_train.kernels.static_attention import counters_for
from dflash_train.models import DFlashDraftModel
from dflash_train.runtime.config import DRAFT_ATTENTIONS, check_compile_scope
from dflash_train.runtime.draft_layer import DraftLayerKernels, supported
from dflash_train.runtime.fused_layer import Shapes


class StaticDrafter:
    def __init__(self, draft: DFlashDraftModel, batch_size: int, block_size: int, max_length: int,
                 kernels: str = "torch", attention: str = "kernel", fused_products: bool = False,
                 skinny_shapes: Shapes = frozenset()) -> None:
        """`attention`: "kernel" runs the block's layers on the Triton kernels where `kernels` is "triton" and
        the layers allow it (`draft_layer.supported`); "sdpa" keeps the drafter's own forward.
        `fused_products`: those layers' products on the fused skinny kernel (`DraftLayerKernels`);
        `skinny_shapes`: the weights whose plain products run on the skinny-matmul kernel there (the target
        runner's, so that both follow the engine's `matmul` setting)."""
        if attention not in DRAFT_ATTENTIONS:
            raise ValueError(f"draft attention must be kernel or sdpa, not {attention!r}")
        self.draft = draft
        self.cache = draft.new_cache(batch_size, max_length)  # keys/values [L, b, kv, max_len, D]
        device = draft.fc.weight.device
        self.dtype = draft.fc.weight.dtype
        self.slots = torch.arange(max_length, device=device)
        self.block_visible = torch.ones(batch_size, 1, block_size, block_size, dtype=torch.bool, device=device)
        self.kernels = kernels
        self.fused_products = fused_products and kernels == "triton"
        self._compiled_hidden: dict[tuple[str, tuple[tuple[str, Any], ...]], Callable[..., torch.Tensor]] = {}
        self._cycle_rows: dict[tuple[int, int], torch.Tensor] = {}
        if kernels == "triton":
            self._prepare_fused(max_length)
        self.layer_kernels: list[DraftLayerKernels] | None = None
        if kernels == "triton" and attention == "kernel" and all(
                supported(layer, block_size, self.dtype) for layer in draft.layers):
            self.layer_kernels = [DraftLayerKernels(layer, fused_products, skinny_shapes) for layer in draft.layers]
        self.rows = torch.arange(batch_size, device=device)
        self.attention_counters = counters_for(batch_size, draft.layers[0].self_attn.num_kv_heads, device)
        self._zero_rows = torch.zeros(batch_size, block_size, draft.config.hidden_size, device=device,
                                      dtype=self.dtype)

    @property
    def attention(self) -> str:
        """What the block's layers run on: "kernel" (split-key kernel over the cache) or "sdpa"."""
        return "sdpa" if self.layer_kernels is None else "kernel"

    def use_sdpa_attention(self) -> None:
        """Run the block's layers through the drafter's own forward from now on (a compiler fallback)."""
        self.layer_kernels = None

    def _prepare_fused(self, max_length: int) -> None:
        attns = [layer.self_attn for layer in self.draft.layers]
        # [L * 2 * kv_heads * D, H]: for each layer its k_proj rows, then its v_proj rows.
        self.kv_weight = torch.cat([torch.cat([a.k_proj.weight, a.v_proj.weight]) for a in attns])
        biases = [torch.cat([a.k_proj.bias, a.v_proj.bias]) for a in attns if a.k_proj.bias is not None]
        self.kv_bias = torch.cat(biases) if biases else None
        self.k_norm_weight = torch.stack([a.k_norm.weight for a in attns])  # [L, D]
        positions = torch.arange(max_length, device=self.slots.device)[None]
        cos, sin = self.draft.rotary_emb(positions, torch.float32)  # [1, max_len, D]
        self.cos, self.sin = cos[0].contiguous(), sin[0].contiguous()

    @torch.no_grad()
    def write_context(self, features: torch.Tensor, positions: torch.Tensor,
                      row_index: torch.Tensor | None = None, compiled: bool = False,
                      compile_options: tuple[tuple[str, Any], ...] = ()) -> None:
        """Context K/V of target features [n, T, K*H] at positions [n, T] into cache rows row_index [n].
        `compiled`: the products before the cache write through torch.compile (with these inductor options),
        so that the hidden norm between them is one kernel rather than a string of eager ones."""
        n, t = positions.shape
        if self.kernels == "triton":
            attn = self.draft.layers[0].self_attn
            product = self._compiled_context(compile_options) if compiled else self._context_kv_product
            kv = product(features.to(self.dtype))
            kv = kv.view(n * t, len(self.draft.layers), 2, attn.num_kv_heads, attn.head_dim)
            context_kv_triton(kv, self.k_norm_weight, self.draft.config.rms_norm_eps, self.cos, self.sin,
                              positions.reshape(-1), self._slot_rows(n, t, row_index),
                              self.cache.keys, self.cache.values)
            return
        rows = torch.arange(n, device=positions.device) if row_index is None else row_index
        context = self.draft.fuse_context(features.to(self.dtype))  # [n, T, H]
        cos, sin = self.draft.rotary_emb(positions, context.dtype)
        for index, layer in enumerate(self.draft.layers):
            k, v = layer.self_attn.key_values(context, cos, sin)  # [n, kv, T, D]
            self.cache.keys[index][rows[:, None], :, positions] = k.transpose(1, 2)
            self.cache.values[index][rows[:, None], :, positions] = v.transpose(1, 2)

    def _slot_rows(self, n: int, t: int, row_index: torch.Tensor | None) -> torch.Tensor:
        """The cache row of each of n * t context tokens: row_index's, or rows 0 .. n-1 (a cycle's, made once
        per shape, so that a cycle launches no kernel to build them)."""
        if row_index is not None:
            return row_index[:, None].expand(n, t).reshape(-1)
        if (n, t) not in self._cycle_rows:
            self._cycle_rows[n, t] = torch.arange(n, device=self.slots.device).repeat_interleave(t)
        return self._cycle_rows[n, t]

    def _compiled_context(self, options: tuple[tuple[str, Any], ...]) -> Callable[[torch.Tensor], torch.Tensor]:
        if ("context", options) not in self._compiled_hidden:
            self._compiled_hidden["context", options] = compile_fixed_shapes(self._context_kv_product, options)
        return self._compiled_hidden["context", options]

    def _context_kv_product(self, features: torch.Tensor) -> torch.Tensor:
        """Every layer's context [k; v] of features [n, T, K*H] before their norm and RoPE: fc, the hidden
        norm and one product over all layers' k/v weights; with the fused products (few rows), two launches,
        the norm folded into the second product instead of a string of eager kernels between them."""
        fc, norm = self.draft.fc, self.draft.hidden_norm
        if self.fused_products and skinny_fits(features.numel() // features.shape[-1]) and (
                norm.weight.dtype == features.dtype == fc.weight.dtype):
            context = skinny_matmul_triton(features, fc.weight, fc.bias)
            return skinny_fused_triton(context, self.kv_weight, self.kv_bias, norm_weight=norm.weight,
                                       norm_eps=norm.eps)
        return F.linear(self.draft.fuse_context(features), self.kv_weight, self.kv_bias)

    @torch.no_grad()
    def hidden(self, block_embeds: torch.Tensor, positions: torch.Tensor, start: torch.Tensor,
               compiled: bool = False, compile_options: tuple[tuple[str, Any], ...] = (),
               compile_scope: str = "step") -> torch.Tensor:
        """Final-normed hidden states [b, B, H] of the block embeds [b, B, H] at positions [b, B]; the block
        attends to context slots < start[r] and to all of itself. `compiled`: through torch.compile (with
        these inductor options), as one graph (`compile_scope` "step") or one graph per part, the layer's
        shared by every layer ("layer"; `dflash_train.runtime.config.COMPILE_SCOPES`)."""
        run = self._hidden
        if compiled:
            run = (self._compiled_by_layer if check_compile_scope(compile_scope) == "layer" else self._compiled)(
                compile_options)
        return run(block_embeds, positions, start)

    def _compiled(self, options: tuple[tuple[str, Any], ...]) -> Callable[..., torch.Tensor]:
        """`_hidden` as one compiled graph (compile scope "step")."""
        if ("step", options) not in self._compiled_hidden:
            self._compiled_hidden["step", options] = compile_fixed_shapes(self._hidden, options)
        return self._compiled_hidden["step", options]

    def _compiled_by_layer(self, options: tuple[tuple[str, Any], ...]) -> Callable[..., torch.Tensor]:
        """`_hidden` with each part compiled on its own, one code for every layer (scope "layer"). The mask and
        RoPE tables before the layers and the final norm after them are small graphs of their own rather than
        eager, so that they stay a few launches (as the target runner's embedding and output)."""
        if ("layer", options) not in self._compiled_hidden:
            regions = _Regions(*(compile_fixed_shapes(part, options) for part in (self._inputs, self._layer, self._norm)))
            self._compiled_hidden["layer", options] = functools.partial(self._hidden, regions=regions)
        return self._compiled_hidden["layer", options]

    def _hidden(self, block_embeds: torch.Tensor, positions: torch.Tensor, start: torch.Tensor,
                regions: _Regions | None = None) -> torch.Tensor:
        inputs, run_layer, norm = regions or (self._inputs, self._layer, self._norm)
        h, cos, sin, visible = inputs(block_embeds, positions, start)
        pending = self._zeros(h)  # the residual add a kernel layer leaves to the next (`DraftLayerKernels`)
        for index, layer in enumerate(self.layer_kernels or self.draft.layers):
            # The layer's cache goes in as tensors: the compiled layer never sees its index, so every layer
            # reuses one compiled code (an index would be a guard, and a recompile, per layer).
            h, pending = run_layer(layer, h, pending, cos, sin, self.cache.keys[index], self.cache.values[index],
                                   visible)
        return norm(h, pending)

    def _zeros(self, h: torch.Tensor) -> torch.Tensor:
        """Zeros of h's shape: the first layer's pending residual (allocated once for the engine's block, so
        that a cycle launches no fill; other shapes, as tests give, get fresh ones)."""
        same = self._zero_rows.shape == h.shape and self._zero_rows.dtype == h.dtype
        return self._zero_rows if same else torch.zeros_like(h)

    def _inputs(self, block_embeds: torch.Tensor, positions: torch.Tensor, start: torch.Tensor) -> tuple[
            torch.Tensor, torch.Tensor, torch.Tensor, Any]:
        """(block rows [b, B, H] in the drafter's dtype, RoPE cos and sin, what the block sees): the mask
        [b, 1, B, max_len + B] over [cache ; block], or on the kernels (positions [b, B], cache rows [b],
        bounds [b, 2, B]: slots 0 .. start + B - 1, the context and the block written at its positions; the
        attention's counters)."""
        b, width = positions.shape
        h = block_embeds.to(self.dtype)
        cos, sin = self.draft.rotary_emb(positions, h.dtype)
        if self.layer_kernels is not None:
            last = (start + width - 1)[:, None].expand(b, width)
            bounds = torch.stack([torch.zeros_like(last), last], dim=1).to(torch.int32)
            return h, cos, sin, (positions, self.rows, bounds, self.attention_counters)
        context_visible = (self.slots[None, :] < start[:, None])[:, None, None, :]  # [b, 1, 1, max_len]
        mask = torch.cat([context_visible.expand(b, 1, width, -1), self.block_visible], dim=-1)
        return h, cos, sin, mask

    @staticmethod
    def _layer(layer: nn.Module | DraftLayerKernels, h: torch.Tensor, pending: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: Any,
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """(h', pending'): the layer's output is their sum (the drafter's own layer adds everything: pending
        stays the zeros it was given)."""
        if isinstance(layer, DraftLayerKernels):
            return layer(h, pending, cos, sin, keys, values, *visible)
        return layer(h, cos, sin, (keys, values), visible), pending

    def _norm(self, h: torch.Tensor, pending: torch.Tensor) -> torch.Tensor:
        return self.draft.norm(h + pending)


class _Regions(NamedTuple):
    """`_hidden`'s parts before, inside and after the layer loop, each compiled on its own (scope "layer")."""

    inputs: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]
    layer: Callable[..., torch.Tensor]
    norm: Callable[..., torch.Tensor]
