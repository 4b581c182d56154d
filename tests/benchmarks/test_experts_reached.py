"""The verify's experts count against a brute-force count from each layer's own router, on a tiny MoE target."""

from __future__ import annotations

import torch

from benchmarks.experts_reached import experts_reached, summary
from tests.helpers.tiny_targets import ACTIVE_EXPERTS, EXPERTS, build_tiny_target

VOCAB = 96


def test_the_count_is_each_layers_routers_own_distinct_choice_over_the_block() -> None:
    model = build_tiny_target("qwen3_moe", VOCAB, seed=2)
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    chosen: list[torch.Tensor] = []  # each router's top-k ids [rows * T, k], in layer order
    hooks = [module.register_forward_hook(lambda _m, _a, out: chosen.append(out[2]))
             for module in model.modules() if type(module).__name__ == "Qwen3MoeTopKRouter"]
    counts = experts_reached(model, ids, block=5)
    for hook in hooks:
        hook.remove()
    assert len(counts) == len(chosen) == model.config.num_hidden_layers
    for count, index in zip(counts, chosen[:len(counts)], strict=True):
        rows = index.view(2, 12, ACTIVE_EXPERTS)[:, -5:]
        assert count == len({int(e) for e in rows[0].flatten()}) + len({int(e) for e in rows[1].flatten()})
    stats = summary(counts, EXPERTS, 5, ACTIVE_EXPERTS)
    assert stats["verify_experts_reached_median"] in counts
    assert abs(stats["verify_experts_reached_even"] - EXPERTS * (1 - 0.5 ** 5)) < 1e-9


def test_a_dense_model_reaches_no_experts() -> None:
    model = build_tiny_target("qwen3", VOCAB)
    assert experts_reached(model, torch.tensor([[5, 6, 7, 8]]), block=2) == []


class KeywordExperts(torch.nn.Module):
    """An experts module in transformers' interface (`has_gate`, `down_proj`) that passes through."""

    has_gate = True

    def __init__(self) -> None:
        super().__init__()
        self.down_proj = torch.nn.Parameter(torch.zeros(4, 2, 2))

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        return hidden_states


class RoutesByTokenId(torch.nn.Module):
    """Token t takes experts t % 4 and (t + 1) % 4, calling its experts by keyword."""

    def __init__(self) -> None:
        super().__init__()
        self.experts = KeywordExperts()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        ids = input_ids.reshape(-1, 1)
        index = torch.cat([ids % 4, (ids + 1) % 4], dim=1)
        return self.experts(hidden_states=ids.float(), top_k_index=index, top_k_weights=torch.ones_like(index))


def test_experts_called_by_keyword_are_counted_too() -> None:
    ids = torch.tensor([[9, 0, 1], [9, 5, 5]])  # last two tokens: {0, 1, 2} and {1, 2}
    assert experts_reached(RoutesByTokenId(), ids, block=2) == [3 + 2]
