"""The target-alone pass kept on disk: read back only under the very key it was written with (same identity,
same prompts), and a file that cannot be used is decoded again, never trusted."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from dflash_train.eval.target_pass_cache import TargetPassCache, pass_key, target_identity
from dflash_train.runtime.engine import EngineConfig, RunStats
from dflash_train.runtime.state import RequestOutput
from tests.helpers.tiny_models import make_tiny_target

IDENTITY = {"format": 1, "target": "v2-abc", "dtype": "torch.bfloat16", "device": "cpu", "torch": "x", "engine": "E"}
PROMPTS = [[1, 2, 3], [4, 5]]
OUTPUTS = [RequestOutput([7, 8, 2], [1, 1, 1], 3, "stop"), RequestOutput([9] * 4, [1] * 4, 2, "length")]
STATS = RunStats(wall_s=2.5, prefill_s=0.5, cycles=7, new_tokens=7)


def test_a_stored_pass_reads_back_whole(tmp_path: Path) -> None:
    cache = TargetPassCache(tmp_path, IDENTITY)
    assert cache.load(PROMPTS) is None
    path = cache.store(PROMPTS, OUTPUTS, STATS)
    assert path.parent == tmp_path and json.loads(path.read_text())["identity"] == IDENTITY
    outputs, stats = TargetPassCache(tmp_path, dict(IDENTITY)).load(PROMPTS)
    assert outputs == OUTPUTS and stats == STATS


@pytest.mark.parametrize("change", ["target", "dtype", "device", "engine"])
def test_another_identity_or_other_prompts_miss(tmp_path: Path, change: str) -> None:
    TargetPassCache(tmp_path, IDENTITY).store(PROMPTS, OUTPUTS, STATS)
    assert TargetPassCache(tmp_path, {**IDENTITY, change: "other"}).load(PROMPTS) is None
    cache = TargetPassCache(tmp_path, IDENTITY)
    assert cache.load([[1, 2, 3], [4, 6]]) is None and cache.load(PROMPTS[:1]) is None
    assert cache.load([[4, 5], [1, 2, 3]]) is None  # the order of the outputs is the order of the prompts
    assert pass_key(IDENTITY, PROMPTS) != pass_key(IDENTITY, [[1, 2], [3, 4, 5]])


def test_an_unusable_file_is_decoded_again(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    cache = TargetPassCache(tmp_path, IDENTITY)
    path = cache.store(PROMPTS, OUTPUTS, STATS)
    for broken in ('{"identity": ', json.dumps({"identity": IDENTITY, "stats": {}, "outputs": [{}, {}]})):
        path.write_text(broken)
        with caplog.at_level(logging.WARNING):
            assert cache.load(PROMPTS) is None
        assert "unusable" in caplog.text
    cache.store(PROMPTS, OUTPUTS, STATS)  # replaced whole by the next store
    assert cache.load(PROMPTS) == (OUTPUTS, STATS)


def test_identity_names_the_weights_and_the_settings() -> None:
    target = make_tiny_target("qwen3", num_layers=2, seed=1)
    other = make_tiny_target("qwen3", num_layers=2, seed=2)
    first = target_identity(target, EngineConfig(max_new_tokens=8))
    assert first == target_identity(target, EngineConfig(max_new_tokens=8))
    assert first["target"] != target_identity(other, EngineConfig(max_new_tokens=8))["target"]
    assert first["engine"] != target_identity(target, EngineConfig(max_new_tokens=9))["engine"]
    assert first["device"] == "cpu" and first["dtype"] == str(next(target.model.parameters()).dtype)


def test_a_failed_write_warns_and_leaves_nothing(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    import dflash_train.eval.target_pass_cache as target_cache

    def full_disk(path: Path, payload: dict) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(target_cache, "write_json_atomically", full_disk)
    cache = TargetPassCache(tmp_path, IDENTITY)
    with caplog.at_level(logging.WARNING):
        assert cache.store(PROMPTS, OUTPUTS, STATS) is None
    assert "No space left" in caplog.text and cache.load(PROMPTS) is None
