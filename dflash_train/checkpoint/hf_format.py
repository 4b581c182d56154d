"""The published checkpoint layout (docs/design.md §9): `config.json` <-> `DFlashConfig`, tensor names/shapes.

`config.json` is Qwen3Config-shaped so that `AutoConfig` and every runtime read it as is. Each
DFlash setting is written where some runtime looks for it:

    block_size, num_target_layers              top level (the z-lab remote code reads both there)
    dflash_config.{mask_token_id,              SGLang and vLLM read these
                   target_layer_ids, block_size}
    rope_theta (+ rope_scaling)                top level (vLLM silently uses 1e6 when it is absent)
    rope_parameters                            transformers 5 reads rope settings from here

Tensor names carry no prefix (vLLM prepends `model.` itself); they equal `DFlashDraftModel`'s
state-dict names.
"""

from __future__ import annotations

from typing import Any

import transformers

from dflash_train.models import DFlashConfig

ARCHITECTURE = "DFlashDraftModel"
AUTO_MAP = {"AutoModel": "dflash.DFlashDraftModel"}
REMOTE_CODE_FILE = "dflash.py"
# vLLM gives this key priority over dflash_config.target_layer_ids and does not shift it by one.
FORBIDDEN_KEYS = ("eagle_aux_hidden_state_layer_ids",)
# Keys a source config.json may carry that must not survive into a new one.
DROPPED_SOURCE_KEYS = (*FORBIDDEN_KEYS, "_name_or_path", "quantization_config")

DTYPE_NAMES = {"bfloat16", "float16", "float32"}


def config_to_hf(config: DFlashConfig, dtype_name: str = "bfloat16") -> dict[str, Any]:
    """The `config.json` dict of a drafter whose tensors are stored as `dtype_name`."""
    layers = config.num_hidden_layers
    scaling = dict(config.rope_scaling) if config.rope_scaling else None
    return {
        "architectures": [ARCHITECTURE],
        "auto_map": dict(AUTO_MAP),
        "model_type": "qwen3",
        "attention_bias": config.attention_bias,
        "attention_dropout": 0.0,
        "block_size": config.block_size,
        "dflash_config": {
            "mask_token_id": config.mask_token_id,
            "target_layer_ids": list(config.target_layer_ids),
            "block_size": config.block_size,
        },
        # transformers 4.x reads `torch_dtype`, 5.x `dtype`.
        "dtype": dtype_name,
        "torch_dtype": dtype_name,
        "head_dim": config.head_dim,
        "hidden_act": config.hidden_act,
        "hidden_size": config.hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": config.intermediate_size,
        "layer_types": ["full_attention"] * layers,
        "max_position_embeddings": config.max_position_embeddings,
        "max_window_layers": layers,
        "num_attention_heads": config.num_attention_heads,
        "num_hidden_layers": layers,
        "num_key_value_heads": config.num_key_value_heads,
        "num_target_layers": config.num_target_layers,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_parameters": _rope_parameters(config.rope_theta, scaling),
        "rope_scaling": scaling,
        "rope_theta": config.rope_theta,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "transformers_version": transformers.__version__,
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": config.vocab_size,
    }


def _rope_parameters(theta: float, scaling: dict[str, Any] | None) -> dict[str, Any]:
    params = dict(scaling or {})
    params["rope_type"] = params.pop("type", params.get("rope_type", "default"))
    params["rope_theta"] = theta
    return params


