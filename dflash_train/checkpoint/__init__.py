"""Checkpoints in the published DFlash layout (docs/design.md §9): save/load, export, check, import, push."""

from dflash_train.checkpoint.check import check_checkpoint
from dflash_train.checkpoint.export import export_checkpoint
from dflash_train.checkpoint.io import draft_from_checkpoint, load_draft, read_checkpoint, save_draft
from dflash_train.checkpoint.push import push_checkpoint

__all__ = ["check_checkpoint", "draft_from_checkpoint", "export_checkpoint", "load_draft", "push_checkpoint", "read_checkpoint", "save_draft"]
