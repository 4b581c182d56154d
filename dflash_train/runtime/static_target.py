"""The target, run layer by layer over a static KV cache: fixed shapes, per-row positions, no host sync.

Supported layouts: Llama, Mistral, Qwen2, Qwen3 in transformers (embed_tokens -> decoder layers with
rotary position embeddings -> norm -> lm_head). Each decoder layer runs with its q/k/v projections as one
matmul and gate/up as another (`fused_layer.py`; `fuse_projections=False` runs the Hugging Face layer
itself, with our attention function); the KV cache and the attention are ours:

- Cache: keys/values [b, kv_heads, max_len, D] per layer. A forward writes each token's K/V at the slot
  equal to its position, so rolling back after a rejection costs nothing: the next verify block starts at
  the first uncommitted position and overwrites the stale slots before any query can see them (a query at
  position p sees only slots <= p).
- Attention: SDPA with each KV head's query heads folded into the query axis (no copy of K/V per query
  head), under a boolean mask built from positions (causal, plus the sliding window where the layer has one).
  With `kernels="triton"`, decode and verify steps (a few new tokens per row) run the split-key kernel of
  `dflash_train.kernels.static_attention` instead, given each query's first and last visible slot; prefill
  stays on SDPA.
- Attention prologue: with `kernels="triton"` and fused projections, the q/k norms (Qwen3), RoPE and the
  K/V cache write of a layer are one kernel (`dflash_train.kernels.rope_cache`, fed the rotary
  embedding's cos/sin); `fuse_prologue=False` keeps the PyTorch path, which stays the reference.

Features for the drafter (outputs of `feature_layer_ids`, before the final norm) are read directly from the
layer loop: no hooks.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface

from dflash_train.kernels.static_attention import bounds_from_positions, fits, static_attention_triton
from dflash_train.runtime.fused_layer import FusedLayer
from dflash_train.target import TargetModel, validate_target_layer_ids

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
ATTENTION_NAME = "dflash_static"
MEMORY_HEADROOM = 0.9  # share of the free device memory the caches may take


def model_type(target: TargetModel) -> str:
    return getattr(target.config.get_text_config(), "model_type", type(target.model).__name__)


def supports(target: TargetModel) -> bool:
    """Whether the static-cache runtime can run this target (else: Hugging Face's own loops)."""
    return model_type(target) in SUPPORTED_MODEL_TYPES


def static_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """query [b, heads, T, D], key/value [b, kv_heads, S, D], mask [b, 1, T, S] bool -> ([b, T, heads, D], None).

    An integer mask is the Triton path's bounds [b, 2, T] (first and last visible slot of each query)."""
    b, heads, t, d = query.shape
    if attention_mask.dtype != torch.bool:
        scale = scaling if scaling is not None else d ** -0.5
        return static_attention_triton(query, key, value, attention_mask, scale), None
    kv_heads, keys = key.shape[1], key.shape[2]
    groups = heads // kv_heads
    # Query head i uses KV head i // groups: fold the group into the query axis instead of repeating K/V.
    q = query.reshape(b, kv_heads, groups * t, d)
    mask = attention_mask[:, :, None].expand(b, 1, groups, t, keys).reshape(b, 1, groups * t, keys)
    out = F.scaled_dot_product_attention(q, key, value, attn_mask=mask, scale=scaling)  # [b, kv, g*T, D]
    return out.reshape(b, heads, t, d).transpose(1, 2), None


def _register_attention() -> None:
    AttentionInterface.register(ATTENTION_NAME, static_attention)


class _WriteCache:
    """The cache object handed to the layers: `update` writes K/V at the tokens' positions (Hugging Face
    layers and the PyTorch path of fused ones); the fused prologue kernel writes `storage` itself."""

    def __init__(self, runner: StaticTarget, row_index: torch.Tensor | None, positions: torch.Tensor,
                 kv_len: int) -> None:
        self.runner, self.row_index, self.positions, self.kv_len = runner, row_index, positions, kv_len
        self.rows = runner.all_rows if row_index is None else row_index  # [n]
        self.fused_prologue = runner.kernels == "triton" and runner.fuse_prologue

    def storage(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's whole cache, keys and values [b, kv, max_len, D]."""
        return self.runner.keys[layer_idx], self.runner.values[layer_idx]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = self.storage(layer_idx)
        keys[self.rows[:, None], :, self.positions] = key_states.transpose(1, 2)  # [n, T, kv, D] at (row, position)
        values[self.rows[:, None], :, self.positions] = value_states.transpose(1, 2)
        return self.visible(layer_idx)

    def visible(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The slots attention may read, [n, kv, kv_len, D], for the forward's rows."""
        keys, values = self.storage(layer_idx)
        if self.row_index is None:
            return keys[:, :, : self.kv_len], values[:, :, : self.kv_len]
        return keys[self.row_index, :, : self.kv_len], values[self.row_index, :, : self.kv_len]


@dataclass
class TargetOutput:
    logits: torch.Tensor  # [n, T or 1, V]
    features: torch.Tensor | None  # [n, T, K*H]


class StaticTarget:
    def __init__(self, target: TargetModel, batch_size: int, max_length: int, kernels: str = "torch",
                 fuse_projections: bool = True, fuse_prologue: bool = True) -> None:
        """`kernels`: "torch" (SDPA), or "triton" for the split-key kernel on decode and verify steps;
        `fuse_projections`: one matmul for q/k/v and one for gate/up per layer (no weight is copied);
        `fuse_prologue`: with "triton" and fused projections, q/k norms + RoPE + cache write in one kernel."""
        if not supports(target):
            raise ValueError(
                f"the static-cache runtime supports {', '.join(SUPPORTED_MODEL_TYPES)} targets, not "
                f"{model_type(target)!r}; use the plain loop `dflash_train.inference.generate_greedy` for others"
            )
        if kernels not in ("torch", "triton"):
            raise ValueError(f"kernels must be 'torch' or 'triton', not {kernels!r}")
        _register_attention()
        self.target, self.base = target, target.model.get_decoder()
        self.layers = target.decoder_layers
        attn = self.layers[0].self_attn
        kv_heads = attn.k_proj.out_features // attn.head_dim
        self.kernels, self.heads, self.kv_heads = kernels, attn.q_proj.out_features // attn.head_dim, kv_heads
        self.fuse_prologue = fuse_prologue  # read at each forward: the engine may switch `kernels` to "torch"
        shape = (batch_size, kv_heads, max_length, attn.head_dim)
        device, dtype = target.device, target.dtype
        _check_memory(2 * len(self.layers) * torch.Size(shape).numel() * dtype.itemsize, device, shape)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in self.layers]  # [b, kv, max_len, D]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in self.layers]
        self.batch_size, self.max_length = batch_size, max_length
        self.all_rows = torch.arange(batch_size, device=device)
        self.slots = torch.arange(max_length, device=device)
        self.windows = [_sliding_window(layer, target.config.get_text_config()) for layer in self.layers]
        params = inspect.signature(self.layers[0].forward).parameters
        self.cache_arg = "cache" if "cache" in params else "past_key_values"
        self._configs = list({id(layer.self_attn.config): layer.self_attn.config for layer in self.layers}.values())
        self._compiled_forward: dict[tuple[tuple[str, Any], ...], Any] = {}
        self.fused = [FusedLayer(layer, static_attention) for layer in self.layers] if fuse_projections else None

    @property
    def attention(self) -> str:
        """The attention of decode and verify steps: "triton" (split-key kernel) or "sdpa"."""
        return "triton" if self.kernels == "triton" else "sdpa"

    @property
    def prologue(self) -> str:
        """The attention prologue of fused layers: "triton" (one kernel, for the layers it covers) or "torch"."""
        return "triton" if self.fused is not None and self.kernels == "triton" and self.fuse_prologue else "torch"

    def cache_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)

    @contextmanager
    def _our_attention(self) -> Iterator[None]:
        """Hugging Face layers (unfused) call our attention through their config, switched for the forward;
        fused layers call it directly and leave the shared config alone, so that other users of the model
        (another thread's `generate`, say) never see the switch."""
        if self.fused is not None:
            yield
            return
        saved = [config._attn_implementation for config in self._configs]
        for config in self._configs:
            config._attn_implementation = ATTENTION_NAME
        try:
            yield
        finally:
            for config, name in zip(self._configs, saved, strict=True):
                config._attn_implementation = name

    def _masks(self, positions: torch.Tensor, kv_len: int) -> dict[int | None, torch.Tensor]:
        """One [n, 1, T, kv_len] bool mask per distinct sliding window (None = full causal), or on the
        Triton path one [n, 2, T] int32 bounds tensor per window."""
        if self.kernels == "triton" and fits(self.heads, self.kv_heads, positions.shape[1]):
            return {window: bounds_from_positions(positions, window) for window in dict.fromkeys(self.windows)}
        slots, query = self.slots[None, None, :kv_len], positions[:, :, None]
        masks = {}
        for window in dict.fromkeys(self.windows):  # ordered, so compiled graphs trace the same way each time
            visible = slots <= query
            if window is not None:  # transformers' sliding window: key > query - window
                visible = visible & (slots > query - window)
            masks[window] = visible[:, None]
        return masks

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        row_index: torch.Tensor | None = None,
        kv_len: int | None = None,
        logit_index: torch.Tensor | None = None,
        feature_layer_ids: Sequence[int] = (),
        compiled: bool = False,
        compile_options: tuple[tuple[str, Any], ...] = (),
    ) -> TargetOutput:
        """input_ids/positions [n, T] for cache rows `row_index` [n] (None: all rows, n = batch).

        kv_len limits attention to the first slots (prefill); logit_index [n] picks one position per row
        for the logits (else all T); features [n, T, K*H] are the outputs of `feature_layer_ids`, in order.
        Writes K/V of every token at its position. `compiled` runs the layers through torch.compile
        (fixed shapes only: the decode cycle), with `compile_options` for inductor.
        """
        ids = tuple(validate_target_layer_ids(feature_layer_ids, len(self.layers))) if feature_layer_ids else ()
        run = self._compiled(compile_options) if compiled else self._forward
        with self._our_attention():
            logits, features = run(input_ids, positions, row_index, kv_len or self.max_length, logit_index, ids)
        return TargetOutput(logits, features)

    def _compiled(self, options: tuple[tuple[str, Any], ...] = ()) -> Any:
        if options not in self._compiled_forward:
            self._compiled_forward[options] = torch.compile(self._forward, dynamic=False, options=dict(options) or None)
        return self._compiled_forward[options]

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, row_index: torch.Tensor | None,
                 kv_len: int, logit_index: torch.Tensor | None,
                 feature_layer_ids: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
        cache = _WriteCache(self, row_index, positions, kv_len)
        masks = self._masks(positions, kv_len)
        captured: dict[int, torch.Tensor] = {}
        h = self.base.embed_tokens(input_ids)
        position_embeddings = self.base.rotary_emb(h, positions)
        for index, layer in enumerate(self.layers):
            mask = masks[self.windows[index]]
            if self.fused is not None:
                h = self.fused[index](h, position_embeddings, mask, cache)
            else:
                out = layer(h, attention_mask=mask, position_ids=positions, position_embeddings=position_embeddings,
                            use_cache=True, **{self.cache_arg: cache})
                h = out[0] if isinstance(out, tuple) else out
            if index in feature_layer_ids:
                captured[index] = h
        if logit_index is not None:
            h = h.gather(1, logit_index[:, None, None].expand(-1, 1, h.shape[-1]))  # [n, 1, H]
        logits = self.target.lm_head(self.base.norm(h))
        features = torch.cat([captured[i] for i in feature_layer_ids], dim=-1) if feature_layer_ids else None
        return logits, features

    @torch.no_grad()
    def compare_with_hf(self, ids: Sequence[int]) -> dict[str, float]:
        """This runner's logits against the model's own forward on one prompt (overwrites cache row 0):
        guards against a transformers version whose layers behave differently from the ones tested."""
        input_ids = torch.tensor([list(ids)], device=self.target.device)
        reference = self.target.model(input_ids).logits[0].float()  # [P, V]
        positions = torch.arange(len(ids), device=self.target.device)[None]
        ours = self.forward(input_ids, positions, row_index=self.all_rows[:1], kv_len=len(ids)).logits[0].float()
        agreement = (reference.argmax(-1) == ours.argmax(-1)).float().mean()
        return {"max_abs_logit_diff": float((reference - ours).abs().max()), "argmax_agreement": float(agreement)}


def _check_memory(needed: int, device: torch.device, shape: tuple[int, ...]) -> None:
    """A clear error before allocating caches that cannot fit, instead of an out-of-memory traceback."""
    if device.type != "cuda":
        return
    free, _ = torch.cuda.mem_get_info(device)
    if needed > MEMORY_HEADROOM * free:
        rows, _, positions, _ = shape
        raise ValueError(f"the KV cache of {rows} rows x {positions} positions needs {needed / 2**30:.1f} GiB, "
                         f"{free / 2**30:.1f} GiB are free: lower the batch size or the prompt and answer lengths")


def _sliding_window(layer: nn.Module, config: Any) -> int | None:
    """The layer's sliding window as transformers applies it (per-layer attribute, else Mistral's config)."""
    attn = layer.self_attn
    if hasattr(attn, "sliding_window"):
        return attn.sliding_window
    if getattr(config, "layer_types", None) is None:
        return getattr(config, "sliding_window", None)
    return None
