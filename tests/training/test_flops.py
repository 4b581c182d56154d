"""The peak rate MFU divides by: the device table, the override variable, and unknown devices."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from dflash_train.training import flops
from dflash_train.training.flops import (
    PEAK_TFLOPS_ENV,
    PeakRate,
    peak_bf16_rate,
    peak_flops,
    training_step_flops,
    visible_pairs,
)
from dflash_train.training.trainer import Trainer
from tests.helpers.tiny_drafts import tiny_config


@pytest.mark.parametrize(
    ("device_name", "tflops", "source"),
    [
        ("NVIDIA H200", 790, "measured"),
        ("NVIDIA H200 NVL", 835, "data sheet"),
        ("NVIDIA H100 80GB HBM3", 743, "measured"),
        ("NVIDIA H100 PCIe", 756, "data sheet"),
        ("NVIDIA H100 NVL", 835, "data sheet"),
        ("NVIDIA GH200 480GB", 989, "data sheet"),
        ("NVIDIA H20", 148, "data sheet"),
        ("NVIDIA A100-SXM4-80GB", 312, "data sheet"),
        ("NVIDIA A100 80GB PCIe", 312, "data sheet"),
        ("NVIDIA L40S", 362, "data sheet"),
        ("NVIDIA L40", 181, "data sheet"),
        ("NVIDIA L4", 121, "data sheet"),
        ("NVIDIA A10", 125, "data sheet"),
        ("NVIDIA GeForce RTX 4090", 165, "data sheet"),
    ],
)
def test_table_by_device_name(device_name: str, tflops: float, source: str) -> None:
    # Whole words only: an L4 is no L40S, an H20 no H200, an A10 no A100.
    assert peak_bf16_rate(device_name, env={}) == PeakRate(tflops * 1e12, source)


@pytest.mark.parametrize("device_name", ["NVIDIA GeForce GTX 1080", "Tesla V100-SXM2-16GB", "cpu", ""])
def test_unknown_device_has_no_rate(device_name: str) -> None:
    assert peak_bf16_rate(device_name, env={}) is None


def test_override_wins_over_the_table() -> None:
    rate = peak_bf16_rate("NVIDIA H200", env={PEAK_TFLOPS_ENV: "989"})
    assert rate == PeakRate(989e12, PEAK_TFLOPS_ENV)
    assert peak_bf16_rate("Some Future GPU", env={PEAK_TFLOPS_ENV: "1500.5"}) == PeakRate(1500.5e12, PEAK_TFLOPS_ENV)


@pytest.mark.parametrize("value", ["abc", "0", "-5", "inf", "nan"])
def test_bad_override_is_a_one_line_error(value: str) -> None:
    with pytest.raises(ValueError, match=PEAK_TFLOPS_ENV):
        peak_bf16_rate("NVIDIA H200", env={PEAK_TFLOPS_ENV: value})


def test_cpu_reports_no_mfu_without_the_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(PEAK_TFLOPS_ENV, raising=False)
    assert peak_flops(torch.device("cpu"), num_devices=2) is None


def test_override_gives_the_sum_over_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PEAK_TFLOPS_ENV, "100")
    assert peak_flops(torch.device("cpu"), num_devices=4) == pytest.approx(400e12)


def test_gpu_rate_comes_from_the_device_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(PEAK_TFLOPS_ENV, raising=False)
    names = {"NVIDIA A100-SXM4-40GB": 312e12, "NVIDIA Mystery 9000": None}
    for name, expected in names.items():
        monkeypatch.setattr(flops.torch.cuda, "get_device_name", lambda device=None, name=name: name)
        total = peak_flops(torch.device("cuda", 0), num_devices=2)
        assert total == (None if expected is None else pytest.approx(2 * expected))


def test_step_flops_count_valid_anchors_only() -> None:
    """A padded anchor slot's block rows are computed but are not model FLOPs: the count equals the
    formula over the valid anchors alone, computed here by hand."""
    config, block = tiny_config(), 4
    anchors = torch.tensor([[3, 9, 0], [5, 0, 0]])
    valid = torch.tensor([[True, True, False], [True, False, False]])
    blocks = SimpleNamespace(anchors=anchors, valid=valid, sequence=None, supervised_index=lambda: torch.arange(10),
                             num_real_rows=None)
    trainer = SimpleNamespace(objective=SimpleNamespace(block_size=block), draft_config=config)
    expected = training_step_flops(config, 40, 3 * block, 10, visible_pairs([([3, 9, 5], 0)], block))
    assert Trainer._flops(trainer, blocks, 40, []) == expected
    blocks.num_real_rows = 7  # blocks padded for a captured step: their real rows only
    expected = training_step_flops(config, 40, 3 * block, 7, visible_pairs([([3, 9, 5], 0)], block))
    assert Trainer._flops(trainer, blocks, 40, []) == expected
