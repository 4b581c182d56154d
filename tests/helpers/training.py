"""A tiny saved target and a tiny prepared dataset on disk, the overrides that train on them, and runs
launched in their own process, for training tests."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import datasets
import torch

from dflash_train.data.prepared import tokenizer_hash
from dflash_train.training.tracking import read_metrics
from tests.helpers.paths import REPO
from tests.helpers.tiny_models import make_tiny_target, make_tiny_tokenizer


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


def overrides(assets: dict[str, Path], out: Path, **extra: object) -> list[str]:
    """Config overrides for a short run on `assets` (a saved tiny target and prepared data) into `out`."""
    values: dict[str, object] = {
        "model.target": assets["target"], "model.target_dtype": "float32", "model.num_draft_layers": 2,
        "model.block_size": 4, "data.prepared": assets["data"], "data.max_length": 64,
        "data.validation_fraction": 0.2, "training.output_dir": out, "training.max_steps": 12,
        "training.batch_size": 2, "training.num_anchors": 8, "training.loss_decay_gamma": 4,
        "training.mixed_precision": "no", "training.learning_rate": 3e-3, "training.log_every": 1,
        "training.eval_every": 6, "training.save_every": 3, "training.keep_last": 2,
        "training.deterministic": True, "tracking.report_to": "none",
    }
    values.update(extra)
    return [f"{k}={v}" for k, v in values.items()]


def train_losses(out: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(out / "metrics.jsonl")["train"]}


def failure_report(output: str, limit: int = 3000) -> str:
    """What a failed multi-process launch printed, for the assertion: each worker's own lines first (a worker
    that crashed first is otherwise buried under the other's barrier error and the launcher's summary), then
    the end of the output."""
    ranks = sorted({line.split("]:", 1)[0] + "]" for line in output.splitlines() if line.startswith("[rank")})
    own = ["\n".join(line for line in output.splitlines() if line.startswith(rank))[-limit:] for rank in ranks]
    return "\n...\n".join([*own, output[-limit:]])


def launch(args: list[str], env_extra: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    # One OpenMP thread, as the test process runs with: a tiny model gains nothing from more, and on a busy
    # 2-core machine their spin-waits make a run several times slower (30 s instead of 8 for 60 steps).
    env = {**os.environ, "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1",
           **(env_extra or {})}
    # Own process group: a launch that hangs is stopped with the workers it started.
    return subprocess.Popen(args, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)


def on_two_cpu_processes(module: list[str], port_base: int, timeout: int = 300) -> str:
    """`accelerate launch` of `python -m <module...>` on two CPU processes (gloo; a port of its own from
    `port_base`, so that tests in parallel do not meet), waited for: what it printed, or an assertion with each
    worker's own lines when it failed, or when it hung (the launch and its workers are stopped then)."""
    args = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
            str(REPO / "recipes/accelerate/cpu_2proc.yaml"), "--main_process_port", str(port_base + os.getpid() % 400),
            "-m", *module]
    proc = launch(args)
    try:
        output = proc.communicate(timeout=timeout)[0].decode()
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError("two processes hung") from None
    assert proc.returncode == 0, failure_report(output)
    return output


def train_on_two_cpu_processes(overrides: list[str], port_base: int) -> str:
    """`dflash_train.train` with the CPU recipe and `overrides` on two CPU processes (`on_two_cpu_processes`)."""
    return on_two_cpu_processes(["dflash_train.train", "--config", str(REPO / "recipes/smollm2-135m-dflash-b16-cpu.yaml"),
                                 *overrides], port_base)
