"""Sampling at temperature > 0 on the device, without host synchronisation (CUDA-graph safe).

Two kinds of draws:

- Seeded draws (`seeded_sample`), for every token the target decides alone (the first token after a
  prompt, and each step of plain decoding): token t of a request comes from one uniform number derived
  from the request's key and t only, by inverse-CDF sampling. A request's output therefore does not
  depend on the row, the batch or the moment it runs in, which is what makes a regeneration resumed
  after a kill write what an uninterrupted run would have.
- Speculative rejection sampling (`speculative_sample`) for one DFlash block (Leviathan et al. 2023;
  Chen et al. 2023). The drafter proposes d_1..d_{B-1}, each d_k drawn from its own distribution q_k
  (slots are drafted in parallel, so q_k depends on the context only). The target's distribution for
  the token at slot k is p_{k-1}. Then:

    accept d_k  with probability min(1, p_{k-1}(d_k) / q_k(d_k)), in order, until the first rejection;
    at the first rejected slot k:   emit a token from norm(max(p_{k-1} - q_k, 0));
    if all B-1 drafts are accepted: emit a bonus token from p_{B-1}.

  Each emitted token is then distributed exactly as p given the committed prefix, whatever q is.
- Block verification (`block_verify_sample`; Sun et al. 2024, "Block Verification Accelerates Speculative
  Decoding") for the same block: the drafts are judged together, not one at a time, so a slot that token-wise
  testing would reject can still be kept when the slots before it were drafted with room to spare. With
  w_0 = 1 and w_k = min(w_{k-1} p_{k-1}(d_k) / q_k(d_k), 1), the weight of keeping the first k drafts, and
  S_k = sum_x max(w_k p_k(x) - q_{k+1}(x), 0):

    h_k = S_k / (S_k + 1 - w_k) for k < B-1,  h_{B-1} = w_{B-1};  with u_k uniform, keep the first
    a = max{k : u_k <= h_k} drafts (k = 0 always qualifies);  emit a token from norm(max(w_a p_a - q_{a+1}, 0))
    (q_B = 0: from p_{B-1} when every draft is kept).

  The committed tokens follow p exactly as with token-wise testing, and no verifier keeps more drafts on
  average (the paper's optimality result); the cost is the same target pass and a few [b, B, V] operations.
  DFlash slots are drafted in parallel, so q_k does not depend on d_<k; the rule does not need it to.

  These draws use the exponential race (argmax of prob / Exp(1) noise is a sample from prob) on the global
  generator: no `torch.multinomial`, whose checks synchronise with the host and break graph capture.

Top-p (nucleus) sampling keeps the smallest set of most likely tokens whose probability reaches top_p
(always at least the most likely one) and renormalises over it; for speculative sampling the logits are
filtered before they reach it, so the committed tokens follow the filtered target distribution.
"""

from __future__ import annotations

import hashlib

import torch

MASK32 = 0xFFFFFFFF


