"""The attention-plan benchmark's candidates (CPU: the timing itself needs a GPU)."""

from __future__ import annotations

import pytest
import torch

from benchmarks import static_attention as bench


def test_plans_are_whole_tiles_and_include_the_default() -> None:
    for tokens in (1, 16):
        rows = max(16, 4 * tokens)
        candidates = bench.plans(1280, rows)
        assert all(plan.split_len % plan.block_n == 0 and plan.split_len < 2 * 1280 for plan in candidates)
        assert all(plan.query_rows < rows for plan in candidates)  # else the same launch as query_rows 0
        assert len(set(candidates)) == len(candidates)
        for dim in (64, 128):  # the default and the untuned rule are among the timed plans
            assert bench.sa.default_plan(8, 1280, rows, 132, dim) in candidates
            assert bench.sa.default_plan(8, 1280, rows, 132) in candidates


@pytest.mark.skipif(torch.cuda.is_available(), reason="the message is for machines without a GPU")
def test_without_a_gpu_it_says_so() -> None:
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--shape", "smollm2"])
    assert exit_info.value.code == 2
