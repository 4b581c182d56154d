"""The drafter's step and the optimizer's update captured in CUDA graphs train as the uncaptured step does: the
same losses and weights over a few packed steps, the graphs never turned off (their first replay checked against
the uncaptured step inside the trainer), eager and with compiled layers, and over two micro-batches a step."""

from __future__ import annotations

import pathlib
import threading

import pytest
import torch

from dflash_train.training.config import load_config
from dflash_train.training.trainer import Trainer
from tests.helpers.training import overrides

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
PACKED = {"data.pack_tokens": 160, "data.max_length": 64}


@pytest.mark.parametrize(("compiled", "accumulation"), [(False, 1), (True, 1), (False, 2)])
def test_captured_steps_train_as_uncaptured_ones(assets: dict[str, pathlib.Path], tmp_path: pathlib.Path,
                                                 compiled: bool, accumulation: int) -> None:
    runs = []
    for graphs in (False, True):
        settings = {**PACKED, "training.compile": compiled, "training.step_cuda_graphs": graphs,
                    "training.gradient_accumulation_steps": accumulation}
        trainer = Trainer(load_config(None, overrides(assets, tmp_path / str(graphs), **settings)))
        losses = [trainer.train_step()["loss"] for _ in range(5)]
        runs.append((losses, {k: v.float().clone() for k, v in trainer.model.state_dict().items()}, trainer))
    (plain_losses, plain_weights, _), (losses, weights, graphed) = runs
    assert graphed.step_graph is not None and graphed.step_graph.graphs  # captured, replayed, never turned off
    assert graphed.optimizer_graph is not None and graphed.optimizer_graph.replay is not None  # the update too
    assert losses == pytest.approx(plain_losses, rel=1e-4)
    for name, value in plain_weights.items():
        torch.testing.assert_close(weights[name], value, rtol=1e-3, atol=1e-5, msg=name)


def test_a_capture_lets_the_loader_thread_pin_host_memory(assets: dict[str, pathlib.Path], tmp_path: pathlib.Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The trainer's loader thread pins the next step's tensors whenever it gets there; one that does so while the
    drafter's step is being captured must neither fail nor spoil the capture."""
    from dflash_train.training import step_graph

    plain = step_graph.GraphedDrafterStep._forward_backward
    pinned: list[object] = []

    def pin_during_capture(self: object, *args: object, **kwargs: object) -> object:
        if torch.cuda.is_current_stream_capturing():
            def pin() -> None:
                try:
                    pinned.append(torch.ones(1024).pin_memory())
                except Exception as error:  # noqa: BLE001 - the test reports what the thread hit
                    pinned.append(error)
            thread = threading.Thread(target=pin)
            thread.start()
            thread.join()
        return plain(self, *args, **kwargs)

    monkeypatch.setattr(step_graph.GraphedDrafterStep, "_forward_backward", pin_during_capture)
    settings = {**PACKED, "training.step_cuda_graphs": True}
    trainer = Trainer(load_config(None, overrides(assets, tmp_path, **settings)))
    losses = [trainer.train_step()["loss"] for _ in range(3)]
    assert pinned and all(isinstance(p, torch.Tensor) and p.is_pinned() for p in pinned), pinned
    assert trainer.step_graph is not None and trainer.step_graph.graphs  # captured and kept
    assert all(loss == loss for loss in losses)
