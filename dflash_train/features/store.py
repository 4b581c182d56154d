"""The offline feature store of target features (the capture call that fills it is
``dflash_train.features.capture.compute_features``, the same one online training makes).

Store layout (``dflash-train extract`` writes it): ``manifest.json`` plus shards
``features-<k>.safetensors``, shard ``k`` holding dataset rows ``[k*R, (k+1)*R)`` packed without padding:

    input_ids  int32   [T]          T = tokens of the shard's rows
    loss_mask  uint8   [T]
    offsets    int64   [rows + 1]   row j is tokens offsets[j]:offsets[j+1]
    features   bf16 or float8_e4m3fn [T, K*H]
    scales     float32 [T, K]       fp8 only: one scale per token and captured layer (amax / 448)

Reading maps a shard lazily (safetensors) and slices one row, so memory stays bounded by one row.
"""

from __future__ import annotations

import bisect
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import Tensor

from dflash_train.json_files import read_json_object
from dflash_train.target.fingerprint import TargetIdentity, is_legacy_fingerprint

MANIFEST = "manifest.json"
FP8_MAX = 448.0  # largest finite float8_e4m3fn
FEATURE_DTYPES = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}


def shard_path(store_dir: Path, unit: int) -> Path:
    return store_dir / f"features-{unit:06d}.safetensors"


def quantize_fp8(features: Tensor, num_layers: int) -> tuple[Tensor, Tensor]:
    """``[T, K*H]`` -> (``[T, K*H]`` float8_e4m3fn, ``[T, K]`` float32 scales). Per token and layer, values
    are scaled so the largest magnitude maps to 448; each element then keeps 3 mantissa bits."""
    tokens = features.shape[0]
    grouped = features.float().view(tokens, num_layers, -1)  # [T, K, H]
    scales = (grouped.abs().amax(dim=-1) / FP8_MAX).clamp(min=1e-12)  # [T, K]
    quantized = (grouped / scales[..., None]).to(torch.float8_e4m3fn)
    return quantized.view(tokens, -1), scales


def dequantize_fp8(quantized: Tensor, scales: Tensor) -> Tensor:
    tokens, num_layers = scales.shape
    grouped = quantized.float().view(tokens, num_layers, -1) * scales[..., None]
    return grouped.view(tokens, -1).to(torch.bfloat16)


_DTYPE_NAMES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}  # extract --target-dtype spellings


def _is_count(value: Any, least: int = 0) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


# What readers take from a manifest, and the values they can use: reading rows needs READ_KEYS,
# verification and the compatibility checks of training more.
MANIFEST_CHECKS: dict[str, Callable[[Any], bool]] = {
    "num_rows": _is_count,
    "rows_per_shard": lambda value: _is_count(value, 1),
    "num_units": _is_count,
    "dtype": lambda value: isinstance(value, str) and value in FEATURE_DTYPES,
    "num_tokens": _is_count,
    "hidden_size": lambda value: _is_count(value, 1),
    "target_layer_ids": lambda value: isinstance(value, list) and bool(value) and all(map(_is_count, value)),
    "target_hash": lambda value: isinstance(value, str),
}
READ_KEYS = ("num_rows", "rows_per_shard", "num_units", "dtype")


def read_manifest(store_dir: Path, keys: Sequence[str] = READ_KEYS) -> dict[str, Any]:
    """The store's manifest, checked for the `keys` its reader uses (see MANIFEST_CHECKS)."""
    path = store_dir / MANIFEST
    if not path.is_file():
        raise ValueError(f"{store_dir} is not a feature store ({MANIFEST} missing); run `dflash-train extract`")
    manifest = read_json_object(path, "run `dflash-train extract` again")
    check_manifest(path, manifest, keys)
    return manifest


def check_manifest(path: Path, manifest: Any, keys: Sequence[str]) -> None:
    """A one-line error naming `path` when `manifest` lacks one of `keys` or holds an unusable value."""
    problem = _manifest_problem(manifest, keys)
    if problem is not None:
        raise ValueError(f"{path} is damaged ({problem}); run `dflash-train extract` again")


