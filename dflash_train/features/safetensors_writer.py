"""Write a safetensors file from tensors given in parts, with no concatenation and no extra copy.

The format: an 8-byte little-endian header length, a JSON header (dtype, shape, byte offsets of each
tensor; optional string metadata), padded with spaces to a multiple of 8, then the raw bytes. Each part
is handed to ``write`` as a buffer of its own memory, so a file of many rows is written straight from
the (pinned) host tensors they landed in; large writes release the GIL, so writer threads overlap the
GPU work of the main thread (one thread per file: concurrent writes into one file queue behind its lock).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import torch
from torch import Tensor

DTYPE_NAMES = {
    torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.float8_e4m3fn: "F8_E4M3",
    torch.int64: "I64", torch.int32: "I32", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
}


def write_safetensors(path: Path, tensors: dict[str, list[Tensor]], metadata: dict[str, str]) -> None:
    """``tensors[name]`` is a list of parts concatenated along dim 0 (same dtype and trailing shape)."""
    header: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for name, parts in tensors.items():
        first = parts[0]
        rows = sum(part.shape[0] for part in parts)
        size = sum(part.numel() * part.element_size() for part in parts)
        header[name] = {"dtype": DTYPE_NAMES[first.dtype], "shape": [rows, *first.shape[1:]],
                        "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(encoded)))
        f.write(encoded)
        for parts in tensors.values():
            for part in parts:
                f.write(part.contiguous().view(torch.uint8).reshape(-1).numpy().data)
