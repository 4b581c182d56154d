"""An oracle drafter that is the target's own marginal at a temperature T, decoded by the project's rejection rule.

A DFlash drafter drafts slots 1..B-1 of a block at once, each slot from the context c alone. Fitted slot by slot
to the target's distribution on the target's own samples at T (a KL or cross-entropy objective), the best it can
become is the target's marginal over the slots before it:

    q_k(x) = E over x_<k ~ p_T(. | c) of p_T(x | c, x_<k),

while the target tests slot k given the tokens actually drafted at 1..k-1. Decoding with q_k in place of a drafter
measures what that leaves of τ. q_k is estimated Rao-Blackwellised: M paths are sampled from the target at T, and
q_k is the mean over them of p_T(. | c, path_<k), a distribution over the whole vocabulary (a histogram of M
sampled tokens would be mostly zeros for a flat target). q_1 is p_T(. | c) itself.

One cycle keeps its rows in one static cache (`StaticTarget`): row 0 holds the committed context and the drafted
block, rows 1..M the paths. Row 0 alone reads the last committed token x0 at position start, which gives
p_T(. | c) = q_1, and its keys and values are copied to the path rows. Step s = 1, 2, ... then feeds row 0 the
draft d_s and row m its path's token, both drawn the step before, at position start + s: one forward gives
p_T(. | c, d_<=s), what slot s+1's draft is tested against, and the M distributions whose mean is q_{s+1}. Each
draft d_s ~ q_s is tested by `speculative_sample` as it is drawn. The first rejection ends the cycle, so the paths
are drawn only as far as the cycle gets (a forwards of M+1 rows, not B-2): each slot's test draws its own uniform
and a draft past the first rejection changes nothing, so the law is that of drafting and testing the whole block
at once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dflash_train.runtime.reference_loop import truncate
from dflash_train.runtime.sampling import (
    block_verify_sample,
    inverse_cdf,
    probabilities,
    sample,
    speculative_sample,
)
from dflash_train.runtime.state import RequestOutput
from dflash_train.runtime.static_target import StaticTarget, model_type, supports
from dflash_train.target import TargetModel

CACHE_ROUNDING = 256  # cache lengths grow in steps of this many positions, so a longer prompt rarely reallocates


@dataclass
class SlotTotals:
    """Sums per draft slot k = 1..B-1 (list index k-1) over the cycles whose draft at slot k was tested."""

    reached: list[int]
    # sum_x min(p_T(x | c, d_<k), q_k(x)): P(slot k accepted | tested, its prefix), its own draft integrated out
    expected: list[float]
    # p_T(argmax q_k | c, d_<k): the same for a point-mass draft on q_k's likeliest token, on the same prefix
    mode: list[float]

    @classmethod
    def zeros(cls, slots: int) -> SlotTotals:
        return cls([0] * slots, [0.0] * slots, [0.0] * slots)

    def rates(self) -> dict[str, list[float | None]]:
        """Per slot, the averages over the cycles that tested it (None for a slot no cycle reached)."""
        def mean(sums: list[float]) -> list[float | None]:
            return [total / count if count else None for total, count in zip(sums, self.reached, strict=True)]

        return {"expected_acceptance_given_reached": mean(self.expected),
                "mode_acceptance_given_reached": mean(self.mode)}


@dataclass
class Cycle:
    accepted: int  # a: drafts accepted
    committed: list[int]  # the a drafts and the token the test emitted after them


class MarginalOracle:
    """Decodes prompts with the marginal oracle in place of a drafter (module docstring); every draw comes from
    `generator`, so a run is fixed by its seed."""

    def __init__(self, target: TargetModel, samples: int, block_size: int, temperature: float,
                 generator: torch.Generator, verification: str = "token") -> None:
        if not supports(target):
            raise ValueError(f"the marginal oracle runs on the static-cache runtime, which does not support this "
                             f"{model_type(target)!r} target")
        if samples < 1 or block_size < 2 or not temperature > 0:
            raise ValueError(f"need samples >= 1, block size >= 2 and a temperature > 0, not {samples}, "
                             f"{block_size}, {temperature}")
        self.target, self.samples, self.block_size = target, samples, block_size
        if verification not in ("token", "block"):
            raise ValueError(f"verification must be token or block, not {verification!r}")
        self.temperature, self.generator, self.verification = temperature, generator, verification
        self.runner: StaticTarget | None = None
        self.synced = 0  # positions of the context already copied from row 0 to the path rows
        self.marginals: list[torch.Tensor] = []  # q_1, q_2, ... of the last cycle, as far as it got (to inspect)

    def _runner(self, length: int) -> StaticTarget:
        """The static cache, [M+1 rows, length] at least; grown (not kept twice) when a request needs more."""
        if self.runner is None or self.runner.max_length < length:
            self.runner = None  # the old cache goes before the new one is allocated
            self.runner = StaticTarget(self.target, self.samples + 1, -(-length // CACHE_ROUNDING) * CACHE_ROUNDING,
                                       kernels="torch")
            # The paths copy the context's keys and values row to row: a recurrent state could not be copied so.
            if any(keys.numel() == 0 for keys in self.runner.keys):
                raise ValueError(f"the marginal oracle copies attention caches between rows; this "
                                 f"{model_type(self.target)!r} target keeps recurrent states")
        return self.runner

    @torch.no_grad()
    def decode(self, prompt: Sequence[int], max_new_tokens: int, stop_ids: Sequence[int] = (),
               slots: SlotTotals | None = None) -> RequestOutput:
        """New tokens of one prompt (at most `max_new_tokens`, up to a stop token), sampled at the temperature as
        the eval loop samples them, with a + 1 of every cycle; `slots` gathers the per-slot sums."""
        slots = slots if slots is not None else SlotTotals.zeros(self.block_size - 1)
        logits = self.prefill(prompt, max_new_tokens)
        generated = [int(sample(probabilities(logits, self.temperature), self.generator))]
        lengths: list[int] = []
        start, stop = len(prompt), set(stop_ids)
        done = generated[-1] in stop
        while len(generated) < max_new_tokens and not done:
            cycle = self.cycle(start, generated[-1], slots)
            start += cycle.accepted + 1
            generated.extend(cycle.committed)
            lengths.append(cycle.accepted + 1)
            done = any(token in stop for token in cycle.committed)
        tokens = truncate(generated, max_new_tokens, stop)
        return RequestOutput(tokens, lengths, len(prompt), "stop" if tokens and tokens[-1] in stop else "length")

    def prefill(self, prompt: Sequence[int], max_new_tokens: int) -> torch.Tensor:
        """The prompt into row 0's cache; its last position's logits [V]."""
        length = len(prompt)
        runner = self._runner(length + max_new_tokens + self.block_size)
        device = self.target.device
        ids = torch.tensor([list(prompt)], device=device)
        out = runner.forward(ids, torch.arange(length, device=device)[None], row_index=torch.zeros(1, dtype=torch.long,
                             device=device), kv_len=length, logit_index=torch.tensor([length - 1], device=device))
        self.synced = 0
        return out.logits[0, -1].float()

    def cycle(self, start: int, last: int, slots: SlotTotals) -> Cycle:
        """One cycle at `start`, the position of `last` (the last committed token, not yet in the cache)."""
        width, temperature = self.block_size - 1, self.temperature
        # Every path starts from the same context: row 0 alone reads `last`, and its keys and values are copied.
        target_logits = self._row_zero(last, start)  # [1, V]: p_T(. | c), what slot 1's draft is tested against
        self._sync(start + 1)
        path_probs = probabilities(target_logits, temperature).expand(self.samples, -1)
        drafts: list[int] = []
        tested: list[torch.Tensor] = []  # p_T(. | c, d_<slot) of each slot, for block verification
        self.marginals = []
        for slot in range(1, width + 1):
            p = probabilities(target_logits[0], temperature)
            q = p if slot == 1 else path_probs.mean(dim=0)  # q_slot, Rao-Blackwellised over the M paths
            self.marginals.append(q)
            draft = sample(q, self.generator)
            tested.append(target_logits[0])
            if self.verification == "token":
                slots.reached[slot - 1] += 1
                slots.expected[slot - 1] += float(torch.minimum(p, q).sum())
                slots.mode[slot - 1] += float(p[q.argmax()])
                # The project's test for a block of one draft: its target rows are p_T(. | c, d_<slot) and a second
                # row for the bonus, which an accepted draft would emit and the next step replaces (so the first
                # again will do). q is handed as log-probabilities at draft temperature 1, which the rule turns
                # back into q.
                accepted, token = speculative_sample(target_logits.expand(2, -1)[None], q.log()[None, None],
                                                     draft.view(1, 1), temperature, draft_temperature=1.0,
                                                     generator=self.generator)
                if not int(accepted):
                    return Cycle(slot - 1, drafts + [int(token)])
            # (block verification drafts every slot and judges the block at the end: `_block_verdict`)
            drafts.append(int(draft))
            if slot < width:
                target_logits, path_probs = self._advance(draft, path_probs, start + slot)
        bonus_logits = self._row_zero(drafts[-1], start + width)  # p_T(. | c, d_1..d_{B-1})
        if self.verification == "block":
            return self._block_verdict(torch.stack([*tested, bonus_logits[0]]), drafts, slots)
        # Every draft accepted: the bonus token, from p_T(. | c, d_1..d_{B-1}).
        no_drafts = torch.zeros(1, 0, dtype=torch.long, device=self.target.device)
        _, bonus = speculative_sample(bonus_logits[:, None], None, no_drafts, temperature, generator=self.generator)
        return Cycle(width, drafts + [int(bonus)])

    def _block_verdict(self, target_logits: torch.Tensor, drafts: list[int], slots: SlotTotals) -> Cycle:
        """The whole drafted block [B, V] judged by block verification (`runtime/sampling.py`); the per-slot sums
        count the slots up to the first one the verdict did not keep, as token-wise testing reaches them."""
        marginals = torch.stack(self.marginals)  # [B-1, V]
        accepted, token = block_verify_sample(target_logits[None], marginals.log()[None],
                                              torch.tensor([drafts], device=target_logits.device), self.temperature,
                                              draft_temperature=1.0, generator=self.generator)
        kept = int(accepted)
        for slot in range(min(kept + 1, len(drafts))):
            p, q = probabilities(target_logits[slot], self.temperature), marginals[slot]
            slots.reached[slot] += 1
            slots.expected[slot] += float(torch.minimum(p, q).sum())
            slots.mode[slot] += float(p[q.argmax()])
        return Cycle(kept, drafts[:kept] + [int(token)])

    def _advance(self, draft: torch.Tensor, path_probs: torch.Tensor, position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Row 0 reads the draft, each path its own next token, at `position`: (p_T(. | c, d_<=slot) as logits
        [1, V], the paths' next distributions [M, V]). The paths' tokens by inverse CDF: one uniform a row, where
        `sample`'s race draws one per token."""
        uniforms = torch.rand(self.samples, device=draft.device, generator=self.generator)
        logits = self._step(torch.cat([draft.view(1), inverse_cdf(path_probs, uniforms)]), position)
        return logits[:1], probabilities(logits[1:], self.temperature)

    def _step(self, tokens: torch.Tensor, position: int) -> torch.Tensor:
        """Every row's token at `position`: logits [rows, V] in float32."""
        assert self.runner is not None
        positions = torch.full((tokens.shape[0], 1), position, dtype=torch.long, device=tokens.device)
        return self.runner.forward(tokens[:, None], positions, kv_len=position + 1).logits[:, 0].float()

    def _row_zero(self, token: int, position: int) -> torch.Tensor:
        """Row 0 alone reads `token` at `position`: logits [1, V] in float32."""
        assert self.runner is not None
        device = self.target.device
        out = self.runner.forward(torch.tensor([[token]], device=device), torch.tensor([[position]], device=device),
                                  row_index=torch.zeros(1, dtype=torch.long, device=device), kv_len=position + 1)
        return out.logits[:, 0].float()

    def _sync(self, start: int) -> None:
        """Row 0's positions [synced, start) into the path rows (its committed context and the cycle's first token):
        the paths continue what row 0 holds, and what they wrote past it is overwritten before any query reads it."""
        assert self.runner is not None
        if start > self.synced:
            for keys, values in zip(self.runner.keys, self.runner.values, strict=True):
                keys[1:, :, self.synced:start] = keys[:1, :, self.synced:start]
                values[1:, :, self.synced:start] = values[:1, :, self.synced:start]
        self.synced = start

