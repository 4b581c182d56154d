from __future__ import annotations

import logging

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from dflash_train.target.mask_token import (
    RULE_DRAFT_CONFIG,
    RULE_EXPLICIT,
    RULE_RESERVED_SPECIAL,
    RULE_TOKENIZER_MASK,
    RULE_UNUSED_ROW,
    MaskTokenChoice,
    chat_template_token_ids,
    choose_mask_token,
    resolve_mask_token_id,
)
from tests.helpers.markers import needs_smollm2
from tests.helpers.tiny_models import CHATML_TEMPLATE, make_tiny_tokenizer

# The tiny tokenizer's ids: 0 <|endoftext|> (pad), 1 <|im_start|>, 2 <|im_end|> (eos), 3 <unk>,
# 4..6 <reserved_0..2>, then words. It has 256 tokens; the tiny models have 320 embedding rows.
ROWS = 320


@pytest.fixture(scope="module")
def tok() -> PreTrainedTokenizerFast:
    return make_tiny_tokenizer()


def test_tiny_tokenizer_layout(tok: PreTrainedTokenizerFast) -> None:
    assert len(tok) == 256
    assert tok.convert_tokens_to_ids(
        ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>", "<reserved_2>"]
    ) == [0, 1, 2, 3, 6]
    assert (tok.pad_token_id, tok.eos_token_id, tok.unk_token_id, tok.mask_token_id) == (0, 2, 3, None)


# ---------------------------------------------------------------------------------------------- 1. explicit


def test_explicit_id_wins_over_everything() -> None:
    tokenizer = make_tiny_tokenizer(mask_token="<mask>")
    choice = choose_mask_token(tokenizer, ROWS, explicit=5, draft_config_mask_id=6)
    assert choice == MaskTokenChoice(5, "<reserved_1>", RULE_EXPLICIT)


def test_explicit_id_past_the_vocabulary_is_fine_if_it_is_a_row(tok: PreTrainedTokenizerFast) -> None:
    assert choose_mask_token(tok, ROWS, explicit=300) == MaskTokenChoice(300, None, RULE_EXPLICIT)


@pytest.mark.parametrize("bad", [ROWS, ROWS + 10, -1])
def test_explicit_id_outside_the_embedding(tok: PreTrainedTokenizerFast, bad: int) -> None:
    with pytest.raises(ValueError, match=f"outside the target's {ROWS}-row embedding"):
        resolve_mask_token_id(tok, ROWS, explicit=bad)


def test_explicit_token_string(tok: PreTrainedTokenizerFast) -> None:
    assert choose_mask_token(tok, ROWS, explicit="<reserved_0>") == MaskTokenChoice(
        4, "<reserved_0>", RULE_EXPLICIT
    )
    assert resolve_mask_token_id(tok, ROWS, explicit="<unk>") == 3  # the unk token itself is a real token
    assert (
        resolve_mask_token_id(tok, ROWS, explicit="paris")
        == tok("paris", add_special_tokens=False)["input_ids"][0]
    )


def test_explicit_token_string_not_in_vocab(tok: PreTrainedTokenizerFast) -> None:
    with pytest.raises(ValueError, match="not in the tokenizer's vocabulary"):
        resolve_mask_token_id(tok, ROWS, explicit="<|mask|>")


def test_explicit_token_string_outside_a_smaller_embedding(tok: PreTrainedTokenizerFast) -> None:
    with pytest.raises(ValueError, match="outside"):
        resolve_mask_token_id(tok, 100, explicit="w200")


def test_explicit_wrong_type(tok: PreTrainedTokenizerFast) -> None:
    with pytest.raises(ValueError, match="integer token id or a token string"):
        resolve_mask_token_id(tok, ROWS, explicit=4.0)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------- 2. draft config


def test_draft_config_id_wins_over_the_tokenizer() -> None:
    tokenizer = make_tiny_tokenizer(mask_token="<mask>")
    assert choose_mask_token(tokenizer, ROWS, draft_config_mask_id=6) == MaskTokenChoice(
        6, "<reserved_2>", RULE_DRAFT_CONFIG
    )


def test_draft_config_id_outside_the_embedding(tok: PreTrainedTokenizerFast) -> None:
    with pytest.raises(ValueError, match="draft config's mask_token_id 400"):
        resolve_mask_token_id(tok, ROWS, draft_config_mask_id=400)


# ---------------------------------------------------------------------------------------------- 3. tokenizer mask


def test_tokenizer_mask_token() -> None:
    tokenizer = make_tiny_tokenizer(mask_token="<mask>")
    assert tokenizer.convert_tokens_to_ids("<mask>") == 7
    assert choose_mask_token(tokenizer, ROWS) == MaskTokenChoice(7, "<mask>", RULE_TOKENIZER_MASK)


