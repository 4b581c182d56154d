"""`make demo`: the whole job on the default target (SmolLM2-135M-Instruct), on this machine.

    make demo                                    # installs, then runs this module
    python -m dflash_train.demo                  # CPU sizes on a CPU machine, GPU sizes when CUDA is visible
    python -m dflash_train.demo --device cpu --out outputs/demo-cpu
    python -m dflash_train.demo --target model.gguf --data prompts.jsonl   # a node without the packages

Six stages, each an ordinary `dflash-train` command (printed before it runs, so the demo doubles as a
walkthrough): regenerate responses with the target → prepare (tokenise, loss masks) → train a drafter →
eval (τ, lossless check, speedup) → export → check. Everything lands under --out (regen/, prepared/, train/,
eval/, export/). The last table sets the result beside what the GPU speedrun gives.

On a CPU the target works through generated math word problems and a 1-layer block-8 drafter learns its
worked solutions, then is evaluated on the math eval set, whose problem kinds it never trained on: a narrow
domain that minutes of CPU training can learn. On a GPU the bundled prompts and 2,000 ShareGPT prompts train
a 5-layer block-16 drafter, evaluated on HumanEval and MT-Bench.

Re-running skips finished stages and resumes an interrupted one (regeneration by shard, training from its
last checkpoint); a stage whose command changed, and every stage after it, starts over. `demo_state.json`
records each stage's command and time; a stage that starts over removes only the files it wrote in its folder.
Start afresh with `rm -rf outputs/demo`.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from dflash_train.cli import main as cli_main
from dflash_train.outputs import (
    EVALUATION,
    EXPORTED,
    PREPARED,
    REGENERATED,
    TRAINING,
    OutputKind,
    remove_owned,
)

REPO = Path(__file__).resolve().parents[1]
TARGET = "smollm2-135m-instruct"
DEMO_PROMPTS = "data/prompts/demo_prompts.jsonl"
STATE_FILE = "demo_state.json"


@dataclass(frozen=True)
class DemoSizes:
    """How much work each stage does; `train_overrides` are dotted recipe overrides."""

    recipe: str
    regen_dtype: str  # the target's dtype when it writes the training data (the eval uses the same)
    sources: tuple[str, ...] = (DEMO_PROMPTS,)
    max_samples: int | None = None  # per source
    max_new_tokens: int = 256
    regen_batch_size: int = 20
    max_length: int = 512
    train_overrides: tuple[str, ...] = ()
    eval_datasets: tuple[str, ...] = ("humaneval", "mt-bench")
    eval_prompts: int = 3
    eval_max_new_tokens: int = 128
    eval_batch_size: int = 1  # requests decoded at once; 1 measures the speedup a single user sees

    @property
    def block_size(self) -> int:
        """The drafter's block size: an override's, else the recipes' 16 (prepare keeps rows of 2 blocks)."""
        values = [o.split("=", 1)[1] for o in self.train_overrides if o.startswith("model.block_size=")]
        return int(values[-1]) if values else 16


