"""The model FLOPs of `benchmarks.train_packing`'s steps, counted on the host: the drafter's and the whole step's.

    python -m benchmarks.step_flops --recipe recipes/smollm2-135m-dflash-b16-packed.yaml --num-anchors 32 \
        --variants packed,packed-4x-rows

MFU divides a step's model FLOPs by its time and the device's peak. The trainer counts them from the blocks it
lays out on the host (training/flops.py): the drafter's (`flops`, the `mfu` it logs) and the whole step's, the
target's forward pass over the chats added (`step_flops`, `step_mfu`). This builds the same trainer on the same
synthetic chats as `train_packing` and lays out the same steps (1..--steps, after the cold first one) without
running a model, so it runs on a CPU in a minute: a GPU run's step times over these FLOPs give its MFU, both ways,
for runs older than a count or on devices the peak table lacks. One table; the figures go to
`benchmarks/results/step_flops.json`.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.common import write_result
from benchmarks.train_packing import TINY_SETTINGS, VARIANTS, save_smollm2_shaped_target, save_synthetic_chats
from dflash_train.features.packed_rows import chat_layout
from dflash_train.training.config import TrainingConfig, load_config
from dflash_train.training.trainer import Trainer, anchor_seed

# Nothing runs on a device here: the layout alone decides the FLOPs, so compilation and graphs stay off.
HOST_ONLY = ["training.compile=false", "training.compile_target=false", "training.target_cuda_graphs=false",
             "training.step_cuda_graphs=false"]


def count_variant(name: str, target: Path, prepared: Path, work: Path, args: argparse.Namespace) -> dict[str, Any]:
    overrides = [f"model.target={target}", "model.mask_token_id=16", f"data.prepared={prepared}",
                 "data.validation_fraction=0", f"training.num_anchors={args.num_anchors}", "tracking.report_to=none",
                 f"training.output_dir={work / name}", "training.resume=none", "training.max_steps=100000",
                 "training.eval_every=0", "training.time_budget_minutes=null",
                 *VARIANTS[name], *(TINY_SETTINGS if args.tiny else []), *HOST_ONLY, *args.set]
    trainer = Trainer(load_config(args.recipe, overrides))
    drafter, whole = [], []
    for step in range(1, args.steps + 1):
        trainer.step = step
        counted = [step_flops(trainer, step, indices, batch) for indices, batch in trainer._load_step(step)]
        drafter.append(sum(d for d, _ in counted))
        whole.append(sum(w for _, w in counted))
    mean_drafter, mean_whole = statistics.fmean(drafter), statistics.fmean(whole)
    return {"variant": name, "steps": args.steps, "drafter_flops_per_step": mean_drafter,
            "step_flops_per_step": mean_whole, "step_over_drafter": mean_whole / mean_drafter}


def step_flops(trainer: Trainer, step: int, indices: list[int], batch: dict[str, Any]) -> tuple[float, float]:
    """(the drafter's FLOPs, the whole step's) of one micro-batch, as the trainer's step counts them."""
    blocks = batch.get("blocks")
    if blocks is None:
        blocks = trainer._host_blocks(batch, [anchor_seed(trainer.config.training.seed, step, i) for i in indices])
    counts = trainer.step_counts(blocks, chat_layout(batch))
    return counts["flops"], counts["step_flops"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chats", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--num-anchors", type=int, default=TrainingConfig.num_anchors)
    parser.add_argument("--variants", default="packed")
    parser.add_argument("--recipe", type=Path, default=None, help="a recipe YAML every variant starts from")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--tiny", action="store_true", help="a tiny Llama and short chats: a CPU smoke test")
    args = parser.parse_args(argv)
    names = [name.strip() for name in args.variants.split(",")]
    if unknown := [name for name in names if name not in VARIANTS]:
        raise SystemExit(f"unknown variants {unknown}: choose from {', '.join(VARIANTS)}")
    work = args.workdir or Path(tempfile.mkdtemp(prefix="dflash_flops_"))
    target, prepared = work / "target", work / "prepared"
    if not (target / "tokenizer.json").exists():
        save_smollm2_shaped_target(target, args.tiny)
    if not (prepared / "dflash_data.json").exists():
        save_synthetic_chats(prepared, args.chats, target, args.tiny)
    results = [count_variant(name, target, prepared, work, args) for name in names]
    print(f"\nModel FLOPs a step, the mean over steps 1..{args.steps} (SmolLM2 shapes, {args.num_anchors} anchors a chat)")
    print(f"{'variant':<22} {'drafter TFLOP':>14} {'step TFLOP':>11} {'step/drafter':>13}")
    for r in results:
        print(f"{r['variant']:<22} {r['drafter_flops_per_step'] / 1e12:>14.3f} {r['step_flops_per_step'] / 1e12:>11.3f} "
              f"{r['step_over_drafter']:>12.2f}x")
    path = write_result("step_flops", {"config": {k: str(v) for k, v in vars(args).items()}, "results": results},
                        smoke=args.tiny)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
