"""`benchmarks/multi_gpu.py --cpu`: the two-process checks of the multi-GPU benchmark pass on CPU processes."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_multi_gpu_benchmark_checks_hold_on_cpu_processes(tmp_path: pathlib.Path) -> None:
    out = tmp_path / "multi.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.multi_gpu", "--cpu", "--workdir", str(tmp_path / "w"),
                           "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=900,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    result = json.loads(out.read_text())
    gaps = result["training"]["max_relative_loss_gap"]
    assert set(gaps) == {"ddp", "fsdp2", "ddp-resumed vs ddp", "ddp-then-one vs reference"}
    assert all(gap < 1e-5 for gap in gaps.values()), gaps
    assert all(check["identical"] and check["shards"] > 1 for check in result["rank_split"].values())
