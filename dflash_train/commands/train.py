"""Train a drafter from a recipe (the same code as `python -m dflash_train.train`).

    dflash-train train --config recipes/smollm2-135m-dflash-b16-cpu.yaml training.max_steps=20
"""

from dflash_train.train import add_arguments, run

__all__ = ["add_arguments", "run"]
