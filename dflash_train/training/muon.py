"""Muon for the drafter's weight matrices, AdamW for the rest, stepped and scheduled as one optimizer.

Muon (Keller Jordan, 2024; `torch.optim.Muon`) replaces each 2-D weight's update by the Newton–Schulz
orthogonalisation of its Nesterov momentum; it is defined for matrices only, so the norm weights (and
projection biases) keep AdamW. The pair is one `torch.optim.Optimizer` so that the learning-rate schedule
(one multiplier for every group), accelerate's wrapper and checkpoints (one state dict) see a single
optimizer, as they do with plain AdamW.

`torch.optim.Muon.step` updates one matrix at a time, 23 small kernels each (momentum, Nesterov, bf16 cast,
norm, five Newton–Schulz iterations of three matmuls, weight decay, update): ~830 launches per step for a
5-layer drafter's 36 matrices, a real share of a short training step on a slow host. `BatchedMuon` does
the same arithmetic per matrix but stacks the matrices of one shape (the five layers' q_proj weights, ...)
and iterates them with batched matmuls, so the launches are ~22 per shape (five shapes there) plus three
`_foreach` ops for the momentum and weight decay: ~115 in all.

Newton–Schulz runs in bf16 on CUDA, as torch's does, and on CPUs with bf16 matrix instructions (AMX,
AVX-512 BF16). On other CPUs it runs in float32: there bf16 matmuls are emulated, many times slower than
float32 ones, enough to make the optimizer most of a CPU training step (docs/results.md, "The demo"), and
float32 only rounds less.
"""

from __future__ import annotations

import functools
import math
from collections import defaultdict
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch


