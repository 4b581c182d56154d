"""A target's fingerprint: what feature stores and checkpoints record of the target they were made with,
and what a loaded target is checked against before they are used with it."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import torch

# Fingerprints since weights are hashed independently of their dtype carry this prefix; older stores and
# checkpoints hold a bare 16-digit hash of the weights as loaded (dtype included).
FINGERPRINT_PREFIX = "v2-"


def target_fingerprint(model: torch.nn.Module) -> str:
    """A hash of the target's config and weights that names the model, not the dtype it is loaded in:
    every tensor's name and shape, and up to 1024 evenly strided values of each rounded through bfloat16,
    so the same target loaded in bfloat16 or float32 has one fingerprint. Cheap enough for 8B models."""
    return FINGERPRINT_PREFIX + _weights_digest(model, with_dtype=False)


def legacy_target_fingerprint(model: torch.nn.Module) -> str:
    """The fingerprint that stores and checkpoints recorded before `target_fingerprint` dropped the
    dtype: it hashed the weights as loaded, dtype included. Kept to read those stores."""
    return _weights_digest(model, with_dtype=True)


def is_legacy_fingerprint(value: object) -> bool:
    return isinstance(value, str) and not value.startswith(FINGERPRINT_PREFIX)


def _weights_digest(model: torch.nn.Module, with_dtype: bool) -> str:
    config = model.config.to_dict()
    for volatile in ("_name_or_path", "name_or_path", "transformers_version", "torch_dtype", "dtype"):
        config.pop(volatile, None)
    digest = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode())
    for name, tensor in sorted(model.state_dict().items()):
        flat = tensor.detach().reshape(-1)
        sample = flat[:: max(1, flat.numel() // 1024)][:1024].float().cpu()
        if with_dtype:
            digest.update(f"{name}{tuple(tensor.shape)}{tensor.dtype}".encode())
            digest.update(sample.numpy().tobytes())
        else:
            # float32 -> bfloat16 rounds the same way whatever the source, so bf16 and fp32 copies agree.
            digest.update(f"{name}{tuple(tensor.shape)}".encode())
            digest.update(sample.to(torch.bfloat16).view(torch.int16).numpy().tobytes())
    return digest.hexdigest()[:16]


@dataclass(frozen=True)
class TargetIdentity:
    """What a feature store is checked against: the loaded target's fingerprint, the dtype it is loaded
    in, and its legacy fingerprint (for stores written before fingerprints ignored the dtype)."""

    fingerprint: str
    dtype: torch.dtype
    legacy_fingerprint: str


def target_identity(model: torch.nn.Module) -> TargetIdentity:
    # The embedding's dtype is the one the target was loaded in (some models keep a few tensors in fp32).
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    dtype = embeddings.weight.dtype if embeddings is not None else next(model.parameters()).dtype
    return TargetIdentity(target_fingerprint(model), dtype, legacy_target_fingerprint(model))
