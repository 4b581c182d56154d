"""What the static-cache runtime does differently for each architecture it runs (`static_target.py`).

The runtime runs every decoder layer as the model's own module, with our attention function and a cache that
writes at positions, or, for the Llama family's layer, as `FusedLayer` (fused projections, Triton prologue).
Most of what differs between architectures happens inside their layers (norms after attention, NoPE layers,
RoPE on some layers only, soft-capped attention scores) and so comes with the module; the rest is done by the
model's own forward around the layers, and is what an adapter here says:

- `fused_layers`: whether `FusedLayer` computes the layer exactly (pre-attention and pre-MLP RMSNorms, separate
  q/k/v projections, optional q/k RMSNorms over each head, a SwiGLU MLP or an experts block); else the
  model's own layer runs;
- `embedding`: what the model's forward does to the embeddings (Granite's multiplier; Gemma's sqrt(hidden)
  lives in its embedding module, so it needs nothing here);
- `logits`: what the causal LM's forward does to the output projection (Gemma's tanh soft-cap, Cohere's scale,
  Granite's division);
- `rope_by_layer_type`: the rotary embedding gives one cos/sin per layer type (Gemma-3's local and global);
- `final_norm`: the name of the norm the model's forward applies after its last layer;
- `refuse`, `min_transformers_major`: configs or transformers versions the adapter does not match, which stay on
  the model's own forward and caches (`hf_target.py`).

Layers of the config's types "linear_attention" (Gated DeltaNet, Nemotron-H's Mamba-2), "conv" (LFM2's short
convolution) and "hybrid" (Falcon-H1's Mamba-2 beside attention) are run by the runtime itself on its state rings
(`linear_attention.py`), whatever the adapter.

The attention extras a layer hands the attention function (scaling, soft-cap, sinks) are honoured by
`cache_attention.static_attention`; sliding windows are in the masks, built per layer as the model builds them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import transformers

TRANSFORMERS_MAJOR = int(transformers.__version__.split(".")[0])

Transform = Callable[[torch.Tensor, Any], torch.Tensor]  # (tensor, text config) -> tensor


def multiplied_by(field: str, x: torch.Tensor, config: Any) -> torch.Tensor:
    return x * getattr(config, field)


def divided_by(field: str, x: torch.Tensor, config: Any) -> torch.Tensor:
    return x / getattr(config, field)


def soft_capped(field: str, x: torch.Tensor, config: Any) -> torch.Tensor:
    """cap * tanh(x / cap) in the model's own order of operations; no cap configured: x."""
    cap = getattr(config, field, None)
    return x if cap is None else torch.tanh(x / cap) * cap


def _runs_any(config: Any) -> str | None:
    return None


@dataclass(frozen=True)
class TargetAdapter:
    """One architecture's differences outside its decoder layers (module docstring)."""

    fused_layers: bool = False
    embedding: Transform | None = None
    logits: Transform | None = None
    rope_by_layer_type: bool = False
    final_norm: str = "norm"  # the base model's norm after the last layer (LFM2's is `embedding_norm`)
    refuse: Callable[[Any], str | None] = _runs_any  # why a config of this type cannot run exactly, or None
    # The oldest transformers major version whose modeling code the adapter matches: before 5, Gemma-2 scaled its
    # embeddings in the model's forward and Gemma-3's layers took a global and a local cos/sin.
    min_transformers_major: int = 4


LLAMA_FAMILY = TargetAdapter(fused_layers=True)


def own_layers(**differences: Any) -> TargetAdapter:
    """The model's own layers (their norms, residual scales, RoPE choices and projections are not FusedLayer's),
    as transformers 5 writes them."""
    return TargetAdapter(min_transformers_major=5, **differences)


def _bidirectional(config: Any) -> str | None:
    return "its attention is bidirectional" if getattr(config, "use_bidirectional_attention", False) else None


