"""The straightforward Hugging Face DFlash loop, as published reference implementations write it: the
baseline that `benchmarks/decode.py` measures the fast loop against. Never used by the eval itself.

Per cycle: a dynamic KV cache grown and cropped, `output_hidden_states=True` on every target forward (all
layers' hidden states kept, the drafter's few picked out), eager kernels, and the accepted length read
back with `.item()`. Same semantics as `dflash_train.runtime.reference_loop` (and so the same tokens and
acceptance lengths as the fast loop, up to floating-point ties).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import DynamicCache

from dflash_train.models import DFlashDraftModel
from dflash_train.runtime.hf_cache import cache_kwargs, rollback
from dflash_train.target import TargetModel


def _features(hidden_states: Sequence[torch.Tensor], layer_ids: Sequence[int]) -> torch.Tensor:
    return torch.cat([hidden_states[i + 1] for i in layer_ids], dim=-1)  # layer k = hidden_states[k + 1]


@torch.inference_mode()
def reference_generate(
    target: TargetModel,
    draft: DFlashDraftModel | None,
    prompt: Sequence[int],
    max_new_tokens: int,
    stop_token_ids: Sequence[int] = (),
    block_size: int = 16,
) -> tuple[list[int], list[int]]:
    """Greedy decoding of one prompt; without a drafter (or block 1) plain target decoding.
    Returns (new tokens, a+1 per cycle)."""
    model, device = target.model, target.device
    block_size = block_size if draft is not None else 1
    hidden = block_size > 1
    cache = DynamicCache()
    kwargs = cache_kwargs(model, cache)
    input_ids = torch.tensor([list(prompt)], device=device)
    out = model(input_ids, output_hidden_states=hidden, **kwargs)
    tokens, lengths, start, stop = [int(out.logits[0, -1].argmax().item())], [], len(prompt), set(stop_token_ids)
    if hidden:
        draft_cache = draft.new_cache(1, len(prompt) + max_new_tokens + block_size)
        ids = draft.config.target_layer_ids
        draft.extend_context(draft_cache, _features(out.hidden_states, ids), torch.arange(start, device=device)[None])
    while len(tokens) < max_new_tokens and tokens[-1] not in stop:
        positions = torch.arange(start, start + block_size, device=device)[None]
        block = torch.full((1, block_size), draft.config.mask_token_id if hidden else 0, device=device)
        block[0, 0] = tokens[-1]
        if hidden:
            states = draft.draft_block(draft_cache, target.embed_tokens(block), positions)
            block[:, 1:] = target.lm_head(states[:, 1:].to(target.dtype)).argmax(dim=-1)
        out = model(block, position_ids=positions, output_hidden_states=hidden, **kwargs)
        posterior = out.logits.argmax(dim=-1)
        accepted = int((block[:, 1:] == posterior[:, :-1]).cumprod(dim=1).sum(dim=1)[0].item())
        committed = block[0, 1 : accepted + 1].tolist() + [int(posterior[0, accepted].item())]
        rollback(cache, start + accepted + 1)
        if hidden:
            features = _features(out.hidden_states, ids)[:, : accepted + 1]
            draft.extend_context(draft_cache, features, positions[:, : accepted + 1])
        start += accepted + 1
        lengths.append(accepted + 1)
        for token in committed:
            tokens.append(token)
            if token in stop:
                break
    return tokens[:max_new_tokens], lengths
