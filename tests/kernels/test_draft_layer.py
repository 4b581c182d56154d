"""The drafter's block layers on the Triton kernels (`dflash_train.runtime.draft_layer`) against the drafter's own
forward with the dense mask (fp32, tiny target; kernels interpreted on CPU): the same hidden states for
blocks at per-row positions, with a context that the block's own K/V never leak into."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dflash_train.runtime import fused_layer
from dflash_train.runtime.draft_layer import supported
from dflash_train.runtime.engine import DecodeEngine, EngineConfig
from dflash_train.runtime.static_draft import StaticDrafter
from tests.helpers.decoding import make_draft
from tests.helpers.draft_blocks import blocks_through
from tests.helpers.kernels import DEVICE, kernels_here, under_interpreter
from tests.helpers.tiny_models import make_tiny_target

test_under_interpreter = under_interpreter(__file__)


@kernels_here
@pytest.mark.parametrize(("fused_products", "prologue_in_product"), [(False, True), (True, True), (True, False)])
def test_kernel_layers_equal_the_drafters_own_forward(fused_products: bool, prologue_in_product: bool,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """With `fused_products`: the layers on the fused products and the context's fc, norm and K/V product on
    the skinny kernels, every block and context write of few rows; the q/k/v product with the prologue in
    its epilogue (`qkv_rope_cache`), or, as for a weight over `PROLOGUE_IN_PRODUCT_MAX_BYTES`, the normed
    product (`skinny_fused`) and then the prologue kernel."""
    if not prologue_in_product:
        monkeypatch.setattr(fused_layer, "PROLOGUE_IN_PRODUCT_MAX_BYTES", 0)
    torch.set_num_threads(1)
    kernel_hidden, kernel_drafter = blocks_through("kernel", fused_products)
    assert all(layer.fused_products == fused_products for layer in kernel_drafter.layer_kernels)
    sdpa_hidden, sdpa_drafter = blocks_through("sdpa")
    assert kernel_drafter.attention == "kernel" and sdpa_drafter.attention == "sdpa"
    for ours, reference in zip(kernel_hidden, sdpa_hidden, strict=True):
        torch.testing.assert_close(ours, reference, atol=2e-5, rtol=1e-5)
    # After each verify's write the caches hold the same context: the block's own K/V were overwritten.
    torch.testing.assert_close(kernel_drafter.cache.keys, sdpa_drafter.cache.keys, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(kernel_drafter.cache.values, sdpa_drafter.cache.values, atol=1e-5, rtol=1e-5)


@kernels_here
def test_plain_products_on_the_skinny_kernel_equal_the_drafters_own_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    """With every weight on the skinny-matmul kernel (`skinny_shapes=None`, the runner's "skinny" matmul), each
    kernel layer's four products of a block run on it, and the layers still compute the drafter's forward."""
    torch.set_num_threads(1)
    shapes: list[tuple[int, ...]] = []
    kernel = fused_layer.skinny_matmul_triton

    def counted(x: torch.Tensor, weight: torch.Tensor, *args: object) -> torch.Tensor:
        shapes.append(tuple(weight.shape))
        return kernel(x, weight, *args)

    monkeypatch.setattr(fused_layer, "skinny_matmul_triton", counted)
    kernel_hidden, drafter = blocks_through("kernel", skinny_shapes=None)
    sdpa_hidden, _ = blocks_through("sdpa")
    for ours, reference in zip(kernel_hidden, sdpa_hidden, strict=True):
        torch.testing.assert_close(ours, reference, atol=2e-5, rtol=1e-5)
    layers = drafter.layer_kernels
    assert len(shapes) == 3 * 4 * len(layers)  # three blocks, four products a layer
    first = layers[0]
    assert set(shapes) == {tuple(w.shape) for w in (first.qkv, first.attn.o_proj.weight, first.gate_up,
                                                      first.mlp.down_proj.weight)}
    shapes.clear()
    blocks_through("kernel")  # the default, no shapes: every product on torch's
    assert shapes == []


@kernels_here
def test_the_compiled_context_write_fills_the_cache_as_the_eager_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """`write_context(compiled=True)` (the cycle's: fc, hidden norm and K/V product as one compiled graph, rows
    made once per shape) writes the caches the eager call writes, for a cycle's rows and a prefill's."""
    real = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: real(fn, backend="aot_eager", dynamic=False))
    target = make_tiny_target("llama", num_layers=5, seed=3)
    draft = make_draft(target, block_size=4, seed=5).to(DEVICE)
    gen = torch.Generator().manual_seed(7)
    features = torch.randn(2, 4, draft.fc.in_features, generator=gen).to(DEVICE)
    positions = torch.tensor([[3, 4, 5, 6], [9, 10, 11, 12]], device=DEVICE)
    caches = []
    for compiled in (False, True):
        drafter = StaticDrafter(draft, batch_size=3, block_size=4, max_length=32, kernels="triton")
        drafter.write_context(features, positions, compiled=compiled)  # rows 0 and 1
        drafter.write_context(features, positions + 1, torch.tensor([2, 0], device=DEVICE), compiled=compiled)
        caches.append((drafter.cache.keys.clone(), drafter.cache.values.clone()))
    assert caches[1][0].abs().sum() > 0
    for eager, compiled_cache in zip(*caches, strict=True):
        torch.testing.assert_close(compiled_cache, eager, atol=1e-6, rtol=1e-6)


def test_the_engine_chooses_the_drafters_attention() -> None:
    target = make_tiny_target("llama", num_layers=5, seed=3)
    draft = make_draft(target, block_size=4, seed=5)
    config = EngineConfig(block_size=4, max_new_tokens=4, max_length=32, kernels="torch")
    assert DecodeEngine(target, draft, config).drafter.attention == "sdpa"  # the torch kernels: the reference
    with pytest.raises(ValueError, match="draft_attention must be kernel or sdpa, not 'flash'"):
        EngineConfig(draft_attention="flash")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="draft attention must be kernel or sdpa"):
        StaticDrafter(draft, 1, 4, 32, attention="flash")


def test_layers_the_kernels_cannot_run_keep_the_drafters_own_forward() -> None:
    target = make_tiny_target("llama", num_layers=5, seed=3)
    layer = make_draft(target, block_size=4, seed=5).layers[0]
    assert supported(layer, 4, torch.float32)
    assert not supported(layer, 4, torch.bfloat16)  # fp32 norm weights would promote bf16 q and k
    assert not supported(layer, 512, torch.float32)  # a block too large for one attention program


def test_a_drafter_whose_projections_the_loop_fused_still_saves_and_loads(tmp_path: Path) -> None:
    from dflash_train.checkpoint import load_draft
    from dflash_train.checkpoint.io import save_draft
    from dflash_train.runtime.fused_layer import fused_projections

    target = make_tiny_target("llama", num_layers=5, seed=3)
    draft = make_draft(target, block_size=4, seed=5)
    before = {name: tensor.clone() for name, tensor in draft.state_dict().items()}
    for layer in draft.layers:
        fused_projections(layer)
    assert draft.layers[0].self_attn.k_proj.weight.untyped_storage().data_ptr() == \
        draft.layers[0].self_attn.q_proj.weight.untyped_storage().data_ptr()  # views of one tensor now
    save_draft(draft, tmp_path / "draft", dtype=torch.float32)
    loaded = load_draft(tmp_path / "draft")
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, before[name]), name