ADAPTERS: dict[str, TargetAdapter] = {
    "llama": LLAMA_FAMILY,
    "mistral": LLAMA_FAMILY,
    "qwen2": LLAMA_FAMILY,
    "qwen3": LLAMA_FAMILY,
    "qwen3_moe": LLAMA_FAMILY,
    "mixtral": LLAMA_FAMILY,
    "gpt_oss": LLAMA_FAMILY,  # sinks read off the attention module, half-width RoPE by the module's own function
    # q/k norms per head where configured, partial RoPE by the module's own function
    "glm4_moe": TargetAdapter(fused_layers=True, min_transformers_major=5),
    "phi3": own_layers(),  # q/k/v and gate/up are one product each already (qkv_proj, gate_up_proj)
    "olmo2": own_layers(),  # norms after attention and MLP, q/k norms over all heads at once
    "smollm3": own_layers(),  # NoPE layers: the attention module itself leaves RoPE out
    "exaone4": own_layers(),  # norms after attention and MLP; RoPE on sliding layers only
    "granite": own_layers(embedding=partial(multiplied_by, "embedding_multiplier"),
                          logits=partial(divided_by, "logits_scaling")),  # residual, attention scales in-layer
    "cohere2": own_layers(logits=partial(multiplied_by, "logit_scale")),  # parallel block, one LayerNorm
    "gemma2": own_layers(logits=partial(soft_capped, "final_logit_softcapping")),  # capped scores: in-layer
    "gemma3_text": own_layers(logits=partial(soft_capped, "final_logit_softcapping"), rope_by_layer_type=True,
                              refuse=_bidirectional),
    # Gated DeltaNet layers on the runtime's state rings (`linear_attention.py`), gated full attention as the
    # model's own layers; the text models of Qwen3.5 and Qwen3.5-MoE (their configs' text model types)
    "qwen3_next": own_layers(),
    "qwen3_5_text": own_layers(),
    "qwen3_5_moe_text": own_layers(),
    # short-convolution layers on the state rings too; attention layers as the model's own
    "lfm2": own_layers(final_norm="embedding_norm"),
    # Mamba-2 blocks on the state rings; attention (no RoPE), MLP and experts blocks as the model's own
    "nemotron_h": own_layers(final_norm="norm_f"),
    # Mamba-2 beside attention in every layer, the ring-kept mixer and our cache both; µP multipliers in-layer
    # multi-head latent attention: keys and values decompressed by its own layer, cached at their own head dims
    "deepseek_v3": own_layers(),
    "falcon_h1": own_layers(embedding=partial(multiplied_by, "embedding_multiplier"),
                            logits=partial(multiplied_by, "lm_head_multiplier"), final_norm="final_layernorm"),
}

# Rope types whose frequencies follow the longest position of the forward: in a batched step one row's RoPE
# would depend on how far the other rows are, unlike the same row decoded alone.
POSITION_DEPENDENT_ROPE = ("dynamic", "longrope")


def refusal(model_type: str, config: Any) -> str | None:
    """Why the static runtime cannot run this text config exactly, or None."""
    adapter = ADAPTERS.get(model_type)
    if adapter is None:
        return f"it has no adapter for {model_type!r} targets"
    if adapter.min_transformers_major > TRANSFORMERS_MAJOR:
        return f"its adapter follows transformers {adapter.min_transformers_major}'s modeling code"
    if any(kind in POSITION_DEPENDENT_ROPE for kind in rope_types(config)):
        return "its rope's frequencies depend on the step's longest position"
    return adapter.refuse(config)


def rope_types(config: Any) -> list[str]:
    """The rope types of a config: one, or one per layer type (Gemma-3's `rope_parameters` by layer type);
    transformers 4 kept them in `rope_scaling`, as "rope_type" or "type"."""
    parameters = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    tables = [parameters, *(p for p in parameters.values() if isinstance(p, dict))]
    return [kind for table in tables if (kind := table.get("rope_type", table.get("type"))) is not None]
