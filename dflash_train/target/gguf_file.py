"""Just enough of a GGUF file to refuse a truncated one and to key its conversion by content.

A GGUF file is a header (magic, version, key/value metadata, one record per tensor: name, dims, type,
offset) followed by the aligned tensor data; the header alone says how long the file must be.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import struct
import tempfile
from pathlib import Path
from typing import Any

from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
# Byte sizes of the scalar metadata value types; 8 is a string, 9 an array.
_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY, _UINT32 = 8, 9, 4
_HASH_CHUNK = 8 * 1024 * 1024


class _Truncated(Exception):
    """The header runs past the end of the file."""


class _Cursor:
    """Reads little-endian values from a buffer, refusing to read past its end."""

    def __init__(self, data: Any) -> None:
        self.data, self.at = data, 0

    def take(self, fmt: str) -> tuple[Any, ...]:
        size = struct.calcsize(fmt)
        if self.at + size > len(self.data):
            raise _Truncated
        values = struct.unpack_from(fmt, self.data, self.at)
        self.at += size
        return values

    def skip(self, size: int) -> None:
        if self.at + size > len(self.data):
            raise _Truncated
        self.at += size

    def string(self) -> bytes:
        (length,) = self.take("<Q")
        start = self.at
        self.skip(length)
        return bytes(self.data[start:self.at])

    def value(self, kind: int) -> Any:
        """Reads one metadata value; returns it for a uint32 (all that is needed), else skips it."""
        if kind == _UINT32:
            return self.take("<I")[0]
        if kind in _SCALAR_BYTES:
            self.skip(_SCALAR_BYTES[kind])
        elif kind == _STRING:
            self.string()
        elif kind == _ARRAY:
            item, count = self.take("<IQ")
            if item in _SCALAR_BYTES:
                self.skip(_SCALAR_BYTES[item] * count)
            else:
                for _ in range(count):
                    self.value(item)
        else:
            raise ValueError(f"unknown GGUF metadata type {kind}")
        return None


def gguf_expected_size(path: Path) -> int | None:
    """The size the header of `path` implies (end of its last tensor), or None when it cannot tell (not
    a little-endian GGUF of version 2 or later, or a tensor type this `gguf` package does not know).

    Raises `ValueError` when the header itself is cut short or is no GGUF header.
    """
    size = path.stat().st_size
    if size == 0:
        raise ValueError(f"{path} is empty; download or copy the GGUF file again")
    with path.open("rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
        if data[:4] != GGUF_MAGIC:
            raise ValueError(f"{path} is not a GGUF file (it does not start with 'GGUF'); pass a .gguf model file")
        try:
            return _expected_size(_Cursor(data))
        except _Truncated:
            raise ValueError(f"{path} is truncated: it ends inside its header ({size:,} bytes); download or copy "
                             f"the GGUF file again") from None


def _expected_size(cursor: _Cursor) -> int | None:
    cursor.skip(4)
    (version,) = cursor.take("<I")
    if version < 2 or version & 0xFFFF == 0:  # version 1, or a big-endian file: not worth reading here
        return None
    tensor_count, kv_count = cursor.take("<QQ")
    alignment = DEFAULT_ALIGNMENT
    for _ in range(kv_count):
        key = cursor.string()
        (kind,) = cursor.take("<I")
        value = cursor.value(kind)
        if key == b"general.alignment" and value:
            alignment = value
    data_end = 0
    for _ in range(tensor_count):
        cursor.string()
        (dims_count,) = cursor.take("<I")
        dims = cursor.take(f"<{dims_count}Q")
        kind, offset = cursor.take("<IQ")
        nbytes = _tensor_bytes(kind, dims)
        if nbytes is None:
            return None
        data_end = max(data_end, offset + nbytes)
    data_start = -(-cursor.at // alignment) * alignment
    return data_start + data_end


def _tensor_bytes(kind: int, dims: tuple[int, ...]) -> int | None:
    try:
        block, type_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
    except (ValueError, KeyError):
        return None
    elements = 1
    for dim in dims:
        elements *= dim
    return elements * type_bytes // block


def check_gguf_whole(path: Path) -> None:
    """Refuse a GGUF file shorter than its header says, naming it and both sizes."""
    expected = gguf_expected_size(path)
    size = path.stat().st_size
    if expected is not None and size < expected:
        raise ValueError(f"{path} is truncated: {size:,} of {expected:,} bytes ({expected - size:,} missing); "
                         f"download or copy the GGUF file again")


def content_digest(path: Path, memo_dir: Path) -> str:
    """The sha256 of `path`'s bytes. Remembered in `memo_dir` per (path, size, mtime, inode), so a file
    is read in full once, not on every load; a copy of it elsewhere gets the same digest."""
    stat = path.stat()
    resolved = str(path.resolve())
    identity = {"file": resolved, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "inode": stat.st_ino}
    memo = memo_dir / f"{hashlib.sha256(resolved.encode()).hexdigest()[:16]}.json"
    try:
        saved = json.loads(memo.read_text())
        if saved.get("identity") == identity and isinstance(saved.get("sha256"), str):
            return saved["sha256"]
    except (OSError, ValueError, AttributeError):
        pass
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(_HASH_CHUNK):
            digest.update(chunk)
    _write_atomically(memo, json.dumps({"identity": identity, "sha256": digest.hexdigest()}))
    return digest.hexdigest()


def _write_atomically(path: Path, text: str) -> None:
    # Processes hashing the same file write the same memo; a rename never shows a half-written one.
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
