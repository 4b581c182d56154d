"""Mistral templates over a SentencePiece-style tokenizer: where the template writes a space before the answer
(``[/INST] answer``), the supervised span starts at the ``▁``-prefixed piece the model emits.

The tokenizer is built here like Mistral's ``tokenizer.json``: BPE over ``▁``-joined words (Metaspace, a ``▁``
prepended only at the start of the text), ``<s>``/``</s>`` special, and in V3 ``[INST]``/``[/INST]`` control
tokens. The expected rows are written by hand: the prompt the model answered, then the answer it emitted.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from dflash_train.data.chat import ChatTokenizer

TEMPLATES = Path(__file__).parent / "golden" / "chat_templates"
SYSTEM, USER1, ANSWER1, USER2, ANSWER2 = (
    "Be brief.", "Where is Paris?", "Paris is the capital of France.", "And Rome?", "Rome is older than Paris.")
CORPUS = [f"{SYSTEM}\n\n{USER1}", ANSWER1, USER2, ANSWER2, "[INST] [/INST]"]


def sentencepiece_tokenizer(template: str, control: list[str]) -> PreTrainedTokenizerFast:
    backend = Tokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    backend.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False)
    backend.train_from_iterator(CORPUS * 10, trainer)
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ["<s>", "</s>", *control]])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    tokenizer.chat_template = (TEMPLATES / template).read_text().rstrip("\n")
    return tokenizer


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

