"""The drafter trains under per-layer sharding (FSDP2 `fully_shard` on every decoder layer, as the FSDP2
launch config wraps it): a sharded layer's weights exist only inside its own forward, so the context K/V
must be projected there. Checked against the same drafter unsharded, on one gloo process."""

from __future__ import annotations

import copy
import pathlib

import pytest
import torch
import torch.distributed as dist

from tests.helpers.tiny_drafts import tiny_draft


@pytest.fixture
def process_group(tmp_path: pathlib.Path):  # type: ignore[no-untyped-def]
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_per_layer_sharded_drafter_equals_the_unsharded_one(process_group: None, compiled: bool) -> None:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    plain = tiny_draft(seed=3)
    sharded = copy.deepcopy(plain)
    for layer in sharded.layers:
        fully_shard(layer)
    fully_shard(sharded)
    assert isinstance(sharded.layers[0].self_attn.k_proj.weight, DTensor)  # really sharded between forwards
    if compiled:  # as the trainer does: each layer compiled after sharding
        sharded.compile_layers()
    gen = torch.Generator().manual_seed(0)
    c, k, q = 10, plain.config.num_context_features, 8
    inputs = (torch.randn(2, q, 32, generator=gen), torch.arange(c, c + q).repeat(2, 1),
              torch.randn(2, c, k * 32, generator=gen), torch.arange(c).repeat(2, 1), None)
    expected, got = plain(*inputs), sharded(*inputs)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    expected.square().sum().backward()
    got.square().sum().backward()
    for (name, p), (_, s) in zip(plain.named_parameters(), sharded.named_parameters(), strict=True):
        torch.testing.assert_close(s.grad.full_tensor(), p.grad, rtol=1e-5, atol=1e-6, msg=name)
