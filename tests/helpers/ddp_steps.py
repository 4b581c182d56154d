"""Run under `accelerate launch`: the same training steps three ways, each process's losses and weights saved.

    accelerate launch ... -m tests.helpers.ddp_steps OUT STEPS OVERRIDE...

- `ddp`: the trainer as prepared, DDP's hooks averaging the gradients;
- `graphed`: the drafter's step and the optimizer's update on the CPU stand-ins of their CUDA graphs, the
  gradients averaged by hand (`training/grad_sync.py`), as a DDP run with `training.step_cuda_graphs` has them;
- `by-hand`: uncaptured steps in the same by-hand regime, as such a run continues after its graphs failed.
Rank r writes OUT/<variant>-rank<r>.pt: {"losses": [...], "grad_norms": [...], "weights": state dict}.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

from dflash_train.training.config import load_config
from dflash_train.training.optimizer_graph import GraphedOptimizerStep
from dflash_train.training.step_graph import GraphedDrafterStep
from dflash_train.training.trainer import Trainer


def stand_in_graphs(trainer: Trainer) -> GraphedDrafterStep:
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    return GraphedDrafterStep(
        lambda inputs: trainer._drafter_loss(inputs.batch, inputs.features, inputs.blocks, inputs.teacher),
        params, trainer.accelerator.device, eager=True)


def stand_in_update(trainer: Trainer) -> GraphedOptimizerStep:
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    return GraphedOptimizerStep(trainer.optimizer.optimizer, params, trainer.config.training.max_grad_norm,
                                trainer.accelerator.device, eager=True)


def run(variant: str, out: Path, steps: int, overrides: list[str]) -> None:
    trainer = Trainer(load_config(None, [*overrides, f"training.output_dir={out / variant}"]))
    if variant != "ddp":
        trainer.sync_by_hand = True
        trainer.step_graph = stand_in_graphs(trainer) if variant == "graphed" else None
        trainer.optimizer_graph = stand_in_update(trainer) if variant == "graphed" else None
    # the gradient's norm, taken after the processes' gradients are averaged: the optimizers barely see their scale
    metrics = [trainer.train_step() for _ in range(steps)]
    weights = {k: v.clone() for k, v in trainer.accelerator.unwrap_model(trainer.model).state_dict().items()}
    torch.save({"losses": [m["loss"] for m in metrics], "grad_norms": [m["grad_norm"] for m in metrics],
                "weights": weights},
               out / f"{variant}-rank{trainer.accelerator.process_index}.pt")


def main(argv: list[str]) -> None:
    out, steps, overrides = Path(argv[0]), int(argv[1]), argv[2:]
    for variant in ("ddp", "graphed", "by-hand"):
        run(variant, out, steps, overrides)
    # Leave without the interpreter's finalization: gloo's worker thread may still be releasing the last
    # hand-made all-reduce (a tensor Python created), which needs the GIL that a finalizing interpreter no longer
    # gives, and the process aborts ("terminate called without an active exception") after its work is done.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1:])
