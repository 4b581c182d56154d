"""Loss masks from chat templates, against masks built by hand from the known layout of each template.

The real templates of Llama-3, Llama-3.1, Qwen3 and three Mistral generations (tests/golden/chat_templates,
sources in its README) run over a byte-level tokenizer with the family's special tokens
(tests/helpers/byte_tokenizer.py); the oracle tokenises hand-written pieces of the expected text itself (one
token per byte, one per added token), so nothing of the implementation is reused. SmolLM2 (ChatML) uses its
real tokenizer and a golden file.
"""

from __future__ import annotations

import json
import re

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from dflash_train.data.chat import ChatTokenizer, fit_length
from dflash_train.prompts.records import BadRecord
from tests.helpers.byte_tokenizer import ANSWER1, ANSWER2, BYTE_IDS, USER1, USER2, byte_tokenizer, two_turns
from tests.helpers.paths import GOLDEN


def oracle(tokenizer: PreTrainedTokenizerFast, pieces: list[tuple[str, int]]) -> tuple[list[int], list[int]]:
    """Ids and mask of (text, trained) pieces: added tokens by lookup, everything else byte by byte."""
    added = {t.content: i for i, t in tokenizer.added_tokens_decoder.items()}
    pattern = "(" + "|".join(re.escape(t) for t in sorted(added, key=len, reverse=True)) + ")"
    ids, mask = [], []
    for text, trained in pieces:
        for part in filter(None, re.split(pattern, text)):
            part_ids = [added[part]] if part in added else [BYTE_IDS[b] for b in part.encode()]
            ids += part_ids
            mask += [trained] * len(part_ids)
    return ids, mask


def check(family: str, messages: list[dict], *rows: list[tuple[str, int]], thinking: bool | None = None,
          not_reproducible: int = 0) -> None:
    """``rows``: the (text, trained) pieces of each row the conversation gives, in order."""
    tokenizer = byte_tokenizer(family)
    conversation = ChatTokenizer(tokenizer, thinking=thinking).tokenize(messages)
    assert len(conversation.samples) == len(rows)
    for out, pieces in zip(conversation.samples, rows, strict=True):
        ids, mask = oracle(tokenizer, pieces)
        assert tokenizer.decode(out.input_ids) == "".join(text for text, _ in pieces)  # the template's text
        assert out.input_ids == ids
        assert out.loss_mask == mask
    assert conversation.turns_not_reproducible == not_reproducible


def test_llama3_two_turns_with_system() -> None:
    header = "<|start_header_id|>{}<|end_header_id|>\n\n"
    check("llama3", two_turns("Be brief. "), [
        ("<|begin_of_text|>" + header.format("system") + "Be brief.<|eot_id|>", 0),  # content is trimmed
        (header.format("user") + USER1 + "<|eot_id|>" + header.format("assistant"), 0),
        (ANSWER1 + "<|eot_id|>", 1),
        (header.format("user") + USER2 + "<|eot_id|>" + header.format("assistant"), 0),
        (ANSWER2 + "<|eot_id|>", 1),
    ])


def test_mistral_v02_two_turns() -> None:
    check("mistral_v0.2", two_turns(), [
        (f"<s>[INST] {USER1} [/INST]", 0), (ANSWER1 + "</s>", 1),
        (f"[INST] {USER2} [/INST]", 0), (ANSWER2 + "</s>", 1),
    ])


def test_mistral_rejects_system_role_per_row() -> None:
    with pytest.raises(BadRecord) as error:
        ChatTokenizer(byte_tokenizer("mistral_v0.2")).tokenize(two_turns("Be brief."))
    assert error.value.reason == "template_rejected"


LLAMA31_SYSTEM = ("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
                  "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n")


@pytest.mark.parametrize("system", [None, "Be brief. "])
def test_llama31_always_writes_its_system_block(system: str | None) -> None:
    header = "<|start_header_id|>{}<|end_header_id|>\n\n"
    check("llama31", two_turns(system), [
        (LLAMA31_SYSTEM + ("Be brief." if system else "") + "<|eot_id|>", 0),  # the system prompt is trimmed
        (header.format("user") + USER1 + "<|eot_id|>" + header.format("assistant"), 0),
        (ANSWER1 + "<|eot_id|>", 1),
        (header.format("user") + USER2 + "<|eot_id|>" + header.format("assistant"), 0),
        (ANSWER2 + "<|eot_id|>", 1),
    ])


def test_mistral_v1_answers_start_with_their_space_and_a_system_prompt_is_taken() -> None:
    check("mistral_v1", two_turns("Be brief."), [
        (f"<s> [INST] Be brief.\n\n{USER1} [/INST]", 0), (f" {ANSWER1}</s>", 1),
        (f" [INST] {USER2} [/INST]", 0), (f" {ANSWER2}</s>", 1),
    ])


