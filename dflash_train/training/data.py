"""Training samples, the train/validation split, the epoch order and rank sharding.

The order of samples is a pure function of (seed, epoch) and the source weights, and each optimizer step consumes a fixed
slice of it, so a resumed run (or a run on another number of processes with the same global batch)
sees exactly the same sequences at the same step.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from dflash_train.data.prepared import load_prepared, read_metadata
from dflash_train.features.store import FeatureStore

EXTRA_DRAWS_STREAM = 7_919  # the fractional draws' generator is seeded apart from the epoch's shuffle


class TrainingSamples:
    """Prepared token data (online features) or an offline feature store, indexed uniformly."""

    def __init__(self, prepared: str | None, features: str | None, max_length: int) -> None:
        self.max_length = max_length
        self.offline = features is not None
        if features is not None:
            self.store: Any = FeatureStore(features)
            self.metadata: dict[str, Any] = dict(self.store.manifest)
        else:
            self.store, self.metadata = load_prepared_dataset(str(prepared))

    def __len__(self) -> int:
        return len(self.store)

    def sources(self, indices: Sequence[int]) -> list[str] | None:
        """The `source` name of each of these rows; None where the data keeps none (feature stores, data
        prepared without the column)."""
        if self.offline or "source" not in self.store.column_names:
            return None
        return list(self.store.select_columns(["source"])[list(indices)]["source"])

    def prompt_keys(self) -> list[str] | None:
        """Each row's prompt as its source label (`source` #`source_index`: the samples and turns of one prompt
        share it); None where the data keeps no labels (feature stores, data prepared without them)."""
        if self.offline or not {"source", "source_index"} <= set(self.store.column_names):
            return None
        labels = self.store.select_columns(["source", "source_index"])
        return [f"{source}#{index}" for source, index in zip(labels["source"], labels["source_index"], strict=True)]

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        row = self.store[index]
        sample = {
            "input_ids": torch.as_tensor(row["input_ids"], dtype=torch.long)[: self.max_length],
            "loss_mask": torch.as_tensor(row["loss_mask"]).bool()[: self.max_length],
        }
        if self.offline:
            sample["features"] = torch.as_tensor(row["features"])[: self.max_length]
        return sample


def load_prepared_dataset(path: str) -> tuple[Any, dict[str, Any]]:
    dataset = load_prepared(path)
    metadata = read_metadata(path)
    missing = {"input_ids", "loss_mask"} - set(dataset.column_names)
    if missing:
        raise ValueError(f"{path} lacks columns {sorted(missing)}; re-create it with `dflash-train prepare`")
    return dataset, metadata


def split_indices(num_samples: int, fraction: float, max_validation: int, seed: int,
                  keys: Sequence[str] | None = None) -> tuple[list[int], list[int]]:
    """A fixed random hold-out: (train indices, validation indices). A positive `fraction` of a small dataset
    (fewer rows than 1 / fraction) still holds out one row: validation that was asked for is never dropped
    without a word, and one row is enough to see the held-out loss and τ̂ move.

    With `keys` (each row's prompt: its source label), rows are held out by prompt, in an order drawn from
    the key and the seed alone: the samples and turns of one prompt never straddle the split, and two datasets
    that share prompts (a regenerated mix with one source changed) hold out mostly the same shared rows, so
    their per-source τ̂ compare. Without keys, rows are drawn by index."""
    num_val = 0
    if fraction > 0 and max_validation > 0 and num_samples >= 2:
        num_val = max(1, min(int(num_samples * fraction), max_validation))
    if num_samples - num_val < 1:
        raise ValueError(f"only {num_samples} samples: nothing left to train on after validation")
    held_out = _held_out_by_key(keys, num_val, seed) if keys is not None and num_val else None
    if held_out is None:
        order = torch.randperm(num_samples, generator=torch.Generator().manual_seed(seed)).tolist()
        held_out = set(order[:num_val])
    return ([i for i in range(num_samples) if i not in held_out], sorted(held_out))


def _held_out_by_key(keys: Sequence[str], num_val: int, seed: int) -> set[int] | None:
    """Whole prompts in the order of their seeded hash until `num_val` rows are held out; None when that would
    leave nothing to train on (every row one prompt's)."""
    rows_of: dict[str, list[int]] = {}
    for index, key in enumerate(keys):
        rows_of.setdefault(key, []).append(index)
    order = sorted(rows_of, key=lambda key: hashlib.sha1(f"{seed}\0{key}".encode()).digest())
    held_out: set[int] = set()
    for key in order:
        if len(held_out) >= num_val:
            break
        held_out.update(rows_of[key])
    return held_out if len(held_out) < len(keys) else None


@dataclass(frozen=True)
class StepPlan:
    """How sequences map to optimizer steps: global batch = batch_size × processes × accumulation."""

    batch_size: int
    num_processes: int
    accumulation: int
    # The last epoch's order, with the very lists, seed and epoch it was built from (held, so that they are compared
    # by identity safely): a step reads one slice of an order that takes O(chats) to build, so it is built once an
    # epoch, not every step.
    _last: list[Any] = field(default_factory=list, compare=False, repr=False)

    @property
    def sequences_per_step(self) -> int:
        return self.batch_size * self.num_processes * self.accumulation

    def steps_per_epoch(self, num_train: int) -> int:
        steps = num_train // self.sequences_per_step
        if steps < 1:
            raise ValueError(
                f"{num_train} training samples do not fill one step of {self.sequences_per_step} sequences; "
                "lower training.batch_size or gradient_accumulation_steps"
            )
        return steps

    def micro_batches(
        self, train: Sequence[int], seed: int, step: int, rank: int, weights: Sequence[float] | None = None
    ) -> Iterator[list[int]]:
        """This rank's micro-batches (sample indices) of optimizer step `step` (0-based, global); `weights`
        as `epoch_order`'s."""
        last = self._last
        same_lists = bool(last) and last[0] is train and last[1] is weights and last[2] == seed
        draws = last[4] if same_lists else draws_per_epoch(train, weights)
        epoch, within = divmod(step, self.steps_per_epoch(draws))
        if not (same_lists and last[3] == epoch):
            last[:] = [train, weights, seed, epoch, draws, epoch_order(train, seed, epoch, weights)]
        order = last[5]
        chunk = order[within * self.sequences_per_step : (within + 1) * self.sequences_per_step]
        per_micro = self.batch_size * self.num_processes
        for micro in range(self.accumulation):
            group = chunk[micro * per_micro : (micro + 1) * per_micro]
            yield group[rank * self.batch_size : (rank + 1) * self.batch_size]


def epoch_order(train: Sequence[int], seed: int, epoch: int, weights: Sequence[float] | None = None) -> list[int]:
    """The chats epoch `epoch` trains on, in order: `train` shuffled, or with `weights` (one per chat of `train`,
    `data.source_weights`) the chats `weighted_draws` draws, shuffled."""
    drawn = train if weights is None else weighted_draws(train, weights, seed, epoch)
    perm = torch.randperm(len(drawn), generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))
    return [drawn[i] for i in perm.tolist()]


def weighted_draws(train: Sequence[int], weights: Sequence[float], seed: int, epoch: int) -> list[int]:
    """Each chat of `train` floor(w) times, and of the chats that share a fractional part f of w, a seeded
    round(f × their number) once more, chosen anew each epoch: a source at 0.5 shows all of its chats over
    the epochs, not the same half each time, and every epoch draws the same number of chats."""
    if len(weights) != len(train):
        raise ValueError(f"{len(weights)} weights for {len(train)} training chats")
    whole = [int(w) for w in weights]  # floor: weights are >= 0 (config validation)
    drawn = [chat for chat, times in zip(train, whole, strict=True) for _ in range(times)]
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch + EXTRA_DRAWS_STREAM)
    for fraction, members in sorted(_by_fraction(weights, whole).items()):
        chosen = torch.randperm(len(members), generator=generator)[: round(fraction * len(members))]
        drawn.extend(train[members[i]] for i in sorted(chosen.tolist()))
    return drawn