def config_from_hf(hf: dict[str, Any]) -> DFlashConfig:
    """Read our `config.json` or a published z-lab one (DFlash keys at top level or in `dflash_config`)."""
    dflash = hf.get("dflash_config") or {}
    if not isinstance(dflash, dict):
        raise ValueError(f"dflash_config must be a JSON object, got {type(dflash).__name__}")
    missing = [key for key in _REQUIRED_ARCH_KEYS if key not in hf]
    if missing:
        raise ValueError(f"config.json lacks {missing}; it is not a DFlash drafter config")
    mask = _first_present("mask_token_id", dflash, hf)
    if mask is None:
        raise ValueError("config.json has no dflash_config.mask_token_id; add the target's mask token id")
    block = _first_present("block_size", hf, dflash)
    theta, scaling = read_rope(hf)
    heads = int(hf["num_attention_heads"])
    return DFlashConfig(
        hidden_size=int(hf["hidden_size"]),
        num_hidden_layers=int(hf["num_hidden_layers"]),
        num_attention_heads=heads,
        num_key_value_heads=int(hf.get("num_key_value_heads") or heads),
        head_dim=int(hf.get("head_dim") or int(hf["hidden_size"]) // heads),
        intermediate_size=int(hf["intermediate_size"]),
        vocab_size=int(hf["vocab_size"]),
        num_target_layers=int(hf["num_target_layers"]),
        mask_token_id=int(mask),
        block_size=int(block) if block is not None else 16,
        # Published remote code falls back to the default spread when no ids are given; so does DFlashConfig.
        target_layer_ids=list(_first_present("target_layer_ids", dflash, hf) or []),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=int(hf.get("max_position_embeddings", 40960)),
        attention_bias=bool(hf.get("attention_bias", False)),
        hidden_act=str(hf.get("hidden_act", "silu")),
    )


_REQUIRED_ARCH_KEYS = (
    "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size",
    "num_target_layers",
)


def _first_present(key: str, *sources: dict[str, Any]) -> Any:
    for source in sources:
        if source.get(key) is not None:
            return source[key]
    return None


def read_rope(hf: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from a transformers 4.x (top level) or 5.x (`rope_parameters`) config."""
    params = hf.get("rope_parameters")
    if isinstance(params, dict) and "rope_theta" in params:
        theta = float(params["rope_theta"])
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    elif hf.get("rope_theta") is not None:
        theta = float(hf["rope_theta"])
        scaling = dict(hf["rope_scaling"]) if hf.get("rope_scaling") else {}
    else:
        raise ValueError("config.json has no rope_theta; add the target's rope_theta at top level")
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    return theta, (scaling if rope_type != "default" else None)


def expected_tensor_shapes(config: DFlashConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor an exported drafter must hold, by name, with its shape (nothing else is allowed)."""
    return tensor_shapes(
        hidden=config.hidden_size, layers=config.num_hidden_layers, heads=config.num_attention_heads,
        kv_heads=config.num_key_value_heads, head_dim=config.head_dim, intermediate=config.intermediate_size,
        num_features=config.num_context_features, attention_bias=config.attention_bias,
    )


def tensor_shapes(
    *, hidden: int, layers: int, heads: int, kv_heads: int, head_dim: int, intermediate: int,
    num_features: int, attention_bias: bool = False,
) -> dict[str, tuple[int, ...]]:
    h, d = hidden, head_dim
    q_out, kv_out = heads * d, kv_heads * d
    shapes: dict[str, tuple[int, ...]] = {
        "fc.weight": (h, num_features * h),
        "hidden_norm.weight": (h,),
        "norm.weight": (h,),
    }
    for i in range(layers):
        p = f"layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q_out, h),
            p + "self_attn.k_proj.weight": (kv_out, h),
            p + "self_attn.v_proj.weight": (kv_out, h),
            p + "self_attn.o_proj.weight": (h, q_out),
            p + "self_attn.q_norm.weight": (d,),
            p + "self_attn.k_norm.weight": (d,),
            p + "mlp.gate_proj.weight": (intermediate, h),
            p + "mlp.up_proj.weight": (intermediate, h),
            p + "mlp.down_proj.weight": (h, intermediate),
        }
        if attention_bias:
            shapes |= {p + f"self_attn.{n}_proj.bias": (s,) for n, s in
                       (("q", q_out), ("k", kv_out), ("v", kv_out), ("o", h))}
    return shapes


def merge_source_config(generated: dict[str, Any], source: dict[str, Any] | None) -> dict[str, Any]:
    """`generated`, plus the keys of a source config.json it does not set (bos/eos ids, notes, ...).

    Generated keys win, so a stale or wrong source value never survives; forbidden keys are dropped.
    """
    merged = {k: v for k, v in (source or {}).items() if k not in generated and k not in DROPPED_SOURCE_KEYS}
    merged.update(generated)
    return dict(sorted(merged.items()))
