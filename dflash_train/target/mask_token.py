"""Which token id the drafter uses as its mask token.

The drafter embeds the mask token with the target's (frozen, shared) embedding, so the id must be a row of
that embedding; it is never resized. The rules, in order:

1. an explicit setting (a token id or a token string);
2. the draft config's ``mask_token_id``;
3. the tokenizer's own mask token;
4. the first embedding row past the tokenizer's vocabulary (e.g. Qwen3: 151669 of 151936 rows);
5. a reserved special token that never appears in training data: the highest added special token that is
   not bos/eos/pad/unk/sep/cls, not produced by the chat template, and not among the caller's forbidden ids
   (for SmolLM2: 16, ``<empty_output>``);
6. otherwise the user has to choose one.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

from transformers.tokenization_utils_base import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

RULE_EXPLICIT = "explicit"
RULE_DRAFT_CONFIG = "draft_config"
RULE_TOKENIZER_MASK = "tokenizer_mask_token"
RULE_UNUSED_ROW = "unused_embedding_row"
RULE_RESERVED_SPECIAL = "reserved_special_token"

_ROLE_TOKENS = ("bos", "eos", "pad", "unk", "sep", "cls")

# Conversations rendered through the chat template to see which special tokens it emits. Variants without a
# system message are there for templates that reject the system role.
_PROBE_CONVERSATIONS: tuple[tuple[list[dict[str, str]], bool], ...] = (
    (
        [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "Hello, who are you?"},
            {"role": "assistant", "content": "I am an assistant."},
        ],
        False,
    ),
    (
        [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "Hello, who are you?"},
        ],
        True,
    ),
    (
        [
            {"role": "user", "content": "Hello, who are you?"},
            {"role": "assistant", "content": "I am an assistant."},
        ],
        False,
    ),
    ([{"role": "user", "content": "Hello, who are you?"}], True),
)


@dataclass(frozen=True)
class MaskTokenChoice:
    """The chosen mask token id, its token string (None for a row past the vocabulary), and the rule used."""

    id: int
    token: str | None
    rule: str


def resolve_mask_token_id(
    tokenizer: PreTrainedTokenizerBase,
    embedding_rows: int,
    explicit: int | str | None = None,
    draft_config_mask_id: int | None = None,
    forbidden_token_ids: Iterable[int] = (),
) -> int:
    """The mask token id; see ``choose_mask_token``."""
    return choose_mask_token(
        tokenizer, embedding_rows, explicit, draft_config_mask_id, forbidden_token_ids
    ).id


def choose_mask_token(
    tokenizer: PreTrainedTokenizerBase,
    embedding_rows: int,
    explicit: int | str | None = None,
    draft_config_mask_id: int | None = None,
    forbidden_token_ids: Iterable[int] = (),
) -> MaskTokenChoice:
    """Pick the mask token by the rules in the module docstring; the id is always below ``embedding_rows``."""
    choice = (
        _from_explicit(tokenizer, embedding_rows, explicit)
        or _from_draft_config(tokenizer, embedding_rows, draft_config_mask_id)
        or _from_tokenizer_mask(tokenizer, embedding_rows)
        or _from_unused_row(tokenizer, embedding_rows)
        or _from_reserved_special(tokenizer, embedding_rows, set(forbidden_token_ids))
    )
    if choice is None:
        raise ValueError(
            f"Found no unused token for the mask: the tokenizer fills all {embedding_rows} embedding rows and has "
            f"no reserved special token; set mask_token_id explicitly to an unused token id."
        )
    logger.info("Mask token id %d (%r), chosen by rule %r.", choice.id, choice.token, choice.rule)
    return choice


def _from_explicit(
    tokenizer: PreTrainedTokenizerBase, embedding_rows: int, explicit: int | str | None
) -> MaskTokenChoice | None:
    if explicit is None:
        return None
    token_id = _token_id(tokenizer, explicit) if isinstance(explicit, str) else explicit
    _check_row(token_id, embedding_rows, "mask_token_id")
    return MaskTokenChoice(token_id, _token_string(tokenizer, token_id), RULE_EXPLICIT)


def _from_draft_config(
    tokenizer: PreTrainedTokenizerBase, embedding_rows: int, mask_id: int | None
) -> MaskTokenChoice | None:
    if mask_id is None:
        return None
    _check_row(mask_id, embedding_rows, "The draft config's mask_token_id")
    return MaskTokenChoice(mask_id, _token_string(tokenizer, mask_id), RULE_DRAFT_CONFIG)


def _from_tokenizer_mask(tokenizer: PreTrainedTokenizerBase, embedding_rows: int) -> MaskTokenChoice | None:
    mask_id = getattr(tokenizer, "mask_token_id", None)
    if mask_id is None or not 0 <= mask_id < embedding_rows:
        return None
    return MaskTokenChoice(mask_id, _token_string(tokenizer, mask_id), RULE_TOKENIZER_MASK)


def _from_unused_row(tokenizer: PreTrainedTokenizerBase, embedding_rows: int) -> MaskTokenChoice | None:
    # Embeddings are often padded past the vocabulary (to a multiple of 64/128); such a row is never an input.
    # The max over the vocabulary guards against tokenizers whose ids have gaps, where len() undercounts.
    first_free = max(len(tokenizer), max(tokenizer.get_vocab().values(), default=-1) + 1)
    if first_free >= embedding_rows:
        return None
    return MaskTokenChoice(first_free, None, RULE_UNUSED_ROW)


def _from_reserved_special(
    tokenizer: PreTrainedTokenizerBase, embedding_rows: int, forbidden: set[int]
) -> MaskTokenChoice | None:
    special = {token_id for token_id, added in tokenizer.added_tokens_decoder.items() if added.special}
    excluded = _role_token_ids(tokenizer) | chat_template_token_ids(tokenizer) | forbidden
    candidates = sorted(token_id for token_id in special - excluded if 0 <= token_id < embedding_rows)
    if not candidates:
        return None
    # Reserved placeholders sit at the end of the special-token block (Llama 3's reserved tokens, SmolLM2's
    # <empty_output>); the low ids are the ones models actually use.
    token_id = candidates[-1]
    return MaskTokenChoice(token_id, _token_string(tokenizer, token_id), RULE_RESERVED_SPECIAL)


def _role_token_ids(tokenizer: PreTrainedTokenizerBase) -> set[int]:
    ids = (getattr(tokenizer, f"{role}_token_id", None) for role in _ROLE_TOKENS)
    return {token_id for token_id in ids if isinstance(token_id, int)}


def chat_template_token_ids(tokenizer: PreTrainedTokenizerBase) -> set[int]:
    """Token ids of probe conversations rendered through the tokenizer's chat template (empty without one)."""
    if not getattr(tokenizer, "chat_template", None):
        return set()
    ids: set[int] = set()
    rendered_any = False
    for messages, add_generation_prompt in _PROBE_CONVERSATIONS:
        try:
            text = tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt
            )
        except Exception:  # templates raise arbitrary errors for roles they do not support
            continue
        rendered_any = True
        ids.update(tokenizer(text, add_special_tokens=False)["input_ids"])
    if not rendered_any:
        logger.warning(
            "The chat template rendered none of the probe conversations; its tokens are not excluded."
        )
    return ids


def _token_id(tokenizer: PreTrainedTokenizerBase, token: str) -> int:
    token_id = tokenizer.convert_tokens_to_ids(token)
    # Unknown tokens come back as the unk id (or None); only the unk token itself may map there.
    if token_id is None or (token_id == tokenizer.unk_token_id and token != tokenizer.unk_token):
        raise ValueError(
            f"Mask token {token!r} is not in the tokenizer's vocabulary; set mask_token_id to a token id."
        )
    return int(token_id)


def _check_row(token_id: int, embedding_rows: int, what: str) -> None:
    if isinstance(token_id, bool) or not isinstance(token_id, int):
        raise ValueError(f"{what} must be an integer token id or a token string, got {token_id!r}.")
    if not 0 <= token_id < embedding_rows:
        raise ValueError(
            f"{what} {token_id} is outside the target's {embedding_rows}-row embedding (which is never resized); "
            f"use an id below {embedding_rows}."
        )


def _token_string(tokenizer: PreTrainedTokenizerBase, token_id: int) -> str | None:
    try:
        token = tokenizer.convert_ids_to_tokens(token_id)
    except (IndexError, KeyError):  # slow tokenizers raise for rows past the vocabulary
        return None
    return token if isinstance(token, str) else None