def chat_weights(source_weights: dict[str, float], sources: Sequence[str] | None) -> list[float]:
    """`data.source_weights` as one weight per training chat, from the chats' sources (None where the data keeps
    none): a source not named weighs 1."""
    if sources is None:
        raise ValueError("data.source_weights needs prepared data with a source per chat (what `dflash-train "
                         "prepare` writes), and this data keeps none: prepare it again, or unset data.source_weights")
    present = set(sources)
    unknown = sorted(set(source_weights) - present)
    if unknown:
        raise ValueError(f"data.source_weights names {', '.join(unknown)}, which no training chat comes from (the "
                         f"sources: {', '.join(sorted(present))}); fix the names")
    weights = [float(source_weights.get(source, 1.0)) for source in sources]
    if not any(weights):
        raise ValueError("data.source_weights leaves no training chat to draw: give some source a weight above 0")
    return weights


def weights_summary(source_weights: dict[str, float], sources: Sequence[str], weights: Sequence[float]) -> str:
    """One line: each weighted source's chats and how many an epoch draws of them."""
    counts: dict[str, int] = {}
    for source in sources:
        counts[source] = counts.get(source, 0) + 1
    parts = [f"{name} x{weight:g} ({counts[name]:,} chats, {round(weight * counts[name]):,} an epoch)"
             for name, weight in sorted(source_weights.items())]
    return f"source weights: {'; '.join(parts)}; every epoch draws {draws_per_epoch(sources, weights):,} chats"


