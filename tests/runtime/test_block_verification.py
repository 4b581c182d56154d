"""Block verification (`runtime/sampling.py`) keeps the target's distribution exactly and keeps at least as many
drafts as token-wise testing.

The law is checked by enumeration against the target's own joint distribution: every draft block of a small
vocabulary, weighted by its draft probability, then every number of kept drafts and emitted token, then the
target's own continuation to a fixed length, must give the target's joint over that length, to rounding. The
sampler is then checked against the law it is meant to draw from.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from dflash_train.runtime.sampling import block_verify_law, block_verify_sample, running_product_capped_at_one

VOCAB, DRAFTS = 3, 3


class ToyModels:
    """A target whose next-token distribution depends on the whole prefix, and a drafter whose slot
    distributions depend on the slot alone (DFlash's) or also on the drafts before it."""

    def __init__(self, seed: int, prefix_dependent_draft: bool) -> None:
        self.gen = torch.Generator().manual_seed(seed)
        self.target: dict[tuple[int, ...], torch.Tensor] = {}
        self.draft: dict[tuple[int, ...], torch.Tensor] = {}
        self.prefix_dependent_draft = prefix_dependent_draft

    def _dist(self) -> torch.Tensor:
        x = torch.rand(VOCAB, generator=self.gen, dtype=torch.float64) ** 3
        return x / x.sum()

    def p(self, prefix: tuple[int, ...]) -> torch.Tensor:
        return self.target.setdefault(prefix, self._dist())

    def q(self, prefix: tuple[int, ...]) -> torch.Tensor:
        key = prefix if self.prefix_dependent_draft else (len(prefix),)
        return self.draft.setdefault(key, self._dist())

    def block(self, drafts: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """p [1, B, V] (the target at each slot, given the drafts before it), q [1, B-1, V]."""
        p = torch.stack([self.p(drafts[:k]) for k in range(len(drafts) + 1)])
        q = torch.stack([self.q(drafts[:k]) for k in range(len(drafts))])
        return p[None], q[None]

    def joint(self, tokens: tuple[int, ...]) -> float:
        return math.prod(float(self.p(tokens[:k])[tokens[k]]) for k in range(len(tokens)))


def emitted_law(models: ToyModels, verify: str) -> tuple[dict[tuple[int, ...], float], float]:
    """P(the first DRAFTS + 1 tokens) when a cycle's output is continued by the target itself, and the expected
    number of kept drafts, by enumeration; `verify`: "block" (the law under test) or "token" (token-wise)."""
    joint: dict[tuple[int, ...], float] = {}
    kept_mean = 0.0
    for drafts in itertools.product(range(VOCAB), repeat=DRAFTS):
        p, q = models.block(drafts)
        drafted = math.prod(float(q[0, k, d]) for k, d in enumerate(drafts))
        for kept, chance, emitted in outcomes(p, q, drafts, verify):
            kept_mean += drafted * chance * kept
            for token in range(VOCAB):
                start = drafts[:kept] + (token,)
                for rest in itertools.product(range(VOCAB), repeat=DRAFTS - kept):
                    tokens = start + rest
                    weight = drafted * chance * float(emitted[token])
                    weight *= math.prod(float(models.p(tokens[:k])[tokens[k]]) for k in range(len(start), DRAFTS + 1))
                    joint[tokens] = joint.get(tokens, 0.0) + weight
    return joint, kept_mean


def normalised(residual: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    """A residual as a distribution; an empty one (an outcome of probability 0, or p equal to q) falls back to p,
    as the samplers do."""
    total = residual.sum()
    return residual / total if total > 0 else fallback


def outcomes(p: torch.Tensor, q: torch.Tensor, drafts: tuple[int, ...], verify: str):  # noqa: ANN201
    """(drafts kept, probability, distribution of the emitted token) of one block."""
    if verify == "token":  # Leviathan et al.: each draft tested on its own, in order
        alive, found = 1.0, []
        for k, d in enumerate(drafts):
            keep = min(1.0, float(p[0, k, d] / q[0, k, d]))
            found.append((k, alive * (1 - keep), normalised((p[0, k] - q[0, k]).clamp_min(0), p[0, k])))
            alive *= keep
        return [*found, (len(drafts), alive, p[0, -1])]
    h, residual = block_verify_law(p, q, torch.tensor([drafts]))
    found, none_longer = [], 1.0
    for k in range(len(drafts), -1, -1):  # the longest prefix whose test passes
        chance = none_longer * (float(h[0, k]) if k else 1.0)
        none_longer *= 1 - float(h[0, k])
        found.append((k, chance, normalised(residual[0, k], p[0, k])))
    return found


@pytest.mark.parametrize("prefix_dependent_draft", [False, True])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_block_verification_keeps_the_targets_joint_and_at_least_token_wise_drafts(
        seed: int, prefix_dependent_draft: bool) -> None:
    models = ToyModels(seed, prefix_dependent_draft)
    block, block_kept = emitted_law(models, "block")
    token, token_kept = emitted_law(models, "token")
    tokens = list(itertools.product(range(VOCAB), repeat=DRAFTS + 1))
    assert max(abs(block[t] - models.joint(t)) for t in tokens) < 1e-12
    assert max(abs(token[t] - models.joint(t)) for t in tokens) < 1e-12  # the reference rule, the same check
    assert block_kept >= token_kept - 1e-12 and block_kept > token_kept  # never fewer; here strictly more


def test_the_two_token_example_keeps_eleven_ninths() -> None:
    """Sun et al.'s example: a target of (1/3, 2/3) and a drafter of (2/3, 1/3) at every slot, two drafts;
    token-wise testing keeps 10/9 drafts on average, block verification 11/9."""
    target, drafter = torch.tensor([1 / 3, 2 / 3], dtype=torch.float64), torch.tensor([2 / 3, 1 / 3], dtype=torch.float64)
    kept = {"block": 0.0, "token": 0.0}
    for drafts in itertools.product(range(2), repeat=2):
        p, q = target.expand(1, 3, 2), drafter.expand(1, 2, 2)
        drafted = float(drafter[drafts[0]] * drafter[drafts[1]])
        for verify in kept:
            kept[verify] += sum(drafted * chance * n for n, chance, _ in outcomes(p, q, drafts, verify))
    assert kept["token"] == pytest.approx(10 / 9) and kept["block"] == pytest.approx(11 / 9)


def test_the_sampler_draws_from_the_law() -> None:
    """20,000 draws of one block: the kept drafts and emitted token against the law's own probabilities."""
    models = ToyModels(4, prefix_dependent_draft=False)
    drafts = (1, 0, 2)
    p, q = models.block(drafts)
    draws = 20_000
    torch.manual_seed(0)
    kept, token = block_verify_sample(p.log().expand(draws, -1, -1), q.log().expand(draws, -1, -1),
                                      torch.tensor([drafts]).expand(draws, -1), 1.0)
    for n, chance, emitted in outcomes(p, q, drafts, "block"):
        for t in range(VOCAB):
            wanted = chance * float(emitted[t])
            seen = float(((kept == n) & (token == t)).double().mean())
            assert abs(seen - wanted) < 4 * math.sqrt(wanted * (1 - wanted) / draws) + 1e-3, (n, t)


def test_the_closed_form_running_product_is_the_slot_by_slot_one() -> None:
    """w_k = min(w_(k-1) * ratio_k, 1) from w_0 = 1, computed slot by slot in float64, against the closed form the
    sampler uses, over ratios around 1, zeros (w stays 0) and infinities (a draft q gave no mass: w back to 1)."""
    gen = torch.Generator().manual_seed(0)
    ratio = torch.exp(torch.randn(64, 15, generator=gen, dtype=torch.float64) * 2)
    ratio[3, 4] = ratio[5, 0] = 0.0
    ratio[7, 2] = ratio[9, 14] = float("inf")
    expected = [torch.ones(64, dtype=torch.float64)]
    for k in range(15):
        expected.append(torch.minimum(expected[-1] * ratio[:, k], torch.ones(64, dtype=torch.float64)))
    got = running_product_capped_at_one(ratio.float())
    torch.testing.assert_close(got, torch.stack(expected, dim=1), rtol=1e-6, atol=0)
    assert (got[3, 5:] == 0).all() and (got[7, 3] == 1) and (got[9, 15] == 1)
