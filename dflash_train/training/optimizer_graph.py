"""The gradient clipping and the optimizer's update, replayed from one CUDA graph.

Why: once the target's pass and the drafter's step replay from graphs, the optimizer is the largest part of
what the host still issues a step: the gradient norm, Muon's momentum and its Newton–Schulz iterations shape by
shape, AdamW's fused update, well over a hundred launches that take the host several times as long as the
device (docs/benchmarks.md, 'Where the packed step's time goes'). Captured, they are one launch.

What makes the update capturable: the captured drafter step leaves every gradient in the same `.grad` tensor,
and the optimizer's state (momentum, AdamW's moments and step counts) exists once it has stepped. The learning
rate changes every step: each parameter group's `lr` stays the Python number the schedule sets (and checkpoints
keep), and the graph reads it from a 0-d tensor of its own that is filled from it before each replay; the groups
see those tensors only while the graph is captured. Optimizers whose update takes such an `lr` qualify: fused
AdamW, and Muon + AdamW (training/muon.py).

A graph's first replay is checked against the update run as usual from the same parameters, gradients and state:
a capture that went wrong stops the graph instead of training on a wrong update.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from dflash_train.training.muon import MuonWithAdamW
from dflash_train.training.step_graph import relative_error

CHECK_TOLERANCE = 1e-3  # relative error of the first replay's update and gradient norm against the uncaptured ones


def capturable(optimizer: torch.optim.Optimizer, device: torch.device) -> bool:
    """Whether `optimizer`'s update can read its learning rate from a tensor on `device`: Muon + AdamW or AdamW,
    their AdamW fused on CUDA (the CUDA update that takes a tensor learning rate captured or not, unchanged)."""
    adamw = optimizer.adamw if isinstance(optimizer, MuonWithAdamW) else optimizer
    if adamw is None:
        return True
    if not isinstance(adamw, torch.optim.AdamW):
        return False
    return device.type != "cuda" or bool(adamw.defaults.get("fused"))


class GraphedOptimizerStep:
    """`clip_grad_norm_(params, max_grad_norm)` then `optimizer.step()`, replayed from a CUDA graph captured at the
    second call (the first makes the optimizer's state, and runs uncaptured). `eager=True` replays by running the
    same update again with the groups' learning rates as tensors (CPU tests of everything but the capture)."""

    def __init__(self, optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter], max_grad_norm: float,
                 device: torch.device, eager: bool = False) -> None:
        if not eager and device.type != "cuda":
            raise ValueError("a CUDA graph of the optimizer's update needs a CUDA device")
        if not capturable(optimizer, device):
            raise ValueError(f"{type(optimizer).__name__} cannot read its learning rate from a device tensor: "
                             "a CUDA graph of its update needs Muon + AdamW or AdamW, fused on CUDA")
        self.optimizer, self.params, self.max_grad_norm = optimizer, params, max_grad_norm
        self.device, self.eager = device, eager
        self.lrs = [torch.zeros((), dtype=torch.float32, device=device) for _ in optimizer.param_groups]
        self.replay: Callable[[], None] | None = None
        self.norm: Tensor | None = None
        self.grads: list[Tensor | None] = []  # the tensors the graph was captured on

    def __call__(self) -> Tensor:
        """Clips the gradients and updates the parameters; returns the gradient norm before clipping (the
        graph's own tensor, overwritten by the next replay)."""
        grads = [param.grad for param in self.params]
        if self.replay is None or any(a is not b for a, b in zip(grads, self.grads, strict=True)):
            if not self.optimizer.state:  # the first step makes the state the graph updates in place
                return self._update()
            self.replay, self.norm = self._first_replay()
            self.grads = grads
            return self.norm
        self._fill_lrs()
        self.replay()
        assert self.norm is not None
        return self.norm

    def _update(self, lrs: list[Tensor] | None = None) -> Tensor:
        """The update as the trainer runs it uncaptured; with `lrs`, each group reads its learning rate from its
        tensor (as the graph does)."""
        groups = self.optimizer.param_groups
        kept = [group["lr"] for group in groups]
        try:
            if lrs is not None:
                for group, lr in zip(groups, lrs, strict=True):
                    group["lr"] = lr
            norm = torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm)
            self.optimizer.step()
        finally:
            for group, lr in zip(groups, kept, strict=True):
                group["lr"] = lr
        return norm

    def _fill_lrs(self) -> None:
        for tensor, group in zip(self.lrs, self.optimizer.param_groups, strict=True):
            tensor.fill_(float(group["lr"]))

    def _first_replay(self) -> tuple[Callable[[], None], Tensor]:
        """A new graph, captured and replayed once, the replay checked against the uncaptured update from the
        same parameters, gradients and state (each put back before the capture and the replay, and after a
        failure)."""
        before = self._snapshot()
        try:
            expected_norm = self._uncaptured().clone()
            expected = [param.detach().clone() for param in self.params]
            self._restore(before)
            replay, norm = self._capture()
            self._restore(before)
            self._fill_lrs()
            replay()
            self._check(norm, expected_norm, before[0], expected)
        except Exception:
            self._restore(before)
            raise
        return replay, norm

    def _uncaptured(self) -> Tensor:
        """The update on a side stream, as a capture's warm-up (its libraries' workspaces made outside it)."""
        if self.eager:
            return self._update()
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            norm = self._update()
        torch.cuda.current_stream(self.device).wait_stream(side)
        return norm

    def _capture(self) -> tuple[Callable[[], None], Tensor]:
        if self.eager:
            norm = self._update(self.lrs).clone()

            def replay() -> None:
                norm.copy_(self._update(self.lrs))

            return replay, norm
        graph = torch.cuda.CUDAGraph()
        capture_flags = self._capture_flags(True)
        try:  # fused AdamW refuses a capture unless its groups say capturable (its update is the same either way)
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                norm = self._update(self.lrs)
        finally:
            self._capture_flags(capture_flags)
        return graph.replay, norm

    def _capture_flags(self, value: bool | list[bool]) -> list[bool]:
        """Sets every group's `capturable` (one value, or one per group); returns what they held."""
        groups = self.optimizer.param_groups
        held = [bool(group.get("capturable", False)) for group in groups]
        values = value if isinstance(value, list) else [value] * len(groups)
        for group, flag in zip(groups, values, strict=True):
            if "capturable" in group:
                group["capturable"] = flag
        return held

    def _snapshot(self) -> tuple[list[Tensor], list[Tensor], list[Tensor]]:
        """Copies of the parameters, their gradients and every tensor of the optimizer's state."""
        params = [param.detach().clone() for param in self.params]
        grads = [param.grad.clone() for param in self.params if param.grad is not None]
        state = [value.clone() for value in self._state_tensors()]
        return params, grads, state

    def _restore(self, snapshot: tuple[list[Tensor], list[Tensor], list[Tensor]]) -> None:
        params, grads, state = snapshot
        with torch.no_grad():
            torch._foreach_copy_([param.detach() for param in self.params], params)
            torch._foreach_copy_([param.grad for param in self.params if param.grad is not None], grads)
            torch._foreach_copy_(self._state_tensors(), state)

    def _state_tensors(self) -> list[Tensor]:
        return [value for param in self.params for value in self.optimizer.state.get(param, {}).values()
                if isinstance(value, Tensor)]

    def _check(self, norm: Tensor, expected_norm: Tensor, start: list[Tensor], expected: list[Tensor]) -> None:
        """The gradient norm, and the update as one vector (the parameters themselves would hide a wrong update
        in their rounding), against the uncaptured ones."""
        replayed = torch.cat([(param.detach() - old).float().flatten() for param, old in zip(self.params, start, strict=True)])
        wanted = torch.cat([(new - old).float().flatten() for new, old in zip(expected, start, strict=True)])
        worst = max(relative_error(norm, expected_norm), relative_error(replayed, wanted))
        if not worst <= CHECK_TOLERANCE:
            raise RuntimeError(f"the replayed optimizer graph's update differs from the uncaptured one (relative "
                               f"error {worst:.2e} > {CHECK_TOLERANCE:.0e})")
