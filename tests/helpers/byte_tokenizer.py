"""A byte-level tokenizer per template family (Llama-3, Llama-3.1, Qwen3, three Mistral generations) over the
family's real chat template (tests/golden/chat_templates), with its special tokens: one token per byte, one
per added token, so a mask can be checked against pieces tokenised by hand. And the two-turn conversation
the mask tests use."""

from __future__ import annotations

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast
from transformers.convert_slow_tokenizer import bytes_to_unicode

from tests.helpers.paths import GOLDEN

BYTE_CHARS = bytes_to_unicode()  # byte -> the printable character byte-level BPE uses for it
BYTE_IDS = {byte: i for i, byte in enumerate(BYTE_CHARS)}  # the vocabulary below, in that order

FAMILIES = {
    # family: (template file, special tokens, non-special added tokens, bos, eos)
    "llama3": ("llama3.jinja", ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"], [],
               "<|begin_of_text|>", "<|eot_id|>"),
    "llama31": ("llama31.jinja", ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                                  "<|eom_id|>", "<|python_tag|>"], [], "<|begin_of_text|>", "<|eot_id|>"),
    "qwen3": ("qwen3.jinja", ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], ["<think>", "</think>"], None,
              "<|im_end|>"),
    "mistral_v0.2": ("mistral_v0.2.jinja", ["<unk>", "<s>", "</s>"], [], "<s>", "</s>"),
    "mistral_v1": ("mistral_v1.jinja", ["<unk>", "<s>", "</s>"], [], "<s>", "</s>"),  # [INST] is plain text in V1
    "mistral_v3": ("mistral_v3.jinja", ["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]",
                                        "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]"], [], "<s>", "</s>"),
}


def byte_tokenizer(family: str) -> PreTrainedTokenizerFast:
    template, specials, plain_added, bos, eos = FAMILIES[family]
    vocab = {char: i for i, char in enumerate(BYTE_CHARS.values())}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in plain_added])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=bos, eos_token=eos)
    tokenizer.chat_template = (GOLDEN / "chat_templates" / template).read_text().rstrip("\n")
    return tokenizer


USER1, ANSWER1, USER2, ANSWER2 = "What is 2+2?", "2 + 2 = 4.", "And 3+3, é?", "3 + 3 = 6, ü."


def two_turns(system: str | None = None) -> list[dict]:
    head = [{"role": "system", "content": system}] if system else []
    return head + [{"role": "user", "content": USER1}, {"role": "assistant", "content": ANSWER1},
                   {"role": "user", "content": USER2}, {"role": "assistant", "content": ANSWER2}]
