"""Chat-passes a minute of the speedrun's training on 1, 2, 4 and 8 GPUs, under DDP and FSDP2: weak scaling.

    python -m benchmarks.train_scaling                   # on an 8-GPU machine: ddp and fsdp2 on 1, 2, 4 and 8 GPUs
    python -m benchmarks.train_scaling --target smollm2-135m-instruct --prepared outputs/speedrun/prepared
                                                         # the speedrun's own target and chats
    python -m benchmarks.train_scaling --launch ddp --gpus 1,8 --steps 100 --tag h100   # a subset
    python -m benchmarks.train_scaling --cpu --gpus 1,2 --steps 6   # CPU processes over gloo: a smoke test

Every run is the speedrun's training launch (`accelerate launch --config_file recipes/accelerate/<launch>.yaml
--num_processes N -m dflash_train.train --config <recipe>`, the recipe by default
recipes/smollm2-135m-dflash-b16-packed.yaml) for a fixed number of steps, without validation or checkpoints
on the way, on GPUs 0..N-1. Each process keeps the recipe's batch, so the global batch grows with N as the
speedrun's GPUS makes it grow. Without `--target`, the target is a random SmolLM2-shaped model and the chats
are synthetic (`benchmarks.train_packing`'s); `--tiny` (implied by `--cpu`) shrinks both to seconds a run.

Throughput is read from each run's metrics.jsonl: the logged rows count the chats every process has trained
on so far (`chats_seen`) and the mean step time since the previous logged row (`step_seconds`). After the
warm-up (`--warmup`, a fraction of the steps: compilation and CUDA-graph captures), chat-passes a minute =
60 x (chats at the last row - chats at the warm-up's last row) / the seconds of the steps between. Scaling is
chat-passes a minute at N over N = 1's with the same launch config (the baseline always runs), efficiency
is scaling / N, and the goal is >= 7x at 8 GPUs. A re-run with the same `--workdir` launches only what has
not finished; `--time-limit` launches nothing after that many seconds. Each launch compiles into an empty
cache, as on a fresh machine. FSDP2 trains the weight matrices with AdamW (Muon refuses sharded weights). A failed launch is recorded with its
log's tail and the others go on; the benchmark then exits non-zero.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import write_result
from benchmarks.multi_gpu import Runs, launch_env, train_metrics
from benchmarks.train_packing import TINY_SETTINGS, save_smollm2_shaped_target, save_synthetic_chats
from dflash_train.training.tracking import read_metrics

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes/smollm2-135m-dflash-b16-packed.yaml"
GPU_LAUNCHES = {"ddp": "ddp.yaml", "fsdp2": "fsdp2.yaml"}
CPU_LAUNCHES = {"ddp": "cpu_2proc.yaml"}  # FSDP needs CUDA devices
# Muon orthogonalises whole weight matrices and refuses FSDP's shards (training/setup.py): under fsdp2 the
# recipe's weight matrices go to AdamW too (`--set training.optimizer=adamw` gives ddp the same optimizer).
LAUNCH_SETTINGS = {"fsdp2": ["training.optimizer=adamw"]}
GOAL_GPUS, GOAL_SCALING = 8, 7.0
# The synthetic target's word tokenizer has no mask token of its own: its `<empty_output>` id stands in.
SYNTHETIC_MASK_TOKEN = 16


def parse_launches(text: str, cpu: bool) -> list[str]:
    """The launch configs asked for, in order; one line naming the choices for a name not among them."""
    choices = CPU_LAUNCHES if cpu else GPU_LAUNCHES
    names = list(dict.fromkeys(name.strip() for name in text.split(",") if name.strip()))
    for name in names:
        if name not in choices:
            where = " on --cpu (FSDP needs CUDA)" if cpu and name in GPU_LAUNCHES else ""
            raise SystemExit(f"--launch: unknown launch config '{name}'{where}; choose from {', '.join(choices)}")
    if not names:
        raise SystemExit(f"--launch: name at least one launch config of {', '.join(choices)}")
    return names


def parse_gpus(text: str, available: int | None) -> list[int]:
    """Process counts, ascending, with 1 (the scaling baseline) always among them; `available` None on CPU."""
    counts = []
    for item in (part.strip() for part in text.split(",")):
        if not item.isdigit() or int(item) < 1:
            raise SystemExit(f"--gpus: '{item}' is not a whole number of processes (1 or more)")
        counts.append(int(item))
    if available is not None and max(counts) > available:
        raise SystemExit(f"--gpus: {max(counts)} GPUs asked for and this machine has {available} CUDA devices "
                         "(--cpu runs CPU processes)")
    return sorted({1, *counts})


def run_name(launch: str, processes: int) -> str:
    return f"{launch}-{processes}"


def overrides(args: argparse.Namespace, target: Path, prepared: Path, launch: str) -> list[str]:
    """The recipe's settings for a fixed-length, timing-only run: no validation, no checkpoints on the way
    (one is written at the end), no resume, no time budget, and steps queued between logged rows; then the
    launch config's own, the tiny settings and --set."""
    common = [f"model.target={target}", f"data.prepared={prepared}", "data.validation_fraction=0",
              "training.eval_every=0", "training.save_every=1000000000", "tracking.report_to=none",
              "training.resume=none", "training.time_budget_minutes=null", f"training.max_steps={args.steps}",
              f"training.log_every={args.log_every}"]
    if args.target is None:
        common.append(f"model.mask_token_id={SYNTHETIC_MASK_TOKEN}")
    return common + LAUNCH_SETTINGS.get(launch, []) + (TINY_SETTINGS if args.tiny else []) + args.set


