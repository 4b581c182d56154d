"""Per-row decoding state of the runtime, kept on the device and updated in place (CUDA-graph safe).

Row r holds one request: `start[r]` is the position of its last committed token (the next block's anchor,
not yet seen by the target), `out[r, :n_out[r]]` its generated tokens, `accept_log[r, :n_cycles[r]]` the
a+1 of each of its cycles, `keys[r]` the key of its seeded draws, `stopped[r]` whether a stop token ended
it, `looped[r]` whether it was ended inside a verbatim loop (with a `LoopDetector`, regeneration's
`--stop-loops`). A row that is `done` (finished, or idle) is carried through every cycle unchanged, so the
batch keeps a static shape.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dflash_train.kernels.decode_state import advance_triton
from dflash_train.runtime.loop_stop import LoopDetector


@dataclass
class RequestOutput:
    tokens: list[int]  # the generated tokens, a final stop token included
    acceptance_lengths: list[int]
    num_prompt_tokens: int
    finish_reason: str = "length"  # "stop": a stop token ended it; "length": max_new_tokens did; "loop": a loop


class DecodeState:
    def __init__(self, batch_size: int, block_size: int, max_new_tokens: int, stop_token_ids: list[int],
                 device: torch.device, loops: LoopDetector | None = None, fused: bool = False) -> None:
        def zeros(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.long, device=device)

        self.max_new_tokens = max_new_tokens
        self.start = zeros(batch_size)
        self.last_token = zeros(batch_size)
        self.out = zeros(batch_size, max_new_tokens + block_size + 1)  # last column: write sink
        self.n_out = zeros(batch_size)
        self.accept_log = zeros(batch_size, max_new_tokens + 1)  # last column: write sink
        self.n_cycles = zeros(batch_size)
        self.keys = zeros(batch_size, 2)
        self.block = zeros(batch_size, block_size)  # the block of the current cycle
        self.done = torch.ones(batch_size, dtype=torch.bool, device=device)  # rows start idle
        self.stopped = torch.zeros(batch_size, dtype=torch.bool, device=device)
        self.looped = torch.zeros(batch_size, dtype=torch.bool, device=device)
        self.loops = loops
        self.fused = fused  # advance as one Triton kernel (kernels/decode_state.py) instead of ~30 small ops
        # [-1] when there are none: no token matches it, and a kernel never gets an empty (null) pointer
        self.stop_ids = torch.tensor(list(stop_token_ids) or [-1], dtype=torch.long, device=device)
        self.slots = torch.arange(block_size, device=device)

    def _is_stop(self, tokens: torch.Tensor) -> torch.Tensor:
        return (tokens[..., None] == self.stop_ids).any(dim=-1)

    def reset_rows(self, row_index: torch.Tensor, first_tokens: torch.Tensor, prompt_lengths: torch.Tensor,
                   keys: torch.Tensor) -> None:
        """Start requests in rows row_index [n]: prompts of prompt_lengths [n] whose first token was sampled,
        with the keys [n, 2] of their seeded draws."""
        self.start[row_index] = prompt_lengths
        self.last_token[row_index] = first_tokens
        self.out[row_index, 0] = first_tokens
        self.n_out[row_index] = 1
        self.n_cycles[row_index] = 0
        self.keys[row_index] = keys
        stopped = self._is_stop(first_tokens)
        self.stopped[row_index] = stopped
        self.looped[row_index] = False
        self.done[row_index] = stopped | (self.max_new_tokens <= 1)

    def advance(self, accept_len: torch.Tensor, bonus: torch.Tensor) -> None:
        """After a cycle committed accept_len [b] tokens into `out` (the last being bonus [b])."""
        active = ~self.done if self.loops is not None else None  # rows this cycle ran
        if self.fused:
            advance_triton(self.out, self.n_out, accept_len, bonus, self.done, self.stopped, self.start,
                           self.last_token, self.n_cycles, self.accept_log, self.stop_ids, self.slots.shape[0],
                           self.max_new_tokens)
        else:
            self._advance(accept_len, bonus)
        if active is not None:  # still running, but repeating itself: ended here
            self.looped |= active & ~self.done & self.loops(self.out, self.n_out)
            self.done |= self.looped

    def _advance(self, accept_len: torch.Tensor, bonus: torch.Tensor) -> None:
        width = self.slots.shape[0]
        sink = self.out.shape[1] - 1
        index = (self.n_out[:, None] + self.slots).clamp(max=sink)
        committed = self.out.gather(1, index)  # [b, B], valid where slot < accept_len
        stops = self._is_stop(committed) & (self.slots < accept_len[:, None])
        hit = stops.any(dim=-1)
        first_stop = torch.where(stops, self.slots, width).amin(dim=-1)
        kept = torch.where(hit, first_stop + 1, accept_len)  # tokens after a stop token are dropped
        active = ~self.done
        step = active.long()
        log_index = torch.where(active, self.n_cycles, self.accept_log.shape[1] - 1)
        self.accept_log.scatter_(1, log_index[:, None], accept_len[:, None])
        self.n_cycles += step
        self.n_out += kept * step
        self.start += accept_len * step
        self.last_token.copy_(torch.where(active, bonus, self.last_token))
        # A stop token past max_new_tokens does not count: the output is cut before it.
        self.stopped |= active & hit & (self.n_out <= self.max_new_tokens)
        self.done |= active & (hit | (self.n_out >= self.max_new_tokens))

    def harvest(self, rows: Sequence[int], prompt_lengths: Sequence[int]) -> list[RequestOutput]:
        """The outputs of finished rows, read back in one transfer per tensor."""
        index = torch.tensor(list(rows), dtype=torch.long, device=self.out.device)
        n_out = self.n_out[index].clamp(max=self.max_new_tokens).tolist()
        n_cycles, stopped = self.n_cycles[index].tolist(), self.stopped[index].tolist()
        looped = self.looped[index].tolist()
        out, log = self.out[index].tolist(), self.accept_log[index].tolist()
        reasons = ["stop" if stop else "loop" if loop else "length" for stop, loop in zip(stopped, looped, strict=True)]
        return [RequestOutput(tokens=out[i][: n_out[i]], acceptance_lengths=log[i][: n_cycles[i]],
                              num_prompt_tokens=length, finish_reason=reasons[i])
                for i, length in enumerate(prompt_lengths)]
