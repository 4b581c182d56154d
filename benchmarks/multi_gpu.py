"""Two processes against one: equal training, scaling, resume across world sizes, rank-split data (2 GPUs).

    python -m benchmarks.multi_gpu                   # on a 2-GPU machine: writes benchmarks/results/multi_gpu.json
    python -m benchmarks.multi_gpu --cpu             # the same checks with CPU processes over gloo (no scaling)

Training runs go through `accelerate launch -m dflash_train.train` with the launch configs of
`recipes/accelerate/`, on a random Qwen3-8B-wide target (GPU; 4 layers, 3,072-token chats, N = 512), the
tiny test target (CPU), or a given target and its prepared chats (`--target DIR --prepared DIR`: the
default recipe's GPU variant on the real SmolLM2-135M-Instruct, say):
- `reference`: 1 process, 2·b sequences per step; `one`: 1 process, b per step (the scaling baseline);
- `ddp`, `zero2` and `fsdp2` (both GPU only): 2 processes, b each — the same global batch as `reference`, so their
  per-step losses must match it (tolerance: 2e-2 relative in bf16 on GPU, 1e-5 in fp32 on CPU);
- `ddp-resumed`: `ddp`'s checkpoint of the middle step resumed by 2 processes; the steps after it must
  equal `ddp`'s;
- `ddp-then-one`: the same checkpoint resumed by 1 process with 2·b per step; must equal `reference`.
Scaling = tokens/s of each 2-process run over `one` (median step time after warm-up; goal ≥ 1.8×).
On GPUs `reference` and `one` run side by side, one GPU each. `--time-limit` stops launching runs after
that many seconds; re-running with the same `--workdir` continues with the runs not yet finished.
`--only ddp,zero2,...` runs a subset (`--shared-gpus` leaves out `one`, whose only use is the scaling figure).
Rank-split data: `regenerate` and `extract` with 2 ranks write byte-identical shards to a 1-rank run.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import stamp, write_result
from dflash_train.training.config import TrainingConfig

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes/smollm2-135m-dflash-b16.yaml"


CHECKS = ("reference", "one", "ddp", "zero2", "fsdp2", "ddp-resumed", "ddp-then-one", "rank-split")


def parse_only(text: str | None, shared_gpus: bool) -> set[str]:
    """The checks to run. `one` exists only as the scaling baseline: pointless on shared GPUs."""
    if text is None:
        return set(CHECKS) - ({"one"} if shared_gpus else set())
    chosen = {name.strip() for name in text.split(",") if name.strip()}
    unknown = chosen - set(CHECKS)
    if unknown:
        raise SystemExit(f"--only: unknown check(s) {', '.join(sorted(unknown))}; choose from {', '.join(CHECKS)}")
    needs = {"ddp-resumed": "ddp", "ddp-then-one": "ddp"}
    missing = sorted({needs[n] for n in chosen if n in needs} - chosen)
    if missing:
        raise SystemExit(f"--only: the resume checks start from ddp's checkpoint; add {', '.join(missing)}")
    return chosen


def launch_configs(cpu: bool) -> dict[str, tuple[str, int]]:
    if cpu:
        return {"reference": ("", 1), "ddp": ("cpu_2proc.yaml", 2)}  # FSDP and DeepSpeed need CUDA
    return {"reference": ("single_gpu.yaml", 1), "one": ("single_gpu.yaml", 1), "ddp": ("ddp.yaml", 2),
            "zero2": ("deepspeed_zero2.yaml", 2), "fsdp2": ("fsdp2.yaml", 2)}


class Runs:
    """The launched training runs of one benchmark, in one work folder: a run whose metrics reach the last
    step is not launched again (a re-invocation with the same --workdir continues), no run starts past
    the deadline, and a failed run is recorded rather than ending the benchmark."""

    def __init__(self, work: Path, common: list[str], steps: int, env: dict[str, str], deadline: float,
                 recipe: Path = RECIPE) -> None:
        self.work, self.common, self.steps, self.env, self.deadline = work, common, steps, env, deadline
        self.recipe = recipe
        self.failed: dict[str, str] = {}
        self.wall_seconds: dict[str, float] = {}  # each launch's, setup included (benchmarks/train_scaling.py)
        self.pending: list[str] = []
        self.keep = {"ddp"}  # runs whose checkpoints later runs resume from

    def done(self, name: str) -> bool:
        path = self.work / name / "metrics.jsonl"
        return path.exists() and self.steps in train_metrics(self.work / name)

    def command(self, config: str, processes: int, port: int) -> list[str]:
        if processes == 1 and not config:
            return [sys.executable, "-m", "dflash_train.train"]
        return [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                str(REPO / "recipes/accelerate" / config), "--num_processes", str(processes),
                "--main_process_port", str(port), "-m", "dflash_train.train"]

    def launch(self, group: list[tuple[str, str, int, int | None, dict[str, str]]]) -> None:
        """Runs (name, launch config, processes, sequences per process, extra env) side by side; sequences
        None keeps the recipe's."""
        todo = [run for run in group if not self.done(run[0])]
        if todo and time.time() > self.deadline:
            self.pending += [run[0] for run in todo]
            return
        procs, started = [], time.time()
        for name, config, processes, batch, extra in todo:
            overrides = [*self.common, f"training.output_dir={self.work / name}",
                         *([f"training.batch_size={batch}"] if batch else [])]
            log = (self.work / f"{name}.log").open("a")
            procs.append((name, log, subprocess.Popen(
                [*self.command(config, processes, free_port()), "--config", str(self.recipe),
                 *overrides], cwd=REPO, env={**self.env, **extra}, stdout=log, stderr=subprocess.STDOUT)))
        for name, log, proc in procs:
            code = proc.wait(timeout=1800)
            self.wall_seconds[name] = time.time() - started
            log.close()
            if code != 0:
                tail = (self.work / f"{name}.log").read_text()[-3000:]
                self.failed[name] = f"exit {code}: {tail}"
                print(f"{name} FAILED (exit {code}):\n{tail}", flush=True)
            else:
                if name not in self.keep:  # checkpoints of Qwen3-8B-wide drafters fill a disk quickly
                    shutil.rmtree(self.work / name / "checkpoints", ignore_errors=True)
                print(f"{name}: {self.steps} steps, last loss {train_metrics(self.work / name)[self.steps]['loss']:.4f}",
                      flush=True)

    def metrics(self) -> dict[str, dict[int, dict[str, Any]]]:
        return {path.parent.name: train_metrics(path.parent) for path in sorted(self.work.glob("*/metrics.jsonl"))
                if self.done(path.parent.name)}