def draws_per_epoch(train: Sequence[int], weights: Sequence[float] | None) -> int:
    """How many chats each epoch draws (the same in every epoch)."""
    if weights is None:
        return len(train)
    whole = [int(w) for w in weights]
    return sum(whole) + sum(round(f * len(m)) for f, m in _by_fraction(weights, whole).items())


def _by_fraction(weights: Sequence[float], whole: Sequence[int]) -> dict[float, list[int]]:
    """Positions in `weights` grouped by their weight's fractional part (whole weights left out)."""
    groups: dict[float, list[int]] = {}
    for position, (weight, times) in enumerate(zip(weights, whole, strict=True)):
        if weight > times:
            groups.setdefault(weight - times, []).append(position)
    return groups


def collate(samples: list[dict[str, torch.Tensor]], pad_to_multiple: int = 1) -> dict[str, torch.Tensor]:
    """Right-pad to the longest sample, rounded up to `pad_to_multiple`; padding is unsupervised and masked
    from the target (compiled attention sees few distinct shapes instead of one per batch)."""
    longest = max(s["input_ids"].shape[0] for s in samples)
    length = -(-longest // pad_to_multiple) * pad_to_multiple
    batch = len(samples)
    input_ids = torch.zeros(batch, length, dtype=torch.long)
    loss_mask = torch.zeros(batch, length, dtype=torch.bool)
    attention_mask = torch.zeros(batch, length, dtype=torch.long)
    for row, sample in enumerate(samples):
        n = sample["input_ids"].shape[0]
        input_ids[row, :n], loss_mask[row, :n], attention_mask[row, :n] = sample["input_ids"], sample["loss_mask"], 1
    out = {"input_ids": input_ids, "loss_mask": loss_mask, "attention_mask": attention_mask}
    if "features" in samples[0]:
        width = samples[0]["features"].shape[-1]
        features = torch.zeros(batch, length, width, dtype=samples[0]["features"].dtype)
        for row, sample in enumerate(samples):
            features[row, : sample["features"].shape[0]] = sample["features"]
        out["features"] = features
    return out