def test_tokenizer_mask_token_outside_the_embedding_is_skipped() -> None:
    tokenizer = make_tiny_tokenizer(mask_token="<mask>")  # <mask> is id 7, past a 7-row embedding
    assert choose_mask_token(tokenizer, 7) == MaskTokenChoice(6, "<reserved_2>", RULE_RESERVED_SPECIAL)


# ---------------------------------------------------------------------------------------------- 4. unused row


def test_first_row_past_the_vocabulary(tok: PreTrainedTokenizerFast) -> None:
    assert choose_mask_token(tok, ROWS) == MaskTokenChoice(256, None, RULE_UNUSED_ROW)
    assert resolve_mask_token_id(tok, 257) == 256


def test_qwen3_sized_vocabulary() -> None:
    # Qwen3: 151669 tokens in a 151936-row embedding.
    tokenizer = make_tiny_tokenizer(vocab_size=151669, chat_template=None)
    assert resolve_mask_token_id(tokenizer, 151936) == 151669


# ---------------------------------------------------------------------------------------------- 5. reserved special


def test_reserved_special_token_when_the_table_is_full(tok: PreTrainedTokenizerFast) -> None:
    rows = len(tok)  # no row past the vocabulary
    assert choose_mask_token(tok, rows) == MaskTokenChoice(6, "<reserved_2>", RULE_RESERVED_SPECIAL)
    assert resolve_mask_token_id(tok, rows, forbidden_token_ids=[6]) == 5
    assert resolve_mask_token_id(tok, rows, forbidden_token_ids={5, 6}) == 4


def test_tokens_the_chat_template_emits_are_excluded() -> None:
    thinking = CHATML_TEMPLATE.replace("'<|im_start|>assistant\n'", "'<|im_start|>assistant\n<reserved_2>'")
    tokenizer = make_tiny_tokenizer(chat_template=thinking)
    assert 6 in chat_template_token_ids(tokenizer)
    assert resolve_mask_token_id(tokenizer, len(tokenizer)) == 5


def test_templates_that_reject_the_system_role_are_still_probed() -> None:
    no_system = (
        "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
        "{% for message in messages %}{{ '<reserved_2>' + message['content'] }}{% endfor %}"
    )
    tokenizer = make_tiny_tokenizer(chat_template=no_system)
    assert resolve_mask_token_id(tokenizer, len(tokenizer)) == 5


def test_without_chat_template_only_role_tokens_are_excluded() -> None:
    tokenizer = make_tiny_tokenizer(chat_template=None)
    assert chat_template_token_ids(tokenizer) == set()
    assert resolve_mask_token_id(tokenizer, len(tokenizer)) == 6


def test_role_tokens_are_never_chosen() -> None:
    # Specials are only pad, a chat marker, eos and unk, and the template uses the marker.
    tokenizer = make_tiny_tokenizer(special_tokens=("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>"))
    with pytest.raises(ValueError, match="set mask_token_id explicitly to an unused token id"):
        resolve_mask_token_id(tokenizer, len(tokenizer))


# ---------------------------------------------------------------------------------------------- 6. nothing fits


def test_nothing_fits(tok: PreTrainedTokenizerFast) -> None:
    with pytest.raises(ValueError, match="set mask_token_id explicitly"):
        resolve_mask_token_id(tok, len(tok), forbidden_token_ids=range(4, 7))


def test_choice_is_always_a_row_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    cases = [
        (make_tiny_tokenizer(mask_token="<mask>"), 8),
        (make_tiny_tokenizer(), 256),
        (make_tiny_tokenizer(), 300),
        (make_tiny_tokenizer(vocab_size=64), 64),
        (make_tiny_tokenizer(vocab_size=64), 5),
    ]
    with caplog.at_level(logging.INFO, logger="dflash_train.target.mask_token"):
        for tokenizer, rows in cases:
            choice = choose_mask_token(tokenizer, rows)
            assert 0 <= choice.id < rows
            assert choice.rule in caplog.text


# ---------------------------------------------------------------------------------------------- real SmolLM2


@needs_smollm2
def test_smollm2_uses_empty_output() -> None:
    from dflash_train.target import DEFAULT_TARGET_ALIASES, ensure_converted_gguf

    # The tokenizer as `load_target` reads it, from the converted copy: the GGUF's own 49k-token vocabulary
    # takes 5 s to parse.
    tokenizer = AutoTokenizer.from_pretrained(ensure_converted_gguf(DEFAULT_TARGET_ALIASES["smollm2-135m-instruct"].path()))
    assert len(tokenizer) == 49152 and tokenizer.mask_token_id is None
    assert {1, 2} <= chat_template_token_ids(tokenizer)
    choice = choose_mask_token(tokenizer, 49152)
    assert choice == MaskTokenChoice(16, "<empty_output>", RULE_RESERVED_SPECIAL)
