"""Mistral templates over a SentencePiece-style tokenizer: where the template writes a space before the answer
(``[/INST] answer``), the supervised span starts at the ``▁``-prefixed piece the model emits.

The tokenizer (tests/helpers/sentencepiece_tokenizer.py) is built like Mistral's ``tokenizer.json``: BPE
over ``▁``-joined words (Metaspace, a ``▁`` prepended only at the start of the text), ``<s>``/``</s>`` special,
and in V3 ``[INST]``/``[/INST]`` control tokens. The expected rows are written by hand: the prompt the model
answered, then the answer it emitted.
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerFast

from dflash_train.data.chat import ChatTokenizer
from tests.helpers.sentencepiece_tokenizer import (
    ANSWER1,
    ANSWER2,
    SYSTEM,
    USER1,
    USER2,
    sentencepiece_tokenizer,
)


def messages() -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER1},
            {"role": "assistant", "content": ANSWER1}, {"role": "user", "content": USER2},
            {"role": "assistant", "content": ANSWER2}]


def expected_row(tokenizer: PreTrainedTokenizerFast, pieces: list[tuple[str, int]]) -> tuple[list[int], list[int]]:
    """Ids of the row's text, and a mask covering the tokens each trained piece adds to the text before it."""
    ids = tokenizer("".join(text for text, _ in pieces), add_special_tokens=False)["input_ids"]
    mask, text = [0] * len(ids), ""
    for piece, trained in pieces:
        start = len(tokenizer(text, add_special_tokens=False)["input_ids"]) if text else 0
        text += piece
        end = len(tokenizer(text, add_special_tokens=False)["input_ids"])
        mask[start:end] = [trained] * (end - start)
    return ids, mask


def check_rows(tokenizer: PreTrainedTokenizerFast, rows: list[list[tuple[str, int]]]) -> None:
    conversation = ChatTokenizer(tokenizer).tokenize(messages())
    assert conversation.turns_not_reproducible == 0
    assert [(row.input_ids, row.loss_mask) for row in conversation.samples] == [expected_row(tokenizer, r) for r in rows]
    first_pieces = [tokenizer.convert_ids_to_tokens(row.input_ids[start]) for row in conversation.samples
                    for start, _ in row.spans]
    assert first_pieces == ["▁Paris", "▁Rome"]  # the answer's first word with its space, as the model emits it
    last_pieces = [tokenizer.convert_ids_to_tokens(row.input_ids[end - 1]) for row in conversation.samples
                   for _, end in row.spans]
    assert last_pieces == ["</s>", "</s>"]


def test_mistral_v1_span_starts_at_the_space_prefixed_piece() -> None:
    tokenizer = sentencepiece_tokenizer("mistral_v1.jinja", [])  # [INST] is plain text in V1
    check_rows(tokenizer, [[
        (f"<s> [INST] {SYSTEM}\n\n{USER1} [/INST]", 0), (f" {ANSWER1}</s>", 1),
        (f" [INST] {USER2} [/INST]", 0), (f" {ANSWER2}</s>", 1),
    ]])


def test_mistral_v3_with_system_prompt_rows_start_at_the_space_prefixed_piece() -> None:
    tokenizer = sentencepiece_tokenizer("mistral_v3.jinja", ["[INST]", "[/INST]"])
    check_rows(tokenizer, [
        [(f"<s>[INST] {SYSTEM}\n\n{USER1}[/INST]", 0), (f" {ANSWER1}</s>", 1)],
        [(f"<s>[INST] {USER1}[/INST] {ANSWER1}</s>[INST] {SYSTEM}\n\n{USER2}[/INST]", 0), (f" {ANSWER2}</s>", 1)],
    ])

