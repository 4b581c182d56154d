"""Rows stuck in a verbatim loop, found on the device after each cycle (regeneration's `--stop-loops`).

A small target that runs into a loop under greedy decoding seldom leaves it: in a speedrun's answers about a
fifth ended at the 512-token cap inside one, about a quarter of all answer text (docs/results.md, 'Many
answers end in a loop'). Decoding those tails
costs regeneration time and yields nothing a training run wants (`prepare --trim-loops` cuts them to two
copies). With this check a row whose last tokens repeat one span verbatim is finished there, its finish
reason "loop" (unfinished, like "length"), and its row takes the next prompt.

A row of n tokens is in a loop of period p (1 <= p <= MAX_PERIOD tokens) when its last max(2p, MIN_COMPARED)
tokens each equal the token p before them: the tail of that length plus p is p-periodic, three copies at
least, and at least MIN_COMPARED + p tokens long, so a short legitimate repeat ("1, 1, 1", a table rule) is
not cut. Everything is tensor work on fixed shapes (no host sync), so it runs inside the captured cycle.
"""

from __future__ import annotations

import torch

MAX_PERIOD = 64  # tokens: a repeated line or sentence (the text rule's 120 characters), not a paragraph
MIN_COMPARED = 64  # tokens that must equal the token one period before them, whatever the period


def required_matches(max_period: int = MAX_PERIOD, min_compared: int = MIN_COMPARED) -> list[int]:
    """Tokens compared for each period 1..max_period."""
    return [max(2 * period, min_compared) for period in range(1, max_period + 1)]


class LoopDetector:
    """`detector(out, n_out)`: which rows [b] end in a loop; out [b, T] the tokens, n_out [b] how many."""

    def __init__(self, device: torch.device, max_period: int = MAX_PERIOD, min_compared: int = MIN_COMPARED) -> None:
        need = torch.tensor(required_matches(max_period, min_compared), device=device)  # [P]
        periods = torch.arange(1, max_period + 1, device=device)
        self.width = int(need.max())
        back = torch.arange(self.width, device=device)  # i: the token i places before the last
        self.compared = back[None, :] < need[:, None]  # [P, W]: which i count for period p
        self.earlier = back[None, :] + periods[:, None]  # [P, W]: the token p places before token i
        self.span = torch.arange(self.width + max_period, device=device)
        self.min_tokens = need + periods  # [P]: a row shorter than this cannot show that period

    def __call__(self, out: torch.Tensor, n_out: torch.Tensor) -> torch.Tensor:
        index = (n_out[:, None] - 1 - self.span).clamp(min=0)
        tail = out.gather(1, index).to(torch.int32)  # [b, W + P], tail[:, i] = the token i before the last
        equal = tail[:, self.earlier] == tail[:, None, : self.width]  # [b, P, W]
        periodic = (equal | ~self.compared).all(dim=-1) & (n_out[:, None] >= self.min_tokens)
        return periodic.any(dim=-1)


def ends_in_loop(tokens: list[int], max_period: int = MAX_PERIOD, min_compared: int = MIN_COMPARED) -> bool:
    """The same rule on a plain list, one token at a time (the reference the tests hold the detector to)."""
    n = len(tokens)
    for period, need in enumerate(required_matches(max_period, min_compared), start=1):
        if n >= need + period and all(tokens[n - 1 - i] == tokens[n - 1 - i - period] for i in range(need)):
            return True
    return False
