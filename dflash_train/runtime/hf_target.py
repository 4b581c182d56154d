"""The target run through its own Hugging Face forward and cache classes, for the architectures the static
runner (`static_target.py`, `SUPPORTED_MODEL_TYPES`) does not cover: families without an adapter
(`target_adapters.py`) and configs it refuses (RoPE that follows the step's longest position). Every family
the package tests (latent attention and the linear-attention, Mamba and convolution hybrids among them) has
an adapter; this path is the exact fallback for the rest. A MoE model's
experts and known routers still run on the decode kernels here (`runtime/experts.py`).

It answers the decode engine's calls as the static runner does (`forward` at per-row positions, rows written
at those positions, `lm_head`), so the engine's loop, verification, sampling and lossless check run unchanged
on any causal LM. Each row keeps the cache the model itself builds. Positions are the contract: a forward whose
first position is `p` sees exactly the row's tokens before `p`, whatever the previous forward wrote after it
(the engine verifies B tokens and commits only a + 1 of them). How a row goes back to `p`:

- `crop`: every cache layer holds all past keys and values (full attention, MLA), so the cache is cut at `p`;
- `replay`: a layer keeps a window or a recurrent state, which cannot be cut back. The row's cache is copied
  whenever every token it holds is committed (after a prompt, before a block of several tokens); a forward
  at `p` that must take tokens back restarts from that copy and first re-reads the committed tokens between
  the copy's length and `p`.

Rows run one after another, each as a batch of one: no padding reaches the model and each row's cache is the
model's own, so the path is exact for every architecture and slower than the static runner's batched step.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from dflash_train.features.capture import feature_hooks
from dflash_train.runtime.hf_cache import cache_kwargs, rollback
from dflash_train.runtime.static_target import TargetOutput
from dflash_train.target import TargetModel

FULL_ATTENTION_LAYERS = ("DynamicLayer",)  # cache layers that hold every past key and value: `crop` is exact


@dataclass
class _Row:
    """One row's cache and, for `replay`, the copy taken before its last forward and the tokens it read."""

    cache: Any = None
    length: int = 0  # positions the cache holds
    snapshot: Any = None
    snapshot_length: int = 0
    tokens: list[int] = field(default_factory=list)  # tokens at positions snapshot_length ..


class HFCacheTarget:
    """The static runner's interface over the model's own forward and caches (module docstring)."""

    attention = "hf"
    matmul = "torch"
    kernels = "torch"
    skinny_shapes: frozenset[tuple[int, int]] = frozenset()
    carries_norm_stats = False
    graphable = False  # the host decides each row's rollback: no CUDA graph, no whole-step compilation

    def __init__(self, target: TargetModel, batch_size: int, max_length: int) -> None:
        self.target, self.batch_size, self.max_length = target, batch_size, max_length
        self.rows = [_Row() for _ in range(batch_size)]
        self.all_rows = torch.arange(batch_size, device=target.device)
        self.rollback: str | None = None  # "crop" or "replay", known once the model has built a cache

    def cache_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for row in self.rows if row.cache is not None
                   for t in _tensors(row.cache))

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, row_index: torch.Tensor | None = None,
                kv_len: int | None = None, logit_index: torch.Tensor | None = None,
                feature_layer_ids: Sequence[int] = (), **_: Any) -> TargetOutput:
        """input_ids/positions [n, T] for rows `row_index` (None: all) -> logits [n, T or 1, V], features
        [n, T, K*H] (zeros past a row's `logit_index`: right padding the model never sees)."""
        rows = self.all_rows if row_index is None else row_index
        lengths = [input_ids.shape[1]] * len(rows) if logit_index is None else (logit_index + 1).tolist()
        logits, features = [], []
        with feature_hooks(self.target, feature_layer_ids or [0]) as store:
            for i, (row, length) in enumerate(zip(rows.tolist(), lengths, strict=True)):
                row_logits = self._row_forward(self.rows[row], input_ids[i, :length], int(positions[i, 0]))
                logits.append(row_logits[-1:] if logit_index is not None else row_logits)
                if feature_layer_ids:
                    features.append(_pad(store.features()[0, -length:], input_ids.shape[1]))
        return TargetOutput(torch.stack(logits), torch.stack(features) if features else None)

    def _row_forward(self, row: _Row, tokens: torch.Tensor, start: int) -> torch.Tensor:
        """The row's logits [T, V] for `tokens` at positions start.. after its tokens before `start`."""
        if start == 0:
            row.cache, row.length, row.snapshot, row.snapshot_length, row.tokens = None, 0, None, 0, []
        else:
            self._rewind(row, start)
        if self.rollback == "replay" and tokens.numel() > 1:  # all before `start` is committed: the point to
            # come back to, should the verify commit fewer of these tokens. One token (a step without a drafter)
            # is copied for no more: the older copy and the tokens read since serve the rare step taken back.
            row.snapshot, row.snapshot_length, row.tokens = copy.deepcopy(row.cache), start, []
        out = self._run(row, tokens[None], start)
        if start == 0 and self.rollback is None:
            self.rollback = _rollback_kind(row.cache)
        if self.rollback == "replay" and start == 0:  # a prompt is committed as a whole
            row.snapshot, row.snapshot_length, row.tokens = copy.deepcopy(row.cache), row.length, []
        elif self.rollback == "replay":
            row.tokens += tokens.tolist()
        return out.logits[0]

    def _run(self, row: _Row, ids: torch.Tensor, start: int) -> Any:
        """The model on ids [1, t] at positions start.., appending to the row's cache (made here if none)."""
        positions = torch.arange(start, start + ids.shape[1], device=ids.device)[None]
        out = self.target.model(ids, position_ids=positions, **cache_kwargs(self.target.model, row.cache))
        row.cache, row.length = out.past_key_values, start + ids.shape[1]
        return out

    def _rewind(self, row: _Row, start: int) -> None:
        """Bring the row's cache to exactly `start` positions: cut it, or go back to the last snapshot and
        re-read the committed tokens after it (module docstring)."""
        if start > row.length:
            raise ValueError(f"a forward at position {start} needs the row's tokens before it; it holds {row.length}")
        if start == row.length:  # everything the row read is committed: nothing to undo
            return
        if self.rollback == "crop":
            rollback(row.cache, start)
            row.length = start
            return
        committed = row.tokens[: start - row.snapshot_length]
        row.cache, row.length = copy.deepcopy(row.snapshot), row.snapshot_length
        if committed:
            self._run(row, torch.tensor([committed], device=self.target.device), row.snapshot_length)

    def lm_head(self, h: torch.Tensor) -> torch.Tensor:
        return self.target.lm_head(h)

    @torch.no_grad()
    def compare_with_hf(self, ids: Sequence[int]) -> dict[str, float]:
        """This runner is the model's own forward: nothing to compare."""
        return {"max_abs_logit_diff": 0.0, "argmax_agreement": 1.0}


def _rollback_kind(cache: Any) -> str:
    layers = getattr(cache, "layers", None)
    if layers and all(type(layer).__name__ in FULL_ATTENTION_LAYERS for layer in layers) and hasattr(cache, "crop"):
        return "crop"
    return "replay"


def _tensors(cache: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    for layer in getattr(cache, "layers", []):
        found += [value for value in vars(layer).values() if isinstance(value, torch.Tensor)]
    return found


def _pad(features: torch.Tensor, length: int) -> torch.Tensor:
    """[t, F] -> [length, F], zeros after row t."""
    return torch.nn.functional.pad(features, (0, 0, 0, length - features.shape[0]))
