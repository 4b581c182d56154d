"""The optimizer's update replayed from a graph (training/optimizer_graph.py), on its CPU stand-in: the learning
rate read from device tensors, the update equal to the optimizer run as usual (`clip_grad_norm_` then `step`) as
the schedule changes the rate, the first replay's check, and the trainer's use of it and fallback from it.
The capture itself runs on the GPU (tests/training/test_step_graph_gpu.py)."""

from __future__ import annotations

import copy
import pathlib

import pytest
import torch

from dflash_train.training.config import load_config
from dflash_train.training.muon import build_muon_with_adamw
from dflash_train.training.optimizer_graph import GraphedOptimizerStep, capturable
from dflash_train.training.trainer import Trainer
from tests.helpers.ddp_steps import stand_in_graphs, stand_in_update
from tests.helpers.tiny_drafts import tiny_draft
from tests.helpers.training import overrides

PACKED = {"data.pack_tokens": 160, "data.max_length": 64}


def optimizer_for(kind: str, draft: torch.nn.Module) -> torch.optim.Optimizer:
    if kind == "muon":
        return build_muon_with_adamw(draft, 0.02, 3e-3, (0.9, 0.95), 0.1)
    return torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=3e-3, weight_decay=0.1)


def set_grads(draft: torch.nn.Module, step: int, kept: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """Gradients of a step, written into the same `.grad` tensors every step (as the captured drafter step does)."""
    gen = torch.Generator().manual_seed(step)
    params = [p for p in draft.parameters() if p.requires_grad]
    values = [torch.randn(p.shape, generator=gen) * (3.0 if step % 2 else 0.01) for p in params]  # clipped or not
    if kept is None:
        for p, value in zip(params, values, strict=True):
            p.grad = value
        return [p.grad for p in params]
    for grad, value in zip(kept, values, strict=True):
        grad.copy_(value)
    return kept


@pytest.mark.parametrize("kind", ["muon", "adamw"])
def test_replayed_updates_equal_the_optimizer_run_as_usual(kind: str) -> None:
    """Six steps, the learning rate changed before each as a schedule does: the parameters, the optimizer's state
    and the gradient norms of the stand-in's replays equal those of `clip_grad_norm_` and `step`."""
    torch.manual_seed(0)
    plain_draft = tiny_draft()
    graphed_draft = copy.deepcopy(plain_draft)
    plain, graphed_opt = optimizer_for(kind, plain_draft), optimizer_for(kind, graphed_draft)
    params = [p for p in graphed_draft.parameters() if p.requires_grad]
    graphed = GraphedOptimizerStep(graphed_opt, params, 1.0, torch.device("cpu"), eager=True)
    kept = None
    for step in range(6):
        for opt in (plain, graphed_opt):
            for group in opt.param_groups:
                group["lr"] = group.setdefault("initial_lr", group["lr"]) * (1.0 - 0.15 * step)
        set_grads(plain_draft, step)
        kept = set_grads(graphed_draft, step, kept)
        expected = torch.nn.utils.clip_grad_norm_(plain_draft.parameters(), 1.0)
        plain.step()
        norm = graphed()
        assert float(norm) == pytest.approx(float(expected), rel=1e-6)
        assert all(isinstance(group["lr"], float) for group in graphed_opt.param_groups)  # tensors only inside
    assert graphed.replay is not None  # stepped once as usual, then captured and replayed
    for (name, a), b in zip(plain_draft.named_parameters(), graphed_draft.parameters(), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7, msg=name)
    for a, b in zip(plain_draft.parameters(), graphed_draft.parameters(), strict=True):
        for key, value in plain.state[a].items():
            torch.testing.assert_close(graphed_opt.state[b][key], value, rtol=1e-5, atol=1e-7, msg=key)


def test_a_wrong_replay_is_caught_and_everything_put_back() -> None:
    """A capture whose replay leaves the weight decay out: the first replay's check raises, and the parameters,
    gradients and state are those before the call."""
    draft = tiny_draft()
    opt = optimizer_for("muon", draft)
    params = [p for p in draft.parameters() if p.requires_grad]
    graphed = GraphedOptimizerStep(opt, params, 1.0, torch.device("cpu"), eager=True)
    kept = set_grads(draft, 0)
    graphed()  # the first step, run as usual, makes the state
    set_grads(draft, 1, kept)
    before = ([p.detach().clone() for p in params], [g.clone() for g in kept],
              [v.clone() for v in graphed._state_tensors()])
    real_update = graphed._update

    def without_decay(lrs: list[torch.Tensor] | None = None) -> torch.Tensor:
        decays = [group["weight_decay"] for group in opt.param_groups]
        for group in opt.param_groups:
            group["weight_decay"] = 0.0 if lrs is not None else group["weight_decay"]
        try:
            return real_update(lrs)
        finally:
            for group, decay in zip(opt.param_groups, decays, strict=True):
                group["weight_decay"] = decay

    graphed._update = without_decay  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="update differs from the uncaptured one"):
        graphed()
    for now, then in zip([p.detach() for p in params], before[0], strict=True):
        assert torch.equal(now, then)
    assert all(torch.equal(g, h) for g, h in zip(kept, before[1], strict=True))
    assert all(torch.equal(v, w) for v, w in zip(graphed._state_tensors(), before[2], strict=True))


