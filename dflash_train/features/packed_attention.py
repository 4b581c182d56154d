"""Which Hugging Face attention the target's forward over packed training rows uses
(`training.target_attention`); `target/attention.py` switches to it for the forward.

Why not SDPA for packed rows: a packed training row holds many chats, and Hugging Face keeps each chat to
itself by building a mask from the per-chat position ids. Under SDPA that mask is a dense [b, 1, S, S]
tensor and the attention kernel computes every one of the S² scores before masking them: for rows of 8,192
tokens holding ~17 chats of ~480 tokens, about 17 times the work the chats need (a large share of a packed
SmolLM2 step: docs/benchmarks.md, 'Figures behind code choices'). Under flex attention the same mask becomes a block
mask, and tiles that no chat fills are skipped; varlen attention (`features/varlen.py`) attends each chat
alone with no mask and nothing to compile.
"""

from __future__ import annotations

import torch

from dflash_train.features.varlen import VARLEN, register

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
