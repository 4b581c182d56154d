"""Turning conversations into prompt token ids with the target's chat template, and its stop tokens."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from dflash_train.runtime.config import stop_token_ids

__all__ = ["prompt_ids", "stop_token_ids", "supports_thinking"]

logger = logging.getLogger(__name__)


def supports_thinking(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether the chat template has a thinking switch (Qwen3-style `enable_thinking`)."""
    return "enable_thinking" in str(getattr(tokenizer, "chat_template", None) or "")


def prompt_ids(tokenizer: PreTrainedTokenizerBase, messages: Sequence[dict[str, str]], thinking: bool) -> list[int]:
    """Token ids of `messages` followed by the assistant's generation prompt.

    Tokenised by the template itself (not template-to-text then `encode`, which would add a second BOS for
    templates that already write one). Without a chat template, the message contents joined by blank lines.
    """
    if not getattr(tokenizer, "chat_template", None):
        return list(tokenizer("\n\n".join(m["content"] for m in messages))["input_ids"])
    kwargs: dict[str, Any] = {"enable_thinking": thinking} if supports_thinking(tokenizer) else {}
    encoded = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True,
                                            return_dict=True, **kwargs)
    return list(encoded["input_ids"])