def test_new_gradient_tensors_are_captured_again() -> None:
    draft = tiny_draft()
    opt = optimizer_for("adamw", draft)
    graphed = GraphedOptimizerStep(opt, [p for p in draft.parameters() if p.requires_grad], 1.0,
                                   torch.device("cpu"), eager=True)
    kept = set_grads(draft, 0)
    graphed()
    graphed()
    first = graphed.replay
    set_grads(draft, 1, kept)
    graphed()
    assert graphed.replay is first  # same tensors: the same graph
    set_grads(draft, 2)  # new .grad tensors (a graph would read the old ones)
    graphed()
    assert graphed.replay is not first


def test_capturable_optimizers() -> None:
    draft = tiny_draft()
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    params = [p for p in draft.parameters() if p.requires_grad]
    assert capturable(optimizer_for("muon", draft), cpu) and capturable(optimizer_for("adamw", draft), cpu)
    assert not capturable(torch.optim.AdamW(params, foreach=True), cuda)  # on CUDA: fused only
    assert capturable(torch.optim.AdamW(params, fused=True), cuda)
    assert not capturable(torch.optim.SGD(params, lr=0.1), cpu)
    with pytest.raises(ValueError, match="cannot read its learning rate from a device tensor"):
        GraphedOptimizerStep(torch.optim.SGD(params, lr=0.1), params, 1.0, cpu, eager=True)


def graphed_trainer(assets: dict[str, pathlib.Path], path: pathlib.Path) -> Trainer:
    trainer = Trainer(load_config(None, overrides(assets, path, **PACKED)))
    assert trainer.optimizer_graph is None  # CPU: no CUDA graphs; the stand-ins are set by hand
    trainer.step_graph, trainer.optimizer_graph = stand_in_graphs(trainer), stand_in_update(trainer)
    return trainer


def test_the_trainer_steps_from_the_graph_as_it_does_without(assets: dict[str, pathlib.Path],
                                                             tmp_path: pathlib.Path) -> None:
    """The whole step on the stand-ins (drafter step and optimizer update) against the trainer run as usual:
    the same losses, gradient norms and weights over four steps of a warming-up schedule."""
    plain = Trainer(load_config(None, overrides(assets, tmp_path / "plain", **PACKED)))
    graphed = graphed_trainer(assets, tmp_path / "graphed")
    for _ in range(4):
        expected, got = plain.train_step(), graphed.train_step()
        assert got["loss"] == pytest.approx(expected["loss"], rel=1e-5)
        assert got["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-5)
    assert graphed.optimizer_graph is not None and graphed.optimizer_graph.replay is not None
    plain_weights = plain.model.state_dict()
    for name, value in graphed.model.state_dict().items():
        torch.testing.assert_close(value, plain_weights[name], rtol=1e-4, atol=1e-6, msg=name)


def test_a_failing_graph_costs_the_speed_up_not_the_run(assets: dict[str, pathlib.Path], tmp_path: pathlib.Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """A capture that fails: one line, the update of that step runs uncaptured, and the run takes the same steps
    as one without the graph."""
    plain = Trainer(load_config(None, overrides(assets, tmp_path / "plain", **PACKED)))
    plain.step_graph = stand_in_graphs(plain)
    graphed = graphed_trainer(assets, tmp_path / "graphed")

    def fails() -> None:
        raise RuntimeError("operation not permitted when stream is capturing")

    graphed.optimizer_graph._capture = fails  # type: ignore[union-attr, method-assign, assignment]
    for _ in range(3):
        assert graphed.train_step()["loss"] == pytest.approx(plain.train_step()["loss"], rel=1e-5)
    assert graphed.optimizer_graph is None
    out = capsys.readouterr().out
    assert out.count("the CUDA graph of the optimizer's update failed (RuntimeError: operation not permitted") == 1
    plain_weights = plain.model.state_dict()
    for name, value in graphed.model.state_dict().items():
        torch.testing.assert_close(value, plain_weights[name], rtol=1e-4, atol=1e-6, msg=name)


def test_the_captured_update_waits_for_the_host_nowhere() -> None:
    """What the graph captures, the clipping and Muon + fused AdamW's update with the learning rates as tensors, runs
    no op that reads a value back to the host and makes no tensor on the host (CUDA's capture refuses both). As
    before a capture, the update runs once first; then a tensor made without a device lands on "meta" and fails."""
    from dflash_train.training.muon import MuonWithAdamW, is_muon_matrix
    from tests.training.test_step_graph import SyncingOps

    draft = tiny_draft()
    named = [(name, p) for name, p in draft.named_parameters() if p.requires_grad]
    opt = MuonWithAdamW([p for n, p in named if is_muon_matrix(n, p)], [p for n, p in named if not is_muon_matrix(n, p)],
                        0.02, 3e-3, (0.9, 0.95), 0.1, fused=True)
    params = [p for _, p in named]
    graphed = GraphedOptimizerStep(opt, params, 1.0, torch.device("cpu"), eager=True)
    set_grads(draft, 0)
    graphed._update(graphed.lrs)  # the state made, as the first step does
    ops = SyncingOps()
    with ops, torch.device("meta"):
        graphed._update(graphed.lrs)
    assert not ops.found, ops.found
