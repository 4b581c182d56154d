"""Safetensors files read without trusting them: a truncated or corrupt file is one `DamagedFileError`
naming the file and what to do, never a `SafetensorError` traceback.

Drafters, training checkpoints, local targets and the target conversion cache are all read through
`open_safetensors` or `safetensors_damage`; the module sits below both `checkpoint` and `target` so that
either can use it without importing the other.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from safetensors import SafetensorError, safe_open

from dflash_train.errors import first_line

DRAFT_ADVICE = "copy or export that checkpoint again"
_HEADER_BYTES = 8  # little-endian u64: the length of the JSON header that follows


class DamagedFileError(ValueError):
    """A weights file that cannot be read (truncated or corrupt); the message names it and what to do."""

    def __init__(self, path: Path, damage: str, advice: str) -> None:
        super().__init__(f"{path} is damaged ({damage}); {advice}")
        self.path = path
        self.damage = damage


def safetensors_damage(path: Path) -> str | None:
    """Why `path` is not a whole safetensors file (truncated, corrupt header), or None when it is.

    Reads the header only: the sizes it declares must cover the file exactly, which is what an
    interrupted copy or write breaks. Flipped bits inside tensor data are not detectable this way.
    """
    size = path.stat().st_size
    if size < _HEADER_BYTES:
        return f"truncated: {size} bytes, shorter than a safetensors header"
    with path.open("rb") as handle:
        header_bytes = int.from_bytes(handle.read(_HEADER_BYTES), "little")
        if _HEADER_BYTES + header_bytes > size:
            return f"truncated or not safetensors: its header claims {header_bytes:,} bytes, the file has {size:,}"
        try:
            header = json.loads(handle.read(header_bytes))
            end = max((int(entry["data_offsets"][1]) for key, entry in header.items() if key != "__metadata__"),
                      default=0)
        except (ValueError, TypeError, KeyError, IndexError, AttributeError):
            return "corrupt header"
    expected = _HEADER_BYTES + header_bytes + end
    if size < expected:
        return f"truncated: {size:,} of {expected:,} bytes"
    if size > expected:
        return f"corrupt: {size - expected:,} bytes past its last tensor"
    return None


@contextmanager
def open_safetensors(path: Path, advice: str = DRAFT_ADVICE) -> Iterator[Any]:
    """`safe_open(path)`, with a damaged file, found up front or while reading, as a `DamagedFileError`."""
    damage = safetensors_damage(path)
    if damage is not None:
        raise DamagedFileError(path, damage, advice)
    try:
        with safe_open(str(path), framework="pt") as handle:
            yield handle
    except SafetensorError as error:
        raise DamagedFileError(path, first_line(error), advice) from error


def damaged_safetensors(directory: Path, recursive: bool = False) -> list[tuple[Path, str]]:
    """(file, damage) for every damaged ``*.safetensors`` file in `directory` (headers only: cheap)."""
    files = directory.rglob("*.safetensors") if recursive else directory.glob("*.safetensors")
    found = ((path, safetensors_damage(path)) for path in sorted(files) if path.is_file())
    return [(path, damage) for path, damage in found if damage is not None]
