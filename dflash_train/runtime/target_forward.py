"""The static target's forward pass, which `StaticTarget.forward` runs eager or compiled: the embedding with
its rotary tables and masks, each decoder layer over the static cache (the fused Llama-family layer, the
model's own, latent attention absorbed, a ring-kept linear-attention layer), the output projection, and the
drafter's features taken from the layer loop. Compile scope "step" compiles it as one graph, "layer" its parts
one by one (`_Regions`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from dflash_train.compiling import compile_fixed_shapes
from dflash_train.kernels.skinny_fused import skinny_fused_stats_triton, skinny_fused_triton
from dflash_train.kernels.skinny_matmul import fits as skinny_fits
from dflash_train.kernels.skinny_matmul import stats_width
from dflash_train.kernels.static_attention import bounds_from_positions, fits
from dflash_train.runtime.fused_layer import FusedLayer, is_rms_norm, norm_eps
from dflash_train.runtime.latent_attention import has_latent_attention, latent_layer
from dflash_train.runtime.linear_attention import gated_delta_forward, mamba2_forward, short_conv_forward

if TYPE_CHECKING:
    from dflash_train.runtime.static_target import StaticTarget


class _WriteCache:
    """The cache handed to one layer's forward: `update` writes K/V at the tokens' positions (Hugging Face
    layers and the PyTorch path of fused ones); the fused prologue kernel writes `storage` itself.

    The layer index the layers pass is ignored: the object is already that layer's. A compiled layer then
    reads its cache through tensors only, so one compiled code serves every layer (compile scope "layer");
    reading the index would guard on its value and recompile for each layer."""

    def __init__(self, runner: StaticTarget, index: int, row_index: torch.Tensor | None, positions: torch.Tensor,
                 kv_len: int) -> None:
        self.keys, self.values = runner.keys[index], runner.values[index]  # [b, kv, max_len, D]
        self.row_index, self.positions, self.kv_len = row_index, positions, kv_len
        self.rows = runner.all_rows if row_index is None else row_index  # [n]
        self.fused_prologue = runner.kernels == "triton" and runner.fuse_prologue
        self.skinny_shapes = runner.skinny_shapes
        self.skinny_fusion = runner.matmul == "fused"
        self.prefetch_weights = runner.prefetch_weights and runner.kernels == "triton"
        self.attention_counters = runner.attention_counters

    def storage(self, layer_idx: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's whole cache, keys and values [b, kv, max_len, D]."""
        return self.keys, self.values

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int | None = None,
               *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        self.keys[self.rows[:, None], :, self.positions] = key_states.transpose(1, 2)  # [n, T, kv, D] at (row, position)
        self.values[self.rows[:, None], :, self.positions] = value_states.transpose(1, 2)
        return self.visible()

    def visible(self, layer_idx: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The slots attention may read, [n, kv, kv_len, D], for the forward's rows."""
        if self.row_index is None:
            return self.keys[:, :, : self.kv_len], self.values[:, :, : self.kv_len]
        return self.keys[self.row_index, :, : self.kv_len], self.values[self.row_index, :, : self.kv_len]


RotaryTables = dict[str | None, tuple[torch.Tensor, torch.Tensor]]  # cos/sin by `StaticTarget.rope_keys`


class _Regions(NamedTuple):
    """The forward's parts outside and inside the layer loop, each compiled on its own (compile scope "layer")."""

    embed: Callable[..., tuple[torch.Tensor, torch.Tensor | None, RotaryTables, dict[int | None, torch.Tensor]]]
    layer: Callable[..., torch.Tensor]
    output: Callable[..., tuple[torch.Tensor, torch.Tensor | None]]
    linear_layer: Callable[..., torch.Tensor]


class TargetForwardMixin:
    """The StaticTarget's forward pass and its compiled forms. Relies on the StaticTarget's `target`, `base`,
    `text_config`, `adapter`, `layers`, `fused`, `keys`, `linear_states`, `all_rows`, `slots`, `windows`,
    `rope_keys`, `heads`, `kv_heads`, `same_head_dims`, `cache_arg`, `step_tokens`, `defer_residual`,
    `absorb_latent`, `kernels`, `matmul`, `carries_norm_stats`, `lm_head` and `_compiled_forward`."""

    def _compiled(self, options: tuple[tuple[str, Any], ...] = ()) -> Callable[..., Any]:
        """The forward as one compiled graph (compile scope "step")."""
        if ("step", options) not in self._compiled_forward:
            self._compiled_forward["step", options] = compile_fixed_shapes(self._forward, options)
        return self._compiled_forward["step", options]

    def _compiled_by_layer(self, options: tuple[tuple[str, Any], ...] = ()) -> Callable[..., Any]:
        """The forward with each of its parts compiled on its own, one code for every layer (scope "layer").
        The embedding and the output are compiled too, not left eager: each is a handful of small kernels
        (gather, RoPE tables, masks; final norm, logits) that a graph of its own fuses into a few launches, at a
        compile cost that does not grow with the depth either."""
        if ("layer", options) not in self._compiled_forward:
            parts = (self._embed, self._layer, self._output, self._linear_layer)
            regions = _Regions(*(compile_fixed_shapes(part, options) for part in parts))
            self._compiled_forward["layer", options] = functools.partial(self._forward, regions=regions)
        return self._compiled_forward["layer", options]

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, row_index: torch.Tensor | None,
                 kv_len: int, logit_index: torch.Tensor | None, feature_layer_ids: tuple[int, ...],
                 regions: _Regions | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The whole forward; `regions`: its parts compiled one by one (else they run as they are, eager or
        traced into the one graph of compile scope "step"). Beside h, each layer hands the next what it left
        for it (`carry`): with deferred residuals, the pending residual (a layer's output is h + pending, which
        the next layer, or the output, forms and returns as its input); with carried norm statistics, the
        shares of h's rows' sums of squares (or None); else None."""
        embed, run_layer, output, run_linear = regions or (self._embed, self._layer, self._output, self._linear_layer)
        h, carry, position_embeddings, masks = embed(input_ids, positions, kv_len)
        captured: dict[int, torch.Tensor] = {}
        rows = self.all_rows if row_index is None else row_index
        last = self._last_kept(input_ids, positions, rows, logit_index)
        for index, layer in enumerate(self.fused or self.layers):
            if (states := self.linear_states[index]) is not None and self.keys[index].numel() == 0:
                h, carry, layer_input = run_linear(layer, h, states.states, states.inputs, rows, positions, last)
            elif states is not None:  # Falcon-H1: Mamba-2 beside attention in one layer
                cache = _WriteCache(self, index, row_index, positions, kv_len)
                h, carry, layer_input = run_linear(layer, h, states.states, states.inputs, rows, positions, last,
                                                   position_embeddings[self.rope_keys[index]],
                                                   masks[self.windows[index]], cache)
            else:
                cache = _WriteCache(self, index, row_index, positions, kv_len)
                h, carry, layer_input = run_layer(layer, h, carry, position_embeddings[self.rope_keys[index]],
                                                  masks[self.windows[index]], cache)
            if not self.defer_residual:
                if index in feature_layer_ids:
                    captured[index] = h
            elif index - 1 in feature_layer_ids:  # the previous layer's output is this layer's input
                captured[index - 1] = layer_input
        if self.defer_residual and len(self.layers) - 1 in feature_layer_ids:  # the last layer's, formed here
            captured[len(self.layers) - 1] = h = h + carry
            carry = torch.zeros_like(h)
        return output(h, carry, logit_index, tuple(captured[i] for i in feature_layer_ids))

    def _last_kept(self, input_ids: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor,
                   logit_index: torch.Tensor | None) -> torch.Tensor | None:
        """What a ring-kept layer keeps of this forward (`linear_attention.py`): every token's state for a step
        of at most `step_tokens` (None), or each row's last real token's for a prompt (`logit_index`, or the
        last token of a forward from position 0 longer than a step: committed whole)."""
        t = input_ids.shape[1]
        if logit_index is not None or t <= self.step_tokens or not any(s is not None for s in self.linear_states):
            return logit_index
        if bool((positions[:, 0] != 0).any()):  # a longer step could not be taken back: refused, never wrong
            raise ValueError(f"a step of {t} tokens after position 0 is longer than the {self.step_tokens} the "
                             "linear-attention states take back: build the runner with step_tokens >= the block")
        return torch.full_like(rows, t - 1)

    def _embed(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_len: int) -> tuple[
            torch.Tensor, torch.Tensor | None, RotaryTables, dict[int | None, torch.Tensor]]:
        """(embeddings [n, T, H] as the model's forward hands them to its first layer, what that layer is handed
        beside them (`_forward`: a zero pending residual, the embeddings' sums of squares as one share a row, or
        None), the rotary embedding's cos/sin (`_rotary`), the masks of `_masks`)."""
        h = self.target.model.get_input_embeddings()(input_ids)
        if self.adapter.embedding is not None:
            h = self.adapter.embedding(h, self.text_config)
        carry = None
        if self.defer_residual:
            carry = torch.zeros_like(h)
        elif self.carries_norm_stats and skinny_fits(h.numel() // h.shape[-1]):
            # as wide as the shares a layer's down product leaves (its other columns exact zeros): every layer
            # then gets the same shapes, and compile scope "layer" one graph for all of them
            down = self.layers[0].mlp.down_proj.weight
            sums = h.float().pow(2).sum(-1).reshape(-1, 1)
            carry = F.pad(sums, (0, stats_width(down.shape[0], down.shape[1]) - 1))
        return h, carry, self._rotary(h, positions), self._masks(positions, kv_len)

    def _rotary(self, h: torch.Tensor, positions: torch.Tensor) -> RotaryTables:
        """The cos/sin each layer gets from the model's forward, by `rope_keys`: one pair for all layers, or one
        per layer type where the model has a rotary embedding per type (Gemma-3's local and global)."""
        if not hasattr(self.base, "rotary_emb"):  # no position embedding at all (Nemotron-H's attention)
            return {None: None}
        if hasattr(self.base.rotary_emb, "mrope_section"):
            # Qwen3.5's multimodal rotary takes a position per grid axis (all three the text position here); some
            # transformers versions broadcast a [b, T] tensor to that, others index a third axis that must exist
            positions = positions[None].expand(3, -1, -1)
        if not self.adapter.rope_by_layer_type:
            return {None: self.base.rotary_emb(h, positions)}
        return {kind: self.base.rotary_emb(h, positions, kind) for kind in dict.fromkeys(self.rope_keys)}

    def _masks(self, positions: torch.Tensor, kv_len: int) -> dict[int | None, torch.Tensor]:
        """One [n, 1, T, kv_len] bool mask per distinct sliding window (None = full causal), or on the
        Triton path one [n, 2, T] int32 bounds tensor per window."""
        if self.kernels == "triton" and self.same_head_dims and fits(self.heads, self.kv_heads, positions.shape[1]):
            return {window: bounds_from_positions(positions, window) for window in dict.fromkeys(self.windows)}
        slots, query = self.slots[None, None, :kv_len], positions[:, :, None]
        masks = {}
        for window in dict.fromkeys(self.windows):  # ordered, so compiled graphs trace the same way each time
            visible = slots <= query
            if window is not None:  # transformers' sliding window: key > query - window
                visible = visible & (slots > query - window)
            masks[window] = visible[:, None]
        return masks

    def _layer(self, layer: FusedLayer | nn.Module, h: torch.Tensor, carry: torch.Tensor | None,
               position_embeddings: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor,
               cache: _WriteCache) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """One decoder layer, fused or the Hugging Face one -> (h, carry, the layer's input): with a pending
        residual (`carry`), the layer's output is h + pending; with carried norm statistics, h and its shares;
        else h and two Nones. Nothing here depends on which layer it is."""
        if isinstance(layer, FusedLayer):
            if self.defer_residual:
                layer_input, h, pending = layer.deferred(h, carry, position_embeddings, mask, cache)
                return h, pending, layer_input
            if self.carries_norm_stats:
                h, shares = layer.carried(h, carry, position_embeddings, mask, cache)
                return h, shares, None
            return layer(h, position_embeddings, mask, cache), None, None
        if self.absorb_latent and h.shape[1] <= self.step_tokens and has_latent_attention(layer):
            return latent_layer(layer, h, position_embeddings, mask, cache), None, None
        out = layer(h, attention_mask=mask, position_ids=cache.positions, position_embeddings=position_embeddings,
                    use_cache=True, **{self.cache_arg: cache})
        return (out[0] if isinstance(out, tuple) else out), None, None

    def _linear_layer(self, layer: nn.Module, h: torch.Tensor, states: torch.Tensor, inputs: torch.Tensor,
                      rows: torch.Tensor, positions: torch.Tensor, last: torch.Tensor | None,
                      position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
                      mask: torch.Tensor | None = None, cache: _WriteCache | None = None) -> tuple[
                          torch.Tensor, None, None]:
        """A ring-kept decoder layer: its token mixer on our state rings (`linear_attention.py`), then its MLP or
        experts, both pre-norm with residuals, as the model's layer: Qwen3-Next's and Qwen3.5's Gated DeltaNet
        layers, or LFM2's short-convolution layers (their norms and MLP under other names)."""
        if hasattr(layer, "mamba"):  # Falcon-H1: Mamba-2 and attention side by side on the same normed input
            x = layer.input_layernorm(h)
            ssm = mamba2_forward(layer.mamba, x, states, inputs, rows, positions, last, self.kernels)
            ssm = ssm * layer.ssm_out_multiplier
            attention, _ = layer.self_attn(hidden_states=x * layer.attention_in_multiplier, attention_mask=mask,
                                           position_ids=positions, position_embeddings=position_embeddings,
                                           use_cache=True, **{self.cache_arg: cache})
            h = h + ssm + attention * layer.attn_out_multiplier
            return h + layer.feed_forward(layer.pre_ff_layernorm(h)), None, None
        if hasattr(layer, "mixer"):  # Nemotron-H's Mamba-2 block: its mixer is its whole body
            x = layer.norm(h.to(layer.norm.weight.dtype))
            return h + mamba2_forward(layer.mixer, x, states, inputs, rows, positions, last, self.kernels), None, None
        if hasattr(layer, "linear_attn"):
            h = h + gated_delta_forward(layer.linear_attn, layer.input_layernorm(h), states, inputs, rows, positions,
                                        last, self.kernels)
            out = layer.mlp(layer.post_attention_layernorm(h))
            return h + (out[0] if isinstance(out, tuple) else out), None, None
        h = h + short_conv_forward(layer.conv, layer.operator_norm(h), inputs, rows, positions, last)
        return h + layer.feed_forward(layer.ffn_norm(h)), None, None

    def _output(self, h: torch.Tensor, carry: torch.Tensor | None, logit_index: torch.Tensor | None,
                captured: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(logits at `logit_index` or at every position, the captured features concatenated or None); the
        last layer's output is h + `carry` where residuals are deferred; `carry` holds its rows' norm shares
        where the layers carry them (`_forward`)."""
        pending, shares = (carry, None) if self.defer_residual else (None, carry)
        if logit_index is not None:
            index = logit_index[:, None, None].expand(-1, 1, h.shape[-1])
            h = h.gather(1, index)  # [n, 1, H]
            pending = None if pending is None else pending.gather(1, index)
            shares = None  # the shares are by row of the whole step: the norm takes its own pass
        if pending is not None:
            h = h + pending
        head, norm = self.target.lm_head, getattr(self.base, self.adapter.final_norm)
        if (self.matmul == "fused" and isinstance(head, nn.Linear) and is_rms_norm(norm, h.shape[-1])
                and norm.weight.dtype == h.dtype and skinny_fits(h.numel() // h.shape[-1])):
            if shares is not None:
                logits, _ = skinny_fused_stats_triton(h, head.weight, head.bias, norm_weight=norm.weight,
                                                      norm_eps=norm_eps(norm), stats_in=shares)
            else:
                logits = skinny_fused_triton(h, head.weight, head.bias, norm_weight=norm.weight,
                                             norm_eps=norm_eps(norm))
        else:
            logits = self.lm_head(norm(h))
        if self.adapter.logits is not None:  # what the causal LM's forward does to its head's output
            logits = self.adapter.logits(logits, self.text_config)
        return logits, torch.cat(captured, dim=-1) if captured else None