def free_port() -> int:
    """A fresh rendezvous port for every launch, from the OS: fixed numbers collide with another benchmark's or
    test's launches on the same machine (the port is free when asked; the launch binds it a moment later)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def launch_env(cpu: bool) -> dict[str, str]:
    """The launched runs' environment: this checkout importable, and CPU processes hide any GPU."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           "NCCL_NVLS_ENABLE": "0"}  # NVLink multicast (NVLS) off: it hangs or fails on some multi-GPU hosts
    if cpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def train_metrics(out: Path) -> dict[int, dict[str, Any]]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {r["step"]: r for r in rows if r["split"] == "train"}


def tokens_per_s(metrics: dict[int, dict[str, Any]], warmup: int) -> float:
    steps = [m for step, m in sorted(metrics.items()) if step > warmup]
    return statistics.median(m["tokens"] / m["step_seconds"] for m in steps)


def max_relative_gap(a: dict[int, dict[str, Any]], b: dict[int, dict[str, Any]], steps: list[int]) -> float:
    return max(abs(a[s]["loss"] - b[s]["loss"]) / abs(a[s]["loss"]) for s in steps)


def setup(work: Path, cpu: bool, rows: int, seq_len: int, layers: int) -> tuple[Path, Path]:
    target, data = work / "target", work / "prepared"
    if (data / "dflash_data.json").exists():
        return target, data  # a continued benchmark
    if cpu:
        from tests.helpers.training import save_tiny_prepared, save_tiny_target

        save_tiny_target(target), save_tiny_prepared(data, num_rows=rows)
    else:
        from benchmarks.train_throughput import save_random_chats, save_random_target

        save_random_target(target, layers)
        save_random_chats(data, rows, seq_len, target)
    return target, data


