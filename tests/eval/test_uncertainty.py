"""Bootstrap intervals against the normal approximation and hand-computed paired differences."""

from __future__ import annotations

import math

import numpy as np
import pytest

from dflash_train.eval.uncertainty import format_difference, mean_interval, paired_difference


def test_the_interval_matches_the_normal_approximation_for_many_requests() -> None:
    values = np.random.default_rng(7).normal(4.0, 1.5, size=400)
    low, high = mean_interval(values.tolist())
    half_width = 1.96 * values.std(ddof=1) / math.sqrt(values.size)  # the textbook interval, independent of ours
    assert low < values.mean() < high
    assert (high - low) / 2 == pytest.approx(half_width, rel=0.12)
    assert (low + high) / 2 == pytest.approx(values.mean(), abs=0.05)


def test_degenerate_samples() -> None:
    assert mean_interval([3.0, 3.0, 3.0]) == (3.0, 3.0)
    assert mean_interval([3.0]) is None and mean_interval([]) is None
    assert mean_interval([1.0, 2.0, 5.0]) == mean_interval([1.0, 2.0, 5.0])  # seeded: the same every time


def test_paired_difference_uses_only_shared_requests() -> None:
    baseline = {(0, 0): 3.0, (1, 0): 4.0, (2, 0): 5.0, (3, 0): 9.0}
    candidate = {(0, 0): 3.5, (1, 0): 4.5, (2, 0): 5.5, (4, 0): 1.0}  # (3, 0) and (4, 0) are not shared
    difference = paired_difference(candidate, baseline)
    assert difference["requests"] == 3 and difference["mean"] == pytest.approx(0.5)
    assert difference["ci95"] == pytest.approx((0.5, 0.5))  # every request gained exactly 0.5
    assert format_difference(difference) == "+0.50 (+0.50…+0.50)*"
    assert paired_difference({(0, 0): 1.0}, baseline) is None and format_difference(None) == "—"


def test_pairing_is_tighter_than_two_independent_intervals() -> None:
    rng = np.random.default_rng(3)
    hardness = rng.normal(4.0, 1.5, size=60)  # what the prompt makes easy or hard, shared by both drafters
    baseline = {(i, 0): h for i, h in enumerate(hardness)}
    candidate = {(i, 0): h + 0.1 + rng.normal(0, 0.2) for i, h in enumerate(hardness)}
    low, high = paired_difference(candidate, baseline)["ci95"]
    assert 0 < low < 0.1 < high  # the 0.1 gain is resolved ...
    alone_low, alone_high = mean_interval(list(candidate.values()))
    assert alone_high - alone_low > 5 * (high - low)  # ... where one run's own interval is far wider
    assert format_difference({"mean": -0.02, "ci95": (-0.1, 0.06), "requests": 60}) == "-0.02 (-0.10…+0.06)"
