"""Speculative rejection sampling keeps the target's distribution exactly.

A tiny target (vocabulary 12, sharpened head) generates 3 tokens at temperature 0.8, 6000 times in one
batch, with a random drafter (block 3: drafts for tokens 2 and 3 are accepted or rejected). The joint
distribution of the 3 tokens is compared with the exact one, enumerated from the target's own forward, by
a chi-square test; so is plain sampling through the same loop, and the two samples with each other. A
deliberately wrong sampler (accepting every draft) must fail the same test.
"""

from __future__ import annotations

import pytest
import torch

import dflash_train.runtime.engine as engine_module
from dflash_train.runtime.engine import EngineConfig
from dflash_train.runtime.sampling import speculative_sample
from dflash_train.target import TargetModel
from tests.helpers.sampling_stats import (
    draw,
    exact_joint,
    goodness_of_fit,
    homogeneity,
    pooled_cells,
    sharpened_target,
)


@pytest.fixture(scope="module")
def target() -> TargetModel:
    return sharpened_target()


@pytest.mark.parametrize("verification", ["token", "block"])
def test_speculative_sampling_matches_the_exact_distribution_and_plain_sampling(target: TargetModel,
                                                                               verification: str) -> None:
    expected = exact_joint(target)
    assert abs(float(expected.sum()) - 1) < 1e-9 and len(pooled_cells(expected)) > 20
    drafted, lengths = draw(target, with_draft=True, seed=1, verification=verification)
    plain, _ = draw(target, with_draft=False, seed=2)
    assert min(lengths[1], lengths[2], lengths[3]) > 100  # rejections, partial and full acceptance all occur
    assert goodness_of_fit(plain, expected) > 1e-3  # the loop's plain sampling, and the enumeration, agree
    assert goodness_of_fit(drafted, expected) > 1e-3
    assert homogeneity(drafted, plain, expected) > 1e-3


@pytest.mark.parametrize("verification", ["token", "block"])
@pytest.mark.parametrize("draft_scale", [0.5, 0.0])
def test_drafts_sampled_colder_or_taken_greedily_keep_the_exact_distribution(target: TargetModel,
                                                                              draft_scale: float,
                                                                              verification: str) -> None:
    """Drafts sampled at half the temperature, or the drafter's argmax (a point mass): the rejection test reads
    the distribution they came from, so the output is still the target's at TEMPERATURE."""
    expected = exact_joint(target)
    drafted, lengths = draw(target, with_draft=True, seed=3, draft_scale=draft_scale, verification=verification)
    assert min(lengths[1], lengths[2]) > 100 and lengths[3] > 0  # drafts rejected and accepted
    assert goodness_of_fit(drafted, expected) > 1e-3


def test_a_sampler_that_accepts_every_draft_fails_the_same_test(target: TargetModel,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    def accept_all(target_logits: torch.Tensor, draft_logits: torch.Tensor | None, drafts: torch.Tensor,
                   temperature: float, draft_temperature: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        _, bonus = speculative_sample(target_logits, draft_logits, drafts, temperature, draft_temperature)
        return torch.full_like(bonus, drafts.shape[1]), bonus

    monkeypatch.setattr(engine_module, "speculative_sample", accept_all)
    assert goodness_of_fit(draw(target, with_draft=True, seed=1)[0], exact_joint(target)) < 1e-6


def test_speculative_sample_hand_cases() -> None:
    vocab = 5
    logits = torch.log(torch.tensor([[[0.1, 0.2, 0.3, 0.2, 0.2]] * 3]))  # p at every slot
    # q == p: every draft is accepted (u * q < p for u < 1), the bonus comes from p.
    accepted, _ = speculative_sample(logits, logits[:, :2], torch.tensor([[2, 4]]), 1.0)
    assert accepted.tolist() == [2]
    # q puts all its mass on token 0 and p gives it 0.1: accepted with probability 0.1; when rejected the
    # replacement comes from max(p - q, 0), which excludes token 0.
    q_logits = torch.full((1, 2, vocab), -1e9)
    q_logits[..., 0] = 0.0
    torch.manual_seed(0)
    results = [speculative_sample(logits, q_logits, torch.tensor([[0, 0]]), 1.0) for _ in range(2000)]
    first_accepted = sum(int(a) >= 1 for a, _ in results) / len(results)
    assert 0.07 < first_accepted < 0.13
    assert all(int(t) != 0 for a, t in results if int(a) == 0)


def test_a_rejection_test_that_reads_another_draft_distribution_fails_the_same_test(
        target: TargetModel, monkeypatch: pytest.MonkeyPatch) -> None:
    """Drafts sampled at half the temperature but tested as if drawn at the full one: no longer the target's
    distribution, and the goodness-of-fit test says so."""
    def wrong_q(target_logits: torch.Tensor, draft_logits: torch.Tensor | None, drafts: torch.Tensor,
                temperature: float, draft_temperature: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return speculative_sample(target_logits, draft_logits, drafts, temperature)

    monkeypatch.setattr(engine_module, "speculative_sample", wrong_q)
    assert goodness_of_fit(draw(target, with_draft=True, seed=3, draft_scale=0.5)[0], exact_joint(target)) < 1e-6


@pytest.mark.parametrize("scale", [-0.1, float("inf"), float("nan")])
def test_a_draft_temperature_scale_outside_zero_to_finite_is_refused(scale: float) -> None:
    with pytest.raises(ValueError, match="draft_temperature_scale must be a finite number >= 0"):
        EngineConfig(temperature=0.7, draft_temperature_scale=scale)
