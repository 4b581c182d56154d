"""Configuration of a DFlash drafter.

The fields mirror the Qwen3-shaped `config.json` of published DFlash checkpoints, plus the
DFlash-specific ones (`block_size`, `num_target_layers`, `target_layer_ids`, `mask_token_id`).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any

from dflash_train.features.layer_ids import default_target_layer_ids, validate_drafter_layer_ids

logger = logging.getLogger(__name__)

# Rope types a drafter follows its target in: transformers (the drafter's rotary embedding, the exported remote
# code) and the serving runtimes that read config.json compute each of them the same way.
DRAFTER_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def rope_type_of(scaling: dict[str, Any] | None) -> str:
    return str((scaling or {}).get("rope_type", (scaling or {}).get("type", "default")))


@dataclass
class DFlashConfig:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    num_target_layers: int
    mask_token_id: int
    block_size: int = 16
    target_layer_ids: list[int] = field(default_factory=list)
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 40960
    attention_bias: bool = False
    hidden_act: str = "silu"

    def __post_init__(self) -> None:
        if not self.target_layer_ids:
            self.target_layer_ids = default_target_layer_ids(self.num_target_layers, self.num_hidden_layers)
        self.target_layer_ids = [int(i) for i in self.target_layer_ids]
        validate_drafter_layer_ids(self.target_layer_ids, self.num_target_layers)
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act={self.hidden_act!r} is not supported; DFlash drafters use 'silu'")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"mask_token_id {self.mask_token_id} is outside the vocabulary [0, {self.vocab_size})")

    @property
    def num_context_features(self) -> int:
        """K: number of captured target layers."""
        return len(self.target_layer_ids)

    @classmethod
    def from_target_config(
        cls,
        target_config: Any,
        mask_token_id: int,
        num_hidden_layers: int = 5,
        block_size: int = 16,
        target_layer_ids: list[int] | None = None,
        **overrides: Any,
    ) -> DFlashConfig:
        """Size a drafter after a Hugging Face target config (same width, heads and MLP)."""
        text_config = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
        heads = text_config.num_attention_heads
        head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // heads
        theta, scaling = _rope_settings(text_config)
        values: dict[str, Any] = dict(
            hidden_size=text_config.hidden_size,
            num_hidden_layers=num_hidden_layers,
            num_attention_heads=heads,
            num_key_value_heads=getattr(text_config, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            intermediate_size=drafter_intermediate_size(text_config),
            vocab_size=text_config.vocab_size,
            num_target_layers=text_config.num_hidden_layers,
            mask_token_id=mask_token_id,
            block_size=block_size,
            target_layer_ids=list(target_layer_ids or []),
            rms_norm_eps=getattr(text_config, "rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=getattr(text_config, "max_position_embeddings", 40960),
        )
        values.update(overrides)
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> DFlashConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown DFlash config keys {unknown}; expected a subset of {sorted(known)}")
        return cls(**values)


def drafter_intermediate_size(text_config: Any) -> int:
    """The drafter's MLP width: the target's dense MLP width where it has one (MoE configs name it too, for
    their dense layers or as the expert size), else the width of its active experts together."""
    width = getattr(text_config, "intermediate_size", None)
    if width:
        return int(width)
    expert, active = getattr(text_config, "moe_intermediate_size", None), getattr(text_config, "num_experts_per_tok", None)
    if expert and active:
        return int(expert) * int(active)
    raise ValueError(f"The target config ({getattr(text_config, 'model_type', '?')}) names no MLP width "
                     "(intermediate_size, or moe_intermediate_size and num_experts_per_tok) to size the "
                     "drafter's MLP after: add intermediate_size to the target's config.json.")


def _rope_settings(text_config: Any) -> tuple[float, dict[str, Any] | None]:
    """The target's rope theta and scaling (transformers 4.x or 5.x configs), as the drafter will use them."""
    params = getattr(text_config, "rope_parameters", None)
    if isinstance(params, dict) and "rope_theta" in params:
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
        theta = float(params["rope_theta"])
    else:
        theta = float(getattr(text_config, "rope_theta", 10000.0))
        scaling = dict(getattr(text_config, "rope_scaling", None) or {})
    rope_type = rope_type_of(scaling)
    if rope_type == "default":
        return theta, None
    if rope_type not in DRAFTER_ROPE_TYPES:
        # The drafter's rotation only relates its block to the context it attends to, so it need not be the
        # target's; a type that serving runtimes compute differently would make served drafts differ.
        logger.warning("The target's rope type %r is not one a drafter follows (%s): the drafter uses plain RoPE "
                       "with theta %g instead.", rope_type, ", ".join(DRAFTER_ROPE_TYPES), theta)
        return theta, None
    return theta, scaling
