"""Offline feature extraction: prepared dataset -> feature store (layout in ``store.py``).

Shard ``k`` = dataset rows ``[k*R, (k+1)*R)``. ``R`` is chosen so that a shard holds about ``shard_bytes``
at the dataset's mean row length (a fixed row count would make a Qwen3-8B shard tens of gigabytes of
pinned host memory), unless given.

Shards are computed in windows of ``window_shards`` (window ``j`` = shards ``[j*W, (j+1)*W)``): the rows
of a window are sorted by length together and grouped into right-padded micro-batches of at most
``token_budget`` padded tokens (``micro_batches``); the more rows are sorted together, the closer each
row's neighbours are in length and the less padding the target computes. Rank ``r`` of ``n`` computes
the windows ``j % n == r``. A shard is written atomically, so a killed run resumes by skipping the shards
that exist; a window with any shard missing is computed whole, so that every shard always comes from the
same micro-batches, bit for bit, however the work was split or interrupted.

The host never waits for the GPU: inputs reach the device from pinned memory, and while the target runs
micro-batch ``j+1``, micro-batch ``j``'s features are copied to pinned host memory on a side stream;
writer threads wait for a shard's copies and write it straight from those buffers. Up to
``write_threads`` shard files are written at once, each by one thread: concurrent writes into one file
queue behind its lock, separate files proceed in parallel.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.compute as pc
import torch
from torch import Tensor

from dflash_train.atomic import write_atomically, write_json_atomically
from dflash_train.features.capture import compute_features
from dflash_train.features.safetensors_writer import write_safetensors
from dflash_train.features.store import MANIFEST, quantize_fp8, read_manifest, shard_path
from dflash_train.shards import check_same_settings


@dataclass
class ExtractConfig:
    layer_ids: list[int]
    dtype: str = "bf16"  # or "fp8"
    rows_per_shard: int | None = None  # None: about `shard_bytes` per shard (an existing store's own value)
    # 64k: a 135M target's forward is launch-bound below ~30k tokens (16k ran markedly slower: docs/benchmarks.md,
    # 'Figures behind code choices')
    token_budget: int = 65536
    disk_margin: float = 1.02
    write_threads: int = 4  # shard files written at once
    shard_bytes: int = 1 << 29
    # shards whose rows are micro-batched together: 8 shards of 64 rows ran closer to the bare forward's speed to
    # host memory than 4 (docs/benchmarks.md, `extract`; fewer rows sorted together pad more, and leave short
    # micro-batches whose forwards are launch-bound)
    window_shards: int = 8
    # pinned host memory holds up to 2 windows of shards (one computed, the one before it being written)


def bytes_per_token(num_layers: int, hidden: int, dtype: str) -> int:
    feature = num_layers * hidden * (2 if dtype == "bf16" else 1) + (4 * num_layers if dtype == "fp8" else 0)
    return feature + 4 + 1  # + input id (int32) + loss mask (uint8)


def row_lengths(dataset: Any) -> list[int]:
    """Token count of every row, read from the Arrow column without materialising the lists."""
    return pc.list_value_length(dataset.data.column("input_ids")).to_pylist()


def plan_rows_per_shard(lengths: Sequence[int], per_token: int, shard_bytes: int) -> int:
    """Rows of the dataset's mean length that make about `shard_bytes`."""
    mean_row_bytes = max(1.0, sum(lengths) / max(len(lengths), 1) * per_token)
    return max(1, int(shard_bytes // mean_row_bytes))


def micro_batches(lengths: Sequence[int], token_budget: int, group_cost: int | None = None) -> list[list[int]]:
    """Indices grouped longest first into right-padded micro-batches of at most ``token_budget`` padded
    tokens (a longer row alone).

    Groups are runs of the length-sorted rows, cut where they cost least: padded tokens plus ``group_cost``
    tokens per group (default ``token_budget // 32``: the fixed cost of one more forward). Filling each group
    to the budget instead pads every row to the longest of a wide length range (38 % extra tokens for 64
    rows of 256-2048 tokens at a 64k budget; these groups: 12 %). Dynamic programming over the sorted rows:
    ``best[j]`` is the cheapest grouping of the first ``j``, the last group ``[i, j)`` padded to ``sorted[i]``.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    widths = np.array([lengths[i] for i in order], dtype=np.int64)
    cost = token_budget // 32 if group_cost is None else group_cost
    best = np.zeros(len(order) + 1, dtype=np.int64)
    first = np.zeros(len(order) + 1, dtype=np.int64)  # first row of the last group of best[j]
    low = 0  # the earliest row that can open a group ending at j; only moves forward as j grows
    for j in range(1, len(order) + 1):
        while low < j - 1 and (j - low) * widths[low] > token_budget:
            low += 1
        starts = np.arange(low, j)
        totals = best[low:j] + (j - starts) * widths[low:j] + cost
        k = int(np.argmin(totals))
        best[j], first[j] = totals[k], low + k
    groups: list[list[int]] = []
    j = len(order)
    while j > 0:
        groups.append(order[first[j]:j])
        j = int(first[j])
    return groups[::-1]


def check_disk(out_dir: Path, needed: int) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(out_dir).free
    if free < needed:
        raise ValueError(f"{out_dir}: the features need {needed / 2**30:.2f} GiB but only {free / 2**30:.2f} GiB "
                         f"is free; free space, pick another --out, or use --dtype fp8 (half the size)")


@dataclass
class ShardRows:
    """One shard's rows straight from Arrow: flat values and row offsets (numpy, no Python lists)."""

    input_ids: np.ndarray  # [T] int32
    loss_mask: np.ndarray  # [T] uint8
    offsets: np.ndarray  # [rows + 1] int64, from 0

    @property
    def lengths(self) -> list[int]:
        return np.diff(self.offsets).tolist()


def join_rows(shards: Sequence[ShardRows]) -> ShardRows:
    """Several shards' rows as one, in order (offsets shifted past the rows before)."""
    starts = np.cumsum([0] + [len(rows.input_ids) for rows in shards[:-1]])
    offsets = np.concatenate([np.zeros(1, np.int64)] + [rows.offsets[1:] + start
                                                       for rows, start in zip(shards, starts, strict=True)])
    return ShardRows(np.concatenate([rows.input_ids for rows in shards]),
                     np.concatenate([rows.loss_mask for rows in shards]), offsets)


def shard_rows(dataset: Any, start: int, stop: int) -> ShardRows:
    table = dataset.flatten_indices().data if dataset._indices is not None else dataset.data
    columns = []
    for name in ("input_ids", "loss_mask"):
        column = table.column(name).slice(start, stop - start).combine_chunks()
        offsets = column.offsets.to_numpy().astype(np.int64)
        columns.append((column.values.to_numpy(zero_copy_only=False)[offsets[0]:offsets[-1]], offsets - offsets[0]))
    (ids, offsets), (mask, _) = columns
    return ShardRows(ids.astype(np.int32), mask.astype(np.uint8), offsets)


@dataclass
class ShardParts:
    """What a shard file holds, as parts in dataset row order, and the event after which they are on the host."""

    tensors: dict[str, list[Tensor]]
    ready: Any = None  # torch.cuda.Event, or None on the CPU

    def wait(self) -> None:
        if self.ready is not None:
            self.ready.synchronize()


class _ShardBuilder:
    """Runs the target over a window of shards' rows; device-to-host copies go on a side stream so that the
    next micro-batch's forward overlaps them."""

    def __init__(self, target: Any, config: ExtractConfig) -> None:
        self.target, self.config = target, config
        self.device = target.device
        self.copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    def run(self, shards: Sequence[ShardRows]) -> list[ShardParts]:
        """One window of shards: all their rows micro-batched together, then each shard's parts."""
        rows = join_rows(shards)
        lengths = rows.lengths
        features: list[Tensor | None] = [None] * len(lengths)
        scales: list[Tensor | None] = [None] * len(lengths)
        for group in micro_batches(lengths, self.config.token_budget):
            packed, scale = self._forward(group, rows, lengths)  # [sum len, K*H] on the host
            splits = [lengths[i] for i in group]
            for i, part in zip(group, packed.split(splits), strict=True):
                features[i] = part
            for i, part in zip(group, scale.split(splits) if scale is not None else [], strict=False):
                scales[i] = part
        ready = None
        if self.copy_stream is not None:
            ready = torch.cuda.Event()
            ready.record(self.copy_stream)
        parts, first = [], 0
        for shard in shards:
            end = first + len(shard.offsets) - 1
            tensors = {
                "input_ids": [torch.from_numpy(shard.input_ids)],
                "loss_mask": [torch.from_numpy(shard.loss_mask)],
                "offsets": [torch.from_numpy(shard.offsets)],
                "features": features[first:end],
            }
            if self.config.dtype == "fp8":
                tensors["scales"] = scales[first:end]
            parts.append(ShardParts(tensors, ready))  # type: ignore[arg-type]
            first = end
        return parts

    def _forward(self, group: list[int], rows: ShardRows, lengths: list[int]) -> tuple[Tensor, Tensor | None]:
        width = lengths[group[0]]
        ids = np.zeros((len(group), width), dtype=np.int64)
        for b, i in enumerate(group):
            ids[b, : lengths[i]] = rows.input_ids[rows.offsets[i]:rows.offsets[i + 1]]
        # No attention mask: the pads come after each row's tokens, which causal attention never lets a real
        # token see, so real tokens' features are those of the row alone. A padding mask would change nothing
        # for them but make Hugging Face check it on the host (two syncs per forward) and leave the causal kernel.
        feats = compute_features(self.target, self._to_device(ids), self.config.layer_ids)  # [b, width, K*H]
        # Real tokens only, gathered with a host-built index (boolean indexing would wait for the GPU).
        keep = np.concatenate([b * width + np.arange(lengths[i]) for b, i in enumerate(group)])
        packed = feats.reshape(-1, feats.shape[-1]).index_select(0, self._to_device(keep))
        scale = None
        if self.config.dtype == "fp8":
            packed, scale = quantize_fp8(packed, len(self.config.layer_ids))
        return self._to_host(packed), (self._to_host(scale) if scale is not None else None)

    def _to_device(self, array: np.ndarray) -> Tensor:
        """A host array on the device without waiting for the GPU: a copy from pageable memory blocks the
        host until the stream's earlier work is done, so the next micro-batch could not be queued behind
        the running one. Staged in pinned memory (the caching host allocator reuses it once the copy ran)."""
        tensor = torch.from_numpy(array)
        if self.copy_stream is None:
            return tensor.to(self.device)
        return tensor.pin_memory().to(self.device, non_blocking=True)

    def _to_host(self, tensor: Tensor) -> Tensor:
        if self.copy_stream is None:
            return tensor.cpu()
        host = pinned_empty(tensor.shape, tensor.dtype)
        self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.copy_stream):
            host.copy_(tensor, non_blocking=True)
        tensor.record_stream(self.copy_stream)  # keep the source alive until the copy has run
        return host


def pinned_empty(shape: torch.Size, dtype: torch.dtype) -> Tensor:
    """Page-locked host memory, or a one-line error that says how to need less of it."""
    try:
        return torch.empty(shape, dtype=dtype, pin_memory=True)
    except RuntimeError as error:  # the host would not lock more pages (cudaHostAlloc failed)
        gib = shape.numel() * dtype.itemsize / 2**30
        raise ValueError(f"could not pin {gib:.2f} GiB more host memory for features ({str(error).splitlines()[0]}); "
                         "lower --window-shards or --shard-gb; shards written so far are kept, rerun to resume") \
            from error


def _save_shard(path: Path, parts: ShardParts, unit: int) -> None:
    parts.wait()
    tensors = parts.tensors
    metadata = {"unit": str(unit), "rows": str(len(tensors["offsets"][0]) - 1),
                "tokens": str(len(tensors["input_ids"][0]))}
    write_atomically(path, lambda tmp: write_safetensors(tmp, tensors, metadata))


def _rows_per_shard(out_dir: Path, config: ExtractConfig, lengths: Sequence[int], per_token: int) -> int:
    if config.rows_per_shard is not None:
        return config.rows_per_shard
    if (out_dir / MANIFEST).is_file():  # resuming: the store's own shard size (a changed one is refused below)
        found = read_manifest(out_dir).get("rows_per_shard")
        if isinstance(found, int) and found > 0:
            return found
    return plan_rows_per_shard(lengths, per_token, config.shard_bytes)


def _windows_to_run(out_dir: Path, units: int, window: int, rank: int, world: int) -> tuple[list[list[int]], set[int]]:
    """This rank's windows that have a shard missing, and those missing shards."""
    windows = [list(range(j * window, min((j + 1) * window, units))) for j in range(-(-units // window))]
    mine = [shards for j, shards in enumerate(windows) if j % world == rank]
    missing = {k for shards in mine for k in shards if not shard_path(out_dir, k).exists()}
    return [shards for shards in mine if missing.intersection(shards)], missing


def extract(
    target: Any, dataset: Any, out_dir: Path, config: ExtractConfig, settings: dict[str, Any],
    rank: int = 0, world: int = 1, progress: Callable[[int, int, int, float], None] | None = None,
) -> dict[str, Any]:
    """Write this rank's missing shards; ``settings`` (target, hashes, ...) go into the manifest."""
    lengths = row_lengths(dataset)
    per_token = bytes_per_token(len(config.layer_ids), target.hidden_size, config.dtype)
    rows_per_shard = _rows_per_shard(out_dir, config, lengths, per_token)
    units = -(-len(lengths) // rows_per_shard)
    manifest = {**settings, "format": "dflash-features-v1", "target_layer_ids": list(config.layer_ids),
                "hidden_size": target.hidden_size, "dtype": config.dtype, "num_rows": len(lengths),
                "num_tokens": sum(lengths), "rows_per_shard": rows_per_shard, "num_units": units,
                "bytes_per_token": per_token}
    check_same_settings(out_dir / MANIFEST, manifest, "a feature store", "extract")
    windows, missing = _windows_to_run(out_dir, units, max(1, config.window_shards), rank, world)
    todo = sorted(missing)
    todo_tokens = sum(sum(lengths[k * rows_per_shard:(k + 1) * rows_per_shard]) for k in todo)
    needed = int(todo_tokens * per_token * config.disk_margin)
    print(f"extract: {sum(lengths):,} tokens in {units} shards, {per_token:,} bytes/token ({config.dtype}): "
          f"{sum(lengths) * per_token / 2**30:.2f} GiB in all; this run (rank {rank}/{world}) writes "
          f"{len(todo)} shards, {todo_tokens * per_token / 2**30:.2f} GiB to {out_dir}", flush=True)
    check_disk(out_dir, needed)
    if rank == 0:
        write_json_atomically(out_dir / MANIFEST, manifest)
    builder = _ShardBuilder(target, config)
    if progress:
        progress(0, len(todo), 0, 0.0)
    threads = max(1, config.write_threads)
    # Shards waiting for the disk: a whole window, so that the next window's forwards are queued while this
    # one is written (fewer would make the GPU wait for the disk within every window); bounds host memory.
    backlog = max(threads, config.window_shards)
    with ThreadPoolExecutor(threads) as writer:
        pending: list[Future[None]] = []
        done, tokens, start = 0, 0, time.perf_counter()
        for window in windows:
            shards = [shard_rows(dataset, k * rows_per_shard, min((k + 1) * rows_per_shard, len(lengths)))
                      for k in window]
            for k, rows, parts in zip(window, shards, builder.run(shards), strict=True):
                if k not in missing:  # written by an earlier run: computed only for its neighbours' batches
                    continue
                for future in [f for f in pending if f.done()]:
                    future.result()  # a failed write stops the run here, with its error
                    pending.remove(future)
                if len(pending) >= backlog:
                    pending.pop(0).result()
                pending.append(writer.submit(_save_shard, shard_path(out_dir, k), parts, k))
                done += 1
                tokens += len(rows.input_ids)
                if progress:  # the mean rate so far: the GPU runs ahead of the host, writes behind it
                    progress(done, len(todo), len(rows.input_ids), tokens / max(time.perf_counter() - start, 1e-9))
        for future in pending:
            future.result()
    return manifest
