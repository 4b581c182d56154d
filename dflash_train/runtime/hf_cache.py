"""Target KV-cache calls that work across transformers 4.57 and 5.x."""

from __future__ import annotations

import inspect
from typing import Any

from torch import nn


def cache_kwargs(model: nn.Module, cache: Any) -> dict[str, Any]:
    """Newer transformers name the argument `cache`, older ones `past_key_values`."""
    params = inspect.signature(model.forward).parameters
    name = "cache" if "cache" in params else "past_key_values"
    return {name: cache, "use_cache": True}


def rollback(cache: Any, length: int) -> None:
    """Drop cached positions >= length. A negative `crop` argument means "remove this many" on every
    version (positive arguments changed meaning in transformers 5)."""
    excess = cache.get_seq_length() - length
    if excess < 0:
        raise ValueError(f"cannot roll a target cache of length {cache.get_seq_length()} forward to {length}")
    if excess:
        cache.crop(-excess)
