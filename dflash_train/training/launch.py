"""What a launch must agree with before the run builds anything: DeepSpeed's accumulation count, and CUDA
devices for an FSDP launch. Checked up front, so that a mismatch stops the run instead of silently changing
it. Also what the launch decides for the run's own settings: whether it shards (DeepSpeed, FSDP), and so whether
its steps can be captured."""

from __future__ import annotations

import os
from typing import Any

import torch


def check_deepspeed_accumulation(deepspeed_config: dict[str, Any], steps: int) -> None:
    """DeepSpeed accumulates by its own count: one that differs from the run's would silently change the
    effective batch (and the schedule's step count)."""
    configured = deepspeed_config.get("gradient_accumulation_steps", "auto")
    if configured != "auto" and int(configured) != steps:
        raise ValueError(
            f"the DeepSpeed launch sets gradient_accumulation_steps: {configured} but "
            f"training.gradient_accumulation_steps={steps}: make them equal (`accelerate launch "
            f"--gradient_accumulation_steps {steps}`, or auto in the launch config)")


def sharding_launch() -> str | None:
    """"DeepSpeed" or "FSDP" when `accelerate launch` started this process under one (they shard parameters and
    gradients in hooks of their own), else None: one process, or DDP."""
    for variable, name in (("ACCELERATE_USE_DEEPSPEED", "DeepSpeed"), ("ACCELERATE_USE_FSDP", "FSDP")):
        if os.environ.get(variable, "false").lower() == "true":
            return name
    return None


def autocast_cache_off(step_cuda_graphs: bool) -> bool:
    """Whether autocast's cache of cast weights goes off: it cannot outlive a CUDA graph's capture, so a run whose
    steps can be captured (CUDA, one process or DDP) casts anew each step; elsewhere the cache stays."""
    return step_cuda_graphs and torch.cuda.is_available() and sharding_launch() is None


def refuse_fsdp_without_cuda() -> None:
    """accelerate quietly runs plain DDP when an FSDP launch config meets CPU processes: say so instead."""
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true" and not torch.cuda.is_available():
        raise ValueError("FSDP needs CUDA devices (on CPU processes accelerate would run plain DDP instead): "
                         "launch CPU processes with recipes/accelerate/cpu_2proc.yaml")
