"""A SentencePiece-style tokenizer, built like Mistral's ``tokenizer.json``: BPE over ``▁``-joined words
(Metaspace, a ``▁`` prepended only at the start of the text), ``<s>``/``</s>`` special, and the given control
tokens; trained on the turns below, with one of the golden chat templates."""

from __future__ import annotations

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from tests.helpers.paths import GOLDEN

TEMPLATES = GOLDEN / "chat_templates"
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
