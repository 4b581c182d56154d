"""Fixtures shared by the target tests."""

from __future__ import annotations

import pytest

from dflash_train.target import TargetModel
from tests.helpers.tiny_models import TINY_ARCHS, make_tiny_target


@pytest.fixture(scope="module", params=TINY_ARCHS)
def tiny(request: pytest.FixtureRequest) -> TargetModel:
    """A tiny target of each architecture."""
    return make_tiny_target(request.param)
