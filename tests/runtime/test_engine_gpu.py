"""The fast loop on CUDA: CUDA graph captured, Triton kernels and torch.compile in use, no host
synchronisation inside a cycle, and still lossless."""

from __future__ import annotations

import pytest
import torch

from dflash_train.kernels import skinny_matmul
from dflash_train.runtime.engine import DecodeEngine, EngineConfig
from dflash_train.runtime.static_target import StaticTarget
from tests.helpers.decoding import assert_own_greedy, make_draft, prompts
from tests.helpers.tiny_models import make_tiny_target

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def target_and_draft() -> tuple:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    target = make_tiny_target("qwen3", num_layers=6, seed=1)
    draft = make_draft(target)
    target.model.cuda()
    return target, draft.cuda()


@pytest.mark.parametrize("batch_size", [1, 3])
def test_graph_compiled_triton_loop_is_lossless(target_and_draft: tuple, batch_size: int) -> None:
    target, draft = target_and_draft
    engine = DecodeEngine(target, draft, EngineConfig(batch_size=batch_size, block_size=8, max_new_tokens=24,
                                                      max_length=64))
    outputs, stats = engine.generate(prompts(5))
    assert engine.uses_cuda_graph and engine.kernels == "triton" and engine.uses_compile, (
        engine.graph_error, engine.compile_error)
    # the drafter's block attention on the split-key kernel and the target's deferred residual adds, compiled
    assert engine.compile_error is None and engine.drafter.attention == "kernel" and engine.runner.defer_residual
    assert_own_greedy(target, prompts(5), [output.tokens for output in outputs], 24)


@pytest.mark.parametrize(("batch_size", "carry"), [(1, False), (3, False), (1, True), (3, True)])
def test_fused_skinny_products_compiled_and_graphed_are_lossless(target_and_draft: tuple, batch_size: int,
                                                                 carry: bool) -> None:
    """The opt-in fused products (norms, SwiGLU, residual adds in the skinny kernel), target and drafter,
    under torch.compile and a CUDA graph: the target's own greedy tokens (fp32); also with the norms reading
    the statistics the product before them left (`carry_norm_stats`)."""
    target, draft = target_and_draft
    runner = StaticTarget(target, batch_size, 64, kernels="triton", skinny_matmul=True, skinny_fusion=True,
                          carry_norm_stats=carry)
    engine = DecodeEngine(target, draft, EngineConfig(batch_size=batch_size, block_size=8, max_new_tokens=24,
                                                      max_length=64), runner=runner)
    outputs, _ = engine.generate(prompts(5))
    assert engine.uses_cuda_graph and engine.uses_compile and engine.compile_error is None, engine.graph_error
    assert engine.runner.matmul == "fused" and all(layer.fused_products for layer in engine.drafter.layer_kernels)
    assert engine.runner.carries_norm_stats == carry
    assert_own_greedy(target, prompts(5), [output.tokens for output in outputs], 24)


@pytest.mark.parametrize("fusion", [False, True])
def test_products_with_k_split_compiled_and_graphed_are_lossless(target_and_draft: tuple, fusion: bool,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Every skinny product with K in three slices (a second kernel adds them) under torch.compile and a CUDA
    graph: the target's own greedy tokens (fp32), with and without the fused norms and epilogues."""
    monkeypatch.setattr(skinny_matmul, "config_for", lambda n, k, swiglu=False: skinny_matmul.Config(16, 32, split_k=3))
    target, draft = target_and_draft
    runner = StaticTarget(target, 2, 64, kernels="triton", skinny_matmul=True, skinny_fusion=fusion)
    engine = DecodeEngine(target, draft, EngineConfig(batch_size=2, block_size=8, max_new_tokens=24,
                                                      max_length=64), runner=runner)
    outputs, _ = engine.generate(prompts(4))
    assert engine.uses_cuda_graph and engine.uses_compile and engine.compile_error is None, engine.graph_error
    assert_own_greedy(target, prompts(4), [output.tokens for output in outputs], 24)


def test_no_host_sync_inside_a_cycle(target_and_draft: tuple) -> None:
    target, draft = target_and_draft
    engine = DecodeEngine(target, draft, EngineConfig(batch_size=2, block_size=8, max_new_tokens=24, max_length=64,
                                                      cuda_graphs=False, compile=False))
    engine.prepare()
    engine.prefill([0, 1], prompts(2))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.no_grad():
            for _ in range(3):
                engine._cycle()
    finally:
        torch.cuda.set_sync_debug_mode("default")
