"""What kind of target a config describes, as far as a drafter's pipeline cares: which layers attend to every
earlier token, which to a window, which carry a recurrent or convolution state; experts; attention sinks and
soft-capping; latent attention. `inspect` shows it, and the steps whose correctness depends on it ask it:
packing several chats into one row is exact only where no layer carries state from one chat into the next.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

FULL, SLIDING = "full_attention", "sliding_attention"
# Layer kinds whose output depends on a state passed along the sequence rather than on attention alone:
# gated-delta-net linear attention, short convolutions, Mamba (alone, or beside attention in one layer).
RECURRENT_KINDS = frozenset({"linear_attention", "conv", "mamba", "mamba2", "hybrid"})
SINK_MODEL_TYPES = ("gpt_oss",)  # attention with a learned sink logit per head


@dataclass(frozen=True)
class Architecture:
    model_type: str
    layer_kinds: tuple[str, ...]  # one per decoder layer, in transformers' names
    sliding_window: int | None
    experts: int | None  # routed experts per MoE layer (None: dense)
    active_experts: int | None
    latent_attention: bool  # multi-head latent attention (keys and values from a low-rank latent)
    attention_sinks: bool
    attention_softcap: float | None

    @property
    def recurrent(self) -> bool:
        return any(kind in RECURRENT_KINDS for kind in self.layer_kinds)

    @property
    def summary(self) -> str:
        """One line: the layer mix, then what else sets the target apart."""
        counts = Counter(self.layer_kinds)
        parts = [", ".join(f"{n} {kind}" for kind, n in counts.items())]
        if self.sliding_window and SLIDING in counts:
            parts.append(f"window {self.sliding_window}")
        if self.experts:
            parts.append(f"MoE {self.experts} experts, {self.active_experts} active")
        if self.latent_attention:
            parts.append("latent attention (MLA)")
        if self.attention_sinks:
            parts.append("attention sinks")
        if self.attention_softcap:
            parts.append(f"attention soft-cap {self.attention_softcap:g}")
        return "; ".join(parts)


def architecture(config: Any) -> Architecture:
    """The facts above, read from a Hugging Face config (its text config for a multimodal one)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    model_type = str(getattr(text, "model_type", "unknown"))
    window = getattr(text, "sliding_window", None)
    return Architecture(
        model_type=model_type,
        layer_kinds=_layer_kinds(text, window),
        sliding_window=window,
        experts=_first(text, "num_experts", "num_local_experts", "n_routed_experts"),
        active_experts=_first(text, "num_experts_per_tok", "moe_topk"),
        latent_attention=bool(getattr(text, "kv_lora_rank", None)),
        attention_sinks=model_type in SINK_MODEL_TYPES,
        attention_softcap=getattr(text, "attn_logit_softcapping", None),
    )


def _layer_kinds(text: Any, window: int | None) -> tuple[str, ...]:
    layers = int(text.num_hidden_layers)
    for name in ("layer_types", "layers_block_type"):
        kinds = getattr(text, name, None)
        if isinstance(kinds, (list, tuple)) and len(kinds) == layers:
            return tuple(str(kind) for kind in kinds)
    # No per-layer list: a set window applies to every layer (Mistral), unless the config switches it off.
    slides = window is not None and getattr(text, "use_sliding_window", True)
    return (SLIDING if slides else FULL,) * layers


def _first(text: Any, *names: str) -> int | None:
    for name in names:
        value = getattr(text, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def packing_problem(arch: Architecture) -> str | None:
    """Why chats packed into one row would not each see only themselves, or None where packing is exact."""
    if arch.recurrent:
        kinds = sorted({kind for kind in arch.layer_kinds if kind in RECURRENT_KINDS})
        return (f"{arch.model_type} targets have {', '.join(kinds)} layers, whose state would run on from one "
                f"packed chat into the next")
    return None
