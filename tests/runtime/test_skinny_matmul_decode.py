"""The decode loop with the skinny-matmul kernel (`StaticTarget(skinny_matmul=True)`) gives the target's own
greedy tokens, target alone (one row a step) and with a drafter (a verify block of 4 rows); the kernel runs
for every product of a decode or verify step and for none of a long prefill (tiny Qwen3, fp32; kernels
interpreted on CPU)."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch

from dflash_train.kernels.skinny_matmul import MAX_ROWS
from dflash_train.runtime import fused_layer
from dflash_train.runtime.engine import DecodeEngine, EngineConfig
from dflash_train.runtime.static_target import StaticTarget
from tests.helpers.decoding import make_draft, own_greedy, prompts
from tests.helpers.kernels import DEVICE, kernels_here, under_interpreter
from tests.helpers.tiny_models import make_tiny_target

test_under_interpreter = under_interpreter(__file__)

NEW = 8
# The attention prologue's kernel is tested elsewhere, and interpreted it would take most of this file's time.
FUSE_PROLOGUE = DEVICE == "cuda"


def count_kernel_calls(monkeypatch: pytest.MonkeyPatch) -> Counter[int]:
    """Rows of each call of the kernel by the layers and the output projection."""
    calls: Counter[int] = Counter()
    kernel = fused_layer.skinny_matmul_triton  # the output projection goes through fused_layer.project too

    def counted(x: torch.Tensor, *args: Any) -> torch.Tensor:
        calls[x.numel() // x.shape[-1]] += 1
        return kernel(x, *args)

    monkeypatch.setattr(fused_layer, "skinny_matmul_triton", counted)
    return calls


@kernels_here
@pytest.mark.parametrize("block_size", [1, 4])
def test_greedy_tokens_with_the_kernel_are_the_targets_own(block_size: int, monkeypatch: pytest.MonkeyPatch) -> None:
    torch.set_num_threads(1)
    layers = 3 if block_size > 1 else 2  # a drafter needs 3
    target = make_tiny_target("qwen3", num_layers=layers, seed=1)
    expected = [own_greedy(target, prompt, NEW) for prompt in prompts(1)]
    draft = make_draft(target, block_size, layers=1).to(DEVICE) if block_size > 1 else None
    target.model.to(DEVICE)
    # Counted on a CPU only: on a GPU the cycle is compiled and replayed as a CUDA graph, no Python per call.
    calls = count_kernel_calls(monkeypatch) if DEVICE == "cpu" else None
    runner = StaticTarget(target, 1, 64, kernels="triton", skinny_matmul=True, fuse_prologue=FUSE_PROLOGUE)
    assert runner.matmul == "skinny"
    config = EngineConfig(block_size=block_size, max_new_tokens=NEW, max_length=64, kernels="triton")
    outputs, _ = DecodeEngine(target, draft, config, runner=runner).generate(prompts(1))
    assert [output.tokens for output in outputs] == expected
    if calls is not None:  # a step: four products in each layer and the logits; the drafter's logits: B - 1 rows
        assert calls[block_size] >= (4 * layers + 1) * 2
        assert calls[block_size - 1] > 0 if block_size > 1 else True


@kernels_here
def test_a_long_prefill_keeps_torchs_matmul(monkeypatch: pytest.MonkeyPatch) -> None:
    target = make_tiny_target("qwen3", num_layers=1, seed=1)
    target.model.to(DEVICE)
    calls = count_kernel_calls(monkeypatch)
    runner = StaticTarget(target, 1, 128, kernels="triton", skinny_matmul=True, fuse_prologue=FUSE_PROLOGUE)
    ids = torch.randint(10, 200, (1, MAX_ROWS + 1), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    runner.forward(ids, torch.arange(MAX_ROWS + 1, device=DEVICE)[None], logit_index=torch.tensor([MAX_ROWS], device=DEVICE))
    assert calls == Counter({1: 1})  # the logits of the last position only


def test_the_kernel_follows_the_runners_kernels() -> None:
    target = make_tiny_target("qwen3", num_layers=1)
    assert StaticTarget(target, 1, 8).matmul == "torch"  # opt-in
    assert StaticTarget(target, 1, 8, kernels="triton").matmul == "torch"
    assert StaticTarget(target, 1, 8, skinny_matmul=True).matmul == "torch"  # kernels="torch"
    runner = StaticTarget(target, 1, 8, kernels="triton", skinny_matmul=True)
    assert runner.matmul == "skinny"
    runner.kernels = "torch"  # as the engine's fallback after a compiler failure
    assert runner.matmul == "torch"