def window(rows: list[dict[str, Any]], warmup_steps: float) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The last logged row of the warm-up (step 0 if none was logged in it) and the logged rows after it."""
    before = [row for row in rows if row["step"] <= warmup_steps]
    start = before[-1] if before else {"step": 0, "chats_seen": 0}
    after = [row for row in rows if row["step"] > start["step"]]
    if not after:
        raise ValueError(f"no logged step after the warm-up's {warmup_steps:g} steps: run more steps or lower "
                         "--warmup or --log-every")
    return start, after


def throughput(rows: list[dict[str, Any]], warmup_steps: float) -> dict[str, float]:
    """Chat-passes a minute and tokens/s over the logged rows after the warm-up. A row's step_seconds is the
    mean of the steps since the row before it, so each counts for that many steps. Chats are a difference
    of two rows' running counts; `tokens` is only the logged step's own, so tokens/s takes it for each of the
    steps the row stands for (an estimate: prefer chats)."""
    start, after = window(rows, warmup_steps)
    spans = [row["step"] - previous["step"] for previous, row in zip([start, *after], after, strict=False)]
    seconds = sum(row["step_seconds"] * span for row, span in zip(after, spans, strict=True))
    chats = after[-1]["chats_seen"] - start["chats_seen"]
    tokens = sum(row["tokens"] * span for row, span in zip(after, spans, strict=True))
    return {"window": [start["step"], after[-1]["step"]], "window_seconds": seconds, "window_chats": chats,
            "chat_passes_per_min": 60 * chats / seconds, "tokens_per_s": tokens / seconds,
            "median_step_s": statistics.median(row["step_seconds"] for row in after)}


def measure(run: Path, steps: int, warmup: float) -> dict[str, Any]:
    """One finished run's figures, from its metrics.jsonl and the launch record written beside it."""
    rows = [row for row in read_metrics(run / "metrics.jsonl")["train"] if row["step"] <= steps]
    launch = json.loads((run / "launch.json").read_text()) if (run / "launch.json").exists() else {}
    first = launch.get("first_step_seconds") or (rows[0]["step_seconds"] if rows[0]["step"] == 1 else None)
    return {**throughput(rows, warmup * steps), "chats_per_step": rows[-1]["chats_seen"] / rows[-1]["step"],
            "first_step_s": first, "wall_s": launch.get("wall_seconds")}


