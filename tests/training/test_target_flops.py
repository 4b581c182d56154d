"""The target's pass in the step's FLOPs: its per-token and per-pair costs against torch's own FLOP counter on
tiny random targets of each family (dense, sliding, MoE, MLA), and causal pairs against a brute-force mask."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from dflash_train.target.model import find_decoder_layers
from dflash_train.training.flops import TargetPassCost, causal_pairs, target_pass_cost
from tests.helpers.tiny_targets import WINDOW, build_tiny_target

VOCAB = 256


@pytest.mark.parametrize(("length", "window"), [(1, None), (7, None), (40, None), (40, WINDOW), (20, WINDOW), (33, 1)])
def test_causal_pairs_match_a_brute_force_mask(length: int, window: int | None) -> None:
    q = torch.arange(length)[:, None]
    k = torch.arange(length)[None, :]
    visible = (k <= q) & ((q - k < window) if window else True)
    assert causal_pairs(length, window) == int(visible.sum())


def _counted_forward_flops(model: torch.nn.Module, length: int) -> int:
    """Matmul FLOPs of the decoder body over one chat, as torch counts them (eager attention and experts: the
    computation the formula describes, the full score matrix included)."""
    model.requires_grad_(False)
    ids = torch.randint(VOCAB, (1, length), generator=torch.Generator().manual_seed(0))
    with FlopCounterMode(display=False) as counter:
        model.model(ids)
    return counter.get_total_flops()


@pytest.mark.parametrize("name", ["llama", "mistral", "gemma3_text", "qwen3_moe", "mixtral", "gpt_oss", "deepseek_v3",
                                  "glm4_moe"])
def test_costs_equal_torchs_flop_counter(name: str) -> None:
    model = build_tiny_target(name, VOCAB, attn_implementation="eager")
    config = model.config.get_text_config()
    config._experts_implementation = "eager"  # each token through its top-k experts, as counted
    layers = find_decoder_layers(model)
    cost = target_pass_cost(config, layers, len(layers), reads_distribution=False)
    length = 24
    # Eager attention multiplies the whole score matrix: every (query, key) pair, masked or not.
    expected = cost.per_token * length + sum(per_pair for per_pair, _ in cost.pair_costs) * length * length
    assert _counted_forward_flops(model, length) == expected


def test_routed_experts_count_at_their_top_k_share() -> None:
    model = build_tiny_target("qwen3_moe", VOCAB)
    config = model.config
    cost = target_pass_cost(config, find_decoder_layers(model), 4, False)
    all_experts = sum(p.numel() for n, p in model.model.layers.named_parameters() if ".experts." in n)
    active = all_experts * config.num_experts_per_tok / config.num_experts
    others = sum(p.numel() for n, p in model.model.layers.named_parameters()
                 if ".experts." not in n and p.dim() == 2)
    assert cost.per_token == 2 * (active + others)


def test_windows_and_layers_run_follow_the_config() -> None:
    model = build_tiny_target("gemma3_text", VOCAB)  # sliding, sliding, sliding, full
    layers = find_decoder_layers(model)
    assert [w for _, w in target_pass_cost(model.config, layers, 4, False).pair_costs] == [WINDOW] * 3 + [None]
    two = target_pass_cost(model.config, layers, 2, False)  # the pass stops after the deepest captured layer
    assert len(two.pair_costs) == 2
    assert two.per_token == 2 * sum(p.numel() for layer in layers[:2] for n, p in layer.named_parameters()
                                    if p.dim() == 2)
    hybrid = build_tiny_target("qwen3_5", VOCAB)  # 3 linear-attention layers, then a full one
    pairs = target_pass_cost(hybrid.config, find_decoder_layers(hybrid), 4, False).pair_costs
    assert [w for _, w in pairs] == [None]


def test_flops_of_a_step() -> None:
    # Two chats, the second past a 4-token window on its one sliding layer; the lm_head over 3 supervised rows.
    cost = TargetPassCost(per_token=10.0, pair_costs=((2.0, None), (3.0, 4)), per_teacher_row=100.0)
    chats = [3, 6]
    full = 3 * 4 // 2 + 6 * 7 // 2  # 6 + 21
    windowed = 6 + (4 * 5 // 2 + 2 * 4)  # the first chat fits the window; the second: 10 + 8
    assert cost.flops(chats, teacher_rows=3) == 10.0 * 9 + 2.0 * full + 3.0 * windowed + 100.0 * 3
    head = target_pass_cost(build_tiny_target("llama", VOCAB).config, [], 0, reads_distribution=True)
    assert head.per_teacher_row == 2 * 64 * VOCAB
