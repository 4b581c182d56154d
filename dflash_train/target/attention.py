"""Which Hugging Face attention a target's forward uses, switched for the length of a `with` block: the
static-cache runtime's own attention for Hugging Face layers (`runtime/static_target.py`), and flex attention
for packed training rows.

Why not SDPA for packed rows: a packed training row holds many chats, and Hugging Face keeps each chat to
itself by building a mask from the per-chat position ids. Under SDPA that mask is a dense [b, 1, S, S] tensor and the attention
kernel computes every one of the S² scores before masking them: for rows of 8,192 tokens holding ~17 chats
of ~480 tokens, about 17 times the work the chats need (in a packed SmolLM2 step on an H200 the target's
attention took ~48 ms, d4927e1). Under flex attention the same mask becomes a block mask, and tiles that
no chat fills are skipped; varlen attention (`target/varlen.py`) attends each chat alone with no mask and
nothing to compile. The switch is process-wide for that model: every attention layer and the mask
code read the one config attribute.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from dflash_train.target.varlen import VARLEN, register

FLEX = "flex_attention"
PACKED_TARGET_ATTENTIONS = ("auto", "sdpa", "flex", "varlen")  # training.target_attention


def packed_target_attention(choice: str, device: torch.device) -> str | None:
    """The Hugging Face attention for the target's forward over packed rows: flex attention, varlen attention
    (registered here), or None for the model's own (SDPA). "auto": flex on CUDA, else SDPA."""
    if choice not in PACKED_TARGET_ATTENTIONS:
        raise ValueError(f"training.target_attention must be one of {', '.join(PACKED_TARGET_ATTENTIONS)}, not {choice!r}")
    if choice == "varlen":
        register()
        return VARLEN
    if choice == "flex" or (choice == "auto" and device.type == "cuda"):
        return FLEX
    return None


def _configs(model: nn.Module) -> list[object]:
    """The distinct config objects the model's modules read (a multimodal model has several)."""
    found = {id(model.config): model.config}
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "_attn_implementation"):
            found.setdefault(id(config), config)
    return list(found.values())


@contextmanager
def attention_implementation(model: nn.Module, name: str | None) -> Iterator[None]:
    """Within: the model's attention layers and mask code use Hugging Face attention `name` ("sdpa",
    "flex_attention", ...); None changes nothing. The previous choice is restored on the way out."""
    if name is None:
        yield
        return
    configs = _configs(model)
    saved = [config._attn_implementation for config in configs]  # type: ignore[attr-defined]
    for config in configs:
        config._attn_implementation = name  # type: ignore[attr-defined]
    try:
        yield
    finally:
        for config, previous in zip(configs, saved, strict=True):
            config._attn_implementation = previous  # type: ignore[attr-defined]