def add_scaling(results: dict[str, dict[int, dict[str, Any]]]) -> None:
    """Scaling (over N = 1's chat-passes with the same launch config) and efficiency (scaling / N), in place."""
    for by_count in results.values():
        base = by_count.get(1)
        for processes, result in by_count.items():
            scaling = result["chat_passes_per_min"] / base["chat_passes_per_min"] if base else None
            result["scaling"] = scaling
            result["efficiency"] = scaling / processes if scaling is not None else None


def goal_mark(processes: int, scaling: float | None) -> str:
    """The goal's mark on the row where it is measured (8 GPUs), blank elsewhere."""
    if processes != GOAL_GPUS or scaling is None:
        return ""
    return f"≥ {GOAL_SCALING:g}× " + ("✓" if scaling >= GOAL_SCALING else "✗")


def faster(results: dict[str, dict[int, dict[str, Any]]]) -> dict[int, str]:
    """Per process count measured under two launch configs or more, the one with more chat-passes a minute."""
    counts = sorted({n for by_count in results.values() for n in by_count})
    return {n: max((launch for launch in results if n in results[launch]),
                   key=lambda launch: results[launch][n]["chat_passes_per_min"])
            for n in counts if sum(n in by_count for by_count in results.values()) > 1}


def setup_data(args: argparse.Namespace, work: Path) -> tuple[Path, Path]:
    """The given target and chats, or a random SmolLM2-shaped target and synthetic chats made once in `work`."""
    if args.target is not None:
        return args.target, args.prepared
    target, prepared = work / "target", work / "prepared"
    if not (target / "tokenizer.json").exists():
        save_smollm2_shaped_target(target, args.tiny)
    if not (prepared / "dflash_data.json").exists():
        save_synthetic_chats(prepared, args.chats, target, args.tiny)
    return target, prepared


def restart_unfinished(runs: Runs, name: str) -> None:
    """A run cut short, or one of another --steps, starts over in an empty folder: under resume=none its old
    rows would mix with the new launch's."""
    run = runs.work / name
    if not (run / "metrics.jsonl").exists() or max(train_metrics(run), default=0) != runs.steps:
        shutil.rmtree(run, ignore_errors=True)
        shutil.rmtree(compile_cache(runs.work, name), ignore_errors=True)


def compile_cache(work: Path, name: str) -> Path:
    """A launch's own compilation cache: beside its output folder, where train accepts only its own files."""
    return work / "inductor" / name


def record_launch(run: Path, wall_seconds: float) -> None:
    """The launch's wall time and the trainer's first step (from its last checkpoint, which goes then with the
    compilation cache: nothing resumes from it), kept beside the metrics for a re-run with the same --workdir."""
    states = sorted(run.glob("checkpoints/step-*/trainer_state.json"))
    first = json.loads(states[-1].read_text()).get("first_step_seconds") if states else None
    (run / "launch.json").write_text(json.dumps({"wall_seconds": wall_seconds, "first_step_seconds": first}))
    shutil.rmtree(run / "checkpoints", ignore_errors=True)
    shutil.rmtree(compile_cache(run.parent, run.name), ignore_errors=True)


def launch_run(runs: Runs, launch: str, processes: int, cpu: bool, settings: list[str]) -> None:
    """One launch of `processes` processes (GPUs 0..processes-1) with `settings` over the recipe's, unless it
    finished in an earlier call."""
    name = run_name(launch, processes)
    runs.common = settings  # this launch config's (fsdp2's optimizer); one Runs keeps every launch's failures
    restart_unfinished(runs, name)
    config = (CPU_LAUNCHES if cpu else GPU_LAUNCHES)[launch]
    # An empty compilation cache for each: every launch's first step and wall time are a fresh machine's, not
    # warmed by the launches before it.
    env = {"TORCHINDUCTOR_CACHE_DIR": str(compile_cache(runs.work, name))}
    if not cpu:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, range(processes)))
    runs.keep.add(name)  # record_launch reads its checkpoint first
    runs.launch([(name, config, processes, None, env)])
    if name in runs.wall_seconds and runs.done(name):
        record_launch(runs.work / name, runs.wall_seconds[name])


