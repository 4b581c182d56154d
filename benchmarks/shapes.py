"""Model shapes of the random-weight targets the speed benchmarks build, and the builder.

Speed depends on a model's shapes, not its weights, so the decode benchmarks time random-weight models of
the real shapes (Qwen3-8B, SmolLM2-135M) and tiny stand-ins of the same architectures for CPU smoke tests.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from dflash_train.target import TargetModel

QWEN3_8B = dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
                rope_theta=1_000_000.0, tie_word_embeddings=False)
TINY_QWEN3 = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, vocab_size=512, max_position_embeddings=4096,
                  rope_theta=1_000_000.0, tie_word_embeddings=False)
SMOLLM2_135M = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                    num_key_value_heads=3, head_dim=64, vocab_size=49152, max_position_embeddings=8192,
                    rope_theta=100_000.0, rms_norm_eps=1e-5, tie_word_embeddings=True)
TINY_LLAMA = dict(hidden_size=48, intermediate_size=96, num_hidden_layers=6, num_attention_heads=3,
                  num_key_value_heads=1, head_dim=16, vocab_size=256, max_position_embeddings=1024,
                  rope_theta=100_000.0, rms_norm_eps=1e-5, tie_word_embeddings=True)
# name -> (model type, shape, tiny stand-in for CPU smoke tests)
SHAPES: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    "qwen3-8b": ("qwen3", QWEN3_8B, TINY_QWEN3), "smollm2": ("llama", SMOLLM2_135M, TINY_LLAMA)}


def random_target(model_type: str, shape: dict[str, Any], device: torch.device, dtype: torch.dtype) -> TargetModel:
    """A `model_type` model of `shape` with seeded random weights, in eval mode."""
    torch.manual_seed(0)
    with torch.device(device):  # initialised in place: 8B parameters would take minutes on the CPU
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **shape), dtype=dtype)
    return TargetModel(model.eval(), tokenizer=None)
