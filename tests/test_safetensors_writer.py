"""The feature-store writer: parts written in place (one thread or several) make the same file, which
the safetensors library reads back as the concatenated tensors."""

from __future__ import annotations

import errno
import os
import pathlib

import pytest
import torch
from safetensors.torch import load_file

from dflash_train.data.safetensors_writer import write_safetensors


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


@pytest.mark.parametrize("threads", [1, 4])
def test_the_file_reads_back_as_the_concatenated_parts(tmp_path: pathlib.Path, threads: int) -> None:
    parts = sample_parts()
    write_safetensors(tmp_path / "s.safetensors", parts, {"unit": "3"}, threads=threads)
    loaded = load_file(tmp_path / "s.safetensors")
    assert loaded.keys() == parts.keys()
    for name, pieces in parts.items():
        expected = torch.cat(pieces)
        assert loaded[name].dtype == expected.dtype
        assert torch.equal(loaded[name].view(torch.uint8), expected.view(torch.uint8)), name


def test_threaded_writes_and_short_pwrites_make_the_same_bytes(tmp_path: pathlib.Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    parts = sample_parts()
    write_safetensors(tmp_path / "one.safetensors", parts, {"unit": "0"}, threads=1)
    real_pwrite = os.pwrite
    monkeypatch.setattr(os, "pwrite", lambda fd, data, offset: real_pwrite(fd, data[:100], offset))
    write_safetensors(tmp_path / "many.safetensors", parts, {"unit": "0"}, threads=4)
    assert (tmp_path / "many.safetensors").read_bytes() == (tmp_path / "one.safetensors").read_bytes()


def test_a_failed_threaded_write_raises(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def full_disk(fd: int, data: memoryview, offset: int) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwrite", full_disk)
    with pytest.raises(OSError, match="No space left"):
        write_safetensors(tmp_path / "s.safetensors", sample_parts(), {}, threads=4)