# Within 15 minutes on 2 idle CPU cores, installs excluded (stage times are printed at the end; measured:
# docs/results.md#the-demo). Minutes of CPU training teach a drafter a narrow domain, not chat: the target's
# worked solutions to generated word problems, evaluated on the math set's problem kinds, which the word
# problems leave out (dflash_train/prompts/word_problems.py).
CPU_SIZES = DemoSizes(
    recipe="recipes/smollm2-135m-dflash-b16-cpu.yaml", regen_dtype="fp32",
    sources=("word-problems:steps",), max_samples=200,
    # Most worked solutions run past 128 tokens, so each answer costs about the same; more answers beat more
    # epochs over fewer (held-out τ̂). A CPU decodes batches of 50 faster than of 20, and of 120 no faster.
    max_new_tokens=128, regen_batch_size=50, max_length=512,
    # One drafter layer, block 8: a cheap step, and the early slots, all a drafter trained for minutes gets
    # right, are what decoding accepts. Target layer 24 gave a higher held-out τ̂ than the default middle
    # layer or a later one. Muon and D-PACE as in the speedrun's recipe; many small steps beat few large ones
    # at this budget (held-out τ̂ at the same wall time).
    train_overrides=("model.num_draft_layers=1", "model.block_size=8", "model.target_layer_ids=[24]",
                     "training.optimizer=muon", "training.position_weighting=dpace", "training.max_steps=400",
                     "training.batch_size=1", "training.num_anchors=32", "training.learning_rate=3e-3",
                     "data.validation_fraction=0", "training.save_every=100", "training.eval_every=0",
                     "training.log_every=10"),
    # All 10 requests at once: on a CPU the eval then takes half as long as at batch 1.
    eval_datasets=("math-synthetic",), eval_prompts=10, eval_max_new_tokens=128, eval_batch_size=10,
)
# One GPU: the bundled prompts plus 2,000 ShareGPT prompts (from the installed package), 3 epochs.
GPU_SIZES = DemoSizes(
    recipe="recipes/smollm2-135m-dflash-b16.yaml", regen_dtype="bf16",
    sources=(DEMO_PROMPTS, "sharegpt"), max_samples=2000,
    max_new_tokens=512, regen_batch_size=128, max_length=2048,
    # Responses of <= 512 tokens: 256 anchors cover them; 16 chats per step keep the GPU busy (as in
    # recipes/smollm2-135m-h200.sh).
    train_overrides=("training.epochs=3", "training.save_every=200", "training.eval_every=200",
                     "training.num_anchors=256", "training.batch_size=16", "training.learning_rate=1e-3"),
    eval_prompts=20, eval_max_new_tokens=256,
)


@dataclass(frozen=True)
class SpeedrunFigures:
    """What `bash recipes/smollm2-135m-speedrun.sh all` gave: a drafter trained from nothing on one GPU."""

    device: str
    minutes: float
    draft_layers: int
    block_size: int
    chats: int
    steps: int
    tau: dict[str, float]  # per eval set, named as `dflash-train eval --dataset` names it
    speedup: dict[str, float]


# The speedrun's latest run, as the README's Results table gives it (a test keeps the two the same; the run
# itself: docs/results.md, 'Speedrun v5').
SPEEDRUN = SpeedrunFigures(device="one H200", minutes=20.5, draft_layers=5, block_size=16, chats=153_610,
                           steps=10_000, tau={"humaneval": 4.09, "mt-bench": 4.09, "math-synthetic": 4.36},
                           speedup={"humaneval": 3.12, "mt-bench": 2.80, "math-synthetic": 3.31})


@dataclass
class Stage:
    name: str
    argv: list[str]  # `dflash-train` arguments
    output: Path | None  # what the stage wrote there is removed when it starts over (other files stay)
    kind: OutputKind | None = None  # what the stage writes into `output`
    resumable: bool = False  # an interrupted run continues with the same command
    always: bool = False  # cheap and read-only: run every time


@dataclass
class DemoResult:
    out_dir: Path
    report: dict[str, Any]
    report_path: Path
    checkpoint: Path
    export: Path
    train_samples: int
    train_steps: int
    seconds: dict[str, float] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)
    target: str = TARGET
    draft_layers: int | None = None  # the trained drafter's, from its config


