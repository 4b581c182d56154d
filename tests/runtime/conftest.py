"""Fixtures shared by the decode-loop tests."""

from __future__ import annotations

import pytest
import torch

from dflash_train.target import TargetModel
from tests.helpers.tiny_models import make_tiny_target


@pytest.fixture(scope="module")
def target() -> TargetModel:
    """A tiny Qwen3 of 6 layers."""
    torch.manual_seed(0)
    return make_tiny_target("qwen3", num_layers=6, seed=1)
