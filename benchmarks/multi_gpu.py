"""Two processes against one: equal training, scaling, resume across world sizes, rank-split data (2 GPUs).

    python -m benchmarks.multi_gpu                   # on a 2-GPU machine: writes benchmarks/results/multi_gpu.json
    python -m benchmarks.multi_gpu --cpu             # the same checks with CPU processes over gloo (no scaling)

Training runs go through `accelerate launch -m dflash_train.train` with the launch configs of
`recipes/accelerate/`, on a random Qwen3-8B-wide target (GPU; 4 layers, 3,072-token chats, N = 512) or the
tiny test target (CPU):
- `reference`: 1 process, 2·b sequences per step; `one`: 1 process, b per step (the scaling baseline);
- `ddp`, `zero2` (GPU only), `fsdp2`: 2 processes, b each — the same global batch as `reference`, so their
  per-step losses must match it (tolerance: 2e-2 relative in bf16 on GPU, 1e-5 in fp32 on CPU);
- `ddp-resumed`: 2 processes stopped after step 1 and relaunched; must equal `ddp`;
- `ddp-then-one`: `ddp`'s step-2 checkpoint resumed by 1 process with 2·b per step; must equal `reference`.
Scaling = tokens/s of `ddp` over `one` (median step time after warm-up; goal ≥ 1.8×).
Rank-split data: `regenerate` and `extract` with 2 ranks write byte-identical shards to a 1-rank run.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import write_result

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes/smollm2-135m-dflash-b16.yaml"


def launch_configs(cpu: bool) -> dict[str, tuple[str, int]]:
    if cpu:
        return {"reference": ("", 1), "ddp": ("cpu_2proc.yaml", 2), "fsdp2": ("cpu_fsdp2.yaml", 2)}
    return {"reference": ("single_gpu.yaml", 1), "one": ("single_gpu.yaml", 1), "ddp": ("ddp.yaml", 2),
            "zero2": ("deepspeed_zero2.yaml", 2), "fsdp2": ("fsdp2.yaml", 2)}


def train(name: str, config: str, processes: int, overrides: list[str], env: dict[str, str], port: int) -> str:
    """One launched run; returns its output (raises with the tail on failure)."""
    if processes == 1 and not config:
        command = [sys.executable, "-m", "dflash_train.train"]
    else:
        command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                   str(REPO / "recipes/accelerate" / config), "--num_processes", str(processes),
                   "--main_process_port", str(port), "-m", "dflash_train.train"]
    proc = subprocess.run([*command, "--config", str(RECIPE), *overrides], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed (exit {proc.returncode}):\n{(proc.stdout + proc.stderr)[-4000:]}")
    return proc.stdout


def train_metrics(out: Path) -> dict[int, dict[str, Any]]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows if r["split"] == "train"}


def tokens_per_s(metrics: dict[int, dict[str, Any]], warmup: int) -> float:
    steps = [m for step, m in sorted(metrics.items()) if step > warmup]
    return statistics.median(m["tokens"] / m["step_seconds"] for m in steps)


def max_relative_gap(a: dict[int, dict[str, Any]], b: dict[int, dict[str, Any]], steps: list[int]) -> float:
    return max(abs(a[s]["loss"] - b[s]["loss"]) / abs(a[s]["loss"]) for s in steps)


def setup(work: Path, cpu: bool, rows: int, seq_len: int, layers: int) -> tuple[Path, Path]:
    target, data = work / "target", work / "prepared"
    if cpu:
        from tests.training_fixtures import save_tiny_prepared, save_tiny_target

        save_tiny_target(target), save_tiny_prepared(data, num_rows=rows)
    else:
        from benchmarks.train_throughput import save_random_chats, save_random_target

        save_random_target(target, layers)
        save_random_chats(data, rows, seq_len, target)
    return target, data


def run_training_checks(args: argparse.Namespace, work: Path, target: Path, data: Path,
                        env: dict[str, str]) -> dict[str, Any]:
    b, steps = args.batch, args.steps
    common = [f"model.target={target}", "model.num_draft_layers=" + ("2" if args.cpu else "5"),
              "data.validation_fraction=0", "tracking.report_to=none", "training.log_every=1",
              f"training.max_steps={steps}", "training.save_every=2", "training.keep_last=10", "training.resume=auto",
              f"data.prepared={data}"]
    if args.cpu:
        common += ["model.target_dtype=float32", "model.block_size=4", "data.max_length=64", "training.num_anchors=8",
                   "training.mixed_precision=no", "training.deterministic=true", "training.loss_decay_gamma=4",
                   "training.learning_rate=3e-3", "training.attention=dense"]
    else:
        common += ["model.mask_token_id=151669", "model.target_layer_ids=[1,2,3]", f"data.max_length={args.seq_len}",
                   "training.num_anchors=512", "training.compile=true", "training.attention=flex"]
    runs: dict[str, dict[int, dict[str, Any]]] = {}
    for i, (name, (config, processes)) in enumerate(launch_configs(args.cpu).items()):
        per_process = 2 * b if name == "reference" else b
        out = work / name
        train(name, config, processes, [*common, f"training.output_dir={out}", f"training.batch_size={per_process}"],
              env, 29400 + i)
        runs[name] = train_metrics(out)
        print(f"{name}: {steps} steps, last loss {runs[name][steps]['loss']:.4f}", flush=True)
    ddp_config = launch_configs(args.cpu)["ddp"][0]
    resumed = work / "ddp-resumed"
    base = [*common, f"training.output_dir={resumed}", f"training.batch_size={b}"]
    train("ddp-stop", ddp_config, 2, [*base, "training.stop_after_minutes=1e-9"], env, 29450)
    train("ddp-resume", ddp_config, 2, base, env, 29451)
    runs["ddp-resumed"] = train_metrics(resumed)
    then_one = work / "ddp-then-one"
    (then_one / "checkpoints").mkdir(parents=True)
    shutil.copytree(work / "ddp" / "checkpoints" / "step-00000002", then_one / "checkpoints" / "step-00000002")
    reference_config = launch_configs(args.cpu)["reference"][0]
    out = train("ddp-then-one", reference_config, 1,
                [*common, f"training.output_dir={then_one}", f"training.batch_size={2 * b}"], env, 29452)
    assert "resumed from" in out, out[-2000:]
    runs["ddp-then-one"] = train_metrics(then_one)
    after = list(range(3, steps + 1))
    gaps = {name: max_relative_gap(runs["reference"], runs[name], list(range(1, steps + 1)))
            for name in ("ddp", "zero2", "fsdp2") if name in runs}
    gaps["ddp-resumed vs ddp"] = max_relative_gap(runs["ddp"], runs["ddp-resumed"], list(range(1, steps + 1)))
    gaps["ddp-then-one vs reference"] = max_relative_gap(runs["reference"], runs["ddp-then-one"], after)
    result: dict[str, Any] = {"max_relative_loss_gap": gaps, "losses": {
        name: [round(m[s]["loss"], 6) for s in sorted(m) if s in m] for name, m in runs.items()}}
    if not args.cpu:
        one, two = tokens_per_s(runs["one"], args.warmup), tokens_per_s(runs["ddp"], args.warmup)
        result["tokens_per_s"] = {"one": one, "ddp": two, "zero2": tokens_per_s(runs["zero2"], args.warmup),
                                  "fsdp2": tokens_per_s(runs["fsdp2"], args.warmup)}
        result["scaling_ddp"] = two / one
    return result


def shard_digests(directory: Path, pattern: str) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.glob(pattern))}


def run_data_checks(work: Path, env: dict[str, str], cpu: bool) -> dict[str, Any]:
    """1 rank vs 2 ranks (each rank its own process and device, as under torchrun), on the tiny test target
    (it has a chat template; what is checked is the split, not the speed)."""
    from tests.training_fixtures import save_tiny_prepared, save_tiny_target

    target, data = save_tiny_target(work / "tiny-target"), save_tiny_prepared(work / "tiny-prepared", num_rows=24)
    device = ["--device", "cpu"] if cpu else []
    prompts = ["--data", str(REPO / "data/prompts/demo_prompts.jsonl"), "--max-samples", "24"]
    regen = [sys.executable, "-m", "dflash_train.cli", "regenerate", "--target", str(target), *prompts,
             "--max-new-tokens", "24", "--batch-size", "4", "--dtype", "fp32", *device]
    extract = [sys.executable, "-m", "dflash_train.cli", "extract", "--target", str(target), "--data", str(data),
               "--layer-ids", "1,2,3", "--rows-per-shard", "4", "--target-dtype", "fp32", *device]
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
    return checks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu", action="store_true", help="CPU processes over gloo, tiny target, no scaling figure")
    parser.add_argument("--steps", type=int, default=None, help="default: 12 on GPU, 6 on CPU")
    parser.add_argument("--batch", type=int, default=None, help="sequences per process per step (default 2, CPU 1)")
    parser.add_argument("--seq-len", type=int, default=3072)
    parser.add_argument("--target-layers", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=4, help="steps left out of the throughput median")
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--out", default=None, help="JSON path (default: benchmarks/results/multi_gpu.json)")
    args = parser.parse_args()
    args.steps = args.steps or (6 if args.cpu else 12)
    args.batch = args.batch or (1 if args.cpu else 2)
    if not args.cpu and torch.cuda.device_count() < 2:
        raise SystemExit("benchmarks/multi_gpu.py needs 2 CUDA devices (or --cpu)")
    work = args.workdir or Path(tempfile.mkdtemp(prefix="dflash_multi_"))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           "NCCL_NVLS_ENABLE": "0"}  # NVLink multicast (NVLS) off: it hangs or fails on some multi-GPU hosts
    if args.cpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    rows = 24 if args.cpu else 4 * args.batch * args.steps
    target, data = setup(work, args.cpu, rows, args.seq_len, args.target_layers)
    results = {"mode": "cpu" if args.cpu else "gpu", "steps": args.steps, "batch_per_process": args.batch,
               "training": run_training_checks(args, work, target, data, env),
               "rank_split": run_data_checks(work, env, args.cpu)}
    print(f"\n{'check':<28} {'result':>14}")
    for name, gap in results["training"]["max_relative_loss_gap"].items():
        print(f"{name:<28} {gap:>14.2e}")
    for name, check in results["rank_split"].items():
        print(f"{name + ' 2 ranks == 1':<28} {str(check['identical']):>14}")
    if "scaling_ddp" in results["training"]:
        print(f"{'DDP scaling (goal >= 1.8x)':<28} {results['training']['scaling_ddp']:>13.2f}x")
    path = write_result("multi_gpu", results) if args.out is None else Path(args.out)
    if args.out is not None:
        path.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
