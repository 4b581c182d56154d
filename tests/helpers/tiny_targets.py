"""Tiny random targets for every architecture users train DFlash drafters for, built locally for CPU tests.

``build_tiny_target(name, vocab_size)`` gives a seeded random causal LM of ``name`` at toy size: 4 decoder
layers, hidden 64, 4 heads / 2 KV heads of head_dim 16, intermediate 128, 4 experts with 2 active, sliding
windows of 32 tokens, max_position_embeddings 4096. Names are transformers ``model_type``s (``qwen3_5`` and
``qwen3_5_moe`` build the text-only models), plus ``qwen3_yarn`` / ``deepseek_v3_yarn`` with the YaRN rope of
their published configs (gpt_oss has it by default). Each keeps what makes its architecture different
(sliding/full layer mix, logit soft-capping, embedding scaling, attention sinks, MLA, shared experts,
linear-attention / Mamba / conv layers...), so tests that extract target features, pack chats or
roll back caches run on all of them. ``TINY_TARGET_FAMILIES`` groups the names; the vocabulary is a
parameter so a real chat tokenizer (SmolLM2's 49,152 tokens) can drive them. No Hub access: configs only.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    Cohere2Config,
    DeepseekV3Config,
    Exaone4Config,
    FalconH1Config,
    Gemma2Config,
    Gemma3TextConfig,
    Glm4MoeConfig,
    GptOssConfig,
    GraniteConfig,
    Lfm2Config,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    NemotronHConfig,
    Olmo2Config,
    Phi3Config,
    PretrainedConfig,
    PreTrainedModel,
    Qwen2Config,
    Qwen3_5MoeTextConfig,
    Qwen3_5TextConfig,
    Qwen3Config,
    Qwen3MoeConfig,
    Qwen3NextConfig,
    SmolLM3Config,
)

HIDDEN = 64
LAYERS = 4
HEADS = 4
KV_HEADS = 2
HEAD_DIM = 16
INTERMEDIATE = 128
EXPERTS = 4
ACTIVE_EXPERTS = 2
WINDOW = 32
MAX_POSITIONS = 4096

# Shared toy sizes; each is passed only to config classes that declare the field.
_TOY: dict[str, Any] = {
    "hidden_size": HIDDEN,
    "num_hidden_layers": LAYERS,
    "num_attention_heads": HEADS,
    "num_key_value_heads": KV_HEADS,
    "head_dim": HEAD_DIM,
    "intermediate_size": INTERMEDIATE,
    "max_position_embeddings": MAX_POSITIONS,
}

# YaRN as published (Qwen3 long-context, DeepSeek-V3, gpt-oss), shrunk: 1024 trained positions x 4 = 4096.
_YARN: dict[str, Any] = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}

_SLIDING, _FULL = "sliding_attention", "full_attention"
_MOE = {"num_experts": EXPERTS, "num_experts_per_tok": ACTIVE_EXPERTS, "moe_intermediate_size": INTERMEDIATE}
_GATED_DELTANET = {  # Qwen3-Next / Qwen3.5 linear-attention layers (3 linear, then 1 full by default)
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": HEAD_DIM,
    "linear_value_head_dim": HEAD_DIM,
}
_DEEPSEEK_MLA = {  # q/kv low-rank projections, decoupled 8-dim rope part, first layer dense
    "q_lora_rank": 48,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 8,
    "qk_rope_head_dim": 8,
    "v_head_dim": HEAD_DIM,
    "num_key_value_heads": HEADS,
    "n_routed_experts": EXPERTS,
    "num_experts_per_tok": ACTIVE_EXPERTS,
    "moe_intermediate_size": INTERMEDIATE,
    "n_group": 2,
    "topk_group": 1,
    "first_k_dense_replace": 1,
}

_SPECS: dict[str, tuple[type[PretrainedConfig], dict[str, Any]]] = {
    # dense, full attention everywhere
    "llama": (LlamaConfig, {}),
    "qwen2": (Qwen2Config, {}),
    "qwen3": (Qwen3Config, {}),
    "qwen3_yarn": (Qwen3Config, {"rope_parameters": {**_YARN, "rope_theta": 1_000_000.0}}),
    "phi3": (Phi3Config, {}),
    "olmo2": (Olmo2Config, {}),
    # Granite 3.x multipliers (embedding x12, logits / 8, residual x0.22, attention 1/head_dim), tied.
    "granite": (
        GraniteConfig,
        {"embedding_multiplier": 12.0, "logits_scaling": 8.0, "residual_multiplier": 0.22}
        | {"attention_multiplier": 1 / HEAD_DIM, "tie_word_embeddings": True},
    ),
    "smollm3": (SmolLM3Config, {}),  # every 4th layer has no rope (NoPE)
    # sliding-window layers
    "mistral": (MistralConfig, {"sliding_window": WINDOW}),  # every layer slides
    "gemma2": (Gemma2Config, {"sliding_window": WINDOW, "query_pre_attn_scalar": HEAD_DIM}),  # S F S F
    "gemma3_text": (
        Gemma3TextConfig,
        {"sliding_window": WINDOW, "query_pre_attn_scalar": HEAD_DIM}
        | {"layer_types": [_SLIDING, _SLIDING, _SLIDING, _FULL]},  # 5:1 published, 3:1 here
    ),
    "cohere2": (Cohere2Config, {"sliding_window": WINDOW}),  # S S S F
    "exaone4": (Exaone4Config, {"sliding_window": WINDOW}),  # S S S F
    # mixture of experts
    "qwen3_moe": (Qwen3MoeConfig, _MOE | {"norm_topk_prob": True}),
    "mixtral": (MixtralConfig, {"num_local_experts": EXPERTS, "num_experts_per_tok": ACTIVE_EXPERTS}),
    # as published: yarn rope, attention sinks, S F S F; intermediate_size is the expert size
    "gpt_oss": (
        GptOssConfig,
        {"num_local_experts": EXPERTS, "num_experts_per_tok": ACTIVE_EXPERTS, "sliding_window": WINDOW}
        | {"rope_parameters": {**_YARN, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False}},
    ),
    "glm4_moe": (
        Glm4MoeConfig,
        {
            "n_routed_experts": EXPERTS,
            "num_experts_per_tok": ACTIVE_EXPERTS,
            "moe_intermediate_size": INTERMEDIATE,
        }
        | {"first_k_dense_replace": 1, "use_qk_norm": True},
    ),
    # multi-head latent attention
    "deepseek_v3": (DeepseekV3Config, _DEEPSEEK_MLA),
    "deepseek_v3_yarn": (
        DeepseekV3Config,
        _DEEPSEEK_MLA
        | {
            "rope_parameters": {
                **_YARN,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
            }
        },
    ),
    # hybrid: linear attention / Mamba / short convolutions mixed with full attention
    "qwen3_next": (
        Qwen3NextConfig,
        _GATED_DELTANET | _MOE | {"shared_expert_intermediate_size": INTERMEDIATE},
    ),
    "qwen3_5": (Qwen3_5TextConfig, _GATED_DELTANET),
    "qwen3_5_moe": (
        Qwen3_5MoeTextConfig,
        _GATED_DELTANET | _MOE | {"shared_expert_intermediate_size": INTERMEDIATE},
    ),
    # every layer runs attention and Mamba-2 in parallel; muP multipliers like Falcon-H1-0.5B's
    "falcon_h1": (
        FalconH1Config,
        {"mamba_d_ssm": 2 * HIDDEN, "mamba_n_heads": 8, "mamba_d_state": 16, "mamba_chunk_size": WINDOW}
        | {"embedding_multiplier": 5.656854, "lm_head_multiplier": 0.0390625},
    ),
    # Mamba-2, MoE, attention, MLP blocks ("ME*-" in the published pattern notation)
    "nemotron_h": (
        NemotronHConfig,
        {"layers_block_type": ["linear_attention", "moe", _FULL, "mlp"], "mamba_num_heads": 8}
        | {"mamba_head_dim": HEAD_DIM, "ssm_state_size": 16, "n_groups": 1, "chunk_size": WINDOW}
        | {"n_routed_experts": EXPERTS, "num_experts_per_tok": ACTIVE_EXPERTS}
        | {"moe_intermediate_size": INTERMEDIATE, "moe_shared_expert_intermediate_size": INTERMEDIATE},
    ),
    "lfm2": (
        Lfm2Config,
        {"layer_types": ["conv", "conv", _FULL, "conv"], "block_auto_adjust_ff_dim": False},
    ),
}

TINY_TARGET_FAMILIES: dict[str, tuple[str, ...]] = {
    "dense": ("llama", "qwen2", "qwen3", "qwen3_yarn", "phi3", "olmo2", "granite", "smollm3"),
    "sliding": ("mistral", "gemma2", "gemma3_text", "cohere2", "exaone4", "gpt_oss"),
    "moe": ("qwen3_moe", "mixtral", "gpt_oss", "glm4_moe", "deepseek_v3", "qwen3_next", "qwen3_5_moe"),
    "mla": ("deepseek_v3", "deepseek_v3_yarn"),
    "hybrid": ("qwen3_next", "qwen3_5", "qwen3_5_moe", "falcon_h1", "nemotron_h", "lfm2"),
}
"""Overlapping groups: gpt_oss is sliding and MoE; deepseek_v3 MLA and MoE; qwen3_next, qwen3_5_moe hybrid
and MoE (nemotron_h has one MoE block too)."""

TINY_TARGETS: tuple[str, ...] = tuple(_SPECS)


def tiny_target_config(model_type: str, *, vocab_size: int, **overrides: Any) -> PretrainedConfig:
    """The toy config of ``model_type`` (a key of ``TINY_TARGETS``) with ``vocab_size`` rows; ``overrides``
    win over everything. Token ids (bos/eos/pad) are unset: pass them as overrides when a test needs them."""
    if model_type not in _SPECS:
        raise ValueError(f"Unknown tiny target {model_type!r}; use one of {', '.join(TINY_TARGETS)}.")
    config_class, spec = _SPECS[model_type]
    declared = config_class.__dataclass_fields__
    toy = {key: value for key, value in _TOY.items() if key in declared}
    ids = {key: None for key in ("bos_token_id", "eos_token_id", "pad_token_id") if key in declared}
    return config_class(**(toy | ids | spec | {"vocab_size": vocab_size} | overrides))


def build_tiny_target(
    model_type: str,
    vocab_size: int,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    **overrides: Any,
) -> PreTrainedModel:
    """A seeded random causal LM of ``model_type`` in eval mode (``AutoModelForCausalLM.from_config``)."""
    config = tiny_target_config(model_type, vocab_size=vocab_size, **overrides)
    # Soft-capped attention scores are the eager attention's alone: some transformers versions would run such a
    # model on SDPA, which drops the cap, and the model's own forward would no longer be a reference.
    softcapped = getattr(config, "attn_logit_softcapping", None) is not None
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype,
                                                 **({"attn_implementation": "eager"} if softcapped else {}))
    return model.eval()
