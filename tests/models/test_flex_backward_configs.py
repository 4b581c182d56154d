"""Inductor's flex backward candidates fitted to 64-token masks: a config added only where none fits, and the
change made once to the class inductor asks (the lowering itself needs a GPU: benchmarks/flex_tiles.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dflash_train.models import flex_backward_configs as fit
from dflash_train.models.attention import SMALL_TILE_KERNEL_OPTIONS


@dataclasses.dataclass
class Config:  # the fields of inductor's FlexBwDConfig
    block_m1: int
    block_n1: int
    block_m2: int
    block_n2: int
    num_stages: int
    num_warps: int


def filtered(configs: list[Config], mask_tile: int) -> list[Config]:
    """Inductor's filter: the candidates whose four backward tiles divide the mask's tile."""
    return [c for c in configs if all(mask_tile % getattr(c, n) == 0 for n in fit.SMALL_BACKWARD_TILES)]


def test_a_config_fitting_64_is_added_only_where_none_fits() -> None:
    hopper = [Config(64, 128, 128, 64, 3, 8)]  # inductor's default on H100/H200 at head dimension 64
    assert filtered(hopper, 64) == []  # why 64-token masks failed to lower
    added = fit.with_small_tile_config(hopper)
    assert added[0] == hopper[0] and len(added) == 2
    assert filtered(added, 64) == [added[1]] and added[1].num_stages == 3
    assert filtered(added, 128) == added  # a 128-token mask keeps its own candidate, beside the new one
    small = [Config(64, 64, 64, 64, 3, 4)]
    assert fit.with_small_tile_config(small) == small  # one fits already: nothing added
    assert fit.with_small_tile_config([]) == [] and fit.with_small_tile_config([object()]) != []


def test_the_added_tiles_keep_the_kernels_constraints_and_the_trainers_options() -> None:
    t = fit.SMALL_BACKWARD_TILES
    assert t["block_n1"] % t["block_m1"] == 0 and t["block_m2"] % t["block_n2"] == 0
    assert {f"bwd_BLOCK_{k[6:].upper()}": v for k, v in t.items()} == {
        k: v for k, v in SMALL_TILE_KERNEL_OPTIONS.items() if k.startswith("bwd_")}


def test_the_fit_is_made_once_on_inductors_class(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch._inductor.choices import InductorChoices

    calls: list[int] = []

    def hopper_defaults(self: object, head_dim: int, dtype: torch.dtype, device_type: str = "cuda") -> list[Config]:
        calls.append(head_dim)
        return [Config(64, 128, 128, 64, 3, 8)]

    monkeypatch.setattr(InductorChoices, "get_flex_attention_bwd_configs", hopper_defaults)
    assert fit.fit_backward_configs_to_small_tiles() and fit.fit_backward_configs_to_small_tiles()
    configs = InductorChoices().get_flex_attention_bwd_configs(64, torch.bfloat16, "cuda")
    assert len(configs) == 2 and filtered(configs, 64) == [configs[1]]
    assert calls == [64]  # wrapped once: the second call found its own wrapper
