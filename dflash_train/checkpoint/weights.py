"""Reading and writing drafter weights as safetensors: one file, or shards plus an index.

Layout written (the Hugging Face convention, which every runtime reads):

    model.safetensors                                   when the weights fit in one shard
    model-00001-of-0000N.safetensors ...                otherwise, with
    model.safetensors.index.json                        {"metadata": {"total_size"}, "weight_map": {name: file}}

Every file is opened through `safetensors_io.open_safetensors`, so a damaged one is one `DamagedFileError`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from dflash_train.atomic import PUBLISHED_FILE_MODE
from dflash_train.safetensors_io import open_safetensors

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# transformers' own default shard size; a Qwen3-8B drafter (~2 GB in bf16) stays in one file.
DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3


@dataclass(frozen=True)
class TensorInfo:
    dtype: str  # safetensors dtype name: "BF16", "F32", ...
    shape: tuple[int, ...]
    file: str


def weight_files(directory: Path) -> dict[str, str] | None:
    """{tensor name -> file name} from the index, {"*": single file}, or None when there are no weights."""
    index = directory / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError) as error:
            raise ValueError(f"{index} is not a valid safetensors index ({error}); re-export the checkpoint") from error
        return {str(name): str(file) for name, file in weight_map.items()}
    if (directory / SINGLE_FILE).is_file():
        return {"*": SINGLE_FILE}
    return None


def _files_in(directory: Path) -> list[str]:
    files = weight_files(directory)
    if files is None:
        raise ValueError(f"{directory} holds no {SINGLE_FILE} nor {INDEX_FILE}; point at a drafter checkpoint")
    names = sorted(set(files.values()))
    absent = [name for name in names if not (directory / name).is_file()]
    if absent:
        raise ValueError(f"{directory} lacks the weight shards {absent} listed in {INDEX_FILE}; copy them back")
    return names


def read_tensor_infos(directory: Path) -> dict[str, TensorInfo]:
    """Names, dtypes and shapes of every stored tensor, from the safetensors headers (no data is read)."""
    infos: dict[str, TensorInfo] = {}
    for name in _files_in(directory):
        with open_safetensors(directory / name) as handle:
            for key in handle.keys():  # noqa: SIM118 - safe_open handles are not iterable
                piece = handle.get_slice(key)
                infos[key] = TensorInfo(piece.get_dtype(), tuple(piece.get_shape()), name)
    return infos


def read_tensors(directory: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for name in _files_in(directory):
        with open_safetensors(directory / name) as handle:
            for key in handle.keys():  # noqa: SIM118
                tensors[key] = handle.get_tensor(key)
    return tensors


def write_tensors(
    tensors: dict[str, torch.Tensor], directory: Path, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES
) -> list[str]:
    """Write `tensors` (in name order) to `directory`; returns the files written."""
    shards = _plan_shards(tensors, max_shard_bytes)
    metadata = {"format": "pt"}  # transformers refuses safetensors files without it
    if len(shards) == 1:
        _save(_contiguous(tensors, shards[0]), directory / SINGLE_FILE, metadata)
        return [SINGLE_FILE]
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map: dict[str, str] = {}
    for file, keys in zip(names, shards, strict=True):
        _save(_contiguous(tensors, keys), directory / file, metadata)
        weight_map |= dict.fromkeys(keys, file)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return [*names, INDEX_FILE]


def _plan_shards(tensors: dict[str, torch.Tensor], max_shard_bytes: int) -> list[list[str]]:
    shards: list[list[str]] = [[]]
    size = 0
    for key in sorted(tensors):
        nbytes = tensors[key].numel() * tensors[key].element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(key)
        size += nbytes
    return shards


def _save(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str]) -> None:
    """One safetensors file, readable by all like the export's other files: safetensors writes through a
    private (0600) temporary file, whose mode the renamed file would keep."""
    save_file(tensors, str(path), metadata=metadata)
    path.chmod(PUBLISHED_FILE_MODE)


def _contiguous(tensors: dict[str, torch.Tensor], keys: list[str]) -> dict[str, torch.Tensor]:
    # safetensors refuses non-contiguous views.
    return {key: tensors[key].detach().to("cpu").contiguous() for key in keys}
