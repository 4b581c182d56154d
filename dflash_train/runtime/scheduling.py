"""The decode engine's host side: requests queued, prefilled in waves as rows free up, harvested as they finish.

Requests are submitted in groups (`submit`), and each group is cut into waves of at most `prefill_rows`
requests and `prefill_tokens` padded tokens. A wave is prefilled in one forward as soon as that many rows are
free, while the other rows keep decoding where they are: a large batch refills in a few forwards instead of
one per finished row. A wave's make-up depends on its group alone, and a request's draws on its own seed, so a
request's output does not depend on the row or the company it runs in.

The host learns which rows finished through a copy of `done` that it reads `lookahead` cycles later
(`_run_until_finished`), so the GPU never waits for it.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from dflash_train.runtime.sampling import request_seed
from dflash_train.runtime.state import RequestOutput


@dataclass
class RunStats:
    wall_s: float = 0.0
    prefill_s: float = 0.0
    cycles: int = 0
    new_tokens: int = 0

    @property
    def decode_tokens_per_s(self) -> float:
        return self.new_tokens / max(self.wall_s - self.prefill_s, 1e-9)


@dataclass
class Group:
    """Requests submitted together; `outputs` (by position in the group) fills in as they finish."""

    size: int
    outputs: dict[int, RequestOutput] = field(default_factory=dict)

    @property
    def finished(self) -> bool:
        return len(self.outputs) == self.size

    def ordered(self) -> list[RequestOutput]:
        return [self.outputs[i] for i in range(self.size)]


@dataclass
class _Request:
    prompt: list[int]
    seed: int
    group: Group
    index: int  # position in its group
    on_finish: Callable[[int, RequestOutput], None] | None


class SchedulingMixin:
    """The DecodeEngine's requests and its loop over them. Relies on the engine's `config`, `device`, `runner`,
    `block_size`, `state`, `prepare`, `prefill`, `step`, `_prepared`, `_requests`, `_waves`, `_row_request`,
    `_next_id` and `_flag_ring`."""

    def submit(self, prompts: Sequence[Sequence[int]], seeds: Sequence[int] | None = None,
               on_finish: Callable[[int, RequestOutput], None] | None = None) -> Group:
        """Queue prompts (lists of token ids) as one group; `run` or `wait` decodes them. `seeds`: one per
        prompt, for its seeded draws (default: from the engine's seed and the request's number);
        `on_finish(index in the group, output)` is called as each one finishes."""
        self._check_fits(prompts)
        if seeds is not None and len(seeds) != len(prompts):
            raise ValueError(f"{len(seeds)} seeds for {len(prompts)} prompts")
        group = Group(len(prompts))
        ids = list(range(self._next_id, self._next_id + len(prompts)))
        self._next_id += len(prompts)
        for index, (request, prompt) in enumerate(zip(ids, prompts, strict=True)):
            seed = seeds[index] if seeds is not None else request_seed(self.config.seed, request)
            self._requests[request] = _Request(list(prompt), seed, group, index, on_finish)
        self._waves.extend(self._cut_waves(ids))
        return group

    def _check_fits(self, prompts: Sequence[Sequence[int]]) -> None:
        if any(len(p) == 0 for p in prompts):
            raise ValueError("empty prompt: every request needs at least one token")
        longest = max((len(p) for p in prompts), default=0)
        need = longest + self.config.max_new_tokens + self.block_size
        if need > self.runner.max_length:
            raise ValueError(f"a prompt of {longest} tokens + {self.config.max_new_tokens} new tokens needs "
                             f"{need} cache positions, the engine has {self.runner.max_length}; raise max_length")

    def _cut_waves(self, ids: list[int]) -> list[list[int]]:
        """Consecutive requests, at most `wave_rows` per wave and `prefill_tokens` padded tokens."""
        waves: list[list[int]] = []
        wave: list[int] = []
        width = 0
        for request in ids:
            length = len(self._requests[request].prompt)
            wider = max(width, length)
            if wave and (len(wave) == self.config.wave_rows or (len(wave) + 1) * wider > self.config.prefill_tokens):
                waves.append(wave)
                wave, wider = [], length
            wave.append(request)
            width = wider
        return waves + [wave] * bool(wave)

    @torch.no_grad()
    def wait(self, group: Group, stats: RunStats) -> list[RequestOutput]:
        """Decode until every request of `group` has finished (others keep running); its outputs in order."""
        self.run(lambda: group.finished, stats)
        return group.ordered()

    @torch.no_grad()
    def run(self, until: Callable[[], bool], stats: RunStats) -> None:
        """Prefill waves as rows free up and decode, until `until()` holds or nothing is left to run."""
        if not self._prepared:
            self.prepare()
        while not until():
            self._admit(stats)
            active = sum(request is not None for request in self._row_request)
            if not active:
                return
            free = len(self._row_request) - active
            # Enough finished rows for the next wave, or (no wave waiting) the first one to finish.
            self._run_until_finished(len(self._waves[0]) - free if self._waves else 1, stats)
            self._harvest(stats)

    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]],
                 on_finish: Callable[[int, RequestOutput], None] | None = None,
                 seeds: Sequence[int] | None = None) -> tuple[list[RequestOutput], RunStats]:
        """Decode every prompt (lists of token ids); returns outputs in prompt order and timing."""
        group = self.submit(prompts, seeds, on_finish)
        stats = RunStats()
        started = time.perf_counter()
        outputs = self.wait(group, stats)
        self._synchronize()
        stats.wall_s = time.perf_counter() - started
        return outputs, stats

    def _admit(self, stats: RunStats) -> None:
        free = [row for row, request in enumerate(self._row_request) if request is None]
        while self._waves and len(self._waves[0]) <= len(free):
            wave = self._waves.popleft()
            rows, free = free[: len(wave)], free[len(wave):]
            self._synchronize()
            started = time.perf_counter()
            requests = [self._requests[r] for r in wave]
            self.prefill(rows, [r.prompt for r in requests], [r.seed for r in requests])
            for row, request in zip(rows, wave, strict=True):
                self._row_request[row] = request
            self._synchronize()
            stats.prefill_s += time.perf_counter() - started

    def _harvest(self, stats: RunStats) -> None:
        done = self.state.done.tolist()
        rows = [row for row, request in enumerate(self._row_request) if request is not None and done[row]]
        if not rows:
            return
        requests = [self._requests.pop(self._row_request[row]) for row in rows]  # type: ignore[arg-type]
        outputs = self.state.harvest(rows, [len(r.prompt) for r in requests])
        for row, request, output in zip(rows, requests, outputs, strict=True):
            self._row_request[row] = None
            request.group.outputs[request.index] = output
            stats.new_tokens += len(output.tokens)
            if request.on_finish is not None:
                request.on_finish(request.index, output)

    def _run_until_finished(self, count: int, stats: RunStats) -> None:
        """Cycles until at least `count` rows holding requests are done."""
        watched = torch.tensor([r is not None for r in self._row_request])

        def enough(flags: torch.Tensor) -> bool:
            return int((flags & watched).sum()) >= count

        if self.device.type != "cuda":
            while not enough(self.state.done.cpu()):
                self.step()
                stats.cycles += 1
            return
        depth = max(1, self.config.lookahead)
        if self._flag_ring is None:  # pinned host buffers, so the copies of `done` are asynchronous
            self._flag_ring = [torch.empty(len(watched), dtype=torch.bool).pin_memory() for _ in range(depth)]
        ring = self._flag_ring
        in_flight: deque[tuple[torch.cuda.Event, torch.Tensor]] = deque()
        # Rows may already be finished right after prefill (stop token first, or max_new_tokens == 1).
        ring[0].copy_(self.state.done)
        if enough(ring[0]):
            return
        while True:
            self.step()
            stats.cycles += 1
            flags = ring[stats.cycles % depth]
            flags.copy_(self.state.done, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            in_flight.append((event, flags))
            if len(in_flight) >= depth:
                event, flags = in_flight.popleft()
                event.synchronize()  # the GPU is already running the cycles queued after this one
                if enough(flags):
                    return

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
