"""Which Hugging Face attention a target's forward uses, switched for the length of a `with` block: the
static-cache runtime's own attention for Hugging Face layers (`runtime/cache_attention.py`), and flex or
varlen attention for packed training rows (`features/packed_attention.py` says which, and why). The
switch is process-wide for that model: every attention layer and the mask code read the one config
attribute.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn


def _configs(model: nn.Module) -> list[object]:
    """The distinct config objects the model's modules read (a multimodal model has several)."""
    found = {id(model.config): model.config}
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "_attn_implementation"):
            found.setdefault(id(config), config)
    return list(found.values())


@contextmanager
def attention_implementation(model: nn.Module, name: str | None) -> Iterator[None]:
    """Within: the model's attention layers and mask code use Hugging Face attention `name` ("sdpa",
    "flex_attention", ...); None changes nothing. The previous choice is restored on the way out."""
    if name is None:
        yield
        return
    configs = _configs(model)
    saved = [config._attn_implementation for config in configs]  # type: ignore[attr-defined]
    for config in configs:
        config._attn_implementation = name  # type: ignore[attr-defined]
    try:
        yield
    finally:
        for config, previous in zip(configs, saved, strict=True):
            config._attn_implementation = previous  # type: ignore[attr-defined]
