"""The extraction benchmark's CPU-side parts (the benchmark itself needs a GPU): the disk-alone write
measures what it claims and leaves nothing behind; the host profile names the operators that ran."""

from __future__ import annotations

from pathlib import Path

import torch

from benchmarks.extract import disk_alone_seconds, host_profile


def test_disk_alone_writes_the_bytes_in_whole_shards_and_cleans_up(tmp_path: Path) -> None:
    seconds, size = disk_alone_seconds(tmp_path / "disk", total_bytes=3_000_000, shards=3, threads=2)
    data = 3 * (1_000_000 // 64) * 64  # 64 equal parts per shard
    assert seconds > 0 and 3 * 8 < size - data < 3 * (8 + 256)  # + a length prefix and a short header per file
    assert not (tmp_path / "disk").exists()


def test_host_profile_lists_the_operators() -> None:
    table = host_profile(lambda: torch.ones(64, 64) @ torch.ones(64, 64))
    assert "aten::mm" in table and "Self CPU" in table
