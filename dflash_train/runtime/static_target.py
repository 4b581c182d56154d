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
- Attention (`cache_attention.py`): SDPA with each KV head's query heads folded into the query axis (no
  copy of K/V per query head), under a boolean mask built from positions (causal, plus the sliding window
  where the layer has one). With `kernels="triton"`, decode and verify steps (a few new tokens per row) run
  the split-key kernel of `dflash_train.kernels.static_attention` instead, given each query's first and last
  visible slot; prefill stays on SDPA. A layer with sink logits (gpt-oss's `self_attn.sinks`) hands them to
  the kernel, which folds them into its merge of the splits; off the kernel (prefill, `kernels="torch"`) it
  runs `_attention_reference`, the PyTorch reference, as does a layer with soft-capped scores (Gemma-2) on
  every step: the kernel has no cap. Each layer's scale is the one it passes (Gemma's, Granite's
  multiplier); every other argument a layer passes is refused unless `HANDLED_ELSEWHERE` says where it is
  honoured.
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

This module owns the runner: its settings and caches, which kernels its steps run, and the forward's entry
point. The forward pass itself, layer by layer and its compiled forms, is `target_forward.py`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from dflash_train.features.layer_ids import validate_target_layer_ids
from dflash_train.kernels.skinny_matmul import tuned_shapes
from dflash_train.kernels.static_attention import counters_for
from dflash_train.runtime.cache_attention import ATTENTION_NAME, register_attention, static_attention
from dflash_train.runtime.cache_layout import cache_layout, check_memory, sliding_window
from dflash_train.runtime.config import check_compile_scope
from dflash_train.runtime.experts import use_decode_experts
from dflash_train.runtime.fused_layer import FusedLayer, project
from dflash_train.runtime.latent_attention import absorbable, has_latent_attention
from dflash_train.runtime.linear_attention import LinearStates, token_mixer
from dflash_train.runtime.target_adapters import ADAPTERS, TargetAdapter, refusal
from dflash_train.runtime.target_forward import TargetForwardMixin
from dflash_train.target import TargetModel
from dflash_train.target.attention import attention_implementation

# The names other modules, tests and benchmarks import from here, wherever they now live.
__all__ = ["SKINNY_MATMULS", "SUPPORTED_MODEL_TYPES", "StaticTarget", "TargetOutput", "model_type",
           "static_attention", "supports"]

SKINNY_MATMULS = ("off", "tuned", "all")  # StaticTarget(skinny_matmul=...)

SUPPORTED_MODEL_TYPES = tuple(ADAPTERS)


def model_type(target: TargetModel) -> str:
    return getattr(target.config.get_text_config(), "model_type", type(target.model).__name__)


def supports(target: TargetModel) -> bool:
    """Whether the static-cache runtime can run this target (else: Hugging Face's own loops)."""
    return refusal(model_type(target), target.config.get_text_config()) is None


@dataclass
class TargetOutput:
    logits: torch.Tensor  # [n, T or 1, V]
    features: torch.Tensor | None  # [n, T, K*H]


def refuse_unsupported(target: TargetModel, config: Any, kernels: str) -> None:
    """One line for a target the static runtime does not cover (and what runs it instead), or unknown kernels."""
    if (why := refusal(model_type(target), config)) is not None:
        raise ValueError(
            f"the static-cache runtime supports {', '.join(SUPPORTED_MODEL_TYPES)} targets, not this "
            f"{model_type(target)!r} one: {why}; the decode engine runs others through their own forward and "
            f"caches (`dflash_train.runtime.hf_target.HFCacheTarget`)"
        )
    if kernels not in ("torch", "triton"):
        raise ValueError(f"kernels must be 'torch' or 'triton', not {kernels!r}")


class StaticTarget(TargetForwardMixin):
    """The target over static caches (module docstring): built here, with the settings that pick its steps'
    kernels; its forward pass is `TargetForwardMixin`'s."""

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
        refuse_unsupported(target, config, kernels)
        register_attention()
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
        self.batch_size, self.max_length, self.step_tokens = batch_size, max_length, step_tokens
        self._allocate_cache()
        device = target.device
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

    def _allocate_cache(self) -> None:
        """The static cache: [b, kv, max_len, D] keys and values per attention layer (as wide as the layer caches
        them), state rings per linear-attention layer; refused in one line if it cannot fit."""
        target, batch_size, max_length, step_tokens = self.target, self.batch_size, self.max_length, self.step_tokens
        layout = cache_layout(target)
        self.same_head_dims = layout.same_head_dims  # the split-key kernel reads keys and values of one width
        shape = (batch_size, layout.cache_heads, max_length, layout.key_dim)
        value_shape = (batch_size, layout.cache_heads, max_length, layout.value_dim)
        device, dtype = target.device, target.dtype
        linear, cached = layout.ring_kept, layout.cached
        check_memory(batch_size * layout.bytes_per_row(target, max_length, step_tokens), device, shape)
        self.keys = [torch.zeros(shape if keeps else (0,), dtype=dtype, device=device) for keeps in cached]
        self.values = [torch.zeros(value_shape if keeps else (0,), dtype=dtype, device=device) for keeps in cached]
        self.linear_states = [LinearStates(token_mixer(layer), batch_size, step_tokens, device, dtype) if is_linear
                              else None for layer, is_linear in zip(self.layers, linear, strict=True)]

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
