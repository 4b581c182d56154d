"""Muon for the drafter's weight matrices, AdamW for the rest, stepped and scheduled as one optimizer.

Muon (Keller Jordan, 2024; `torch.optim.Muon`) replaces each 2-D weight's update by the Newton–Schulz
orthogonalisation of its Nesterov momentum; it is defined for matrices only, so the norm weights (and
projection biases) keep AdamW. The pair is one `torch.optim.Optimizer` so that the learning-rate schedule
(one multiplier for every group), accelerate's wrapper and checkpoints (one state dict) see a single
optimizer, as they do with plain AdamW.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch


def is_muon_matrix(name: str, param: torch.nn.Parameter) -> bool:
    """The context projection `fc` and the layers' q/k/v/o and gate/up/down projections."""
    return param.ndim == 2 and (name.startswith("fc.") or name.startswith("layers."))


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
        self.muon = torch.optim.Muon(matrices, lr=muon_lr, weight_decay=weight_decay) if matrices else None
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
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
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