def common_overrides(args: argparse.Namespace, target: Path, data: Path) -> list[str]:
    common = [f"model.target={target}", "model.num_draft_layers=" + ("2" if args.cpu else "5"),
              "data.validation_fraction=0", "tracking.report_to=none", "training.log_every=1",
              f"training.max_steps={args.steps}", f"training.save_every={resume_step(args)}", "training.keep_last=2",
              "training.resume=auto", f"data.prepared={data}"]
    if args.cpu:
        common += ["model.target_dtype=float32", "model.block_size=4", "training.num_anchors=8",
                   "training.mixed_precision=no", "training.deterministic=true", "training.loss_decay_gamma=4",
                   "training.learning_rate=3e-3", "training.attention=dense"]
        return common + ([] if args.target else ["data.max_length=64"])
    if not args.target:  # the random Qwen3-8B-wide target
        common += ["model.mask_token_id=151669", "model.target_layer_ids=[1,2,3]"]
    return common + [f"data.max_length={args.seq_len}", f"training.num_anchors={args.num_anchors}",
                     "training.compile=true", "training.attention=flex"]


def resume_step(args: argparse.Namespace) -> int:
    return args.steps // 2  # the resume checks start from ddp's checkpoint here


def copy_checkpoint(runs: Runs, source: str, dest: str, step: int) -> None:
    """`dest` starts as a resume of `source`'s checkpoint at `step` (nothing else of `source` is copied);
    a finished `dest` (whose own checkpoints are pruned) is left alone."""
    name = f"step-{step:08d}"
    target = runs.work / dest / "checkpoints" / name
    if runs.done(source) and not runs.done(dest) and not target.exists():
        shutil.rmtree(runs.work / dest, ignore_errors=True)
        shutil.copytree(runs.work / source / "checkpoints" / name, target)


def run_training_checks(args: argparse.Namespace, work: Path, target: Path, data: Path,
                        env: dict[str, str]) -> dict[str, Any]:
    b, configs = args.batch, {n: c for n, c in launch_configs(args.cpu).items() if n in args.only}
    runs = Runs(work, common_overrides(args, target, data), args.steps, env, args.deadline)
    gpu = {} if args.cpu else {"reference": {"CUDA_VISIBLE_DEVICES": "0"}, "one": {"CUDA_VISIBLE_DEVICES": "1"}}
    # The one-process runs side by side, one GPU each; then the two-process runs one at a time (ddp first:
    # the resume checks start from its middle checkpoint); then the resume checks: on 2 processes (must
    # continue as ddp did) and on 1 process with the same global batch (must continue as the reference did).
    runs.launch([(name, configs[name][0], 1, 2 * b if name == "reference" else b, gpu.get(name, {}))
                 for name in configs if configs[name][1] == 1])
    for name in sorted((n for n in configs if configs[n][1] == 2), key=lambda n: n != "ddp"):
        runs.launch([(name, configs[name][0], 2, b, {})])
    resumes = [("ddp-resumed", configs.get("ddp", ("", 0))[0], 2, b, {}),
               ("ddp-then-one", launch_configs(args.cpu)["reference"][0], 1, 2 * b, gpu.get("reference", {}))]
    for name, config, processes, batch, extra in resumes:
        if name in args.only and "ddp" in configs:
            copy_checkpoint(runs, "ddp", name, resume_step(args))
            runs.launch([(name, config, processes, batch, extra)])
    if all(runs.done(name) for name, *_ in resumes if name in args.only):
        shutil.rmtree(work / "ddp" / "checkpoints", ignore_errors=True)
    return training_result(args, runs)


