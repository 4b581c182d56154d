"""The trainer's side of training checkpoints: saving one (the disk's room checked first, on every rank at
once) and resuming from one. Where they live and how they are written, kept and checked is resume.py's.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

from dflash_train.checkpoint.io import save_draft
from dflash_train.models import DFlashDraftModel
from dflash_train.training import resume as ckpt
from dflash_train.training.packing import PACK_RULE
from dflash_train.training.run_files import read_trainer_state


def device_name(device: torch.device) -> str:
    """The device a run trained on, as its figures are quoted ("NVIDIA H100 80GB HBM3", or "cpu")."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


class CheckpointMixin:
    """The Trainer's saving and resuming. Relies on the Trainer's `config`, `accelerator`, `model`,
    `draft_config`, `compat`, `output_dir`, `packed`, `plan`, `budget`, `step`, `total_steps`,
    `first_step_seconds`, `_agree` and `_distributed_type`."""

    def save_checkpoint(self) -> Path:
        t = self.config.training
        tmp, final = ckpt.checkpoint_root(self.output_dir) / f"step-{self.step:08d}.tmp", None
        if self.accelerator.is_main_process:
            tmp, final = ckpt.staging_dir(self.output_dir, self.step)
        # staging_dir removes stale *.tmp folders: a rank already writing its RNG state into this one lost it
        self.accelerator.wait_for_everyone()
        self._check_disk_room()
        try:
            self.accelerator.save_state(str(tmp / "state"))
        except (OSError, RuntimeError) as error:  # torch.save reports a full disk as a RuntimeError
            shutil.rmtree(tmp, ignore_errors=True)
            problem = ckpt.space_error(self.output_dir, self.step, self._checkpoint_estimate())
            if problem is None:
                raise
            raise problem from error
        state_dict = self.accelerator.get_state_dict(self.model)
        if self.accelerator.is_main_process:
            draft = DFlashDraftModel(self.draft_config)
            draft.load_state_dict({k: v.detach().float().cpu() for k, v in state_dict.items()})
            save_draft(draft, tmp / "draft", extra_config={"dflash_train": {"step": self.step, **self.compat}})
            trainer_state = {"step": self.step, "total_steps": self.total_steps,
                             "sequences_seen": self._sequences_seen(),
                             "train_seconds": round(self.budget.elapsed(), 3), "budget_sized": self.budget.sized,
                             "first_step_seconds": self.first_step_seconds,
                             "distributed_type": self._distributed_type(), "device": device_name(self.accelerator.device),
                             "num_processes": self.accelerator.num_processes, "packing": self._packing_record(),
                             **self.compat}
            ckpt.finalize(tmp, final, trainer_state, t.keep_last)
        self.accelerator.wait_for_everyone()
        return ckpt.checkpoint_root(self.output_dir) / f"step-{self.step:08d}"

    def _sequences_seen(self) -> int:
        if self.packed is not None:
            return self.packed.chats_seen(self.step)
        return self.step * self.plan.sequences_per_step

    def _checkpoint_estimate(self) -> int:
        """Bytes of the first checkpoint before any exists: fp32 weights twice (accelerate state and the
        drafter export) and AdamW's two fp32 moments, for this process's share of the parameters."""
        params = sum(p.numel() for p in self.model.parameters())
        return ckpt.bytes_needed(self.output_dir, 16 * params)

    def _check_disk_room(self) -> None:
        """Refuse a checkpoint the disk cannot hold before writing any of it (all ranks stop together)."""
        problem = None
        if self.accelerator.is_main_process:
            problem = ckpt.space_error(self.output_dir, self.step, self._checkpoint_estimate())
        if self._agree(int(problem is not None), "max"):
            raise problem or ckpt.CheckpointSpaceError(
                f"disk full: rank 0 cannot write checkpoint step-{self.step:08d} to {self.output_dir}")
        self.accelerator.wait_for_everyone()

    def maybe_resume(self) -> None:
        path = ckpt.resolve_resume(self.config.training.resume, self.output_dir)
        if path is None:
            return
        state = read_trainer_state(path)
        ckpt.check_compatible(state, self.compat, path)
        ckpt.check_launch(state, self._distributed_type(), self.accelerator.num_processes, path)
        self.accelerator.load_state(str(path / "state"))
        self.step = int(state["step"])
        self.first_step_seconds = state.get("first_step_seconds")
        self.budget.resume(float(state.get("train_seconds", 0.0)), bool(state.get("budget_sized", False)))
        if self.budget.sized:  # a budgeted run keeps the length it settled on (others follow their config)
            self.total_steps = int(state["total_steps"])
        self.accelerator.print(f"resumed from {path} at step {self.step}")
        if self.packed is not None and state.get("packing") != self._packing_record():
            saved = state.get("packing") or "not recorded"
            self.accelerator.print(f"the checkpoint's rows were packed otherwise ({saved}; this run: "
                                   f"{self._packing_record()}): its next steps hold other chats than the saved run's "
                                   "would have, from the same epochs")

    def _packing_record(self) -> dict[str, Any] | None:
        """How a packed run fills its rows (None unpacked): the rule and the anchor slots a row."""
        if self.packed is None:
            return None
        return {"rule": PACK_RULE, "anchors_per_row": self.packed.anchors_per_row}
