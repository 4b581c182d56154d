"""The decode loop with the fused skinny products (`StaticTarget(skinny_matmul=True, skinny_fusion=True)`): each
layer's norms, SwiGLU and residual adds folded into four products, the first with the attention prologue in
its epilogue where the prologue kernel is on. Greedy tokens equal the target's own (Llama and Qwen3 layouts,
target alone and with a drafter whose layers fuse too); a step runs exactly four products a layer plus one
for the final norm and logits; a layer forward equals the Hugging Face
layer's; layers the kernel does not reproduce keep the unfused path. Tiny models in fp32, kernels interpreted
on CPU."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
from torch import nn

from dflash_train.kernels import qkv_rope_cache, skinny_fused
from dflash_train.runtime import draft_layer, fused_layer, target_forward
from dflash_train.runtime.engine import DecodeEngine, EngineConfig
from dflash_train.runtime.fused_layer import FusedLayer, fusion_supported
from dflash_train.runtime.static_target import StaticTarget
from tests.helpers.decoding import make_draft, own_greedy, prompts
from tests.helpers.kernels import DEVICE, kernels_here, under_interpreter
from tests.helpers.tiny_models import make_tiny_target

test_under_interpreter = under_interpreter(__file__)

NEW = 6


def count_fused_calls(monkeypatch: pytest.MonkeyPatch) -> Counter[tuple[str, str, int]]:
    """(where, which kernel, rows) of every fused product (`skinny_fused`) and every q/k/v product with the
    attention prologue (`qkv_rope_cache`), by the target's layers, its output and the drafter's layers."""
    calls: Counter[tuple[str, str, int]] = Counter()

    def counted(where: str, name: str, kernel: Any) -> Any:
        def call(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            calls[where, name, x.numel() // x.shape[-1]] += 1
            return kernel(x, *args, **kwargs)
        return call

    for module, where in ((fused_layer, "target layer"), (target_forward, "output"), (draft_layer, "draft layer")):
        monkeypatch.setattr(module, "skinny_fused_triton", counted(where, "fused", skinny_fused.skinny_fused_triton))
        if hasattr(module, "qkv_rope_cache_triton"):
            monkeypatch.setattr(module, "qkv_rope_cache_triton",
                                counted(where, "qkv_rope", qkv_rope_cache.qkv_rope_cache_triton))
    return calls


@kernels_here
@pytest.mark.parametrize(("model_type", "block_size", "prologue"), [
    ("qwen3", 1, False),  # the q/k/v product, then the PyTorch prologue
    ("qwen3", 1, True), ("llama", 4, True),  # the q/k/v product with the prologue kernel in its epilogue
])
def test_greedy_tokens_are_the_targets_own(model_type: str, block_size: int, prologue: bool,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    torch.set_num_threads(1)
    layers = 3 if block_size > 1 else 2  # a drafter needs 3
    target = make_tiny_target(model_type, num_layers=layers, seed=1)
    expected = [own_greedy(target, prompt, NEW) for prompt in prompts(1)]
    draft = make_draft(target, block_size, layers=1).to(DEVICE) if block_size > 1 else None
    target.model.to(DEVICE)
    calls = count_fused_calls(monkeypatch) if DEVICE == "cpu" else None  # a GPU replays graphs: no Python
    runner = StaticTarget(target, 1, 64, kernels="triton", skinny_matmul=True, skinny_fusion=True,
                          fuse_prologue=prologue)
    assert runner.matmul == "fused" and not runner.defer_residual
    config = EngineConfig(block_size=block_size, max_new_tokens=NEW, max_length=64, kernels="triton")
    outputs, _ = DecodeEngine(target, draft, config, runner=runner).generate(prompts(1))
    assert [output.tokens for output in outputs] == expected
    if calls is not None:
        # Four products a layer in every decode or verify step (the first with the prologue where it is on),
        # and the step's logits (the prefill's last position's logits are one row too, hence at least as many).
        steps, rest = divmod(calls["target layer", "fused", block_size], (3 if prologue else 4) * layers)
        assert rest == 0 and steps >= 2 and calls["output", "fused", block_size] >= steps
        assert calls["target layer", "qkv_rope", block_size] == (layers * steps if prologue else 0)
        if block_size > 1:  # the drafter's one layer over its block, once a cycle (each cycle one verify)
            assert calls["draft layer", "fused", block_size] == 3 * steps
            assert calls["draft layer", "qkv_rope", block_size] == steps


@kernels_here
def test_a_layer_equals_the_hugging_face_layer() -> None:
    """One fused layer over 3 new tokens after a 5-token context, against the model's own layer on the same
    8 tokens with its own cache (fp32: equal to rounding)."""
    torch.manual_seed(0)
    target = make_tiny_target("llama", num_layers=1, seed=2)
    target.model.to(DEVICE)
    ids = torch.randint(10, 200, (1, 8), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    with torch.no_grad():
        expected = target.model(ids).logits[0, 5:]
        runner = StaticTarget(target, 1, 16, kernels="triton", skinny_matmul=True, skinny_fusion=True)
        runner.forward(ids[:, :5], torch.arange(5, device=DEVICE)[None])
        got = runner.forward(ids[:, 5:], torch.arange(5, 8, device=DEVICE)[None]).logits[0]
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_fusion_is_opt_in_and_follows_the_runners_kernels() -> None:
    target = make_tiny_target("qwen3", num_layers=1)
    assert StaticTarget(target, 1, 8, kernels="triton", skinny_fusion=True).matmul == "torch"  # needs skinny
    assert StaticTarget(target, 1, 8, kernels="triton", skinny_matmul=True).matmul == "skinny"
    runner = StaticTarget(target, 1, 8, kernels="triton", skinny_matmul=True, skinny_fusion=True)
    assert runner.matmul == "fused" and not runner.defer_residual
    runner.kernels = "torch"  # the engine's fallback after a compiler failure
    assert runner.matmul == "torch"
    unfused = StaticTarget(target, 1, 8, kernels="triton", skinny_matmul=True, skinny_fusion=True,
                           fuse_projections=False)
    assert unfused.matmul == "skinny"  # the fusion lives in the fused layers


def test_which_layers_the_kernel_reproduces() -> None:
    """The Llama family's layers and the drafter's: yes. A GELU MLP or a LayerNorm: no (they keep the unfused
    path, which computes them as they are)."""
    for model_type in ("llama", "qwen3", "qwen2", "mistral"):
        layer = make_tiny_target(model_type, num_layers=1).decoder_layers[0]
        assert fusion_supported(layer), model_type
    target = make_tiny_target("llama", num_layers=3)
    assert fusion_supported(make_draft(target, 4, layers=1).layers[0])
    gelu = make_tiny_target("llama", num_layers=1).decoder_layers[0]
    gelu.mlp.act_fn = nn.GELU()
    assert not fusion_supported(gelu)
    layer_norm = make_tiny_target("llama", num_layers=1).decoder_layers[0]
    layer_norm.post_attention_layernorm = nn.LayerNorm(layer_norm.self_attn.o_proj.out_features)
    assert not fusion_supported(layer_norm)
    assert not FusedLayer(gelu, lambda *a, **k: None).fusion_supported


def test_the_engine_config_chooses_the_products() -> None:
    target = make_tiny_target("qwen3", num_layers=1)
    assert DecodeEngine(target, None, EngineConfig(max_length=16, kernels="torch")).runner.matmul == "torch"
    with pytest.raises(ValueError, match="matmul must be one of auto, torch, skinny, fused"):
        EngineConfig(matmul="cublas")
    runner = DecodeEngine(target, None, EngineConfig(max_length=16, kernels="torch", matmul="fused")).runner
    assert runner.skinny_matmul and runner.skinny_fusion and runner.matmul == "torch"  # no Triton kernels here
    runner.kernels = "triton"
    assert runner.matmul == "fused"


def test_the_prologue_goes_into_the_product_for_small_weights_only() -> None:
    """A small target's q/k/v weight (SmolLM2's 1.1 MB) takes the prologue in its product; Qwen3-8B's 50 MB
    keeps the wide skinny product and the prologue kernel apart."""
    assert fused_layer.prologue_in_product(torch.empty(960, 576, dtype=torch.bfloat16, device="meta"))
    assert not fused_layer.prologue_in_product(torch.empty(6144, 4096, dtype=torch.bfloat16, device="meta"))


def count_carried_calls(monkeypatch: pytest.MonkeyPatch) -> Counter[tuple[str, str]]:
    """(where, what) of every fused product that carries norm statistics: "reads" (a norm taking the shares
    the product before it left) or "writes" (a residual product leaving its output's), and of every fused
    product that does neither ("plain"), by the target's layers and its output."""
    calls: Counter[tuple[str, str]] = Counter()

    def counted(where: str) -> Any:
        def carrying(x: torch.Tensor, *args: Any, stats_in: Any = None, stats_out: bool = False, **kwargs: Any) -> Any:
            calls[where, "reads"] += stats_in is not None
            calls[where, "writes"] += stats_out
            return skinny_fused.skinny_fused_stats_triton(x, *args, stats_in=stats_in, stats_out=stats_out, **kwargs)
        return carrying

    def plain(where: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> torch.Tensor:
            calls[where, "plain"] += 1
            return skinny_fused.skinny_fused_triton(*args, **kwargs)
        return call

    for module, where in ((fused_layer, "target layer"), (target_forward, "output")):
        monkeypatch.setattr(module, "skinny_fused_stats_triton", counted(where))
        monkeypatch.setattr(module, "skinny_fused_triton", plain(where))
    return calls


@kernels_here
@pytest.mark.parametrize(("model_type", "block_size", "prologue"), [
    ("qwen3", 1, False), ("qwen3", 4, False),  # every norm reads shares: q/k/v's, gate/up's and the output's
    ("llama", 4, True),  # the q/k/v product with the prologue kernel takes its own pass
])
def test_carried_norm_statistics_keep_the_targets_own_tokens(model_type: str, block_size: int, prologue: bool,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The norms reading the sums of squares the product before them left (`carry_norm_stats`): greedy tokens
    equal the target's own, alone and verifying a drafter's blocks; in every decode or verify step each layer's
    o_proj and down leave shares, gate/up reads them, and so do the next layer's q/k/v and the logits' norm."""
    torch.set_num_threads(1)
    layers = 3 if block_size > 1 else 2
    target = make_tiny_target(model_type, num_layers=layers, seed=3)
    expected = [own_greedy(target, prompt, NEW) for prompt in prompts(1)]
    draft = make_draft(target, block_size, layers=1).to(DEVICE) if block_size > 1 else None
    target.model.to(DEVICE)
    calls = count_carried_calls(monkeypatch) if DEVICE == "cpu" else None
    runner = StaticTarget(target, 1, 64, kernels="triton", skinny_matmul=True, skinny_fusion=True,
                          fuse_prologue=prologue, carry_norm_stats=True)
    assert runner.carries_norm_stats
    config = EngineConfig(block_size=block_size, max_new_tokens=NEW, max_length=64, kernels="triton")
    outputs, _ = DecodeEngine(target, draft, config, runner=runner).generate(prompts(1))
    assert [output.tokens for output in outputs] == expected
    if calls is not None:
        steps, rest = divmod(calls["target layer", "writes"], 2 * layers)
        assert rest == 0 and steps >= 2 and calls["target layer", "plain"] == 0
        reads_a_layer = 1 if prologue else 2  # gate/up; and q/k/v unless the prologue kernel takes it
        assert calls["target layer", "reads"] == reads_a_layer * layers * steps
        # the logits of every step read them too, but the prefill's (a short prompt fits the fused products):
        # its logits at one position a row take the norm's own pass
        assert calls["output", "reads"] + calls["output", "plain"] == steps and calls["output", "plain"] == 1


@kernels_here
def test_a_carrying_layer_equals_the_hugging_face_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two layers over 3 new tokens after a 5-token context, the second reading the first's shares, against the
    model's own forward (fp32: equal to rounding). Every layer is handed shares of one shape, the first the
    embeddings' (so that one compiled layer serves all)."""
    target = make_tiny_target("qwen3", num_layers=2, seed=4)
    target.model.to(DEVICE)
    ids = torch.randint(10, 200, (1, 8), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    handed: list[tuple[int, ...] | None] = []
    carried = FusedLayer.carried

    def recording(layer: FusedLayer, hidden: torch.Tensor, shares: torch.Tensor | None, *args: Any) -> Any:
        handed.append(None if shares is None else tuple(shares.shape))
        return carried(layer, hidden, shares, *args)

    monkeypatch.setattr(FusedLayer, "carried", recording)
    with torch.no_grad():
        expected = target.model(ids).logits[0, 5:]
        runner = StaticTarget(target, 1, 16, kernels="triton", skinny_matmul=True, skinny_fusion=True,
                              carry_norm_stats=True)
        runner.forward(ids[:, :5], torch.arange(5, device=DEVICE)[None])
        handed.clear()
        got = runner.forward(ids[:, 5:], torch.arange(5, 8, device=DEVICE)[None]).logits[0]
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    assert len(handed) == 2 and handed[0] == handed[1] and handed[0] is not None and handed[0][0] == 3


def test_carrying_needs_the_fused_products() -> None:
    target = make_tiny_target("qwen3", num_layers=1)
    assert not StaticTarget(target, 1, 8, kernels="triton", skinny_matmul=True, carry_norm_stats=True).carries_norm_stats
    runner = StaticTarget(target, 1, 8, kernels="triton", skinny_matmul=True, skinny_fusion=True, carry_norm_stats=True)
    assert runner.carries_norm_stats and not runner.defer_residual
    runner.kernels = "torch"  # the engine's fallback after a compiler failure: nothing fused, nothing carried
    assert not runner.carries_norm_stats