def training_result(args: argparse.Namespace, runs: Runs) -> dict[str, Any]:
    metrics, steps = runs.metrics(), args.steps
    every, after = list(range(1, steps + 1)), list(range(resume_step(args) + 1, steps + 1))
    comparisons = {name: ("reference", name, every) for name in ("ddp", "zero2", "fsdp2")}
    comparisons |= {"ddp-resumed vs ddp": ("ddp", "ddp-resumed", after),
                    "ddp-then-one vs reference": ("reference", "ddp-then-one", after)}
    gaps = {label: max_relative_gap(metrics[a], metrics[b], at) for label, (a, b, at) in comparisons.items()
            if a in metrics and b in metrics}
    result: dict[str, Any] = {
        "max_relative_loss_gap": gaps, "failed": runs.failed, "not_run": runs.pending,
        "losses": {name: [round(m[s]["loss"], 6) for s in sorted(m)] for name, m in metrics.items()}}
    if args.shared_gpus:
        result["throughput"] = "not measured: the GPUs were shared with another job (--shared-gpus)"
    elif not args.cpu:
        result["tokens_per_s"] = {name: tokens_per_s(metrics[name], args.warmup)
                                  for name in ("one", "ddp", "zero2", "fsdp2") if name in metrics}
        for name in ("ddp", "zero2", "fsdp2"):
            if name in result["tokens_per_s"] and "one" in result["tokens_per_s"]:
                result[f"scaling_{name}"] = result["tokens_per_s"][name] / result["tokens_per_s"]["one"]
    return result


def shard_digests(directory: Path, pattern: str) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.glob(pattern))}


def run_data_checks(work: Path, env: dict[str, str], cpu: bool) -> dict[str, Any]:
    """1 rank vs 2 ranks (each rank its own process and device, as under torchrun), on the tiny test target
    (it has a chat template; what is checked is the split, not the speed). Kept in the work folder."""
    saved = work / "rank_split.json"
    if saved.exists():
        return json.loads(saved.read_text())
    from tests.helpers.training import save_tiny_prepared, save_tiny_target

    target, data = save_tiny_target(work / "tiny-target"), save_tiny_prepared(work / "tiny-prepared", num_rows=24)
    device = ["--device", "cpu"] if cpu else []
    prompts = ["--data", str(REPO / "data/prompts/demo_prompts.jsonl"), "--max-samples", "24"]
    regen = [sys.executable, "-m", "dflash_train.cli", "regenerate", "--target", str(target), *prompts,
             "--max-new-tokens", "24", "--batch-size", "4", "--dtype", "fp32", *device]
    extract = [sys.executable, "-m", "dflash_train.cli", "extract", "--target", str(target), "--data", str(data),
               "--layer-ids", "1,2,3", "--rows-per-shard", "4", "--window-shards", "1", "--target-dtype", "fp32",
               *device]  # 6 windows of one shard: both ranks compute some
    checks = {}
    for name, command, pattern in (("regenerate", regen, "part-*.jsonl"), ("extract", extract, "*.safetensors")):
        one, two = work / f"{name}-1", work / f"{name}-2"
        subprocess.run([*command, "--out", str(one)], cwd=REPO, env=env, check=True, capture_output=True)
        ranks = [subprocess.Popen([*command, "--out", str(two), "--rank", str(r), "--world-size", "2"], cwd=REPO,
                                  env={**env, "LOCAL_RANK": str(r)}, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.PIPE) for r in range(2)]
        for proc in ranks:
            if proc.wait() != 0:
                raise SystemExit(f"{name} rank failed: {proc.stderr.read().decode()[-3000:]}")
        if name == "regenerate":  # the manifest is completed by the last run to finish: run once more
            subprocess.run([*command, "--out", str(two)], cwd=REPO, env=env, check=True, capture_output=True)
        a, b = shard_digests(one, pattern), shard_digests(two, pattern)
        checks[name] = {"shards": len(a), "identical": a == b and len(a) > 0}
    saved.write_text(json.dumps(checks))
    return checks


