"""The decode loop with the skinny-matmul kernel (`StaticTarget(skinny_matmul=True)`) gives the target's own
greedy tokens, target alone (one row a step) and with a drafter (a verify block of 4 rows); the kernel runs
for every product of a decode or verify step and for none of a long prefill; by default ("tuned") only for the
weight shapes of its swept table, on their architecture (tiny Qwen3, fp32; kernels interpreted on CPU)."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch

from dflash_train.kernels.skinny_matmul import CONFIGS, MAX_ROWS, tuned_shapes
from dflash_train.runtime import fused_layer, static_target
from dflash_train.runtime.engine import DecodeEngine, EngineConfig
from dflash_train.runtime.static_target import StaticTarget
from tests.helpers.decoding import make_draft, own_greedy, prompts
from tests.helpers.kernels import DEVICE, kernels_here, under_interpreter
from tests.helpers.tiny_models import make_tiny_target

test_under_interpreter = under_interpreter(__file__)

NEW = 8
# The attention prologue's kernel is tested elsewhere, and interpreted it would take most of this file's time.
FUSE_PROLOGUE = DEVICE == "cuda"


def count_kernel_calls(monkeypatch: pytest.MonkeyPatch, shapes: Counter[tuple[int, int]] | None = None,
                       ) -> Counter[int]:
    """Rows of each call of the kernel by the layers and the output projection (and into `shapes`, the
    weight's shape of each call)."""
    calls: Counter[int] = Counter()
    kernel = fused_layer.skinny_matmul_triton  # the output projection goes through fused_layer.project too

    def counted(x: torch.Tensor, weight: torch.Tensor, *args: Any) -> torch.Tensor:
        calls[x.numel() // x.shape[-1]] += 1
        if shapes is not None:
            shapes[tuple(weight.shape)] += 1
        return kernel(x, weight, *args)

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


@kernels_here
def test_tuned_shapes_alone_run_on_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """The default ("tuned"): the products whose weight shape the table was swept for on this GPU's
    architecture run on the kernel, every other product on torch's matmul, and the tokens stay the target's
    own. The tuned shapes are this tiny model's o_proj and logits here (on a CPU none are tuned)."""
    torch.set_num_threads(1)
    target = make_tiny_target("qwen3", num_layers=2, seed=1)
    expected = [own_greedy(target, prompt, NEW) for prompt in prompts(1)]
    target.model.to(DEVICE)
    o_proj = tuple(target.decoder_layers[0].self_attn.o_proj.weight.shape)
    head = tuple(target.lm_head.weight.shape)
    monkeypatch.setattr(static_target, "tuned_shapes", lambda device: frozenset({o_proj, head}))
    shapes: Counter[tuple[int, int]] = Counter()
    calls = count_kernel_calls(monkeypatch, shapes) if DEVICE == "cpu" else None
    runner = StaticTarget(target, 1, 64, kernels="triton", fuse_prologue=FUSE_PROLOGUE)
    assert runner.matmul == "tuned" and runner.skinny_shapes == {o_proj, head}
    config = EngineConfig(block_size=1, max_new_tokens=NEW, max_length=64, kernels="triton")
    outputs, _ = DecodeEngine(target, None, config, runner=runner).generate(prompts(1))
    assert [output.tokens for output in outputs] == expected
    if calls is not None:  # every decode step: one o_proj a layer and the logits, nothing else
        assert set(shapes) == {o_proj, head} and shapes[o_proj] == 2 * shapes[head] and shapes[head] >= NEW - 1


def test_tuned_shapes_take_the_kernel_only_at_the_rows_they_were_tuned_at() -> None:
    """A tuned shape runs on the kernel up to TUNED_ROWS rows (cuBLAS beyond: a batch-4 verify, a batch-64
    step); a product asked onto the kernel (shapes None) up to MAX_ROWS; an untuned shape never."""
    from dflash_train.kernels.skinny_matmul import TUNED_ROWS
    from dflash_train.runtime.fused_layer import on_skinny_kernel

    weight = torch.zeros(8, 4)
    for rows, tuned, asked in [(1, True, True), (TUNED_ROWS, True, True), (TUNED_ROWS + 1, False, True),
                               (MAX_ROWS, False, True), (MAX_ROWS + 1, False, False)]:
        x = torch.zeros(rows, 4)
        assert on_skinny_kernel(x, weight, frozenset({(8, 4)})) is tuned, rows
        assert on_skinny_kernel(x, weight, None) is asked, rows
        assert not on_skinny_kernel(x, weight, frozenset({(4, 8)}))


def test_the_kernel_follows_the_runners_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    target = make_tiny_target("qwen3", num_layers=1)
    assert StaticTarget(target, 1, 8).matmul == "torch"  # kernels="torch"
    assert StaticTarget(target, 1, 8, kernels="triton").matmul == "torch"  # no shape tuned on a CPU
    assert StaticTarget(target, 1, 8, skinny_matmul=True).matmul == "torch"  # kernels="torch"
    runner = StaticTarget(target, 1, 8, kernels="triton", skinny_matmul=True)
    assert runner.matmul == "skinny" and runner.skinny_shapes is None
    runner.kernels = "torch"  # as the engine's fallback after a compiler failure
    assert runner.matmul == "torch" and runner.skinny_shapes == frozenset()
    assert StaticTarget(target, 1, 8, kernels="triton", skinny_matmul="off").skinny_shapes == frozenset()
    monkeypatch.setattr(static_target, "tuned_shapes", lambda device: frozenset({(8, 8)}))
    tuned = StaticTarget(target, 1, 8, kernels="triton")
    assert tuned.matmul == "tuned" and tuned.skinny_shapes == {(8, 8)}
    assert StaticTarget(target, 1, 8, kernels="triton", skinny_matmul="off").matmul == "torch"
    with pytest.raises(ValueError, match="skinny_matmul must be one of off, tuned, all"):
        StaticTarget(target, 1, 8, skinny_matmul="some")


def test_tuned_shapes_are_the_tables_on_its_architecture_only(monkeypatch: pytest.MonkeyPatch) -> None:
    assert tuned_shapes(torch.device("cpu")) == frozenset()
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert tuned_shapes(torch.device("cuda")) == frozenset(CONFIGS) and (4096, 12288) in CONFIGS
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert tuned_shapes(torch.device("cuda")) == frozenset()
