"""Fixtures shared by the benchmark tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from benchmarks import decode


@pytest.fixture(scope="module")
def short_profiles() -> Iterator[None]:
    """`benchmarks/decode.py`'s profiles of 2 calls instead of the script's 10, for a whole module (its
    module-scoped runs included): on a CPU the profiler's bookkeeping of the tiny step's operators takes
    most of a run's time, and 2 calls already run every line that 10 do. The arithmetic itself is checked
    on known intervals in test_decode_profile.py."""
    profiled_calls, kernel_profile = decode.profiled_calls, decode.kernel_profile
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(decode, "profiled_calls", lambda step, device, iters=2: profiled_calls(step, device, iters))
        patch.setattr(decode, "kernel_profile", lambda step, device, iters=2: kernel_profile(step, device, iters))
        yield
