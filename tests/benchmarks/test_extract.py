"""The extraction benchmark's CPU-side parts (the benchmark itself needs a GPU): the disk-alone write
measures what it claims and leaves nothing behind; the host profile names the operators that ran."""

from __future__ import annotations

from pathlib import Path

import pytest
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


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_to_host_variant_runs_the_extraction_but_writes_no_shard(tmp_path: Path, monkeypatch, dtype: str) -> None:
    import argparse

    import datasets

    import dflash_train.features.extract as extract_module
    from benchmarks.extract import to_host_seconds
    from tests.helpers.tiny_models import make_tiny_target

    saved, capture, batches = extract_module._save_shard, extract_module.compute_features, []

    def counted_capture(*args, **kwargs):
        batches.append(1)
        return capture(*args, **kwargs)

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)  # the benchmark's timing fences, CPU run
    monkeypatch.setattr(extract_module, "compute_features", counted_capture)
    monkeypatch.setattr("benchmarks.extract.LAYER_IDS", [0, 2])
    target = make_tiny_target("qwen3", num_layers=6)
    data = datasets.Dataset.from_dict({"input_ids": [[7, 8, 9, 10]] * 5, "loss_mask": [[0, 0, 1, 1]] * 5})
    args = argparse.Namespace(rows_per_shard=2, token_budget=8, write_threads=2)
    seconds, size = to_host_seconds(target, data, tmp_path / "host", dtype, args)
    assert seconds > 0 and size == 0 and len(batches) == 3  # 3 shards of 2, 2, 1 rows ran; nothing written
    assert not list(tmp_path.glob("**/*.safetensors"))
    assert extract_module._save_shard is saved  # restored for the variants after it


def test_padding_ratios_count_the_baselines_and_each_shards_groups() -> None:
    from benchmarks.extract import padding_ratios

    # budget 64 (a group costs 2 tokens): all rows at once -> [20, 20] and [19, 19], no padding; each window
    # of 2 rows -> [20, 19] padded to 40 (one pad is cheaper than a second group)
    ratios = padding_ratios([20, 19, 20, 19], token_budget=64, rows_per_window=2)
    assert ratios == {"baseline": 1.0, "extract": 80 / 78}


def test_summary_sets_each_variant_against_the_faster_baseline_and_the_disks_ceilings(capsys) -> None:
    from benchmarks.extract import LAYER_IDS, summarize

    results = {
        "baseline": {"tokens_per_s": 800.0, "bytes_written": 0, "write_gb_per_s": 0.0},
        "baseline, HF check": {"tokens_per_s": 1000.0, "bytes_written": 0, "write_gb_per_s": 0.0},
        "extract-bf16": {"tokens_per_s": 900.0, "bytes_written": 10**9, "write_gb_per_s": 1.0},
        "disk alone": {"tokens_per_s": 5.0, "bytes_written": 10**9, "write_gb_per_s": 2.0},
    }
    summarize(results, hidden_size=10)
    assert results["extract-bf16"]["fraction_of_baseline"] == pytest.approx(0.9)  # of the faster baseline
    assert results["baseline"]["fraction_of_baseline"] == pytest.approx(0.8)
    disk = results["disk alone"]
    assert disk["tokens_per_s"] is None and "fraction_of_baseline" not in disk
    layers = len(LAYER_IDS)  # 2 GB/s over a token's bytes: bf16 features, int32 id, uint8 mask (fp8: + scales)
    assert disk["ceiling_bf16_tokens_per_s"] == pytest.approx(2e9 / (layers * 10 * 2 + 5))
    assert disk["ceiling_fp8_tokens_per_s"] == pytest.approx(2e9 / (layers * 10 + 4 * layers + 5))
    assert "extract-bf16" in capsys.readouterr().out