def run_all(args: argparse.Namespace, work: Path) -> tuple[dict[str, dict[int, dict[str, Any]]], Runs]:
    """Every launch config on every process count, the counts in ascending order (the baselines first, should
    the time limit stop the rest), then the figures of those that finished."""
    target, prepared = setup_data(args, work)
    runs = Runs(work, [], args.steps, launch_env(args.cpu), args.deadline, recipe=args.recipe)
    for processes in args.gpus:
        for launch in args.launch:
            launch_run(runs, launch, processes, args.cpu, overrides(args, target, prepared, launch))
    results = {launch: {n: measure(work / run_name(launch, n), args.steps, args.warmup) for n in args.gpus
                        if runs.done(run_name(launch, n))} for launch in args.launch}
    add_scaling(results)
    return results, runs


HEADER = (f"{'launch':<7} {'GPUs':>4} {'chats/step':>10} {'step s':>8} {'chat-passes/min':>15} {'tokens/s':>11} "
          f"{'scaling':>8} {'effic.':>7} {'first s':>8} {'wall s':>7}  goal")


def table_row(launch: str, processes: int, result: dict[str, Any]) -> str:
    scaling, efficiency = result["scaling"], result["efficiency"]
    first, wall = result["first_step_s"], result["wall_s"]
    return (f"{launch:<7} {processes:>4} {result['chats_per_step']:>10.1f} {result['median_step_s']:>8.3f} "
            f"{result['chat_passes_per_min']:>15,.0f} {result['tokens_per_s']:>11,.0f} "
            f"{'-' if scaling is None else f'{scaling:.2f}x':>8} "
            f"{'-' if efficiency is None else f'{efficiency:.0%}':>7} "
            f"{'-' if first is None else f'{first:.1f}':>8} {'-' if wall is None else f'{wall:.0f}':>7}  "
            f"{goal_mark(processes, scaling)}")


def print_table(results: dict[str, dict[int, dict[str, Any]]], runs: Runs, args: argparse.Namespace) -> None:
    print(f"\nChat-passes a minute, {args.recipe.name}, {args.steps} steps (after {args.warmup:.0%} warm-up), "
          "the recipe's batch on each process")
    print(HEADER)
    for launch, by_count in results.items():
        for processes, result in sorted(by_count.items()):
            print(table_row(launch, processes, result))
    for launch in (launch for launch in args.launch if LAUNCH_SETTINGS.get(launch)):
        print(f"{launch} runs with {' '.join(LAUNCH_SETTINGS[launch])}")
    best = faster(results)
    if best:
        print("faster: " + ", ".join(f"{n} GPU{'s' if n > 1 else ''} {launch}" for n, launch in best.items()))
    for label, names in (("FAILED", list(runs.failed)), ("not run (time limit)", runs.pending)):
        if names:
            print(f"{label}: {', '.join(names)}")


