"""What the decode-loop tests share: a random drafter for a target, prompts, and the target's own greedy
decoding by full recomputation (the lossless reference)."""

from __future__ import annotations

import torch

from dflash_train.models import DFlashConfig, DFlashDraftModel
from dflash_train.target import TargetModel, resolve_mask_token_id

PROMPT_LENGTHS = (11, 6, 15, 9, 4)


def make_draft(target: TargetModel, block_size: int = 16, seed: int = 0, layers: int = 2,
               target_layer_ids: list[int] | None = None) -> DFlashDraftModel:
    torch.manual_seed(seed)
    # a target built without a tokenizer (tests/helpers/static_target.tiny_target) gets the last row: any row
    # works for a random drafter, and the resolver needs a tokenizer to choose one
    mask_id = (target.vocab_size - 1 if target.tokenizer is None
               else resolve_mask_token_id(target.tokenizer, target.vocab_size))
    config = DFlashConfig.from_target_config(target.config, mask_token_id=mask_id, num_hidden_layers=layers,
                                             block_size=block_size, target_layer_ids=target_layer_ids)
    return DFlashDraftModel(config).eval()


def prompts(count: int = 3) -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(10, 200, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS[:count]]


def own_greedy(target: TargetModel, prompt: list[int], count: int) -> list[int]:
    """The target's greedy decoding by full recomputation: no cache, nothing shared with either loop."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(count):
            ids = torch.cat([ids, target.model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids[0, len(prompt) :].tolist()


def assert_own_greedy(target: TargetModel, prompt_list: list[list[int]], token_lists: list[list[int]],
                      count: int) -> None:
    """Each token list is the target's own greedy continuation of its prompt (computed on the CPU, the model
    moved back to its device after)."""
    device = target.model.device
    target.model.cpu()
    try:
        for prompt, tokens in zip(prompt_list, token_lists, strict=True):
            assert tokens == own_greedy(target, prompt, count)
    finally:
        target.model.to(device)
