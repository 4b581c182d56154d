"""Speculative rejection sampling keeps the target's distribution exactly.

A tiny target (vocabulary 12, sharpened head) generates 3 tokens at temperature 0.8, 6000 times in one
batch, with a random drafter (block 3: drafts for tokens 2 and 3 are accepted or rejected). The joint
distribution of the 3 tokens is compared with the exact one, enumerated from the target's own forward, by
a chi-square test; so is plain sampling through the same loop, and the two samples with each other. A
deliberately wrong sampler (accepting every draft) must fail the same test.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

import dflash_train.runtime.engine as engine_module
from dflash_train.models import DFlashConfig, DFlashDraftModel
from dflash_train.runtime.engine import DecodeEngine, EngineConfig
from dflash_train.runtime.sampling import speculative_sample
from dflash_train.target import TargetModel
from tests.helpers.tiny_models import make_tiny_model

VOCAB, PROMPT, TEMPERATURE, SAMPLES, NEW = 12, [3, 7, 1, 4], 0.8, 6000, 3


@pytest.fixture(scope="module")
def target() -> TargetModel:
    model = make_tiny_model("llama", num_layers=3, seed=3, vocab_rows=VOCAB)
    with torch.no_grad():
        model.lm_head.weight.mul_(12)  # peaked but not degenerate next-token distributions
    return TargetModel(model, tokenizer=None)


def exact_joint(target: TargetModel) -> torch.Tensor:
    """P(t1, t2, t3 | prompt) [V, V, V] by enumeration."""
    def next_probs(prefixes: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return torch.softmax(target.model(prefixes).logits[:, -1].double() / TEMPERATURE, dim=-1)

    prompt = torch.tensor([PROMPT])
    p1 = next_probs(prompt)[0]  # [V]
    firsts = torch.arange(VOCAB)[:, None]
    p2 = next_probs(torch.cat([prompt.expand(VOCAB, -1), firsts], 1))  # [V, V]
    pairs = torch.cartesian_prod(torch.arange(VOCAB), torch.arange(VOCAB))  # [V*V, 2]
    p3 = next_probs(torch.cat([prompt.expand(VOCAB * VOCAB, -1), pairs], 1)).view(VOCAB, VOCAB, VOCAB)
    return p1[:, None, None] * p2[:, :, None] * p3


def draw(target: TargetModel, with_draft: bool, seed: int, draft_scale: float = 1.0,
         verification: str = "token") -> tuple[Counter[tuple[int, ...]], Counter[int]]:
    """Token triples and acceptance lengths of SAMPLES generations (drafts sampled at TEMPERATURE * draft_scale)."""
    torch.manual_seed(seed)
    config = DFlashConfig.from_target_config(target.config, mask_token_id=VOCAB - 1, num_hidden_layers=1,
                                             block_size=3)
    draft = DFlashDraftModel(config).eval() if with_draft else None
    engine = DecodeEngine(target, draft, EngineConfig(batch_size=SAMPLES, block_size=3, max_new_tokens=NEW,
                                                      max_length=16, temperature=TEMPERATURE, kernels="torch",
                                                      draft_temperature_scale=draft_scale,
                                                      verification=verification))
    outputs, _ = engine.generate([PROMPT] * SAMPLES)
    return Counter(tuple(o.tokens) for o in outputs), Counter(a for o in outputs for a in o.acceptance_lengths)


def pooled_cells(expected: torch.Tensor) -> list[list[tuple[int, ...]]]:
    """Cells with at least 5 expected samples, and one cell pooling all the others."""
    cells = [tuple(int(i) for i in index) for index in torch.cartesian_prod(*[torch.arange(VOCAB)] * NEW)]
    big = [[c] for c in cells if float(expected[c]) * SAMPLES >= 5]
    return big + [[c for c in cells if float(expected[c]) * SAMPLES < 5]]


def chi2_pvalue(statistic: float, dof: int) -> float:
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(statistic / 2, dtype=torch.float64)))


def goodness_of_fit(counts: Counter[tuple[int, ...]], expected: torch.Tensor) -> float:
    cells = pooled_cells(expected)
    observed = torch.tensor([sum(counts[c] for c in group) for group in cells], dtype=torch.float64)
    wanted = torch.tensor([sum(float(expected[c]) for c in group) for group in cells], dtype=torch.float64) * SAMPLES
    return chi2_pvalue(float(((observed - wanted) ** 2 / wanted).sum()), len(cells) - 1)


def homogeneity(a: Counter[tuple[int, ...]], b: Counter[tuple[int, ...]], expected: torch.Tensor) -> float:
    cells = pooled_cells(expected)
    table = torch.tensor([[sum(s[c] for c in group) for group in cells] for s in (a, b)], dtype=torch.float64)
    fitted = table.sum(1, keepdim=True) * table.sum(0, keepdim=True) / table.sum()
    return chi2_pvalue(float(((table - fitted) ** 2 / fitted).sum()), len(cells) - 1)


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
