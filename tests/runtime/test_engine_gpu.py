"""The fast loop on CUDA: CUDA graph captured, Triton kernels and torch.compile in use, no host
synchronisation inside a cycle, and still lossless."""

from __future__ import annotations

import pytest
import torch

from dflash_train.runtime.engine import DecodeEngine, EngineConfig
from tests.helpers.decoding import make_draft, own_greedy, prompts
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
    cpu = target.model.cpu()
    try:
        for prompt, output in zip(prompts(5), outputs, strict=True):
            assert output.tokens == own_greedy(target, prompt, 24)
    finally:
        cpu.cuda()


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
