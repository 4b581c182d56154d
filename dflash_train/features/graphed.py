"""The target's feature pass over packed training rows, replayed from CUDA graphs.

Why: in a packed SmolLM2 step the host spent a large share of the step launching the target's pass (28
compiled decoder layers, up to the deepest feature layer, with the varlen attention between them) for much
less GPU work, and the GPU waited on it (docs/benchmarks.md, 'Where the gaps come from'). A CUDA graph
replays the whole pass with one launch.

What makes the pass capturable: every step has rows of one shape, but the chats' boundaries change. The
varlen kernel reads them from a device buffer of fixed capacity (the unused entries repeat the last
boundary: empty chats, which the kernel skips), and its grid comes from the longest chat, rounded up to a
power-of-two bucket. So one graph serves every step with the same (capacity, bucket): each is captured on
first use, after two warm-up passes outside the capture (compilation and autotuning cannot run inside
one), checked once against the uncaptured pass on the same rows, and replayed from then on. The graphs
share one memory pool: they never run at once, and each one's outputs are read before the next replay
(the drafter's forward and backward come first in stream order).

The outputs are the graph's own tensors, overwritten by the next replay: the trainer consumes them within
the step. `training.target_cuda_graphs` turns this on (CUDA, varlen attention, whole rows).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from dflash_train.features.varlen import PackedSequences, packed_sequences, sequence_bounds, use_sequences

FeaturePass = Callable[[Tensor, Tensor], tuple[Tensor, Tensor | None]]  # (ids, positions) -> (features, final)
MIN_BUCKET = 256
CAPACITY_STEP = 32  # boundaries are padded to a multiple of this: a few graphs cover the chats-per-step range
CHECK_TOLERANCE = 1e-2  # relative error of a new graph's first features: rounding passes, a wrong replay not
FIRST_CAPACITY = 256  # the buffer's first size; a step with more chats grows it (and captures again)


def longest_bucket(longest: int, length: int) -> int:
    """The varlen kernel's longest chat for a graph: a power of two >= `longest`, at most the row length."""
    bucket = MIN_BUCKET
    while bucket < longest:
        bucket *= 2
    return min(bucket, length)


def padded_bounds(bounds: tuple[int, ...], capacity: int) -> list[int]:
    """`bounds` (n + 1 cumulative boundaries) extended to `capacity` + 1 entries by empty chats at the end."""
    chats = len(bounds) - 1
    if chats > capacity:
        raise ValueError(f"{chats} chats do not fit {capacity} boundary slots")
    return [*bounds, *[bounds[-1]] * (capacity - chats)]


@dataclass
class _Captured:
    replay: Callable[[], None]
    outputs: tuple[Tensor, Tensor | None]


