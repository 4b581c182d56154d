"""`python -m dflash_train.train`: the training command as a module, the form `accelerate launch -m` runs.
The command itself (arguments, usage, errors) is `dflash_train.commands.train`.

    accelerate launch --config_file recipes/accelerate/ddp.yaml -m dflash_train.train \\
        --config recipes/qwen3-8b-dflash-b16.yaml
"""

from __future__ import annotations

import sys

from dflash_train.commands.train import add_arguments, main, run

__all__ = ["add_arguments", "main", "run"]

if __name__ == "__main__":
    sys.exit(main())
