"""The feature-store writer: parts written one after another make a file that the safetensors library
reads back as the concatenated tensors."""

from __future__ import annotations

import pathlib

import torch
from safetensors.torch import load_file

from dflash_train.features.safetensors_writer import write_safetensors


def sample_parts() -> dict[str, list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    lengths = [7, 1, 30, 12, 5]
    return {
        "input_ids": [torch.randint(0, 50_000, (sum(lengths),), generator=gen, dtype=torch.int32)],
        "loss_mask": [torch.randint(0, 2, (sum(lengths),), generator=gen, dtype=torch.uint8)],
        "features": [torch.randn(n, 24, generator=gen).to(torch.bfloat16) for n in lengths],
        "scales": [torch.rand(n, 3, generator=gen) for n in lengths],
        "fp8": [torch.randn(n, 24, generator=gen).to(torch.float8_e4m3fn) for n in lengths],
    }


def test_the_file_reads_back_as_the_concatenated_parts(tmp_path: pathlib.Path) -> None:
    parts = sample_parts()
    write_safetensors(tmp_path / "s.safetensors", parts, {"unit": "3"})
    loaded = load_file(tmp_path / "s.safetensors")
    assert loaded.keys() == parts.keys()
    for name, pieces in parts.items():
        expected = torch.cat(pieces)
        assert loaded[name].dtype == expected.dtype
        assert torch.equal(loaded[name].view(torch.uint8), expected.view(torch.uint8)), name
