"""The target, run layer by layer over a static KV cache: fixed shapes, per-row positions, no host sync.

Supported layouts: the transformers causal LMs of `SUPPORTED_MODEL_TYPES` (embed_tokens -> decoder layers
with rotary position embeddings -> norm -> lm_head), each with an adapter (`target_adapters.py`) that says what
its model's forward does around the layers: embedding and logit scales, Gemma's logit soft-cap, Gemma-3's
rotary embedding per layer type. The Llama family's decoder layers (Llama, Mistral, Qwen2/3, their MoE kin,
gpt-oss, GLM-4-MoE) run with their q/k/v projections as one matmul and gate/up as another (`fused_layer.py`;
`fuse_projections=False` runs the Hugging Face layer itself); every other architecture's layers (Phi-3,
OLMo-2, Granite, SmolLM3, Gemma-2/3, Cohere-2, EXAONE-4: other norms, residual scales, NoPE layers) run as the
model's own modules, which call our attention function and write our cache. A config whose RoPE frequencies
follow the step's longest position (dynamic, longrope) is refused: in a batched step a row's RoPE would depend on
the other rows. The KV cache and the attention are ours:

- Cache: keys/values [b, kv_heads, max_len, D] per layer. A forward writes each token's K/V at the slot
  equal to its position, so rolling back after a rejection costs nothing: the next verify block starts at
  the first uncommitted position and overwrites the stale slots before any query can see them (a query at
  position p sees only slots <= p).
- Attention: SDPA with each KV head's query heads folded into the query axis (no copy of K/V per query
  head), under a boolean mask built from positions (causal, plus the sliding window where the layer has one).
  With `kernels="triton"`, decode and verify steps (a few new tokens per row) run the split-key kernel of
  `dflash_train.kernels.static_attention` instead, given each query's first and last visible slot; prefill
  stays on SDPA. A layer with sink logits (gpt-oss's `self_attn.sinks`) hands them to the kernel, which
  folds them into its merge of the splits; off the kernel (prefill, `kernels="torch"`) it runs
  `_attention_reference`, the PyTorch reference, as does a layer with soft-capped scores (Gemma-2) on every
  step: the kernel has no cap. Each layer's scale is the one it passes (Gemma's, Granite's multiplier); every
  other argument a layer passes is refused unless `HANDLED_ELSEWHERE` says where it is honoured.
- Attention prologue: with `kernels="triton"` and fused projections, the q/k norms (Qwen3), RoPE and the
  K/V cache write of a layer are one kernel (`dflash_train.kernels.rope_cache`, fed the rotary
  embedding's cos/sin); `fuse_prologue=False` keeps the PyTorch path, which stays the reference.
- Matmuls (with `kernels="triton"`): a step of at most `MAX_ROWS` rows (decode, verify, the drafter's logits)
  runs the fused layers' products and the output projection on `dflash_train.kernels.skinny_matmul` instead of
  cuBLAS where the kernel's tiling table was swept on this GPU's architecture (`skinny_matmul="tuned"`, the
  default: Qwen3-8B's five products, each level with or faster than cuBLAS on the GPU they were swept on), or
  for every product (`"all"`), or for none (`"off"`); prefill keeps torch's matmul. With `skinny_matmul="all"` and `skinny_fusion`
  too, those steps run each layer as four products of `dflash_train.kernels.skinny_fused` (RMSNorms, SwiGLU and
  residual adds folded in; the attention prologue in the q/k/v product's epilogue for small weights,
  `dflash_train.kernels.qkv_rope_cache`) and the final norm inside the output projection's.

Features for the drafter (outputs of `feature_layer_ids`, before the final norm) are read directly from the
layer loop: no hooks.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface

from dflash_train.features.layer_ids import validate_target_layer_ids
from dflash_train.kernels.skinny_fused import skinny_fused_stats_triton, skinny_fused_triton
from dflash_train.kernels.skinny_matmul import fits as skinny_fits
from dflash_train.kernels.skinny_matmul import stats_width, tuned_shapes
from dflash_train.kernels.static_attention import (
    bounds_from_positions,
    counters_for,
    fits,
    mask_from_bounds,
    static_attention_triton,
)
from dflash_train.runtime.cache_layout import cache_layout, check_memory, sliding_window
from dflash_train.runtime.config import check_compile_scope
from dflash_train.runtime.experts import use_decode_experts
from dflash_train.runtime.fused_layer import FusedLayer, is_rms_norm, norm_eps, project
from dflash_train.runtime.latent_attention import absorbable, has_latent_attention, latent_layer
from dflash_train.runtime.linear_attention import (
    LinearStates,
    gated_delta_forward,
    mamba2_forward,
    short_conv_forward,
    token_mixer,
)
from dflash_train.runtime.target_adapters import ADAPTERS, TargetAdapter, refusal
from dflash_train.target import TargetModel
from dflash_train.target.attention import attention_implementation

SKINNY_MATMULS = ("off", "tuned", "all")  # StaticTarget(skinny_matmul=...)

SUPPORTED_MODEL_TYPES = tuple(ADAPTERS)
ATTENTION_NAME = "dflash_static"


def model_type(target: TargetModel) -> str:
    return getattr(target.config.get_text_config(), "model_type", type(target.model).__name__)


def supports(target: TargetModel) -> bool:
    """Whether the static-cache runtime can run this target (else: Hugging Face's own loops)."""
    return refusal(model_type(target), target.config.get_text_config()) is None


# Keyword arguments layers hand the attention function beyond those it reads: each layer's sliding window is in
# its mask (built per layer as the model's own forward builds its masks), the others describe the call. Any other
# one is refused rather than ignored (a new transformers whose layers ask for more fails loudly).
HANDLED_ELSEWHERE = frozenset({"sliding_window", "position_ids", "use_cache", "cache_position"})


def static_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor,
    scaling: float | None = None,
    dropout: float = 0.0,
    softcap: float | None = None,
    s_aux: torch.Tensor | None = None,
    prefetch: torch.Tensor | None = None,
    counters: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """query [b, heads, T, D], key/value [b, kv_heads, S, D], mask [b, 1, T, S] bool -> ([b, T, heads, D], None).

    An integer mask is the Triton path's bounds [b, 2, T] (first and last visible slot of each query); there a
    `prefetch` weight (the fused layers' o_proj, `StaticTarget(prefetch_weights=True)`) is asked of L2 meanwhile,
    and the fused layers' `counters` let a plan that merges in its split kernel do so. The module's `sinks`
    [heads] (gpt-oss; `s_aux` where its own layer passes them), where it has them, join the softmax on either
    path. `softcap` (Gemma-2) caps the scores
    with cap * tanh(score / cap) before the mask, as the model's eager attention does; the kernel has no cap, so
    such a layer takes the PyTorch path, its mask made from the bounds."""
    _check_arguments(kwargs)
    b, heads, t, d = query.shape
    scale = scaling if scaling is not None else d ** -0.5
    sinks = s_aux if s_aux is not None else getattr(module, "sinks", None)  # the HF layer's, or the fused one's
    if attention_mask.dtype != torch.bool:
        if softcap is None:
            return static_attention_triton(query, key, value, attention_mask, scale, prefetch, counters,
                                           sinks=sinks), None
        attention_mask = mask_from_bounds(attention_mask, key.shape[2])
    kv_heads, keys = key.shape[1], key.shape[2]
    groups = heads // kv_heads
    # Query head i uses KV head i // groups: fold the group into the query axis instead of repeating K/V.
    q = query.reshape(b, kv_heads, groups * t, d)
    mask = attention_mask[:, :, None].expand(b, 1, groups, t, keys).reshape(b, 1, groups * t, keys)
    if sinks is not None or softcap is not None:
        out = _attention_reference(q, key, value, mask, scale, t, sinks=sinks, softcap=softcap)
    else:
        out = F.scaled_dot_product_attention(q, key, value, attn_mask=mask, scale=scaling)  # [b, kv, g*T, Dv]
    return out.reshape(b, heads, t, value.shape[-1]).transpose(1, 2), None


def _check_arguments(kwargs: dict[str, Any]) -> None:
    # the handled ones' values are never read: under torch.compile a read would specialise the layer's code on
    # them (a sliding layer's window, say) and compile it again for each
    unknown = sorted(name for name in kwargs if name not in HANDLED_ELSEWHERE and kwargs[name] is not None)
    if unknown:
        raise ValueError(f"the static runtime's attention does not implement {', '.join(unknown)}")


def _attention_reference(q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor, scale: float,
                         t: int, sinks: torch.Tensor | None = None, softcap: float | None = None) -> torch.Tensor:
    """Attention as the models' own eager functions compute it, with what SDPA has not: gpt-oss's sinks (one more
    logit per head that no value goes with) and Gemma-2's soft-capped scores. q [b, kv, g*T, D] grouped as above,
    sinks [heads] -> [b, kv, g*T, D]."""
    b, kv_heads, rows, _ = q.shape
    logits = (q @ key.transpose(-1, -2)).float() * scale  # [b, kv, g*T, S]
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    logits = logits.masked_fill(~mask, float("-inf"))
    if sinks is None:
        return logits.softmax(-1).to(value.dtype) @ value
    sink = sinks.float().reshape(kv_heads, -1, 1, 1).expand(kv_heads, rows // t, t, 1).reshape(1, kv_heads, rows, 1)
    weights = torch.cat([logits, sink.expand(b, -1, -1, -1)], dim=-1).softmax(-1)[..., :-1]
    return weights.to(value.dtype) @ value


def _register_attention() -> None:
    AttentionInterface.register(ATTENTION_NAME, static_attention)


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


@dataclass
class TargetOutput:
    logits: torch.Tensor  # [n, T or 1, V]
    features: torch.Tensor | None  # [n, T, K*H]


class StaticTarget:
    def __init__(self, target: TargetModel, batch_size: int, max_length: int, kernels: str = "torch",
                 fuse_projections: bool = True, fuse_prologue: bool = True, skinny_matmul: bool | str = "tuned",
                 skinny_fusion: bool = False, defer_residual: bool = True, prefetch_weights: bool = False,
                 carry_norm_stats: bool = False, decode_experts: bool = True, step_tokens: int = 16,
                 absorb_latent: bool = True) -> None:
        """`kernels`: "torch" (SDPA), or "triton" for the split-key kernel on decode and verify steps;
        `fuse_projections`: one matmul for q/k/v and one for gate/up per layer (no weight is copied);
        `fuse_prologue`: with "triton" and fused projections, q/k norms + RoPE + cache write in one kernel;
        `skinny_matmul`: with "triton", which products of steps with few rows run on the skinny-matmul kernel
        (the fused layers' and the output projection): "tuned" (those whose shape the kernel's table has
        tilings for, swept on this GPU's architecture), "all" (True) or "off" (False);
        `skinny_fusion`: with `skinny_matmul="all"`, those steps with the layers' norms, SwiGLU and residual adds folded
        into the products (`FusedLayer._fused_call`; residuals are then not deferred);
        `carry_norm_stats`: with `skinny_fusion`, each norm reads its rows' sums of squares as the product before
        it left them, in place of its own pass over x (`FusedLayer.carried`; experimental, opt-in);
        `decode_experts`: with "triton", a MoE target's experts on steps of few tokens run on the
        decode-experts kernel (`runtime/experts.py`), else on the implementation the model was loaded with;
        `defer_residual`: with fused projections, each layer's last residual add is done by the next layer
        (or the output) with its RMSNorm (`FusedLayer.deferred`): one kernel fewer per layer when layers
        are compiled one at a time;
        `prefetch_weights`: with "triton" and fused projections, the attention kernel of decode and verify steps
        asks L2 for the layer's o_proj weight while it reads the cache (`kernels/static_attention.py`; off by
        default: at Qwen3-8B's shape it cost the attention more than it saved the products, docs/benchmarks.md,
        'Asking L2 for o_proj's weight');
        `step_tokens`: the longest step (the verify block) whose tokens a hybrid target's linear-attention
        states can be taken back through (`linear_attention.py`); longer forwards are prompts, committed whole;
        `absorb_latent`: a latent-attention target's steps of at most `step_tokens` tokens attend in latent space,
        the up-projections moved to the queries (`latent_attention.py`), instead of expanding every cached slot."""
        config = target.config.get_text_config()
        if (why := refusal(model_type(target), config)) is not None:
            raise ValueError(
                f"the static-cache runtime supports {', '.join(SUPPORTED_MODEL_TYPES)} targets, not this "
                f"{model_type(target)!r} one: {why}; the decode engine runs others through their own forward and "
                f"caches (`dflash_train.runtime.hf_target.HFCacheTarget`)"
            )
        if kernels not in ("torch", "triton"):
            raise ValueError(f"kernels must be 'torch' or 'triton', not {kernels!r}")
        _register_attention()
        self.target, self.base, self.text_config = target, target.model.get_decoder(), config
        self.adapter: TargetAdapter = ADAPTERS[model_type(target)]
        self.layers = target.decoder_layers
        kv_heads = config.num_key_value_heads
        self.heads, self.kv_heads = config.num_attention_heads, kv_heads
        self.decode_experts = decode_experts
        self.kernels = kernels  # a property: also switches a MoE target's experts to the decode kernel
        self.fuse_prologue = fuse_prologue  # read at each forward: the engine may switch `kernels` to "torch"
        self.skinny_matmul = {True: "all", False: "off"}.get(skinny_matmul, skinny_matmul)  # type: ignore[call-overload]
        if self.skinny_matmul not in SKINNY_MATMULS:
            raise ValueError(f"skinny_matmul must be one of {', '.join(SKINNY_MATMULS)}, not {skinny_matmul!r}")
        self.skinny_fusion = skinny_fusion  # read at each forward, as `kernels`
        self.carry_norm_stats = carry_norm_stats
        self.prefetch_weights = prefetch_weights
        self.tuned_shapes = tuned_shapes(target.device)
        layout = cache_layout(target)
        self.same_head_dims = layout.same_head_dims  # the split-key kernel reads keys and values of one width
        shape = (batch_size, layout.cache_heads, max_length, layout.key_dim)
        value_shape = (batch_size, layout.cache_heads, max_length, layout.value_dim)
        device, dtype = target.device, target.dtype
        linear, cached = layout.ring_kept, layout.cached
        check_memory(batch_size * layout.bytes_per_row(target, max_length, step_tokens), device, shape)
        # [b, kv, max_len, D] per attention layer; a linear-attention layer keeps its state rings instead
        self.keys = [torch.zeros(shape if keeps else (0,), dtype=dtype, device=device) for keeps in cached]
        self.values = [torch.zeros(value_shape if keeps else (0,), dtype=dtype, device=device) for keeps in cached]
        self.linear_states = [LinearStates(token_mixer(layer), batch_size, step_tokens, device, dtype) if is_linear
                              else None for layer, is_linear in zip(self.layers, linear, strict=True)]
        self.batch_size, self.max_length, self.step_tokens = batch_size, max_length, step_tokens
        latent = [layer for layer in self.layers if has_latent_attention(layer)]
        self.absorb_latent = absorb_latent and bool(latent) and all(absorbable(layer) for layer in latent)
        self.all_rows = torch.arange(batch_size, device=device)
        self.attention_counters = counters_for(batch_size, kv_heads, device)  # for plans that merge in one launch
        self.slots = torch.arange(max_length, device=device)
        self.windows = [sliding_window(config, index) for index in range(len(self.layers))]
        # the key of each layer's cos/sin in what `_rotary` returns (Gemma-3: its layer type)
        self.rope_keys = [config.layer_types[i] if self.adapter.rope_by_layer_type else None
                          for i in range(len(self.layers))]
        params = inspect.signature(self.layers[0].forward).parameters
        self.cache_arg = "cache" if "cache" in params else "past_key_values"
        self._compiled_forward: dict[tuple[str, tuple[tuple[str, Any], ...]], Callable[..., Any]] = {}
        fuses = fuse_projections and self.adapter.fused_layers
        self.fused = [FusedLayer(layer, static_attention) for layer in self.layers] if fuses else None
        # Folded into the products' epilogues, the residual adds have nothing left to join.
        self.defer_residual = defer_residual and self.fused is not None and not (self.skinny_matmul == "all" and skinny_fusion)

    @property
    def kernels(self) -> str:
        return self._kernels

    @kernels.setter
    def kernels(self, kernels: str) -> None:
        """"triton" also runs the experts of a MoE target's steps of few tokens on the decode-experts kernel
        (`runtime/experts.py`); "torch" puts back the implementation the model had."""
        self._kernels = kernels
        use_decode_experts(self.target.model, enabled=kernels == "triton" and self.decode_experts)

    @property
    def attention(self) -> str:
        """The attention of decode and verify steps: "triton" (split-key kernel) or "sdpa"."""
        return "triton" if self.kernels == "triton" else "sdpa"

    @property
    def prologue(self) -> str:
        """The attention prologue of fused layers: "triton" (one kernel, for the layers it covers) or "torch"."""
        return "triton" if self.fused is not None and self.kernels == "triton" and self.fuse_prologue else "torch"

    @property
    def matmul(self) -> str:
        """The products of decode and verify steps: "fused" (the skinny kernel with norms and epilogues folded
        in), "skinny" (all on the skinny-matmul kernel), "tuned" (those of the tuned shapes on it, the others on
        cuBLAS) or "torch"."""
        if self.kernels != "triton" or self.skinny_matmul == "off":
            return "torch"
        if self.skinny_matmul == "tuned":
            return "tuned" if self.tuned_shapes else "torch"
        return "fused" if self.skinny_fusion and self.fused is not None else "skinny"

    @property
    def carries_norm_stats(self) -> bool:
        """Whether the fused products of decode and verify steps carry their norms' statistics."""
        return self.carry_norm_stats and self.matmul == "fused"

    @property
    def skinny_shapes(self) -> frozenset[tuple[int, int]] | None:
        """The weights [N, K] whose products of few rows run on the skinny-matmul kernel (None: every one)."""
        return {"torch": frozenset(), "tuned": self.tuned_shapes}.get(self.matmul)

    def cache_bytes(self) -> int:
        rings = [t for states in self.linear_states if states is not None for t in (states.states, states.inputs)]
        return sum(t.numel() * t.element_size() for t in self.keys + self.values + rings)

    @contextmanager
    def _our_attention(self) -> Iterator[None]:
        """Hugging Face layers (unfused) call our attention through their config, switched for the forward;
        fused layers call it directly and leave the shared config alone, so that other users of the model
        (another thread's `generate`, say) never see the switch."""
        if self.fused is not None:
            yield
            return
        with attention_implementation(self.target.model, ATTENTION_NAME):
            yield

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
        compile_scope: str = "step",
    ) -> TargetOutput:
        """input_ids/positions [n, T] for cache rows `row_index` [n] (None: all rows, n = batch).

        kv_len limits attention to the first slots (prefill); logit_index [n] picks one position per row
        for the logits (else all T); features [n, T, K*H] are the outputs of `feature_layer_ids`, in order.
        Writes K/V of every token at its position. `compiled` runs the forward through torch.compile (fixed
        shapes only: the decode cycle), with `compile_options` for inductor; `compile_scope` "step" compiles
        it as one graph, "layer" compiles one decoder layer whose code every layer reuses, and the embedding
        and the output as two small graphs (`dflash_train.runtime.config.COMPILE_SCOPES`).
        """
        ids = tuple(validate_target_layer_ids(feature_layer_ids, len(self.layers))) if feature_layer_ids else ()
        run = self._forward
        if compiled:
            run = (self._compiled_by_layer if check_compile_scope(compile_scope) == "layer" else self._compiled)(
                compile_options)
        with self._our_attention():
            logits, features = run(input_ids, positions, row_index, kv_len or self.max_length, logit_index, ids)
        return TargetOutput(logits, features)

    def _compiled(self, options: tuple[tuple[str, Any], ...] = ()) -> Callable[..., Any]:
        """The forward as one compiled graph (compile scope "step")."""
        if ("step", options) not in self._compiled_forward:
            self._compiled_forward["step", options] = _compile(self._forward, options)
        return self._compiled_forward["step", options]

    def _compiled_by_layer(self, options: tuple[tuple[str, Any], ...] = ()) -> Callable[..., Any]:
        """The forward with each of its parts compiled on its own, one code for every layer (scope "layer").
        The embedding and the output are compiled too, not left eager: each is a handful of small kernels
        (gather, RoPE tables, masks; final norm, logits) that a graph of its own fuses into a few launches, at a
        compile cost that does not grow with the depth either."""
        if ("layer", options) not in self._compiled_forward:
            parts = (self._embed, self._layer, self._output, self._linear_layer)
            regions = _Regions(*(_compile(part, options) for part in parts))
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

    def lm_head(self, h: torch.Tensor) -> torch.Tensor:
        """The target's output projection of h [..., H] (the drafter's hidden states too): on the skinny
        kernel for few rows where the runner asks for it (as `fused_layer.project`)."""
        head = self.target.lm_head
        return project(head, h, self.skinny_shapes)

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


def _compile(fn: Callable[..., Any], options: tuple[tuple[str, Any], ...]) -> Callable[..., Any]:
    return torch.compile(fn, dynamic=False, options=dict(options) or None)
