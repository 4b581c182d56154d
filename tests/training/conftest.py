"""Fixtures shared by the training tests."""

from __future__ import annotations

import pathlib

import pytest

from tests.helpers.training import save_tiny_prepared, save_tiny_target


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, pathlib.Path]:
    """A saved tiny target and a tiny prepared dataset, for `tests.helpers.training.overrides`."""
    root = tmp_path_factory.mktemp("train_assets")
    return {"target": save_tiny_target(root / "target"), "data": save_tiny_prepared(root / "data")}
