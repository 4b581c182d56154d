"""Checkpoints for the export/import/check tests: written by hand, independently of the exporter, or
exported from a tiny random drafter; and an export loaded back through Transformers remote code.

`ZLAB_QWEN3_8B_CONFIG` is the config.json of the published z-lab/Qwen3-8B-DFlash-b16;
`write_zlab_checkpoint` writes a checkpoint in that layout (its tensor names spelled out here, not
taken from the package) at tiny sizes.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from transformers import AutoModel

from dflash_train.checkpoint import export_checkpoint, save_draft
from dflash_train.models import DFlashConfig, DFlashDraftModel
from dflash_train.target import TargetModel

ZLAB_QWEN3_8B_CONFIG: dict[str, Any] = {
    "architectures": ["DFlashDraftModel"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
    "block_size": 16,
    "bos_token_id": 151643,
    "dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33], "block_size": 16},
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 12288,
    "layer_types": ["full_attention"] * 5,
    "max_position_embeddings": 40960,
    "max_window_layers": 5,
    "model_type": "qwen3",
    "num_attention_heads": 32,
    "num_hidden_layers": 5,
    "num_key_value_heads": 8,
    "num_target_layers": 36,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.57.1",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}


def zlab_tiny_config(**overrides: Any) -> dict[str, Any]:
    """The published layout at tiny sizes: 2 layers, hidden 64, 4/2 heads of 16, 6-layer target of vocab 320."""
    config = json.loads(json.dumps(ZLAB_QWEN3_8B_CONFIG))
    config.update(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  num_hidden_layers=2, layer_types=["full_attention"] * 2, max_window_layers=2, num_target_layers=6,
                  vocab_size=320, max_position_embeddings=256, rope_theta=10000)
    config["dflash_config"] = {"mask_token_id": 300, "target_layer_ids": [1, 3], "block_size": 16}
    config.update(overrides)
    return config


def zlab_tensors(config: dict[str, Any], seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """Random tensors named as in the published safetensors file (no prefix, no embed/lm_head)."""
    gen = torch.Generator().manual_seed(seed)
    h, d, inter = config["hidden_size"], config["head_dim"], config["intermediate_size"]
    q, kv = config["num_attention_heads"] * d, config["num_key_value_heads"] * d
    k = len(config["dflash_config"]["target_layer_ids"])
    shapes = {"fc.weight": (h, k * h), "hidden_norm.weight": (h,), "norm.weight": (h,)}
    for i in range(config["num_hidden_layers"]):
        shapes |= {
            f"layers.{i}.input_layernorm.weight": (h,),
            f"layers.{i}.post_attention_layernorm.weight": (h,),
            f"layers.{i}.self_attn.q_proj.weight": (q, h),
            f"layers.{i}.self_attn.k_proj.weight": (kv, h),
            f"layers.{i}.self_attn.v_proj.weight": (kv, h),
            f"layers.{i}.self_attn.o_proj.weight": (h, q),
            f"layers.{i}.self_attn.q_norm.weight": (d,),
            f"layers.{i}.self_attn.k_norm.weight": (d,),
            f"layers.{i}.mlp.gate_proj.weight": (inter, h),
            f"layers.{i}.mlp.up_proj.weight": (inter, h),
            f"layers.{i}.mlp.down_proj.weight": (h, inter),
        }
    # Norm weights near 1 and projections of std 0.05, as in a trained drafter.
    return {name: ((1 + 0.1 * torch.randn(shape, generator=gen)) if len(shape) == 1
                   else 0.05 * torch.randn(shape, generator=gen)).to(dtype) for name, shape in shapes.items()}


def write_zlab_checkpoint(
    directory: Path, config: dict[str, Any] | None = None, seed: int = 0, prefix: str = ""
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    config = config or zlab_tiny_config()
    tensors = zlab_tensors(config, seed)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    save_file({prefix + k: v for k, v in tensors.items()}, str(directory / "model.safetensors"),
              metadata={"format": "pt"})
    return config, tensors


def tiny_draft_for(
    target: TargetModel, block_size: int = 4, seed: int = 0, layers: int = 2, **overrides: Any
) -> DFlashDraftModel:
    """A random drafter sized after `target`, with norm weights perturbed so that they matter."""
    config = DFlashConfig.from_target_config(target.config, mask_token_id=256, num_hidden_layers=layers,
                                             block_size=block_size, **overrides)
    torch.manual_seed(seed)
    draft = DFlashDraftModel(config)
    with torch.no_grad():
        for param in draft.parameters():
            if param.ndim == 1:
                param.add_(0.1 * torch.randn_like(param))
    return draft.eval()


def export_tiny(tmp_path: Path, target: TargetModel, name: str = "export", **draft_kwargs: Any) -> Path:
    """A drafter for `target`, saved as a training checkpoint and exported to `tmp_path / name`."""
    train_dir = save_draft(tiny_draft_for(target, **draft_kwargs), tmp_path / f"{name}-train", dtype=torch.float32)
    out = export_checkpoint(train_dir, tmp_path / name, target=target.config)
    shutil.rmtree(train_dir)
    return out


def load_remote(directory: Path) -> Any:
    model, info = AutoModel.from_pretrained(directory, trust_remote_code=True, dtype=torch.float32,
                                            output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    return model


def reference_greedy(target: TargetModel, input_ids: torch.Tensor, num_tokens: int) -> list[int]:
    """Greedy decoding by full recomputation each step: no cache, nothing shared with the loop."""
    ids = input_ids
    for _ in range(num_tokens):
        ids = torch.cat([ids, target.model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids[0, input_ids.shape[1] :].tolist()
