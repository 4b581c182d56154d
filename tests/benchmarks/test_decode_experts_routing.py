"""The experts benchmark's routing: each token's experts distinct, and with `reached`, all tokens' drawn from the
same few experts (the concentrated routing a verify's similar tokens may get), counted by brute force."""

from __future__ import annotations

import pytest
import torch

from benchmarks.decode_experts import routing


@pytest.mark.parametrize("reached", [None, 8, 16])
def test_routing_draws_distinct_experts_from_the_pool(reached: int | None) -> None:
    index, weights = routing(16, 128, 8, torch.device("cpu"), reached)
    assert index.shape == weights.shape == (16, 8)
    assert all(len(set(row.tolist())) == 8 for row in index)  # a token takes k different experts
    distinct = {int(e) for e in index.flatten()}
    assert len(distinct) == (reached if reached is not None else len(distinct))
    assert reached is not None or len(distinct) > 40  # even routing of 128 pairs over 128 experts spreads wide
    torch.testing.assert_close(weights.float().sum(-1), torch.ones(16), atol=1e-2, rtol=0)


def test_a_pool_smaller_than_top_k_is_a_one_line_error() -> None:
    with pytest.raises(SystemExit, match="--reached 4 is below the 8 experts a token takes"):
        routing(16, 128, 8, torch.device("cpu"), 4)