def _manifest_problem(manifest: Any, keys: Sequence[str]) -> str | None:
    if not isinstance(manifest, dict):
        return "not a JSON object"
    for key in keys:
        if not MANIFEST_CHECKS[key](manifest.get(key)):
            return f"{key} is {manifest.get(key)!r}" if key in manifest else f"no {key}"
    rows, per_shard, units = (manifest.get(key) for key in ("num_rows", "rows_per_shard", "num_units"))
    if set(READ_KEYS) <= set(keys) and units != -(-rows // per_shard):
        return f"{units} shards cannot hold {rows} rows of {per_shard}"
    return None


def open_shard(path: Path) -> Any:
    try:
        return safe_open(str(path), framework="pt")
    except Exception as error:  # safetensors raises its own error types for corrupt headers
        raise ValueError(
            f"{path}: unreadable feature shard ({error}); delete it and run `dflash-train extract` again "
            f"(it resumes and rewrites only that shard)"
        ) from error


def _unreadable(path: Path, error: Exception) -> ValueError:
    what = " ".join(str(error).split()) or type(error).__name__  # one line, whatever the library wrote
    return ValueError(f"{path}: unreadable feature shard ({what}); delete it and run `dflash-train extract` again")


class FeatureStore:
    """Random access to an offline store: ``store[i]`` is row ``i`` of the prepared dataset it was made from."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.manifest = read_manifest(self.path)
        rows, per_shard = self.manifest["num_rows"], self.manifest["rows_per_shard"]
        self.num_units = self.manifest["num_units"]
        missing = [k for k in range(self.num_units) if not shard_path(self.path, k).is_file()]
        if missing:
            raise ValueError(
                f"{self.path}: feature store incomplete ({len(missing)} of {self.num_units} shards missing, "
                f"first {shard_path(self.path, missing[0]).name}); run `dflash-train extract` again to finish"
            )
        self._starts = list(range(0, rows, per_shard))
        self._rows = rows
        self._handles: OrderedDict[int, tuple[Any, list[int]]] = OrderedDict()

    def __len__(self) -> int:
        return self._rows

    def __getstate__(self) -> dict[str, Any]:
        # Open shard handles stay in their process: data-loader workers reopen what they read.
        return {**self.__dict__, "_handles": OrderedDict()}

    def _open(self, unit: int) -> tuple[Any, list[int]]:
        """The shard's handle and row offsets; at most two shards are kept open (memory-mapped)."""
        if unit not in self._handles:
            path = shard_path(self.path, unit)
            handle = open_shard(path)
            try:
                offsets = handle.get_tensor("offsets").tolist()
            except Exception as error:  # a shard renamed or rewritten by hand: safetensors' own error types
                raise _unreadable(path, error) from error
            self._handles[unit] = (handle, offsets)
            if len(self._handles) > 2:
                self._handles.popitem(last=False)
        self._handles.move_to_end(unit)
        return self._handles[unit]

    def __getitem__(self, i: int) -> dict[str, Tensor]:
        if not 0 <= i < self._rows:
            raise IndexError(f"row {i} outside the store's {self._rows} rows")
        unit = bisect.bisect_right(self._starts, i) - 1
        handle, offsets = self._open(unit)
        try:
            return self._row(handle, offsets, i - self._starts[unit])
        except Exception as error:
            raise _unreadable(shard_path(self.path, unit), error) from error

    def _row(self, handle: Any, offsets: list[int], j: int) -> dict[str, Tensor]:
        start, end = offsets[j], offsets[j + 1]
        features = handle.get_slice("features")[start:end]
        if self.manifest["dtype"] == "fp8":
            features = dequantize_fp8(features, handle.get_slice("scales")[start:end])
        row = {
            "input_ids": handle.get_slice("input_ids")[start:end].long(),
            "loss_mask": handle.get_slice("loss_mask")[start:end].bool(),
            "features": features,
        }
        # Slicing past the end shortens a tensor silently; damaged offsets must not reach training.
        if end <= start or any(len(tensor) != end - start for tensor in row.values()):
            raise ValueError(f"row {j} spans tokens {start}..{end}, beyond its tensors")
        return row

    def __iter__(self) -> Iterator[dict[str, Tensor]]:
        return (self[i] for i in range(len(self)))

    def check_compatible(self, target_layer_ids: Sequence[int], hidden_size: int,
                         target_hash: str | TargetIdentity | None = None, *, tokenizer_hash: str | None = None) -> None:
        """Refuse a store made for other layer ids, another hidden size, or (given their hashes) another
        target or tokenizer. Given a `TargetIdentity`, a target loaded in another dtype than the store's
        is refused as such, with the setting that fixes it."""
        m = self.manifest
        needed = ("target_layer_ids", "hidden_size") + (("target_hash",) if target_hash is not None else ())
        check_manifest(self.path / MANIFEST, m, needed)
        if list(target_layer_ids) != list(m["target_layer_ids"]):
            raise ValueError(f"{self.path}: features of layers {m['target_layer_ids']}, the drafter wants "
                             f"{list(target_layer_ids)}; extract again with --layer-ids or use matching layers")
        if hidden_size != m["hidden_size"]:
            raise ValueError(f"{self.path}: hidden size {m['hidden_size']} != the drafter's {hidden_size}; "
                             f"this store was made for another target")
        if isinstance(target_hash, TargetIdentity):
            self._check_target(target_hash)
        elif target_hash is not None and target_hash != m["target_hash"]:
            raise self._another_target(target_hash)
        if tokenizer_hash is not None and tokenizer_hash != m.get("tokenizer_hash"):
            raise ValueError(f"{self.path}: tokenised with another vocabulary than the loaded target's; prepare "
                             f"and extract again with this target")

    def _check_target(self, target: TargetIdentity) -> None:
        stored_hash = self.manifest["target_hash"]
        stored = self.manifest.get("target_dtype")
        stored_dtype = _DTYPE_NAMES.get(stored, stored) if isinstance(stored, str) else None  # None: not recorded
        loaded_dtype = str(target.dtype).removeprefix("torch.")
        dtype_differs = stored_dtype is not None and stored_dtype != loaded_dtype
        if is_legacy_fingerprint(stored_hash):
            # An older store's hash includes the dtype: comparable only when the dtypes agree.
            same_model = None if dtype_differs else stored_hash == target.legacy_fingerprint
        else:
            same_model = stored_hash == target.fingerprint
        if same_model is False:
            raise self._another_target(target.fingerprint, stored_dtype if dtype_differs else None)
        if dtype_differs:
            cli_name = {v: k for k, v in _DTYPE_NAMES.items()}.get(loaded_dtype, loaded_dtype)
            raise ValueError(f"{self.path}: features were extracted with the target in {stored_dtype}, this run "
                             f"loads it in {loaded_dtype}: set model.target_dtype={stored_dtype} (or extract again "
                             f"with --target-dtype {cli_name})")

    def _another_target(self, loaded_hash: str, stored_dtype: str | None = None) -> ValueError:
        m = self.manifest
        hint = f"; if it is the same model, set model.target_dtype={stored_dtype}" if stored_dtype else ""
        return ValueError(f"{self.path}: made with target {m.get('target')!r} (hash {m['target_hash']}), not the loaded "
                          f"target (hash {loaded_hash}); extract again with this target{hint}")
