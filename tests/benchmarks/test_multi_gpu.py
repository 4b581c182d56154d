"""`benchmarks/multi_gpu.py --cpu`: the two-process checks of the multi-GPU benchmark pass on CPU processes,
and an interrupted benchmark continues where it stopped without launching a finished run again."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

from tests.helpers.paths import REPO

ENV = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": ""}


def run_benchmark(work: pathlib.Path, out: pathlib.Path, *extra: str) -> dict:
    proc = subprocess.run([sys.executable, "-m", "benchmarks.multi_gpu", "--cpu", "--workdir", str(work),
                           "--out", str(out), *extra], cwd=REPO, capture_output=True, text=True, timeout=900, env=ENV)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    return json.loads(out.read_text())


@pytest.mark.slow
def test_multi_gpu_benchmark_checks_hold_on_cpu_processes(tmp_path: pathlib.Path) -> None:
    work, out = tmp_path / "w", tmp_path / "multi.json"
    stopped = run_benchmark(work, out, "--time-limit", "0")  # the data checks, then no training run starts
    assert stopped["training"]["not_run"] == ["reference", "ddp", "ddp-resumed", "ddp-then-one"]
    result = run_benchmark(work, out)
    gaps = result["training"]["max_relative_loss_gap"]
    assert set(gaps) == {"ddp", "ddp-resumed vs ddp", "ddp-then-one vs reference"}
    assert all(gap < 1e-5 for gap in gaps.values()), gaps
    assert all(check["identical"] and check["shards"] > 1 for check in result["rank_split"].values())
    logs = {log.name: log.read_text() for log in work.glob("*.log")}
    again = run_benchmark(work, out)  # everything finished: nothing is launched again, same figures
    assert {log.name: log.read_text() for log in work.glob("*.log")} == logs
    assert again["training"]["max_relative_loss_gap"] == gaps and not again["training"]["not_run"]


@pytest.mark.slow
def test_multi_gpu_benchmark_on_a_given_target_and_its_chats(tmp_path: pathlib.Path) -> None:
    from tests.helpers.training import save_tiny_prepared, save_tiny_target

    target, prepared = save_tiny_target(tmp_path / "target"), save_tiny_prepared(tmp_path / "prepared", num_rows=24)
    result = run_benchmark(tmp_path / "w", tmp_path / "multi.json", "--target", str(target), "--prepared", str(prepared),
                           "--shared-gpus", "--only", "reference,ddp,ddp-then-one")
    assert result["training"]["throughput"].startswith("not measured")
    assert result["target"] == str(target) and not (tmp_path / "w" / "target").exists()
    gaps = result["training"]["max_relative_loss_gap"]
    assert set(gaps) == {"ddp", "ddp-then-one vs reference"} and all(gap < 1e-5 for gap in gaps.values()), gaps
    assert result["rank_split"] == {} and not (tmp_path / "w" / "regenerate-1").exists()
    assert sorted(path.name for path in (tmp_path / "w").glob("*.log")) == ["ddp-then-one.log", "ddp.log",
                                                                           "reference.log"]


def test_multi_gpu_benchmark_wants_a_target_with_its_chats(tmp_path: pathlib.Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "benchmarks.multi_gpu", "--cpu", "--target", str(tmp_path)],
                          cwd=REPO, capture_output=True, text=True, timeout=120, env=ENV)
    assert proc.returncode != 0 and "--target and --prepared go together" in proc.stderr


def test_only_selects_checks_and_refuses_what_cannot_run() -> None:
    from benchmarks.multi_gpu import CHECKS, parse_only

    assert parse_only(None, shared_gpus=False) == set(CHECKS)
    assert parse_only(None, shared_gpus=True) == set(CHECKS) - {"one"}  # a scaling baseline needs idle GPUs
    assert parse_only(" zero2, fsdp2 ,reference", shared_gpus=True) == {"zero2", "fsdp2", "reference"}
    with pytest.raises(SystemExit, match="unknown check.*zero3"):
        parse_only("ddp,zero3", shared_gpus=False)
    with pytest.raises(SystemExit, match="add ddp"):
        parse_only("reference,ddp-then-one", shared_gpus=False)
