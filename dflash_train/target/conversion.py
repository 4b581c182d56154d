"""A GGUF target converted once into a safetensors directory and loaded from there: dequantising the GGUF on
every load is ten times slower. Conversions live under ``$DFLASH_TRAIN_CACHE/targets`` (else
``~/.cache/dflash_train/targets``), named after the file's content."""

from __future__ import annotations

import copy
import fcntl
import functools
import json
import logging
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from dflash_train.atomic import replace_dir, staging_dir
from dflash_train.json_files import json_object_or_none
from dflash_train.safetensors_io import damaged_safetensors
from dflash_train.target.gguf_file import check_gguf_whole, content_digest

try:  # transformers releases that can keep GGUF weights packed have it; older ones always dequantise
    from transformers import GgufConfig
except ImportError:
    GgufConfig = None  # type: ignore[assignment,misc]
try:  # where transformers keeps it since 5.0; before, in modeling_utils
    from transformers.initialization import no_init_weights
except ImportError:
    from transformers.modeling_utils import no_init_weights  # type: ignore[no-redef,attr-defined]

logger = logging.getLogger(__name__)

CONVERSION_MARKER = "dflash_train_source.json"
# bf16 and float32 copies come from one float32 dequantisation (a bf16 load rounds the same float32 values, so
# the copies are those of two conversions) and are written together while the float32 copy is small: reading
# the GGUF is most of a conversion, dequantising a small part (docs/data.md, 'Targets').
PAIRED_DTYPES = (torch.bfloat16, torch.float32)
PAIRED_MAX_FP32_BYTES = 4 << 30
# Held while `gguf`'s reader and name map are swapped (`_gguf_parsed_once`): two threads loading at once would
# otherwise restore each other's swap and could leave one installed.
_GGUF_SWAP = threading.Lock()
# Content digests of GGUF files, remembered per file so that a large file is read in full only once.
DIGESTS_DIR = "gguf-digests"


def default_targets_cache_dir() -> Path:
    return Path(os.environ.get("DFLASH_TRAIN_CACHE") or "~/.cache/dflash_train").expanduser() / "targets"


def _cache_root(cache_dir: str | None) -> Path:
    return Path(cache_dir).expanduser() if cache_dir else default_targets_cache_dir()


def converted_gguf_dir(
    gguf_path: Path, dtype: torch.dtype = torch.bfloat16, cache_dir: str | None = None
) -> Path:
    """Where the converted copy of ``gguf_path`` lives: named by the file's content digest (non-bf16
    copies get their dtype in the name), so every copy of one file, in any clone, shares one conversion
    and different files never evict each other's."""
    root = _cache_root(cache_dir)
    digest = content_digest(gguf_path, root / DIGESTS_DIR)
    return root / f"{digest[:24]}{_dtype_suffix(dtype)}"


def _dtype_suffix(dtype: torch.dtype) -> str:
    return "" if dtype == torch.bfloat16 else f"-{str(dtype).removeprefix('torch.')}"


def _sibling_dir(out_dir: Path, dtype: torch.dtype, other: torch.dtype) -> Path:
    """The conversion folder of the same file in `other` dtype, next to `out_dir` (its `dtype` copy)."""
    stem = out_dir.name.removesuffix(_dtype_suffix(dtype)) if _dtype_suffix(dtype) else out_dir.name
    return out_dir.with_name(stem + _dtype_suffix(other))


def ensure_converted_gguf(
    gguf_path: Path, dtype: torch.dtype = torch.bfloat16, cache_dir: str | None = None
) -> Path:
    """The cached safetensors copy of ``gguf_path``, converting it first if there is none (or it is damaged).

    A conversion is published whole by a rename and never removed while whole: processes loading it
    from other clones are never pulled out from under. Conversions of files no longer used stay; delete
    the cache directory to reclaim them.
    """
    out_dir = converted_gguf_dir(gguf_path, dtype, cache_dir)
    marker = _source_marker(out_dir, dtype)
    if _is_converted(out_dir, marker):
        return out_dir
    with _exclusive(out_dir.parent):  # processes started together convert once
        if _is_converted(out_dir, marker):
            return out_dir
        check_gguf_whole(gguf_path)
        logger.info("Converting %s to %s once; later loads read the converted copy.", gguf_path, out_dir)
        paired = dtype in PAIRED_DTYPES
        model, tokenizer = load_gguf(gguf_path, torch.float32 if paired else dtype)
        wanted = [dtype]
        if paired and 4 * model.num_parameters() <= PAIRED_MAX_FP32_BYTES:
            wanted = list(PAIRED_DTYPES)
        for each in wanted:
            each_dir = _sibling_dir(out_dir, dtype, each)
            each_marker = _source_marker(each_dir, each)
            if each == dtype or not _is_converted(each_dir, each_marker):
                _save_atomically(_dense_copy(model, each), tokenizer, each_dir,
                                 {**each_marker, "converted_from": gguf_path.name})
    return out_dir


