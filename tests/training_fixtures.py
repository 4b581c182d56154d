"""A tiny saved target and a tiny prepared dataset on disk, for training tests."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import torch

from dflash_train.data.prepared import tokenizer_hash
from tests.tiny_models import make_tiny_target, make_tiny_tokenizer


def save_tiny_target(path: Path, arch: str = "qwen3", num_layers: int = 6, seed: int = 0) -> Path:
    target = make_tiny_target(arch, num_layers=num_layers, seed=seed)
    with torch.no_grad():  # a peaked head and distinct embeddings, so a drafter can learn in few steps
        target.model.get_output_embeddings().weight.mul_(25.0)
        target.model.get_input_embeddings().weight.mul_(25.0)
    target.model.save_pretrained(path)
    target.tokenizer.save_pretrained(path)
    return path


def save_tiny_prepared(path: Path, num_rows: int = 24, seed: int = 0, min_len: int = 40, max_len: int = 72) -> Path:
    """Random 'chats': a prompt of unsupervised tokens, then a supervised response."""
    gen = torch.Generator().manual_seed(seed)
    rows: dict[str, list[list[int]]] = {"input_ids": [], "loss_mask": []}
    for _ in range(num_rows):
        length = int(torch.randint(min_len, max_len + 1, (1,), generator=gen))
        prompt = int(torch.randint(5, 15, (1,), generator=gen))
        # a learnable pattern: each response token follows from the previous one
        start = int(torch.randint(10, 200, (1,), generator=gen))
        ids = torch.randint(10, 250, (prompt,), generator=gen).tolist()
        ids += [10 + (start + 7 * i) % 240 for i in range(length - prompt)]
        rows["input_ids"].append(ids)
        rows["loss_mask"].append([0] * prompt + [1] * (length - prompt))
    datasets.Dataset.from_dict(rows).save_to_disk(str(path))
    meta = {"target": "tiny", "tokenizer_hash": tokenizer_hash(make_tiny_tokenizer()), "rows": num_rows}
    (path / "dflash_data.json").write_text(json.dumps(meta))
    return path