def plan_stages(out: Path, sizes: DemoSizes, device: str, target_name: str = TARGET) -> list[Stage]:
    target = ["--target", target_name]
    sources = [arg for source in sizes.sources for arg in ("--data", source)]
    limit = ["--max-samples", str(sizes.max_samples), "--shuffle-seed", "0"] if sizes.max_samples else []
    paths = {name: out / name for name in ("regen", "prepared", "train", "eval", "export")}
    train = [f"model.target={target_name}", "data.prepared=" + str(paths["prepared"]),
             "training.output_dir=" + str(paths["train"]),
             f"data.max_length={sizes.max_length}", "tracking.report_to=none", *sizes.train_overrides]
    return [
        Stage("regenerate", ["regenerate", *target, *sources, *limit, "--max-new-tokens", str(sizes.max_new_tokens),
                             "--batch-size", str(sizes.regen_batch_size), "--max-prompt-tokens", "1024",
                             "--dtype", sizes.regen_dtype, "--device", device, "--out", str(paths["regen"])],
              paths["regen"], REGENERATED, resumable=True),
        Stage("prepare", ["prepare", *target, "--data", str(paths["regen"]), "--max-length", str(sizes.max_length),
                          "--block-size", str(sizes.block_size), "--out", str(paths["prepared"])],
              paths["prepared"], PREPARED),
        Stage("train", ["train", "--config", sizes.recipe, *train], paths["train"], TRAINING, resumable=True),
        Stage("eval", ["eval", *target, "--draft", "<final checkpoint>",
                       *[arg for name in sizes.eval_datasets for arg in ("--dataset", name)],
                       "--num-prompts", str(sizes.eval_prompts), "--max-new-tokens", str(sizes.eval_max_new_tokens),
                       *(["--batch-size", str(sizes.eval_batch_size)] if sizes.eval_batch_size > 1 else []),
                       "--device", device, "--out", str(paths["eval"] / "report.json")], paths["eval"], EVALUATION),
        Stage("export", ["export", "<final checkpoint>", *target, "--eval-report", str(paths["eval"] / "report.json"),
                         "--overwrite", "--out", str(paths["export"])], paths["export"], EXPORTED),
        Stage("check", ["check", str(paths["export"]), *target], None, always=True),
    ]


def final_checkpoint(train_dir: Path) -> Path | None:
    """The newest checkpoint if training reached its last step, else None."""
    # Deferred, as every import of torch or huggingface_hub here: main() sets their environment first.
    from dflash_train.training.run_files import list_checkpoints, read_trainer_state

    found = list_checkpoints(train_dir)
    if not found:
        return None
    state = read_trainer_state(found[-1])
    return found[-1] if state["step"] == state["total_steps"] else None


def is_done(stage: Stage, out: Path) -> bool:
    """Whether the stage's output on disk is complete (the state file alone could outlive it)."""
    if stage.name == "regenerate":
        manifest = out / "regen" / "regenerate.json"
        return manifest.is_file() and json.loads(manifest.read_text()).get("complete", False)
    if stage.name == "train":
        return final_checkpoint(out / "train") is not None
    marker = {"prepare": "dflash_data.json", "eval": "report.json", "export": "config.json"}[stage.name]
    return stage.output is not None and (stage.output / marker).is_file()