def probabilities(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    return torch.softmax(logits.float() / temperature, dim=-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One draw per row of probs [..., V] -> [...] int64, from `generator` (None: the global generator)."""
    noise = torch.empty_like(probs).exponential_(1.0, generator=generator)
    return (probs / noise).argmax(dim=-1)


def top_p_filter(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """logits [..., V] with the tokens outside the nucleus of softmax(logits / temperature) set to -inf."""
    if top_p >= 1.0:
        return logits
    probs = probabilities(logits, temperature)
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    outside_sorted = sorted_probs.cumsum(dim=-1) - sorted_probs >= top_p  # mass before it already reaches top_p
    outside = torch.zeros_like(outside_sorted).scatter(-1, order, outside_sorted)
    return logits.masked_fill(outside, float("-inf"))


def request_seed(*parts: int) -> int:
    """A 64-bit seed from integers (a run's seed, a row id, a sample index): stable across processes."""
    return int.from_bytes(_digest(",".join(str(int(p)) for p in parts)), "little")


def seed_keys(seeds: list[int]) -> torch.Tensor:
    """Per-request keys [n, 2] int64 for `seeded_uniform`: two 32-bit words hashed from each seed, so that
    nearby seeds (0, 1, 2, ...) still give unrelated streams."""
    words = [_digest(f"key:{int(seed)}") for seed in seeds]
    keys = [[int.from_bytes(w[:4], "little"), int.from_bytes(w[4:], "little")] for w in words]
    return torch.tensor(keys, dtype=torch.long).reshape(len(seeds), 2)


def _digest(text: str) -> bytes:
    return hashlib.blake2b(text.encode(), digest_size=8).digest()


def _mul32(x: torch.Tensor, constant: int) -> torch.Tensor:
    """x * constant mod 2^32 for x in [0, 2^32), in int64 without overflow: the constant in 16-bit halves."""
    high, low = constant >> 16, constant & 0xFFFF
    return (x * low + (((x * high) & 0xFFFF) << 16)) & MASK32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (Wellons' lowbias32) of int64 values in [0, 2^32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def seeded_uniform(keys: torch.Tensor, counter: torch.Tensor) -> torch.Tensor:
    """keys [b, 2], counter [b] (the index of the token drawn) -> [b] float32 uniform in [0, 1)."""
    h = _mix32(_mix32(keys[:, 0] ^ (counter & MASK32)) ^ keys[:, 1])
    return (h >> 8).float() * 2.0 ** -24  # 24 bits: exact in float32


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The index where the running sum of probs [b, V] first exceeds u [b] times the total: a draw from
    probs. A zero-probability token never is that index (the sum does not grow there)."""
    cdf = probs.cumsum(dim=-1)
    total = cdf[:, -1:]
    below = (cdf <= u[:, None] * total).sum(dim=-1)
    last = (cdf < total).sum(dim=-1)  # the first index reaching the total: where rounding of u * total ends
    return torch.minimum(below, last)


def seeded_sample(logits: torch.Tensor, temperature: float, top_p: float, keys: torch.Tensor,
                  counter: torch.Tensor) -> torch.Tensor:
    """One token per row of logits [b, V] at `temperature` and `top_p`, drawn with seeded_uniform(keys, counter)."""
    probs = probabilities(logits, temperature)
    u = seeded_uniform(keys, counter)
    if top_p >= 1.0:
        return inverse_cdf(probs, u)
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    sorted_probs = sorted_probs.masked_fill(sorted_probs.cumsum(dim=-1) - sorted_probs >= top_p, 0.0)
    return order.gather(1, inverse_cdf(sorted_probs, u)[:, None])[:, 0]


def block_probabilities(target_logits: torch.Tensor, draft_logits: torch.Tensor | None, drafts: torch.Tensor,
                        temperature: float, draft_temperature: float | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(p [b, B, V], the target's at `temperature`; q [b, B-1, V], the distribution the drafts were drawn from at
    `draft_temperature` (None: `temperature`; 0: a point mass on each draft), or None for a block of no drafts)."""
    p = probabilities(target_logits, temperature)
    if p.shape[1] == 1:
        return p, None
    draft_temperature = temperature if draft_temperature is None else draft_temperature
    if draft_temperature > 0:
        return p, probabilities(draft_logits, draft_temperature)
    return p, torch.nn.functional.one_hot(drafts, p.shape[-1]).to(p.dtype)


def speculative_sample(
    target_logits: torch.Tensor,
    draft_logits: torch.Tensor | None,
    drafts: torch.Tensor,
    temperature: float,
    draft_temperature: float | None = None,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """target_logits [b, B, V]; draft_logits [b, B-1, V] (None when B == 1); drafts [b, B-1] sampled from
    them at `draft_temperature` (None: `temperature`; 0: the drafts are their argmax, q a point mass on each).
    Returns (a [b]: accepted drafts, token [b]: the token emitted after them). The uniforms and the emitted
    token come from `generator` (None: the global generator, as the decode loop's graph-captured step uses)."""
    p, q = block_probabilities(target_logits, draft_logits, drafts, temperature, draft_temperature)
    b, width, vocab = p.shape
    if q is None:  # no drafts: the token comes from the target alone
        return torch.zeros(b, dtype=torch.long, device=p.device), sample(p[:, 0], generator)
    p_draft = p[:, :-1].gather(-1, drafts[..., None])[..., 0]  # p_{k-1}(d_k), [b, B-1]
    q_draft = q.gather(-1, drafts[..., None])[..., 0]  # q_k(d_k)
    u = torch.rand(p_draft.shape, device=p.device, generator=generator)
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
    return accepted, sample(residual, generator)


def block_verify_law(p: torch.Tensor, q: torch.Tensor, drafts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The block verification rule's law (module docstring) for target probabilities p [b, B, V], draft
    probabilities q [b, B-1, V] and drafts [b, B-1]: (h [b, B], the chance to keep at least k drafts given that
    no longer prefix was kept; residual [b, B, V], the unnormalised distribution of the token emitted after k
    kept drafts)."""
    ratio = p[:, :-1].gather(-1, drafts[..., None])[..., 0] / q.gather(-1, drafts[..., None])[..., 0]  # [b, B-1]
    w = running_product_capped_at_one(ratio).to(p.dtype)  # [b, B]
    q_padded = torch.cat([q, torch.zeros_like(q[:, :1])], dim=1)  # [b, B, V]: nothing drafted after the block
    residual = (w[..., None] * p - q_padded).clamp_min(0.0)
    mass = residual[:, :-1].sum(dim=-1)  # S_k, [b, B-1]
    denominator = mass + (1.0 - w[:, :-1])  # not (mass + 1) - w, which rounding can leave below mass: h > 1
    h = torch.where(denominator > 0, mass / denominator.clamp_min(torch.finfo(p.dtype).tiny), 1.0).clamp(0.0, 1.0)
    return torch.cat([h, w[:, -1:]], dim=1), residual


def running_product_capped_at_one(ratio: torch.Tensor) -> torch.Tensor:
    """w [b, B] for ratios [b, B-1]: w_0 = 1, w_k = min(w_(k-1) * ratio_k, 1). In closed form rather than slot by
    slot (two kernels a slot inside the decode cycle's graph): with S the running sum of log ratios from S_0 = 0,
    log w_k = S_k - max(S_0..S_k). In float64, where those sums lose nothing a float32 product would keep; a
    ratio of 0 gives -inf and w = 0 from there on, as the product does, and an infinite one (a draft its q gave
    no mass) is capped where it can only matter below exp(-700)."""
    logs = ratio.double().log().clamp_max(700.0)
    sums = torch.cat([torch.zeros_like(logs[:, :1]), logs.cumsum(dim=-1)], dim=1)
    return (sums - sums.cummax(dim=-1).values).exp()


def block_verify_sample(
    target_logits: torch.Tensor,
    draft_logits: torch.Tensor | None,
    drafts: torch.Tensor,
    temperature: float,
    draft_temperature: float | None = None,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`speculative_sample`'s contract, with the block verification rule (module docstring) in place of testing
    each draft on its own."""
    p, q = block_probabilities(target_logits, draft_logits, drafts, temperature, draft_temperature)
    b, width, vocab = p.shape
    if q is None:  # no drafts: the token comes from the target alone
        return torch.zeros(b, dtype=torch.long, device=p.device), sample(p[:, 0], generator)
    h, residual = block_verify_law(p, q, drafts)
    u = torch.rand(h.shape, device=p.device, generator=generator)
    kept = (u <= h) | (torch.arange(width, device=p.device) == 0)  # [b, B]
    # The longest qualifying prefix: the last k with kept[k], as the index of the largest k * kept[k].
    accepted = (kept.long() * torch.arange(width, device=p.device)).argmax(dim=-1)  # a, [b]
    index = accepted[:, None, None].expand(b, 1, vocab)
    chosen, p_a = residual.gather(1, index)[:, 0], p.gather(1, index)[:, 0]
    # Rounding can leave an all-zero residual when p and q agree almost everywhere; p itself is then exact enough.
    empty = chosen.sum(dim=-1, keepdim=True) <= 0
    return accepted, sample(torch.where(empty, p_a, chosen), generator)
