"""A conversation's prompt ids and stop tokens: the chat template's own tokenisation, its thinking switch,
and a refused prompt as one line."""

from __future__ import annotations

import pytest

from dflash_train.data.prompt_ids import prompt_ids, stop_token_ids, supports_thinking
from dflash_train.data.target_tokenizer import load_target_tokenizer
from tests.helpers.markers import needs_smollm2
from tests.helpers.tiny_models import make_tiny_tokenizer


def test_chat_prompt_ids_and_thinking_switch() -> None:
    tokenizer = make_tiny_tokenizer()
    ids = prompt_ids(tokenizer, [{"role": "user", "content": "hello who are you"}], thinking=False)
    assert ids == tokenizer("<|im_start|>user\nhello who are you<|im_end|>\n<|im_start|>assistant\n")["input_ids"]
    assert not supports_thinking(tokenizer)
    tokenizer.chat_template = ("{% if enable_thinking is defined and not enable_thinking %}no {% endif %}"
                               "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert supports_thinking(tokenizer)
    assert prompt_ids(tokenizer, [{"role": "user", "content": "yes"}], thinking=False) == tokenizer("no yes")["input_ids"]
    assert prompt_ids(tokenizer, [{"role": "user", "content": "yes"}], thinking=True) == tokenizer("yes")["input_ids"]
    tokenizer.chat_template = None
    assert prompt_ids(tokenizer, [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], False) \
        == tokenizer("a\n\nb")["input_ids"]


def test_stop_tokens_merge_tokenizer_and_generation_config() -> None:
    tokenizer = make_tiny_tokenizer()

    class GenerationConfig:
        eos_token_id = [0, 2]

    assert stop_token_ids(tokenizer, GenerationConfig()) == [0, 2]
    assert stop_token_ids(tokenizer) == [tokenizer.eos_token_id]


@needs_smollm2
def test_eval_prompts_are_encoded_as_the_template_tokenises_them() -> None:
    """The template's own tokenisation (apply_chat_template with tokenize=True) is the reference: eval's ids
    are regeneration's (`ChatTokenizer.encode_prompt`) and both equal it, system prompts and turns included."""
    tokenizer = load_target_tokenizer("smollm2-135m-instruct")
    conversations = [
        [{"role": "user", "content": "Write a haiku about the sea."}],
        [{"role": "system", "content": "You answer in French."}, {"role": "user", "content": "Hello!  How are you?"}],
        [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
         {"role": "user", "content": "and times 3?\n\n```python\nprint(1)\n```"}],
    ]
    for messages in conversations:
        expected = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                      return_dict=True)["input_ids"])
        assert prompt_ids(tokenizer, messages, thinking=False) == expected


def test_a_prompt_the_template_refuses_is_a_one_line_error() -> None:
    tokenizer = make_tiny_tokenizer()
    tokenizer.chat_template = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(ValueError, match="chat template refuses this prompt .*roles must alternate") as error:
        prompt_ids(tokenizer, [{"role": "user", "content": "a"}], thinking=False)
    assert "\n" not in str(error.value)
