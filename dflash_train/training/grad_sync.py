"""The gradients of several processes averaged by hand, for steps that do not go through DDP's hooks.

Why: DDP all-reduces gradients from hooks its own forward arms, bucket by bucket, with host-side bookkeeping
that a CUDA graph cannot hold. A drafter step replayed from graphs (`training/step_graph.py`) therefore runs on
the unwrapped drafter, and its gradients are this process's alone; once the step's last micro-batch has written
them, one all-reduce per dtype over a flat copy makes them every process's mean, which is what DDP leaves. The
hooks stay disarmed (DDP arms them in its forward, which these steps never call), so nothing is reduced twice.
A run that starts so keeps to it even after its graphs are turned off: every process then issues the same
collectives, whichever of them fell back to uncaptured steps.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def average_gradients(params: Sequence[torch.nn.Parameter], world_size: int) -> None:
    """Every parameter's gradient replaced by its mean over the `world_size` processes of the default group
    (a missing gradient counts as zeros, as a parameter this process's step did not reach)."""
    if world_size == 1:
        return
    for param in params:
        if param.grad is None:
            param.grad = torch.zeros_like(param)
    by_dtype: dict[torch.dtype, list[Tensor]] = {}
    for param in params:
        by_dtype.setdefault(param.grad.dtype, []).append(param.grad)
    for grads in by_dtype.values():
        flat = torch.cat([grad.flatten() for grad in grads])
        torch.distributed.all_reduce(flat)
        flat.div_(world_size)
        torch._foreach_copy_(grads, [part.view_as(grad) for part, grad in zip(
            flat.split([grad.numel() for grad in grads]), grads, strict=True)])