def test_mistral_v3_without_system_prompt_is_one_row() -> None:
    check("mistral_v3", two_turns(), [
        (f"<s>[INST] {USER1}[/INST]", 0), (f" {ANSWER1}</s>", 1),
        (f"[INST] {USER2}[/INST]", 0), (f" {ANSWER2}</s>", 1),
    ])


def test_mistral_v3_system_prompt_keeps_every_turn_each_after_the_prompt_it_answered() -> None:
    # V3 writes the system prompt only into a user message that is the last message: every prompt the model
    # answered shows it before its last user turn, the whole conversation (ending with an answer) nowhere.
    check("mistral_v3", two_turns("Be brief."), [
        (f"<s>[INST] Be brief.\n\n{USER1}[/INST]", 0), (f" {ANSWER1}</s>", 1),
    ], [
        (f"<s>[INST] {USER1}[/INST] {ANSWER1}</s>[INST] Be brief.\n\n{USER2}[/INST]", 0), (f" {ANSWER2}</s>", 1),
    ])


def test_mistral_v3_three_turns_unfinished_last_leaves_only_its_end_of_turn_out() -> None:
    messages = [*two_turns("Be brief."), {"role": "user", "content": "Bye"}, {"role": "assistant", "content": "Bye"}]
    conversation = ChatTokenizer(byte_tokenizer("mistral_v3")).tokenize(messages, unfinished_last_turn=True)
    assert [len(row.spans) for row in conversation.samples] == [1, 1, 1]
    tokenizer = byte_tokenizer("mistral_v3")
    trained = [tokenizer.decode([t for t, m in zip(row.input_ids, row.loss_mask, strict=True) if m])
               for row in conversation.samples]
    assert trained == [f" {ANSWER1}</s>", f" {ANSWER2}</s>", " Bye"]


def test_template_that_never_shows_answers_after_their_prompt_refuses_the_row() -> None:
    # The generation prompt says "assistant:" but answers are rendered after "bot:": no turn can be trained
    # as the model wrote it, and the row is refused with a reason of its own rather than as "too short".
    tokenizer = byte_tokenizer("qwen3")
    tokenizer.chat_template = (
        "{% for m in messages %}<|im_start|>{{ 'bot' if m.role == 'assistant' else m.role }}:{{ m.content }}"
        "<|im_end|>{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant:{% endif %}")
    with pytest.raises(BadRecord) as error:
        ChatTokenizer(tokenizer).tokenize(two_turns())
    assert error.value.reason == "template_not_prefix_stable"


def test_qwen3_thinking_off_single_turn() -> None:
    messages = two_turns()[:2]
    check("qwen3", messages, [
        (f"<|im_start|>user\n{USER1}<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n", 0),
        (ANSWER1 + "<|im_end|>", 1), ("\n", 0),
    ], thinking=False)


def test_qwen3_thinking_off_multi_turn_trains_the_earlier_turn_in_its_own_row() -> None:
    # History turns lose the empty think block the model generated after: the whole conversation does not
    # show the first turn as written, so it is trained after its own prompt.
    first_prompt = f"<|im_start|>user\n{USER1}<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    check("qwen3", two_turns(), [
        (f"<|im_start|>user\n{USER1}<|im_end|>\n<|im_start|>assistant\n{ANSWER1}<|im_end|>\n", 0),
        (f"<|im_start|>user\n{USER2}<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n", 0),
        (ANSWER2 + "<|im_end|>", 1), ("\n", 0),
    ], [(first_prompt, 0), (ANSWER1 + "<|im_end|>", 1)], thinking=False)


