"""Sampling at temperature > 0: plain sampling and speculative rejection sampling, on device, sync-free.

Speculative rejection sampling (Leviathan et al. 2023; Chen et al. 2023) for one DFlash block. The
drafter proposes d_1..d_{B-1}, each d_k drawn from its own distribution q_k (slots are drafted in parallel,
so q_k depends on the context only). The target's distribution for the token at slot k is p_{k-1}. Then:

    accept d_k  with probability min(1, p_{k-1}(d_k) / q_k(d_k)), in order, until the first rejection;
    at the first rejected slot k:   emit a token from norm(max(p_{k-1} - q_k, 0));
    if all B-1 drafts are accepted: emit a bonus token from p_{B-1}.

Each emitted token is then distributed exactly as p given the committed prefix, whatever q is.

Draws use the exponential race (argmax of prob / Exp(1) noise is a sample from prob): no
`torch.multinomial`, whose checks synchronise with the host and break CUDA-graph capture.
"""

from __future__ import annotations

import torch


def probabilities(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    return torch.softmax(logits.float() / temperature, dim=-1)


def sample(probs: torch.Tensor) -> torch.Tensor:
    """One draw per row of probs [..., V] -> [...] int64."""
    noise = torch.empty_like(probs).exponential_(1.0)
    return (probs / noise).argmax(dim=-1)


def speculative_sample(
    target_logits: torch.Tensor,
    draft_logits: torch.Tensor | None,
    drafts: torch.Tensor,
    temperature: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """target_logits [b, B, V]; draft_logits [b, B-1, V] (None when B == 1); drafts [b, B-1] sampled from
    them. Returns (a [b]: accepted drafts, token [b]: the token emitted after them)."""
    p = probabilities(target_logits, temperature)  # [b, B, V]
    b, width, vocab = p.shape
    if width == 1:
        return torch.zeros(b, dtype=torch.long, device=p.device), sample(p[:, 0])
    q = probabilities(draft_logits, temperature)  # [b, B-1, V]
    p_draft = p[:, :-1].gather(-1, drafts[..., None])[..., 0]  # p_{k-1}(d_k), [b, B-1]
    q_draft = q.gather(-1, drafts[..., None])[..., 0]  # q_k(d_k)
    u = torch.rand(p_draft.shape, device=p.device)
    accept = u * q_draft < p_draft  # u < p/q without dividing by q
    accepted = accept.long().cumprod(dim=-1).sum(dim=-1)  # a, [b]
    # Residual at slot a: q of the rejected draft, or zero past the last draft (then it is p_{B-1} itself).
    q_padded = torch.cat([q, torch.zeros_like(q[:, :1])], dim=1)  # [b, B, V]
    index = accepted[:, None, None].expand(b, 1, vocab)
    p_a, q_a = p.gather(1, index)[:, 0], q_padded.gather(1, index)[:, 0]
    residual = (p_a - q_a).clamp_min(0.0)
    # Rounding can leave an all-zero residual when p == q almost everywhere; p itself is then exact enough.
    empty = residual.sum(dim=-1, keepdim=True) <= 0
    residual = torch.where(empty, p_a, residual)
    return accepted, sample(residual)