def payload(results: dict[str, dict[int, dict[str, Any]]], runs: Runs, args: argparse.Namespace) -> dict[str, Any]:
    data = str(args.target) if args.target else f"random SmolLM2-shaped{' (tiny)' if args.tiny else ''}, synthetic chats"
    met = {launch: by_count[GOAL_GPUS]["scaling"] >= GOAL_SCALING for launch, by_count in results.items()
           if by_count.get(GOAL_GPUS, {}).get("scaling") is not None}
    return {"mode": "cpu" if args.cpu else "gpu", "recipe": str(args.recipe), "target": data,
            "prepared": str(args.prepared) if args.prepared else None, "steps": args.steps,
            "log_every": args.log_every, "warmup": args.warmup, "set": args.set,
            "launch_settings": {launch: LAUNCH_SETTINGS.get(launch, []) for launch in args.launch},
            "goal": f"≥ {GOAL_SCALING:g}× the chat-passes a minute of 1 GPU at {GOAL_GPUS}", "goal_met": met,
            "runs": {launch: {str(n): result for n, result in sorted(by_count.items())}
                     for launch, by_count in results.items()},
            "faster": {str(n): launch for n, launch in faster(results).items()},
            "failed": runs.failed, "not_run": runs.pending}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--launch", default=None, help="launch configs, comma-separated (default ddp,fsdp2; "
                                                       "on --cpu ddp, over gloo)")
    parser.add_argument("--gpus", default=None, help="process counts (default 1,2,4,8; on --cpu 1,2); 1 always runs")
    parser.add_argument("--steps", type=int, default=None, help="steps a run (default 200; on --cpu 6)")
    parser.add_argument("--log-every", type=int, default=None,
                        help="training.log_every (default 10: steps queued between logged rows, as in a real run; "
                             "on --cpu 1)")
    parser.add_argument("--warmup", type=float, default=0.25, help="fraction of the steps left out at the start")
    parser.add_argument("--recipe", type=Path, default=RECIPE)
    parser.add_argument("--target", type=Path, default=None,
                        help="a real target, as model.target takes it (a folder or a known name), with --prepared")
    parser.add_argument("--prepared", type=Path, default=None, help="with --target: `dflash-train prepare` output")
    parser.add_argument("--chats", type=int, default=None, help="synthetic chats (default 4096; --tiny 256)")
    parser.add_argument("--tiny", action="store_true", help="a tiny Llama, short chats and no compilation")
    parser.add_argument("--cpu", action="store_true", help="CPU processes over gloo, --tiny implied: a smoke test")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a setting over the recipe's and the benchmark's (repeatable)")
    parser.add_argument("--workdir", type=Path, default=None, help="re-use one to continue an interrupted benchmark")
    parser.add_argument("--time-limit", type=float, default=None, help="seconds after which no launch starts")
    parser.add_argument("--tag", default=None, help="results/train_scaling-TAG.json instead of train_scaling.json")
    return parser.parse_args(argv)


def check_args(args: argparse.Namespace) -> None:
    """Defaults that depend on --cpu, and a one-line refusal of each mistake before anything is launched."""
    args.tiny = args.tiny or args.cpu
    args.launch = parse_launches(args.launch or ("ddp" if args.cpu else "ddp,fsdp2"), args.cpu)
    args.gpus = parse_gpus(args.gpus or ("1,2" if args.cpu else "1,2,4,8"),
                           None if args.cpu else torch.cuda.device_count())
    args.steps = args.steps or (6 if args.cpu else 200)
    args.log_every = args.log_every or (1 if args.cpu else 10)
    args.chats = args.chats or (256 if args.tiny else 4096)
    if (args.target is None) != (args.prepared is None):
        raise SystemExit("--target and --prepared go together (a target and chats prepared for it)")
    if not 0 <= args.warmup < 1:
        raise SystemExit(f"--warmup is a fraction of the steps, at least 0 and below 1, not {args.warmup:g}")
    if args.steps < 2 or args.log_every < 1:
        raise SystemExit("--steps must be 2 or more and --log-every 1 or more")
    args.deadline = time.time() + (args.time_limit if args.time_limit is not None else 1e9)


WORKDIR_MARK = ".train_scaling"  # a work folder this benchmark made: the only kind whose runs it deletes


def claim_workdir(work: Path) -> None:
    """`work` made (or found empty) and marked as this benchmark's; one with other files is refused, since an
    unfinished run's folder in it is deleted before its launch starts over."""
    if work.is_dir() and any(work.iterdir()) and not (work / WORKDIR_MARK).exists():
        sys.exit(f"train_scaling: --workdir {work} holds files this benchmark did not write: give an empty folder "
                 "or one an earlier train_scaling run used")
    work.mkdir(parents=True, exist_ok=True)
    (work / WORKDIR_MARK).touch()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    check_args(args)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="dflash_scaling_"))
    claim_workdir(work)
    results, runs = run_all(args, work)
    print_table(results, runs, args)
    path = write_result("train_scaling" + (f"-{args.tag}" if args.tag else ""), payload(results, runs, args),
                        smoke=args.tiny)
    print(f"wrote {path}")
    if runs.failed:
        sys.exit(f"train_scaling: {len(runs.failed)} launch(es) failed: {', '.join(runs.failed)} (their logs' "
                 f"tails are above and in {path.name})")


if __name__ == "__main__":
    main()
