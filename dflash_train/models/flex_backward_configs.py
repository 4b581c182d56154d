"""Flex attention's backward for masks of 64-token tiles: a kernel config inductor can keep for them.

Why: inductor lowers flex attention's backward by filtering its candidate kernel configs to those whose tiles
divide the mask's, and only then applies the caller's tile options (`bwd_BLOCK_*`). Without max-autotune the
candidates are one default per GPU generation; on H100 and H200 at head dimension 64 its tiles are up to 128,
so for a 64-token mask none is left and the lowering fails ("NoValidChoicesError: No choices to select"),
whatever tile options the caller passed (docs/benchmarks.md, `flex_tiles`). Appending, when no candidate
fits, a copy of the default whose tiles divide 64 leaves the caller's options a config to apply to.

The change is to inductor's `InductorChoices` class, so it holds in every thread (the backward is compiled on
autograd's), for the rest of the process; it is made only once a 64-token mask asks for it, and only adds a
candidate where none fits 64. A mask of 128-token tiles compiled after it has two candidates that fit, which
inductor times against each other at compile time, keeping the faster.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

SMALL_TILE = 64
# The backward's tiles for 64-token masks: they divide 64 and keep the kernel's own constraints
# (BLOCK_N1 % BLOCK_M1 == 0, BLOCK_M2 % BLOCK_N2 == 0).
SMALL_BACKWARD_TILES = {"block_m1": 32, "block_n1": 64, "block_m2": 64, "block_n2": 32}
SMALL_TILE_WARPS = {"num_warps": 4}  # half of the 128-tile default's 8 on H100: a quarter of the tile's work
_MARK = "_dflash_fits_small_tiles"


def fits(config: Any, tile: int = SMALL_TILE) -> bool:
    """Whether every backward tile of `config` divides `tile`."""
    return all(tile % getattr(config, name) == 0 for name in SMALL_BACKWARD_TILES)


def with_small_tile_config(configs: list[Any]) -> list[Any]:
    """`configs`, plus a copy of the last with `SMALL_BACKWARD_TILES` when none fits a 64-token mask; unchanged
    when one does, or when the configs are not the dataclasses with backward tiles this expects."""
    if not configs or not all(dataclasses.is_dataclass(c) and all(hasattr(c, n) for n in SMALL_BACKWARD_TILES)
                              for c in configs):
        return configs
    if any(fits(config) for config in configs):
        return configs
    return [*configs, dataclasses.replace(configs[-1], **SMALL_BACKWARD_TILES, **SMALL_TILE_WARPS)]


def fit_backward_configs_to_small_tiles() -> bool:
    """Makes inductor's flex backward candidates include one for 64-token masks (once per process). -> whether
    this torch has the hook it changes (False: nothing changed, and 64-token tiles may not lower)."""
    try:
        from torch._inductor.choices import InductorChoices
    except ImportError:
        return False
    original: Callable[..., list[Any]] | None = getattr(InductorChoices, "get_flex_attention_bwd_configs", None)
    if original is None:
        return False
    if getattr(original, _MARK, False):
        return True

    def bwd_configs(self: Any, *args: Any, **kwargs: Any) -> list[Any]:
        return with_small_tile_config(original(self, *args, **kwargs))

    setattr(bwd_configs, _MARK, True)
    InductorChoices.get_flex_attention_bwd_configs = bwd_configs  # type: ignore[method-assign]
    return True