@functools.cache
def cpu_has_bf16_matmul(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether this CPU multiplies bf16 matrices in hardware (AMX or AVX-512 BF16), from the kernel's CPU flags;
    False where they cannot be read."""
    try:
        flags = set(Path(cpuinfo).read_text().split())
    except OSError:
        return False
    return bool(flags & {"amx_bf16", "avx512_bf16"})


def is_muon_matrix(name: str, param: torch.nn.Parameter) -> bool:
    """The context projection `fc` and the layers' q/k/v/o and gate/up/down projections."""
    return param.ndim == 2 and (name.startswith("fc.") or name.startswith("layers."))


def newton_schulz_batched(update: torch.Tensor, coefficients: tuple[float, float, float], steps: int,
                          eps: float, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """`torch.optim._muon._zeropower_via_newtonschulz` on each matrix of a [n, rows, cols] stack, in `dtype`
    (torch's: bf16).

    Wide (rows ≤ cols) orientation as torch's, and each matrix divided by its own Frobenius norm, not the
    stack's. Returns a `dtype` [n, rows, cols] tensor (a transposed view when rows > cols).
    """
    a, b, c = coefficients
    tall = update.size(-2) > update.size(-1)
    x = update.to(dtype)
    if tall:
        x = x.mT
    x = x / torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True).clamp(min=eps)
    for _ in range(steps):
        gram = torch.bmm(x, x.mT)
        gram_update = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.baddbmm(x, gram_update, x, beta=a)
    return x.mT if tall else x


def adjusted_lr(lr: float, adjust_lr_fn: str | None, shape: torch.Size) -> float:
    """`torch.optim._muon._adjust_lr`: the update's scale for a rows × cols matrix."""
    rows, cols = shape[:2]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return lr * math.sqrt(max(1, rows / cols))
    if adjust_lr_fn == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    return lr


def closure_loss(closure: Callable[[], float] | None) -> float | None:
    """The optimizer-step convention: re-evaluate the loss with gradients on, if a closure is given."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


class BatchedMuon(torch.optim.Muon):
    """`torch.optim.Muon` with the matrices of one shape stepped together (see the module docstring).

    Same hyperparameters, param groups and per-parameter `momentum_buffer` state as `torch.optim.Muon`, so
    their state dicts load into each other; only `step` differs, in the order of floating-point operations
    inside the batched matmuls and norms at most. `ns_dtype` is Newton–Schulz's dtype: None picks bf16 on
    CUDA (torch's) and on CPUs with bf16 matrix instructions, float32 elsewhere (see the module docstring).
    """

    def __init__(self, params: Any, *args: Any, ns_dtype: torch.dtype | None = None, **kwargs: Any) -> None:
        super().__init__(params, *args, **kwargs)
        self.ns_dtype = ns_dtype

    def _newton_schulz_dtype(self, device: torch.device) -> torch.dtype:
        if self.ns_dtype is not None:
            return self.ns_dtype
        fast_bf16 = device.type == "cuda" or (device.type == "cpu" and cpu_has_bf16_matmul())
        return torch.bfloat16 if fast_bf16 else torch.float32

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = closure_loss(closure)
        for group in self.param_groups:
            params: list[torch.Tensor] = []
            grads: list[torch.Tensor] = []
            bufs: list[torch.Tensor] = []
            self._init_group(group, params, grads, bufs)  # skips grad-less params, makes the buffers
            if params:
                self._step_group(group, params, grads, bufs)
        return loss

    def _step_group(self, group: dict[str, Any], params: list[torch.Tensor], grads: list[torch.Tensor],
                    bufs: list[torch.Tensor]) -> None:
        """torch's `_single_tensor_muon` on every parameter of `group` that has a gradient. The group's `lr` may
        be a 0-d tensor on the parameters' device, which a CUDA graph of the step reads at each replay
        (training/optimizer_graph.py); the update is then scaled by it on the device, in one more launch a shape."""
        lr, momentum, decay = group["lr"], group["momentum"], group["weight_decay"]
        on_device = isinstance(lr, torch.Tensor)
        torch._foreach_lerp_(bufs, grads, 1 - momentum)
        updates = torch._foreach_lerp(grads, bufs, momentum) if group["nesterov"] else bufs
        if decay != 0 and (on_device or lr != 0):  # torch multiplies by 1.0 too; that changes nothing
            torch._foreach_mul_(params, 1 - lr * decay)
        by_shape: dict[tuple[torch.Size, torch.dtype, torch.device], list[int]] = defaultdict(list)
        for i, param in enumerate(params):
            by_shape[param.shape, param.dtype, param.device].append(i)
        for (shape, dtype, device), members in by_shape.items():
            ortho = newton_schulz_batched(torch.stack([updates[i] for i in members]), group["ns_coefficients"],
                                          group["ns_steps"], group["eps"], self._newton_schulz_dtype(device))
            # Contiguous and in the parameters' dtype, so that the `_foreach_add_` stays one fused launch.
            ortho = ortho.to(dtype=dtype, memory_format=torch.contiguous_format)
            if on_device:  # the update's scale is linear in lr
                ortho.mul_(lr * -adjusted_lr(1.0, group["adjust_lr_fn"], shape))
                torch._foreach_add_([params[i] for i in members], list(ortho.unbind(0)))
            else:
                torch._foreach_add_([params[i] for i in members], list(ortho.unbind(0)),
                                    alpha=-adjusted_lr(lr, group["adjust_lr_fn"], shape))


class MuonWithAdamW(torch.optim.Optimizer):
    """Muon over `matrices`, AdamW over `others`; `param_groups` lists AdamW's groups first.

    Deliberately no `Optimizer.__init__`: the groups and the state live in the two inner optimizers, and
    `param_groups` is their concatenation (the same dicts), so a scheduler that sets a group's `lr` sets
    the inner optimizer's.
    """

    def __init__(self, matrices: Iterable[torch.nn.Parameter], others: Iterable[torch.nn.Parameter],
                 muon_lr: float, adamw_lr: float, betas: tuple[float, float], weight_decay: float,
                 fused: bool | None = None) -> None:
        matrices, others = list(matrices), list(others)
        self.muon = BatchedMuon(matrices, lr=muon_lr, weight_decay=weight_decay) if matrices else None
        self.adamw = (torch.optim.AdamW(others, lr=adamw_lr, betas=betas, weight_decay=weight_decay, fused=fused)
                      if others else None)
        self.defaults: dict[str, Any] = {}

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        return [opt for opt in (self.adamw, self.muon) if opt is not None]

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return [group for opt in self.optimizers for group in opt.param_groups]

    @property
    def state(self) -> dict[torch.Tensor, Any]:  # type: ignore[override]
        return {param: value for opt in self.optimizers for param, value in opt.state.items()}

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = closure_loss(closure)
        for opt in self.optimizers:
            opt.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        return {name: None if opt is None else opt.state_dict()
                for name, opt in (("adamw", self.adamw), ("muon", self.muon))}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        if set(state_dict) != {"adamw", "muon"}:
            raise ValueError("not a Muon + AdamW optimizer state (was the checkpoint made with "
                             "training.optimizer: adamw?)")
        for name in ("adamw", "muon"):
            opt, state = getattr(self, name), state_dict[name]
            if (opt is None) != (state is None):
                raise ValueError(f"the checkpoint's {name} parameter group does not match this drafter's")
            if opt is not None:
                opt.load_state_dict(state)

    def __repr__(self) -> str:
        return f"MuonWithAdamW({self.muon!r}, {self.adamw!r})"


def build_muon_with_adamw(draft: torch.nn.Module, muon_lr: float, adamw_lr: float, betas: tuple[float, float],
                          weight_decay: float) -> MuonWithAdamW:
    """Splits the drafter's trainable parameters: `is_muon_matrix` ones to Muon, the rest to AdamW."""
    named = [(name, p) for name, p in draft.named_parameters() if p.requires_grad]
    matrices = [p for name, p in named if is_muon_matrix(name, p)]
    others = [p for name, p in named if not is_muon_matrix(name, p)]
    fused = all(p.is_cuda for p in others) or None
    return MuonWithAdamW(matrices, others, muon_lr, adamw_lr, betas, weight_decay, fused)