def print_table(results: dict[str, Any]) -> None:
    training = results["training"]
    print(f"\n{'check':<32} {'result':>14}")
    for name, gap in training["max_relative_loss_gap"].items():
        print(f"{'loss gap ' + name:<32} {gap:>14.2e}")
    for name, check in results["rank_split"].items():
        print(f"{name + ' 2 ranks == 1 rank':<32} {str(check['identical']):>14}")
    for name, rate in training.get("tokens_per_s", {}).items():
        scaling = f" ({training[f'scaling_{name}']:.2f}x)" if f"scaling_{name}" in training else ""
        print(f"{'tokens/s ' + name:<32} {rate:>14,.0f}{scaling}")
    for label, names in (("FAILED", list(training["failed"])), ("not run (time limit)", training["not_run"])):
        if names:
            print(f"{label}: {', '.join(names)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu", action="store_true", help="CPU processes over gloo, tiny target, no scaling figure")
    parser.add_argument("--steps", type=int, default=None, help="default: 12 on GPU, 6 on CPU")
    parser.add_argument("--batch", type=int, default=None, help="sequences per process per step (default 2, CPU 1)")
    parser.add_argument("--seq-len", type=int, default=3072)
    parser.add_argument("--num-anchors", type=int, default=TrainingConfig.num_anchors)
    parser.add_argument("--target-layers", type=int, default=4, help="layers of the random target")
    parser.add_argument("--target", type=Path, default=None,
                        help="train the checks on this target (e.g. SmolLM2-135M-Instruct, the default recipe's GPU "
                             "variant) and its --prepared chats instead of a random Qwen3-8B-wide target")
    parser.add_argument("--prepared", type=Path, default=None, help="with --target: `dflash-train prepare` output")
    parser.add_argument("--warmup", type=int, default=4, help="steps left out of the throughput median")
    parser.add_argument("--workdir", type=Path, default=None, help="re-use one to continue an interrupted benchmark")
    parser.add_argument("--time-limit", type=float, default=None,
                        help="seconds after which no further run starts (what is left is listed; re-run to finish)")
    parser.add_argument("--shared-gpus", action="store_true",
                        help="another job uses the GPUs: check equivalence and resume only, report no throughput")
    parser.add_argument("--only", default=None,
                        help=f"comma-separated subset of {','.join(CHECKS)} (default: all; without one under "
                             "--shared-gpus)")
    parser.add_argument("--out", default=None, help="JSON path (default: benchmarks/results/multi_gpu.json)")
    args = parser.parse_args()
    args.only = parse_only(args.only, args.shared_gpus)
    args.steps = args.steps or (6 if args.cpu else 12)
    args.batch = args.batch or (1 if args.cpu else 2)
    if bool(args.target) != bool(args.prepared):
        raise SystemExit("--target and --prepared go together (a target and chats prepared for it)")
    args.deadline = time.time() + (args.time_limit if args.time_limit is not None else 1e9)
    if not args.cpu and torch.cuda.device_count() < 2:
        raise SystemExit("benchmarks/multi_gpu.py needs 2 CUDA devices (or --cpu)")
    work = args.workdir or Path(tempfile.mkdtemp(prefix="dflash_multi_"))
    work.mkdir(parents=True, exist_ok=True)
    env = launch_env(args.cpu)
    rows = 24 if args.cpu else 4 * args.batch * args.steps
    if args.target:
        target, data = args.target, args.prepared
    else:
        target, data = setup(work, args.cpu, rows, args.seq_len, args.target_layers)
    # First: quick, and independent of the training runs.
    rank_split = run_data_checks(work, env, args.cpu) if "rank-split" in args.only else {}
    results = {"mode": "cpu" if args.cpu else "gpu", "steps": args.steps, "batch_per_process": args.batch,
               "target": str(args.target) if args.target else "random Qwen3-8B-wide",
               "training": run_training_checks(args, work, target, data, env), "rank_split": rank_split}
    print_table(results)
    if args.out is None:
        path = write_result("multi_gpu", results)
    else:
        path = Path(args.out)
        path.write_text(json.dumps({**stamp(), **results}, indent=2) + "\n")
    print(f"wrote {path}")
    if results["training"]["failed"]:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
