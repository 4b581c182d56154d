"""Turning conversations into prompt token ids with the target's chat template, and its stop tokens."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from dflash_train.data.chat import ChatTokenizer
from dflash_train.prompts.records import BadRecord
from dflash_train.runtime.config import stop_token_ids

__all__ = ["prompt_ids", "stop_token_ids", "supports_thinking"]

logger = logging.getLogger(__name__)


def supports_thinking(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether the chat template has a thinking switch (Qwen3-style `enable_thinking`)."""
    return "enable_thinking" in str(getattr(tokenizer, "chat_template", None) or "")


def prompt_ids(tokenizer: PreTrainedTokenizerBase, messages: Sequence[dict[str, str]], thinking: bool) -> list[int]:
    """Token ids of `messages` followed by the assistant's generation prompt: the encoding regeneration gives
    a training prompt (`ChatTokenizer.encode_prompt`), so the drafter is evaluated on the format it was trained
    on. Without a chat template (a base model), the message contents joined by blank lines."""
    if not getattr(tokenizer, "chat_template", None):
        return list(tokenizer("\n\n".join(m["content"] for m in messages))["input_ids"])
    chat = ChatTokenizer(tokenizer, thinking if supports_thinking(tokenizer) else None)
    try:
        return chat.encode_prompt(messages)
    except BadRecord as bad:  # a prompt the template refuses (e.g. roles that do not alternate)
        raise ValueError(f"the chat template refuses this prompt ({bad}); fix the prompt file") from None
