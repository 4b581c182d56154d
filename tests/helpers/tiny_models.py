"""Tiny random causal LMs and tokenizers built locally, for fast CPU tests.

Import these helpers from any test: ``make_tiny_tokenizer``, ``make_tiny_model``, ``make_tiny_target``;
``write_tiny_gguf`` writes a small well-formed GGUF file.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from tokenizers import AddedToken, Tokenizer, models, normalizers, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MistralConfig,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
)

from dflash_train.target import TargetModel

TINY_ARCHS: tuple[str, ...] = ("llama", "qwen2", "qwen3", "mistral")

_CONFIG_CLASSES: dict[str, type[PretrainedConfig]] = {
    "llama": LlamaConfig,
    "qwen2": Qwen2Config,
    "qwen3": Qwen3Config,
    "mistral": MistralConfig,
}

# ChatML, as used by SmolLM2 and Qwen.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Ids 0..n-1 in this order; the <reserved_*> tokens are never used by the chat template.
DEFAULT_SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<unk>",
    "<reserved_0>",
    "<reserved_1>",
    "<reserved_2>",
)

TINY_WORDS: tuple[str, ...] = (
    *("system", "user", "assistant", "you", "are", "a", "helpful", "hello", "who", "i", "am", "an", "the"),
    *("of", "and", "to", "is", "in", "it", "what", "capital", "france", "paris", "be", "brief", "yes", "no"),
    *(".", ",", "?", "!", ":"),
)

TINY_EMBEDDING_ROWS = 320


def make_tiny_tokenizer(
    vocab_size: int = 256,
    special_tokens: Sequence[str] = DEFAULT_SPECIAL_TOKENS,
    chat_template: str | None = CHATML_TEMPLATE,
    mask_token: str | None = None,
) -> PreTrainedTokenizerFast:
    """A lower-casing word-level tokenizer with ``vocab_size`` tokens: specials first, then words.

    ``<|im_end|>`` is eos, ``<|endoftext|>`` pad, ``<unk>`` unk (each only if listed in ``special_tokens``);
    ``mask_token``, if given, is appended to the specials and registered as the tokenizer's mask token.
    """
    specials = list(special_tokens) + ([mask_token] if mask_token else [])
    words = list(TINY_WORDS) + [f"w{i}" for i in range(vocab_size)]
    vocab = {token: i for i, token in enumerate((specials + words)[:vocab_size])}
    if len(vocab) != vocab_size:
        raise ValueError(
            f"vocab_size {vocab_size} is too small for {len(specials)} special tokens plus words."
        )
    unk = "<unk>" if "<unk>" in vocab else None
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=unk))
    backend.normalizer = normalizers.Lowercase()
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in specials])

    def listed(token: str) -> str | None:
        return token if token in specials else None

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=listed("<|im_end|>"),
        pad_token=listed("<|endoftext|>"),
        unk_token=unk,
        mask_token=mask_token,
    )
    tokenizer.chat_template = chat_template
    return tokenizer


def make_tiny_config(
    arch: str,
    num_layers: int = 6,
    tie_embeddings: bool = False,
    vocab_rows: int = TINY_EMBEDDING_ROWS,
    tokenizer: PreTrainedTokenizerFast | None = None,
) -> PretrainedConfig:
    if arch not in _CONFIG_CLASSES:
        raise ValueError(f"Unknown tiny arch {arch!r}; use one of {', '.join(TINY_ARCHS)}.")
    return _CONFIG_CLASSES[arch](
        vocab_size=vocab_rows,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        tie_word_embeddings=tie_embeddings,
        eos_token_id=tokenizer.eos_token_id if tokenizer else None,
        pad_token_id=tokenizer.pad_token_id if tokenizer else None,
        bos_token_id=None,
    )


def make_tiny_model(
    arch: str,
    num_layers: int = 6,
    seed: int = 0,
    tie_embeddings: bool = False,
    vocab_rows: int = TINY_EMBEDDING_ROWS,
    tokenizer: PreTrainedTokenizerFast | None = None,
) -> PreTrainedModel:
    """A seeded random fp32 causal LM of ``arch`` (llama, qwen2, qwen3, mistral), in eval mode."""
    config = make_tiny_config(arch, num_layers, tie_embeddings, vocab_rows, tokenizer)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model.eval()


def make_tiny_target(
    arch: str, num_layers: int = 6, seed: int = 0, tie_embeddings: bool = False
) -> TargetModel:
    """A frozen ``TargetModel`` around ``make_tiny_model`` and ``make_tiny_tokenizer``."""
    tokenizer = make_tiny_tokenizer()
    model = make_tiny_model(arch, num_layers, seed, tie_embeddings, tokenizer=tokenizer)
    return TargetModel(model, tokenizer)


def tiny_batch(
    batch: int = 2, seq_len: int = 12, seed: int = 0, low: int = 7, high: int = 256
) -> torch.Tensor:
    """Random token ids of ordinary words (above the tiny tokenizer's special tokens)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(low, high, (batch, seq_len), generator=generator)


def write_tiny_gguf(path: Path, seed: int = 0) -> Path:
    """A small well-formed GGUF file (header, metadata, two float32 tensors); `seed` changes the values."""
    import gguf

    path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(2)
    rng = np.random.default_rng(seed)
    writer.add_tensor("token_embd.weight", rng.standard_normal((64, 32), dtype=np.float32))
    writer.add_tensor("output_norm.weight", np.ones(32, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def save_tiny_target_dir(path: Path, arch: str = "qwen3", num_layers: int = 6, seed: int = 1) -> Path:
    """A tiny random target saved as a local model directory (weights and tokenizer), for commands to load."""
    target = make_tiny_target(arch, num_layers=num_layers, seed=seed)
    target.model.save_pretrained(path)
    target.tokenizer.save_pretrained(path)
    return path