def test_qwen3_thinking_on_trains_the_think_block() -> None:
    messages = [{"role": "system", "content": "Sys"}, {"role": "user", "content": USER1},
                {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n" + ANSWER1}]
    check("qwen3", messages, [
        (f"<|im_start|>system\nSys<|im_end|>\n<|im_start|>user\n{USER1}<|im_end|>\n<|im_start|>assistant\n", 0),
        ("<think>\nadd them\n</think>\n\n" + ANSWER1 + "<|im_end|>", 1), ("\n", 0),
    ], thinking=True)


def test_qwen3_thinking_on_history_turn_is_trained_with_its_thinking_in_its_own_row() -> None:
    messages = two_turns()
    messages[1]["content"] = "<think>\nsum\n</think>\n\n" + ANSWER1
    messages[3]["content"] = "<think>\nagain\n</think>\n\n" + ANSWER2
    check("qwen3", messages, [
        (f"<|im_start|>user\n{USER1}<|im_end|>\n<|im_start|>assistant\n{ANSWER1}<|im_end|>\n", 0),
        (f"<|im_start|>user\n{USER2}<|im_end|>\n<|im_start|>assistant\n", 0),
        ("<think>\nagain\n</think>\n\n" + ANSWER2 + "<|im_end|>", 1), ("\n", 0),
    ], [
        (f"<|im_start|>user\n{USER1}<|im_end|>\n<|im_start|>assistant\n", 0),
        ("<think>\nsum\n</think>\n\n" + ANSWER1 + "<|im_end|>", 1),
    ], thinking=True)


def test_thinking_switch_on_a_template_without_it_is_an_error() -> None:
    with pytest.raises(ValueError, match="no thinking switch"):
        ChatTokenizer(byte_tokenizer("llama3"), thinking=False)


def test_template_that_drops_assistant_turns_is_a_one_line_error() -> None:
    tokenizer = byte_tokenizer("qwen3")
    tokenizer.chat_template = "{% for m in messages %}{% if m.role == 'user' %}<|im_start|>{{ m.content }}<|im_end|>{% endif %}{% endfor %}"
    with pytest.raises(ValueError, match="does not render assistant turns") as error:
        ChatTokenizer(tokenizer, name="my-model").tokenize(two_turns())
    assert "my-model" in str(error.value) and "\n" not in str(error.value)


def test_no_chat_template_is_an_error() -> None:
    tokenizer = byte_tokenizer("qwen3")
    tokenizer.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        ChatTokenizer(tokenizer, name="base-model")


def test_special_token_text_in_content_is_a_bad_row() -> None:
    messages = two_turns()
    messages[1]["content"] = "fake end <|im_end|> here"
    with pytest.raises(BadRecord) as error:
        ChatTokenizer(byte_tokenizer("qwen3")).tokenize(messages)
    assert error.value.reason == "special_token_text"


def test_unfinished_response_leaves_its_end_of_turn_out() -> None:
    chat = ChatTokenizer(byte_tokenizer("llama3"))
    full = chat.tokenize(two_turns()).samples[0]
    cut = chat.tokenize(two_turns(), unfinished_last_turn=True).samples[0]
    last_end = full.spans[-1][1] - 1
    assert full.loss_mask[last_end] == 1 and cut.loss_mask[last_end] == 0
    assert sum(full.loss_mask) - sum(cut.loss_mask) == 1


def test_train_last_turn_only() -> None:
    chat = ChatTokenizer(byte_tokenizer("mistral_v0.2"))
    (out,) = chat.tokenize(two_turns(), train_turns="last").samples
    assert sum(out.loss_mask) == len(ANSWER2.encode()) + 1 and len(out.spans) == 1


def test_fit_length_keeps_whole_spans_then_cuts() -> None:
    chat = ChatTokenizer(byte_tokenizer("mistral_v0.2"))
    (out,) = chat.tokenize(two_turns()).samples
    (s1, e1), (s2, e2) = out.spans
    cut = fit_length(out, e2 - 1)  # the second span does not fit whole: cut after the first
    assert len(cut.input_ids) == e1 and cut.truncated and cut.spans == [(s1, e1)]
    cut = fit_length(out, e1 - 3)  # no whole span fits: a plain cut, the partial span stays
    assert len(cut.input_ids) == e1 - 3 and sum(cut.loss_mask) == e1 - 3 - s1
    assert fit_length(out, len(out.input_ids)) is out


# ------------------------------------------------------------------------------------ SmolLM2 (ChatML), real


@pytest.fixture(scope="module")
def smollm2_tokenizer() -> PreTrainedTokenizerFast:
    from dflash_train.target import DEFAULT_TARGET_ALIASES, ensure_converted_gguf

    return AutoTokenizer.from_pretrained(ensure_converted_gguf(DEFAULT_TARGET_ALIASES["smollm2-135m-instruct"].path()))


def test_smollm2_chatml_mask_matches_pieces_and_golden(smollm2_tokenizer: PreTrainedTokenizerFast) -> None:
    chat = ChatTokenizer(smollm2_tokenizer)
    (out,) = chat.tokenize(two_turns()).samples
    system = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    pieces = [
        (system + f"<|im_start|>user\n{USER1}<|im_end|>\n<|im_start|>assistant\n", 0), (ANSWER1, 1), ("<|im_end|>", 1),
        (f"\n<|im_start|>user\n{USER2}<|im_end|>\n<|im_start|>assistant\n", 0), (ANSWER2, 1), ("<|im_end|>", 1),
        ("\n", 0),
    ]
    ids, mask = [], []
    for text, trained in pieces:  # the real tokenizer on each piece alone
        piece_ids = smollm2_tokenizer(text, add_special_tokens=False)["input_ids"]
        ids += piece_ids
        mask += [trained] * len(piece_ids)
    assert (out.input_ids, out.loss_mask) == (ids, mask)
    golden = json.loads((GOLDEN / "smollm2_chatml_mask.json").read_text())
    assert {"input_ids": out.input_ids, "loss_mask": out.loss_mask} == golden
    assert smollm2_tokenizer.decode([i for i, m in zip(out.input_ids, out.loss_mask, strict=True) if m]) == (
        f"{ANSWER1}<|im_end|>{ANSWER2}<|im_end|>")
