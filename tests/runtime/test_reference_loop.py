"""The plain greedy verify loop is lossless: it reproduces the target's own greedy decoding."""

from __future__ import annotations

import pytest
import torch

from dflash_train.features.capture import capture_features
from dflash_train.models import DFlashConfig, DFlashDraftModel
from dflash_train.runtime.reference_loop import accepted_prefix_length, generate_greedy
from dflash_train.target import TargetModel, resolve_mask_token_id
from tests.helpers.tiny_models import make_tiny_target


def reference_greedy(target: TargetModel, input_ids: torch.Tensor, num_tokens: int) -> list[int]:
    """Greedy decoding by full recomputation each step: no cache, nothing shared with the loop."""
    ids = input_ids
    for _ in range(num_tokens):
        next_token = target.model(ids).logits[:, -1].argmax(-1, keepdim=True)
        ids = torch.cat([ids, next_token], dim=1)
    return ids[0, input_ids.shape[1] :].tolist()


def make_draft(target: TargetModel, block_size: int, seed: int = 0) -> DFlashDraftModel:
    torch.manual_seed(seed)
    mask_id = resolve_mask_token_id(target.tokenizer, target.vocab_size)
    config = DFlashConfig.from_target_config(target.config, mask_token_id=mask_id, num_hidden_layers=2,
                                             block_size=block_size)
    return DFlashDraftModel(config).eval()


def prompt(seed: int, length: int = 11) -> torch.Tensor:
    return torch.randint(10, 200, (1, length), generator=torch.Generator().manual_seed(seed))


def test_accepted_prefix_length() -> None:
    assert accepted_prefix_length(torch.tensor([[5, 6, 7]]), torch.tensor([[5, 6, 9, 1]])) == 2
    assert accepted_prefix_length(torch.tensor([[4, 6, 7]]), torch.tensor([[5, 6, 7, 1]])) == 0
    assert accepted_prefix_length(torch.tensor([[5, 6, 7]]), torch.tensor([[5, 6, 7, 1]])) == 3


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_random_drafter_is_lossless(arch: str, block_size: int) -> None:
    target = make_tiny_target(arch, num_layers=6, seed=1)
    draft = make_draft(target, block_size)
    input_ids = prompt(block_size)
    result, _ = generate_greedy(target, draft, input_ids, max_new_tokens=30)
    assert result.new_tokens.tolist() == reference_greedy(target, input_ids, 30)
    assert all(1 <= a <= block_size for a in result.acceptance_lengths)


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("error_rate", [0.0, 0.3])
def test_oracle_drafts_are_accepted_and_stay_lossless(block_size: int, error_rate: float) -> None:
    """Drafts copied from the reference (with random corruption) exercise multi-token acceptance."""
    target = make_tiny_target("qwen3", num_layers=6, seed=2)
    draft = make_draft(target, block_size)
    input_ids = prompt(7)
    total = 40
    reference = reference_greedy(target, input_ids, total + block_size)
    prompt_len, gen = input_ids.shape[1], torch.Generator().manual_seed(0)
    expected_lengths: list[int] = []

    def oracle(block_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        first = int(positions[0, 1]) - prompt_len  # reference index of slot 1's token
        drafts = torch.tensor([reference[first : first + block_size - 1]])
        wrong = torch.rand(drafts.shape, generator=gen) < error_rate
        drafts = torch.where(wrong, (drafts + 1) % 300, drafts)
        expected_lengths.append(int((~wrong).int().cumprod(-1).sum()) + 1)
        return drafts

    result, _ = generate_greedy(target, draft, input_ids, max_new_tokens=total, proposer=oracle)
    assert result.new_tokens.tolist() == reference[:total]
    assert result.acceptance_lengths == expected_lengths
    if error_rate == 0.0:
        assert all(a == block_size for a in result.acceptance_lengths[:-1])


def test_stop_token_ends_generation_and_is_kept() -> None:
    target = make_tiny_target("llama", num_layers=6, seed=1)
    draft = make_draft(target, 4)
    input_ids = prompt(3)
    reference = reference_greedy(target, input_ids, 30)
    stop = reference[12]
    result, _ = generate_greedy(target, draft, input_ids, max_new_tokens=30, stop_token_ids=[stop])
    assert result.new_tokens.tolist() == reference[: reference.index(stop) + 1]


def test_draft_context_cache_matches_features_of_the_committed_sequence() -> None:
    """After rollbacks, the cached context K/V equal those built from one full-sequence capture."""
    target = make_tiny_target("qwen2", num_layers=6, seed=3)
    draft = make_draft(target, 4)
    input_ids = prompt(5)
    result, cache = generate_greedy(target, draft, input_ids, max_new_tokens=25)
    length = cache.length
    assert length == result.output_ids.shape[1] - 1 or len(result.new_tokens) == 25
    features = capture_features(target, result.output_ids[:, :length], draft.config.target_layer_ids)
    fresh = draft.new_cache(1, length)
    draft.extend_context(fresh, features, torch.arange(length)[None])
    torch.testing.assert_close(cache.keys[:, :, :, :length], fresh.keys, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(cache.values[:, :, :, :length], fresh.values, atol=1e-5, rtol=1e-4)