class StageRunner:
    """Runs stages in order, skipping finished ones; a stage that runs makes every later one run too."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.path = out / STATE_FILE
        self.state: dict[str, Any] = json.loads(self.path.read_text()) if self.path.is_file() else {}
        self.upstream_ran = False
        self.seconds: dict[str, float] = {}
        self.skipped: list[str] = []

    def _save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.state, indent=2) + "\n")
        os.replace(tmp, self.path)

    def run(self, stage: Stage, index: int, total: int) -> None:
        console, record = Console(), self.state.get(stage.name, {})
        same = record.get("argv") == stage.argv and not self.upstream_ran
        header = f"[{index}/{total}] {stage.name}"
        if same and record.get("done") and not stage.always and is_done(stage, self.out):
            console.print(f"[bold]{header}[/]: done earlier ({record['seconds']:.0f} s), skipped")
            self.seconds[stage.name] = record["seconds"]
            self.skipped.append(stage.name)
            return
        resume = same and stage.resumable and not record.get("done")
        if stage.output is not None and stage.kind is not None and not resume:
            remove_owned(stage.output, stage.kind)  # stale: made by another command or from other inputs
        self.state[stage.name] = {"argv": stage.argv, "done": False}
        self._save()
        console.rule(header + (" (resuming)" if resume else ""))
        console.print("$ dflash-train " + shlex.join(stage.argv), highlight=False, soft_wrap=True)
        started = time.perf_counter()
        code = cli_main(stage.argv)
        if code != 0:
            raise DemoError(f"stage {stage.name} failed (exit {code}); fix the error above and re-run `make demo` "
                            f"(finished stages are kept)")
        self.seconds[stage.name] = time.perf_counter() - started
        self.state[stage.name] = {"argv": stage.argv, "done": True, "seconds": round(self.seconds[stage.name], 1)}
        self._save()
        self.upstream_ran = True


class DemoError(RuntimeError):
    """A stage failed; the message says which and what to do."""


def run_demo(out: str | Path, sizes: DemoSizes, device: str, target: str = TARGET) -> DemoResult:
    """All stages under `out` (CWD-independent: relative data paths are the repository's)."""
    out = Path(out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    stages = plan_stages(out, _in_repo(sizes), device, target)
    runner = StageRunner(out)
    checkpoint: Path | None = None
    for index, stage in enumerate(stages, 1):
        if checkpoint is not None:  # the trained drafter is known only once training has finished
            stage.argv = [str(checkpoint / "draft") if a == "<final checkpoint>" else a for a in stage.argv]
        runner.run(stage, index, len(stages))
        if stage.name == "train":
            checkpoint = final_checkpoint(out / "train")
            assert checkpoint is not None, "training finished without its final checkpoint"
    from dflash_train.data.prepared import read_metadata  # loads huggingface_hub: after main()'s environment

    report_path = out / "eval" / "report.json"
    draft_config = json.loads((checkpoint / "draft" / "config.json").read_text())
    return DemoResult(out, json.loads(report_path.read_text()), report_path, checkpoint, out / "export",
                      int(read_metadata(out / "prepared")["counts"]["kept"]),
                      int(checkpoint.name.removeprefix("step-")), runner.seconds, runner.skipped, target,
                      draft_config.get("num_hidden_layers"))


def _in_repo(sizes: DemoSizes) -> DemoSizes:
    """Relative recipe and prompt paths resolved against the repository, so any working directory works."""
    def resolve(path: str) -> str:
        return str(REPO / path) if (REPO / path).exists() else path

    return replace(sizes, recipe=resolve(sizes.recipe), sources=tuple(resolve(s) for s in sizes.sources))


def summary_tables(result: DemoResult, device: str) -> list[Any]:
    """The result per dataset, where the time went, then what the GPU speedrun gives instead."""
    from dflash_train.eval.console import lossless_mark  # loads torch: after main()'s environment

    results = Table(title=f"DFlash demo: {result.target} + {_drafter(result)}",
                    caption=f"drafter trained {result.train_steps} steps on {result.train_samples} target-regenerated "
                            f"chats ({device}); τ counts the bonus token: 1.00 = no draft accepted")
    for column in ("dataset", "requests", "τ", "τ 95% CI", "lossless", "tok/s with drafter", "tok/s target alone",
                   "speedup"):
        results.add_column(column, justify="left" if column == "dataset" else "right")
    for name, row in result.report["datasets"].items():
        lossless, ci = lossless_mark(row), row.get("acceptance_length_ci95")
        results.add_row(name, str(row["requests"]), f"{row['acceptance_length']:.2f}",
                        "—" if not ci else f"{ci[0]:.2f}–{ci[1]:.2f}", lossless,
                        _number(row["tokens_per_s_with_draft"], ".1f"), _number(row["tokens_per_s_target_only"], ".1f"),
                        _number(row["speedup"], ".2f", "×"))
    times = Table(title="stage times")
    times.add_column("stage")
    times.add_column("seconds", justify="right")
    for name, seconds in result.seconds.items():
        times.add_row(name + (" (done earlier)" if name in result.skipped else ""), f"{seconds:.0f}")
    times.add_row("total", f"{sum(result.seconds.values()):.0f}", style="bold")
    return [results, times, speedrun_table(result, device)]


def speedrun_table(result: DemoResult, device: str, speedrun: SpeedrunFigures = SPEEDRUN) -> Table:
    """This run beside the GPU speedrun's, set by set: what 25 minutes of one GPU buy that minutes here do not."""
    table = Table(title="what the GPU speedrun gives instead (bash recipes/smollm2-135m-speedrun.sh all)",
                  caption="speedrun: README.md's Results, docs/results.md#the-speedrun")
    for column in ("", "this demo", "GPU speedrun"):
        table.add_column(column, justify="left" if not column else "right")
    cores = f", {os.cpu_count()} cores" if device == "cpu" else ""
    table.add_row("machine", device + cores, speedrun.device)
    table.add_row("minutes", f"{sum(result.seconds.values()) / 60:.1f}", f"{speedrun.minutes:.1f}")
    table.add_row("drafter", _drafter(result), f"{speedrun.draft_layers}-layer drafter, block {speedrun.block_size}")
    table.add_row("trained on", f"{result.train_samples:,} chats, {result.train_steps:,} steps",
                  f"{speedrun.chats:,} chats, {speedrun.steps:,} steps")
    rows = result.report["datasets"]
    for name in [*rows, *(name for name in speedrun.tau if name not in rows)]:
        row = rows.get(name)
        mine = "not run" if row is None else (f"{row['acceptance_length']:.2f}"
                                              + _number(row.get("speedup"), ".2f", "×", " ({})", ""))
        theirs = ("—" if name not in speedrun.tau
                  else f"{speedrun.tau[name]:.2f}" + _number(speedrun.speedup.get(name), ".2f", "×", " ({})", ""))
        table.add_row(f"τ {name} (speedup)", mine, theirs, style="bold" if row is not None else None)
    return table


def _drafter(result: DemoResult) -> str:
    block = result.report.get("settings", {}).get("block_size", 16)
    layers = result.draft_layers
    return f"{layers}-layer drafter, block {block}" if layers else f"drafter, block {block}"


def _number(value: float | None, spec: str, suffix: str = "", form: str = "{}", missing: str = "—") -> str:
    return missing if value is None else form.format(format(value, spec) + suffix)


def print_summary(result: DemoResult, device: str, load: tuple[tuple[float, ...], tuple[float, ...]]) -> None:
    from dflash_train.eval.console import wide_console  # loads torch: after main()'s environment

    console = wide_console()
    console.rule("demo finished")
    for table in summary_tables(result, device):
        console.print(table)
    cwd = Path.cwd()

    def show(path: Path) -> str:
        return str(path.relative_to(cwd)) if path.is_relative_to(cwd) else str(path)

    console.print(f"checkpoint  {show(result.checkpoint)}\n"
                  f"export      {show(result.export)}  (dflash-train check: OK; serve it with SGLang or vLLM, "
                  f"see its README.md)\n"
                  f"report      {show(result.report_path)}  (+ report.png: acceptance histogram)\n"
                  f"load avg    {_load(load[0])} at start, {_load(load[1])} at the end, {os.cpu_count()} CPUs",
                  highlight=False, soft_wrap=True)


def _load(values: tuple[float, ...]) -> str:
    return "/".join(f"{v:.1f}" for v in values)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dflash_train.demo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="outputs/demo", help="where every stage writes (default: outputs/demo)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="auto: cuda when a GPU is visible (GPU sizes), else cpu (CPU sizes)")
    parser.add_argument("--target", default=TARGET,
                        help="the target: alias, local directory or .gguf (default: the SmolLM2 wheel's model)")
    parser.add_argument("--data", default=None,
                        help="prompt file to regenerate instead of the size's sources (a machine without the "
                             "sharegpt package, say)")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the demo uses only what is installed, never the Hub
    if args.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before torch loads: training must stay on the CPU too
    import torch  # only now: torch reads CUDA_VISIBLE_DEVICES, huggingface_hub HF_HUB_OFFLINE, when imported

    if args.device == "cuda" and not torch.cuda.is_available():
        print("make demo: error: --device cuda but no CUDA device is visible; use --device cpu", file=sys.stderr)
        return 2
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    load_start = os.getloadavg()
    try:
        sizes = GPU_SIZES if device == "cuda" else CPU_SIZES
        if args.data:
            sizes = replace(sizes, sources=(args.data,))
        result = run_demo(args.out, sizes, device, args.target)
    except DemoError as error:
        print(f"make demo: error: {error}", file=sys.stderr)
        return 1
    print_summary(result, device, (load_start, os.getloadavg()))
    from dflash_train.eval.console import lossless_failed  # loads torch: after the environment above
    if any(lossless_failed(row) for row in result.report["datasets"].values()):
        print("make demo: error: speculative decoding changed the target's output (lossless: NO); "
              f"see 'mismatches' in {result.report_path} and report it", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
