"""Forwards over batches whose rows are never packed, without Hugging Face's per-forward packing check.

On every forward with no attention mask and no cache, Hugging Face's mask code asks whether the position
ids describe several sequences packed into one row (``find_packed_sequence_indices``), and answers with
``.all()`` on a GPU tensor: a host sync. The sync drains the GPU's queue once per forward, so while the host
then prepares the next batch (and launches its first kernels) the GPU idles; for a small target that is a
tenth of extraction's time. Our captures pass one sequence per row, for which the check answers ``None``
("not packed"), so inside :func:`rows_not_packed` it answers that without looking. Packed training passes
per-chat position ids and runs outside it: there the check finds the chats and keeps each to itself. Nothing else in the mask
code changes: causal, sliding-window and padding masks are built as before. The answer holds for the
whole process while a capture runs: a forward on packed rows in another thread at the same moment would
need its own attention mask.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

_CHECK = "find_packed_sequence_indices"
_lock = threading.Lock()
_depth = 0
_original: Any = None


def _not_packed(position_ids: Any) -> None:
    return None


@contextmanager
def rows_not_packed() -> Iterator[None]:
    """Within: Hugging Face treats every row as one sequence without checking (re-entrant)."""
    global _depth, _original
    module = sys.modules.get("transformers.masking_utils")
    if module is None or not hasattr(module, _CHECK):  # another transformers version: nothing to skip
        yield
        return
    with _lock:
        if _depth == 0:
            _original = getattr(module, _CHECK)
            setattr(module, _CHECK, _not_packed)
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                setattr(module, _CHECK, _original)
