"""Test-wide settings, and the fixtures that test files share (plain helpers live in tests/helpers/)."""

from __future__ import annotations

import pathlib
from collections.abc import Iterator

import pytest
import torch

from dflash_train.target import TargetModel
from tests.helpers.tiny_models import TINY_ARCHS, make_tiny_target
from tests.helpers.training import save_tiny_prepared, save_tiny_target


@pytest.fixture(autouse=True, scope="session")
def _one_thread() -> Iterator[None]:
    # Tiny models gain nothing from intra-op threads, and on a busy 2-core machine OpenMP spin-waits
    # make them several times slower. Subprocesses started by tests pick their own thread counts.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, pathlib.Path]:
    """A saved tiny target and a tiny prepared dataset, for `tests.helpers.training.overrides`."""
    root = tmp_path_factory.mktemp("train_assets")
    return {"target": save_tiny_target(root / "target"), "data": save_tiny_prepared(root / "data")}


@pytest.fixture(scope="module")
def target() -> TargetModel:
    """The decode-loop tests' target: a tiny Qwen3 of 6 layers."""
    torch.manual_seed(0)
    return make_tiny_target("qwen3", num_layers=6, seed=1)


@pytest.fixture(scope="module", params=TINY_ARCHS)
def tiny(request: pytest.FixtureRequest) -> TargetModel:
    """A tiny target of each architecture."""
    return make_tiny_target(request.param)
