"""Check every shard of a feature store: readable, complete, consistent, finite; optionally against the
prepared dataset it was made from and against features recomputed by the target."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dflash_train.features.capture import compute_features
from dflash_train.features.extract import shard_rows
from dflash_train.features.store import (
    READ_KEYS,
    FeatureStore,
    open_shard,
    read_manifest,
    shard_path,
)

CHUNK_TOKENS = 65536  # finiteness is checked in chunks so memory stays bounded


def _fail(path: Path, what: str) -> None:
    raise ValueError(f"{path}: {what}; delete it and run `dflash-train extract` again (it rewrites only that shard)")


def verify_shard(path: Path, manifest: dict[str, Any], unit: int) -> int:
    """Raises a one-line ValueError naming ``path`` on the first problem; returns the shard's token count."""
    handle = open_shard(path)
    names = set(handle.keys())
    expected = {"input_ids", "loss_mask", "offsets", "features"} | ({"scales"} if manifest["dtype"] == "fp8" else set())
    if names != expected:
        _fail(path, f"tensors {sorted(names)} != {sorted(expected)}")
    offsets = handle.get_tensor("offsets")
    rows = min(manifest["rows_per_shard"], manifest["num_rows"] - unit * manifest["rows_per_shard"])
    # Shape and dtype first: a damaged header may declare offsets that cannot be indexed or compared.
    if offsets.dtype != torch.int64 or tuple(offsets.shape) != (rows + 1,) or int(offsets[0]) != 0 \
            or bool((offsets.diff() <= 0).any()):
        _fail(path, f"offsets do not describe {rows} non-empty rows")
    tokens = int(offsets[-1])
    width = len(manifest["target_layer_ids"]) * manifest["hidden_size"]
    if handle.get_slice("features").get_shape() != [tokens, width]:
        _fail(path, f"features shape {handle.get_slice('features').get_shape()} != [{tokens}, {width}]")
    mask = handle.get_tensor("loss_mask")
    if len(handle.get_tensor("input_ids")) != tokens or len(mask) != tokens or bool((mask > 1).any()):
        _fail(path, "input_ids/loss_mask lengths or values are inconsistent")
    for start in range(0, tokens, CHUNK_TOKENS):
        chunk = handle.get_slice("features")[start:start + CHUNK_TOKENS].float()
        if not bool(torch.isfinite(chunk).all()):
            _fail(path, f"non-finite features in tokens {start}..{start + len(chunk)}")
    return tokens


def verify_store(store_dir: Path, dataset: Any = None, target: Any = None, recompute: int = 0,
                 progress: Callable[[int, int], None] | None = None) -> dict[str, int]:
    manifest = read_manifest(store_dir, keys=(*READ_KEYS, "num_tokens", "hidden_size", "target_layer_ids"))
    tokens = 0
    if progress:
        progress(0, manifest["num_units"])
    for k in range(manifest["num_units"]):
        path = shard_path(store_dir, k)
        if not path.is_file():
            raise ValueError(f"{path} is missing; run `dflash-train extract` again to finish the store")
        tokens += verify_shard(path, manifest, k)
        if progress:
            progress(k + 1, manifest["num_units"])
    if tokens != manifest["num_tokens"]:
        raise ValueError(f"{store_dir}: {tokens} tokens in shards, manifest says {manifest['num_tokens']}; extract again")
    store = FeatureStore(store_dir)
    if dataset is not None:
        _compare_with_dataset(store, dataset)
    if target is not None and recompute:
        _compare_with_target(store, target, recompute)
    return {"shards": manifest["num_units"], "rows": manifest["num_rows"], "tokens": tokens}


def _compare_with_dataset(store: FeatureStore, dataset: Any) -> None:
    """Token ids and loss masks of every shard against the prepared dataset, shard by shard (no features read)."""
    if len(dataset) != len(store):
        raise ValueError(f"{store.path}: {len(store)} rows, the prepared dataset has {len(dataset)}; extract again")
    per_shard = store.manifest["rows_per_shard"]
    for k in range(store.num_units):
        handle = open_shard(shard_path(store.path, k))
        expected = shard_rows(dataset, k * per_shard, min((k + 1) * per_shard, len(dataset)))
        same = (np.array_equal(handle.get_tensor("offsets").numpy(), expected.offsets)
                and np.array_equal(handle.get_tensor("input_ids").numpy(), expected.input_ids)
                and np.array_equal(handle.get_tensor("loss_mask").numpy(), expected.loss_mask))
        if not same:
            raise ValueError(f"{shard_path(store.path, k)}: token ids or loss masks differ from the prepared dataset; "
                             f"the store was made from other data")


def _compare_with_target(store: FeatureStore, target: Any, count: int) -> None:
    """Recompute ``count`` evenly spread rows one at a time. Batching changes rounding, so this compares
    the relative error (bf16: 2 %, fp8: 8 %), which a store of another target or layers far exceeds."""
    layer_ids = store.manifest["target_layer_ids"]
    bound = 0.02 if store.manifest["dtype"] == "bf16" else 0.08
    for i in list(range(0, len(store), max(1, len(store) // count)))[:count]:
        row = store[i]
        fresh = compute_features(target, row["input_ids"][None].to(target.device), layer_ids)[0].cpu().float()
        error = (fresh - row["features"].float()).norm() / fresh.norm().clamp(min=1e-12)
        if float(error) > bound:
            raise ValueError(f"{store.path}: row {i}'s features differ from this target's (relative error "
                             f"{float(error):.3f}); the store was made with another target or layers")