class GraphedFeatures:
    """`features_pass(ids, positions)` of packed rows [rows, length], replayed from CUDA graphs keyed by
    (capacity, bucket). `eager=True` replays by calling the pass again on the same buffers (CPU tests of the
    buffers' bookkeeping; the arithmetic is then the varlen fallback's)."""

    def __init__(self, features_pass: FeaturePass, rows: int, length: int, device: torch.device,
                 eager: bool = False) -> None:
        if not eager and device.type != "cuda":
            raise ValueError("CUDA graphs of the target's pass need a CUDA device")
        self.features_pass, self.rows, self.length, self.eager = features_pass, rows, length, eager
        self.ids = torch.zeros(rows, length, dtype=torch.long, device=device)
        self.positions = torch.zeros(rows, length, dtype=torch.long, device=device)
        self.capacity = FIRST_CAPACITY
        self.cu = torch.zeros(FIRST_CAPACITY + 1, dtype=torch.int32, device=device)
        self.graphs: dict[tuple[int, int], _Captured] = {}
        self.pool = None if eager else torch.cuda.graph_pool_handle()

    def __call__(self, ids: Tensor, positions: Tensor, host_positions: Tensor) -> tuple[Tensor, Tensor | None]:
        """`ids`, `positions` [rows, length] on the device; `host_positions` the same positions on the host
        (the boundaries are computed there: no device sync)."""
        if tuple(ids.shape) != (self.rows, self.length):
            raise ValueError(f"graphed target pass: rows of shape {tuple(ids.shape)}, captured for "
                             f"{(self.rows, self.length)}")
        bounds = sequence_bounds(host_positions)
        chats = len(bounds) - 1
        capacity = -(-chats // CAPACITY_STEP) * CAPACITY_STEP
        bucket = longest_bucket(max(b - a for a, b in zip(bounds, bounds[1:], strict=False)), self.length)
        self._fill(ids, positions, bounds, capacity)
        key = (capacity, bucket)
        captured = self.graphs.get(key)
        if captured is None:
            captured = self._capture(capacity, bucket)
            captured.replay()
            self._check(captured.outputs[0], ids, positions, host_positions)
            self.graphs[key] = captured
        else:
            captured.replay()
        return captured.outputs

    def _check(self, replayed: Tensor, ids: Tensor, positions: Tensor, host_positions: Tensor) -> None:
        """A new graph's first features against the uncaptured pass over the same rows (once per graph, so a
        capture that went wrong stops the graphs instead of training on wrong features)."""
        with packed_sequences(host_positions, ids.device):
            expected = self.features_pass(ids, positions)[0].float()
        error = float((replayed.float() - expected).norm() / expected.norm().clamp_min(1e-12))
        if not error <= CHECK_TOLERANCE:
            raise RuntimeError(f"a replayed graph's features differ from the uncaptured pass (relative error "
                               f"{error:.2e} > {CHECK_TOLERANCE:.0e})")

    def _fill(self, ids: Tensor, positions: Tensor, bounds: tuple[int, ...], capacity: int) -> None:
        """Copy this step's rows and boundaries into the buffers every graph reads."""
        if capacity > self.capacity:  # a larger buffer: graphs captured on the old one read stale memory
            self.capacity, self.graphs = capacity, {}
            self.cu = torch.zeros(capacity + 1, dtype=torch.int32, device=self.ids.device)
        self.ids.copy_(ids, non_blocking=True)
        self.positions.copy_(positions, non_blocking=True)
        host = torch.tensor(padded_bounds(bounds, self.capacity), dtype=torch.int32)
        self.cu.copy_(host.pin_memory() if self.cu.is_cuda else host, non_blocking=True)

    def _sequences(self, capacity: int, bucket: int) -> PackedSequences:
        """The boundaries the captured kernels read: the first capacity + 1 entries of the buffer."""
        bounds = tuple(self.cu[: capacity + 1].tolist()) if self.eager else ()
        return PackedSequences(self.cu[: capacity + 1], bounds, bucket)

    def _capture(self, capacity: int, bucket: int) -> _Captured:
        if self.eager:
            return self._eager_stand_in(capacity, bucket)
        sequences = self._sequences(capacity, bucket)
        side = torch.cuda.Stream(self.ids.device)
        side.wait_stream(torch.cuda.current_stream(self.ids.device))
        with torch.cuda.stream(side), use_sequences(sequences):
            for _ in range(2):
                self.features_pass(self.ids, self.positions)
        torch.cuda.current_stream(self.ids.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: the trainer's loader thread may pin host memory during the capture (see step_graph.py)
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"), use_sequences(sequences):
            outputs = self.features_pass(self.ids, self.positions)
        return _Captured(graph.replay, outputs)

    def _eager_stand_in(self, capacity: int, bucket: int) -> _Captured:
        """Outputs of its own, overwritten in place by every replay, as a graph's are."""
        def run() -> tuple[Tensor, Tensor | None]:
            with use_sequences(self._sequences(capacity, bucket)):
                return self.features_pass(self.ids, self.positions)

        features, final = run()
        outputs = (features.clone(), None if final is None else final.clone())

        def replay() -> None:
            for kept, new in zip(outputs, run(), strict=True):
                if kept is not None:
                    kept.copy_(new)

        return _Captured(replay, outputs)