def existing_conversion(gguf_path: Path, cache_dir: str | None = None) -> Path | None:
    """The whole bf16 conversion of ``gguf_path`` if one is cached, else None; converts nothing."""
    out_dir = converted_gguf_dir(gguf_path, torch.bfloat16, cache_dir)
    return out_dir if _is_converted(out_dir, _source_marker(out_dir, torch.bfloat16)) else None


@contextmanager
def _exclusive(directory: Path) -> Iterator[None]:
    """An exclusive lock on a directory (flock on its descriptor: no lock file to leave behind)."""
    directory.mkdir(parents=True, exist_ok=True)
    fd = os.open(directory, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def load_gguf(
    gguf_path: Path, dtype: torch.dtype = torch.bfloat16
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a ``.gguf`` file directly, with every weight dequantised to ``dtype``."""
    directory, name = str(gguf_path.parent), gguf_path.name
    with _gguf_parsed_once():
        model = AutoModelForCausalLM.from_pretrained(
            directory, gguf_file=name, dtype=dtype, **_dequantize_kwargs()
        )
        tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    return model, tokenizer


@contextmanager
def _gguf_parsed_once() -> Iterator[None]:
    """One reading of the file's metadata and one tensor-name map per load, where transformers parses the
    whole header three times (config, weights, tokenizer: the vocabulary's strings one numpy view each) and
    rebuilds gguf's name map for every tensor; most of a small model's conversion went to those. transformers
    imports both from the `gguf` module when it needs them, so they are swapped there, and only while loading:
    the file does not change meanwhile and both are read-only."""
    try:
        import gguf
    except ImportError:  # transformers says what to install when it needs gguf
        yield
        return
    readers: dict[tuple[str, str], Any] = {}

    def shared_reader(path: str | os.PathLike[str], mode: str = "r") -> Any:
        key = (os.fspath(path), mode)
        if key not in readers:
            readers[key] = real_reader(path, mode)
        return readers[key]

    with _GGUF_SWAP:
        real_reader, real_name_map = gguf.GGUFReader, gguf.get_tensor_name_map
        gguf.GGUFReader, gguf.get_tensor_name_map = shared_reader, functools.cache(real_name_map)
        try:
            yield
        finally:
            gguf.GGUFReader, gguf.get_tensor_name_map = real_reader, real_name_map


def _dequantize_kwargs() -> dict[str, Any]:
    # Recent transformers keep GGUF weights packed when a matmul kernel is available; the cache must hold
    # plain dense weights, so ask for dequantisation wherever that option exists.
    return {} if GgufConfig is None else {"quantization_config": GgufConfig(dequantize=True)}


def _dense_copy(model: PreTrainedModel, dtype: torch.dtype) -> PreTrainedModel:
    """A plain model with the same weights: ``save_pretrained`` refuses models loaded from GGUF."""
    config = copy.deepcopy(model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with no_init_weights():  # every weight is overwritten next: a random initialisation first is wasted time
        dense = type(model)._from_config(config, dtype=dtype)
    dense.tie_weights()  # which transformers does inside the initialisation just skipped
    dense.load_state_dict(model.state_dict())
    dense.generation_config = copy.deepcopy(model.generation_config)
    return dense


def _source_marker(out_dir: Path, dtype: torch.dtype) -> dict[str, Any]:
    # The folder name holds the content digest; the marker repeats it with the dtype, and goes in last.
    return {"content": out_dir.name, "dtype": str(dtype)}


def _is_converted(out_dir: Path, marker: dict[str, Any]) -> bool:
    """Whether `out_dir` holds a whole conversion for `marker` (its weights files are not truncated)."""
    saved = json_object_or_none(out_dir / CONVERSION_MARKER)
    if saved is None or any(saved.get(key) != value for key, value in marker.items()):
        return False
    damaged = damaged_safetensors(out_dir)
    if damaged:
        logger.warning("The converted copy %s is damaged (%s); converting again.", damaged[0][0], damaged[0][1])
    return not damaged


def _save_atomically(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, out_dir: Path, marker: dict[str, Any]
) -> None:
    # Written to a sibling temp dir and renamed, so an interrupted conversion never leaves a half-written
    # directory that a later load would trust. The marker goes in last for the same reason.
    with staging_dir(out_dir) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / CONVERSION_MARKER).write_text(json.dumps(marker))
        # An existing copy is damaged (the caller holds the lock and found no whole one): it is of no use to
        # anyone, so it is replaced whole.
        replace_dir(tmp, out_dir)
