"""Sampled decoding in the fast loop on CUDA (its cycle captured in a CUDA graph, torch.compile and the Triton
kernels on) keeps the target's distribution under both verification rules: the chi-square test of
`test_sampling.py`, with the random draws taken inside the replayed cycle."""

from __future__ import annotations

import copy

import pytest
import torch

from dflash_train.target import TargetModel
from tests.helpers.sampling_stats import (
    exact_joint,
    generations,
    goodness_of_fit,
    sampling_engine,
    sharpened_target,
)

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def expected_and_cuda_target() -> tuple[torch.Tensor, TargetModel]:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    target = sharpened_target()
    return exact_joint(target), TargetModel(copy.deepcopy(target.model).cuda(), tokenizer=None)


@pytest.mark.parametrize("verification", ["token", "block"])
def test_graphed_sampled_decoding_keeps_the_exact_distribution(expected_and_cuda_target: tuple,
                                                               verification: str) -> None:
    expected, target = expected_and_cuda_target
    engine = sampling_engine(target, with_draft=True, seed=1, verification=verification)
    drafted, lengths = generations(engine)
    assert engine.uses_cuda_graph and engine.graph_error is None, engine.graph_error
    assert min(lengths[1], lengths[2]) > 100 and lengths[3] > 0  # drafts rejected and accepted
    assert goodness_of_fit(drafted, expected) > 1e-3
