"""A plain greedy DFlash verify loop (batch 1): the semantic reference for faster loops.

One cycle, with `start` = position of the last committed token (not yet seen by the target):

    block      = [x_start, MASK × (B-1)]                     at positions start .. start+B-1
    drafts     = argmax lm_head(draft(block | context < start))[1:]
    target     = argmax of the target's logits on the drafted block (KV cache up to `start`)
    a          = longest prefix with drafts[k] == target[k-1]          (0 <= a <= B-1)
    commit     = drafts[:a] + [target[a]]                              (a+1 tokens: the bonus)
    rollback   = target cache to start+a+1; draft context += features of positions start..start+a

Output equals the target's own greedy decoding token for token; each cycle yields one acceptance
length sample `a+1` (1..B).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from dflash_train.features.capture import feature_hooks
from dflash_train.models import DFlashDraftModel, DraftKVCache
from dflash_train.runtime.hf_cache import cache_kwargs, rollback
from dflash_train.target import TargetModel

# (block_ids [1, B], positions [1, B]) -> draft tokens for slots 1..B-1, [1, B-1]
Proposer = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class GenerationResult:
    output_ids: torch.Tensor  # [1, prompt + new]
    num_prompt_tokens: int
    acceptance_lengths: list[int] = field(default_factory=list)

    @property
    def new_tokens(self) -> torch.Tensor:
        return self.output_ids[0, self.num_prompt_tokens :]


def accepted_prefix_length(drafts: torch.Tensor, target_tokens: torch.Tensor) -> int:
    """a = #leading k with drafts[k] == target_tokens[k] (drafts = slots 1.., target = slots 0..)."""
    matches = (drafts == target_tokens[..., : drafts.shape[-1]]).int()
    return int(matches.cumprod(dim=-1).sum())


def drafter_proposer(target: TargetModel, draft: DFlashDraftModel, cache: DraftKVCache) -> Proposer:
    def propose(block_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = draft.draft_block(cache, target.embed_tokens(block_ids), positions)
        return target.lm_head(hidden[:, 1:].to(target.dtype)).argmax(dim=-1)

    return propose


@torch.no_grad()
def generate_greedy(
    target: TargetModel,
    draft: DFlashDraftModel,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    stop_token_ids: Sequence[int] = (),
    block_size: int | None = None,
    proposer: Proposer | None = None,
) -> tuple[GenerationResult, DraftKVCache]:
    """Greedy speculative decoding of one prompt [1, P]. Returns the result and the draft cache."""
    block_size = block_size or draft.block_size
    layer_ids = draft.config.target_layer_ids
    prompt_len, device = input_ids.shape[1], input_ids.device
    target_cache = DynamicCache()
    draft_cache = draft.new_cache(1, prompt_len + max_new_tokens + block_size)
    propose = proposer or drafter_proposer(target, draft, draft_cache)
    with feature_hooks(target, layer_ids) as store:
        kwargs = cache_kwargs(target.model, target_cache)
        logits = target.model(input_ids, **kwargs).logits
        prompt_positions = torch.arange(prompt_len, device=device)[None]
        draft.extend_context(draft_cache, store.features().to(draft.fc.weight.dtype), prompt_positions)
        generated = [int(logits[0, -1].argmax())]
        result = GenerationResult(input_ids, prompt_len)
        start = prompt_len  # position of generated[-1], the last committed token
        stop = set(stop_token_ids)
        done = generated[-1] in stop
        while len(generated) < max_new_tokens and not done:
            positions = torch.arange(start, start + block_size, device=device)[None]
            block = torch.full((1, block_size), draft.config.mask_token_id, device=device, dtype=torch.long)
            block[0, 0] = generated[-1]
            if block_size > 1:
                block[:, 1:] = propose(block, positions)
            out = target.model(block, position_ids=positions, **kwargs)
            target_tokens = out.logits.argmax(dim=-1)  # [1, B]
            accepted = accepted_prefix_length(block[:, 1:], target_tokens)
            committed = block[0, 1 : accepted + 1].tolist() + [int(target_tokens[0, accepted])]
            rollback(target_cache, start + accepted + 1)
            new_features = store.features()[:, : accepted + 1].to(draft.fc.weight.dtype)
            draft.extend_context(draft_cache, new_features, positions[:, : accepted + 1])
            start += accepted + 1
            generated.extend(committed)
            result.acceptance_lengths.append(accepted + 1)
            done = any(token in stop for token in committed)
    generated = truncate(generated, max_new_tokens, stop)
    result.output_ids = torch.cat([input_ids, torch.tensor([generated], device=device)], dim=1)
    return result, draft_cache


def truncate(tokens: list[int], max_new_tokens: int, stop: set[int]) -> list[int]:
    """At most `max_new_tokens`, ending at the first stop token (included), as the decode loops commit them."""
    tokens = tokens[:max_new_tokens]
    for index, token in enumerate(tokens):
        if token in stop:
            return tokens[: index + 1]
    return tokens
