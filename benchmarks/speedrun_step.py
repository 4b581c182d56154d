"""The speedrun's training step on real chats, from one or more checkouts of the project, in one run:

    python -m benchmarks.speedrun_step --prepared OUT/prepared --target TARGET                   # this tree
    python -m benchmarks.speedrun_step --prepared OUT/prepared --target TARGET \\
        --tree before=/path/to/older/checkout --tree after=. --repeat 2                       # a same-run ablation

Each run is the speedrun's own training (`recipes/smollm2-135m-dflash-b16-packed.yaml` of that tree) on the same
prepared chats for `--minutes` of its time budget, launched as `dflash_train.cli train` from the tree's folder
with that folder first on the import path, one after the other; `--repeat 2` runs them again in the reverse order
(a warm machine favours the later runs). `--set KEY=VALUE` overrides the recipe in every run. From each run's
`metrics.jsonl`: the median step and whole-step MFU of the logged steps after the first (its compilation says
nothing of the step), their 10th and 90th percentiles, chats a second after the first step, how full the rows'
tokens and anchor slots were, and the held-out τ̂ at the end. The first tree is the baseline of the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.common import write_result

RECIPE = "recipes/smollm2-135m-dflash-b16-packed.yaml"
NEVER = 10**9  # steps between checkpoints and validations: none before the run's last


def train_command(tree: Path, args: argparse.Namespace, output_dir: Path) -> list[str]:
    return [sys.executable, "-m", "dflash_train.cli", "train", "--config", str(tree / args.recipe),
            f"model.target={args.target}", f"data.prepared={args.prepared}", f"training.output_dir={output_dir}",
            f"training.time_budget_minutes={args.minutes}", f"training.save_every={NEVER}",
            f"training.eval_every={NEVER}", "tracking.report_to=none", *args.set]


def percentiles(values: list[float]) -> dict[str, float] | None:
    """Median, 10th and 90th percentile (the nearest logged value)."""
    if not values:
        return None
    ordered = sorted(values)
    return {"median": statistics.median(ordered), "p10": ordered[len(ordered) // 10],
            "p90": ordered[9 * len(ordered) // 10]}


def run_figures(output_dir: Path) -> dict[str, Any]:
    """What a finished run's metrics.jsonl and trainer_state.json say of its step."""
    records = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    train = [r for r in records if r.get("split") == "train"][1:]
    validation = [r for r in records if r.get("split") == "validation"]
    states = sorted(output_dir.glob("checkpoints/step-*/trainer_state.json"))
    state = json.loads(states[-1].read_text()) if states else {}
    seconds = (state.get("train_seconds") or 0.0) - (state.get("first_step_seconds") or 0.0)
    figures: dict[str, Any] = {
        "steps": state.get("step"), "device": state.get("device"), "first_step_seconds": state.get("first_step_seconds"),
        "chats_per_second": state["sequences_seen"] / seconds if seconds > 0 and "sequences_seen" in state else None,
        "held_out_tau_hat": validation[-1].get("expected_acceptance_length") if validation else None,
        "logged": [[r["step"], r.get("step_seconds"), r.get("step_mfu")] for r in train],
    }
    for key in ("step_seconds", "step_mfu", "mfu", "step_flops", "pack_token_fill", "pack_anchor_fill"):
        figures[key] = percentiles([r[key] for r in train if r.get(key) is not None])
    return figures


def train_once(name: str, tree: Path, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    output_dir = work / name
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tree), os.environ.get("PYTHONPATH")]))}
    log = work / f"{name}.log"
    with log.open("w") as out:
        done = subprocess.run(train_command(tree, args, output_dir), cwd=tree, env=env, stdout=out,
                              stderr=subprocess.STDOUT, check=False)
    text = log.read_text()
    if done.returncode != 0:
        tail = " | ".join(text.strip().splitlines()[-3:])
        return {"name": name, "tree": str(tree), "error": f"exit {done.returncode}: {tail[-400:]}"}
    packing = next((line.strip() for line in text.splitlines() if line.startswith("packing:")), None)
    return {"name": name, "tree": str(tree), "packing": packing, **run_figures(output_dir)}


def print_table(results: list[dict[str, Any]]) -> None:
    print(f"{'run':22} {'steps':>6} {'median step':>11} {'MFU (p10-p90)':>20} {'chats/s':>8} {'vs first':>8} "
          f"{'slots full':>10} {'tokens full':>11} {'tau_hat':>7}")
    baseline = next((r for r in results if "error" not in r), None)
    for r in results:
        if "error" in r:
            print(f"{r['name']:22} failed: {r['error']}")
            continue
        step, mfu = r["step_seconds"], r["step_mfu"]
        ratio = (r["chats_per_second"] / baseline["chats_per_second"]
                 if baseline and r["chats_per_second"] and baseline["chats_per_second"] else float("nan"))
        mfu_text = f"{100 * mfu['median']:.1f} % ({100 * mfu['p10']:.1f}-{100 * mfu['p90']:.1f})" if mfu else "-"
        tau = f"{r['held_out_tau_hat']:.3f}" if r.get("held_out_tau_hat") is not None else "-"
        print(f"{r['name']:22} {r['steps'] or 0:>6} {1e3 * step['median'] if step else float('nan'):>8.1f} ms "
              f"{mfu_text:>20} {r['chats_per_second'] or float('nan'):>8.0f} {ratio:>7.3f}x "
              f"{share(r['pack_anchor_fill']):>10} {share(r['pack_token_fill']):>11} {tau:>7}")


def share(figure: dict[str, float] | None) -> str:
    return f"{figure['median']:.1%}" if figure else "-"


def parse_trees(specs: list[str]) -> list[tuple[str, Path]]:
    trees = []
    for spec in specs or ["this=."]:
        name, sep, folder = spec.partition("=")
        path = Path(folder if sep else name).resolve()
        if not (path / "dflash_train").is_dir():
            raise SystemExit(f"speedrun_step: --tree {spec}: {path} holds no dflash_train package (a checkout of this "
                             "project is needed)")
        trees.append((name if sep else path.name, path))
    return trees


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prepared", required=True, help="prepared chats (`dflash-train prepare` output)")
    parser.add_argument("--target", required=True, help="the target the chats were prepared for")
    parser.add_argument("--tree", action="append", default=[], metavar="NAME=DIR",
                        help="a checkout to train from (repeatable; default: this one)")
    parser.add_argument("--minutes", type=float, default=1.5, help="each run's training time budget")
    parser.add_argument("--repeat", type=int, default=1, choices=(1, 2), help="2: again, in the reverse order")
    parser.add_argument("--recipe", default=RECIPE, help="the recipe, relative to each tree")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a recipe override")
    parser.add_argument("--workdir", type=Path, default=None, help="where the runs go (default: a temporary folder)")
    args = parser.parse_args(argv)
    args.prepared, args.target = str(Path(args.prepared).resolve()), str(args.target)
    trees = parse_trees(args.tree)
    order = trees + (list(reversed(trees)) if args.repeat == 2 else [])
    work = args.workdir or Path(tempfile.mkdtemp(prefix="speedrun_step-"))
    work.mkdir(parents=True, exist_ok=True)
    results = []
    for i, (name, tree) in enumerate(order):
        label = name if i < len(trees) else f"{name} (again)"
        print(f"training {label} from {tree} for {args.minutes} minutes ...", flush=True)
        results.append(train_once(f"{i}-{name}", tree, args, work))
        results[-1]["name"] = label
    print_table(results)
    path = write_result("speedrun_step", {"config": {k: str(v) for k, v in vars(args).items()}, "results": results})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
