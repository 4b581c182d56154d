"""The static-cache target runner against the model's own Hugging Face forward (no cache), per
architecture: prefill of some rows, then per-row verify blocks at different positions."""

from __future__ import annotations

import pytest
import torch

from dflash_train.features.capture import capture_features
from dflash_train.runtime.static_target import StaticTarget
from tests.helpers.static_target import check_prefill_and_verify
from tests.helpers.tiny_models import make_tiny_target


@pytest.mark.parametrize("fuse_projections", [True, False])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral", "qwen3_moe", "mixtral", "gpt_oss"])
def test_prefill_and_verify_match_the_full_forward(arch: str, fuse_projections: bool) -> None:
    check_prefill_and_verify(arch, kernels="torch", fuse_projections=fuse_projections)


OWN_LAYERS = ("phi3", "olmo2", "granite", "smollm3", "glm4_moe", "gemma2", "gemma3_text", "cohere2", "exaone4",
              "qwen3_next", "qwen3_5", "qwen3_5_moe", "lfm2", "nemotron_h",
              "falcon_h1", "deepseek_v3")


@pytest.mark.parametrize("arch", OWN_LAYERS)
def test_prefill_and_verify_match_the_full_forward_on_more_architectures(arch: str) -> None:
    """The same on the architectures added by their adapters (`runtime/target_adapters.py`): the models' own
    layers (glm4_moe's fused), embedding and logit scales, soft-caps, Gemma-3's rotary embedding per layer type,
    windows of 5 on the sliding layers, Gated DeltaNet layers on state rings (a right-padded prompt's padding
    leaves its row's recurrent and convolution states as the unpadded prompt's)."""
    check_prefill_and_verify(arch, kernels="torch")


def test_sliding_window_is_applied() -> None:
    """The window changes the logits, and the runner follows it (else the test above could pass vacuously)."""
    target = make_tiny_target("mistral", num_layers=2, seed=1)
    ids = torch.randint(10, 200, (1, 14), generator=torch.Generator().manual_seed(0))
    target.model.config.sliding_window = None
    runner = StaticTarget(target, batch_size=1, max_length=16)
    full = runner.forward(ids, torch.arange(14)[None]).logits
    target.model.config.sliding_window = 4
    windowed = StaticTarget(target, batch_size=1, max_length=16).forward(ids, torch.arange(14)[None]).logits
    with torch.no_grad():
        torch.testing.assert_close(windowed, target.model(ids).logits, atol=1e-5, rtol=1e-4)
    assert not torch.allclose(full[0, -1], windowed[0, -1], atol=1e-4)


def test_compare_with_hf_reports_agreement() -> None:
    target = make_tiny_target("qwen3", num_layers=2, seed=2)
    check = StaticTarget(target, batch_size=1, max_length=16).compare_with_hf(list(range(20, 32)))
    assert check["argmax_agreement"] == 1.0 and check["max_abs_logit_diff"] < 1e-4


def test_attention_implementation_is_restored() -> None:
    target = make_tiny_target("llama", num_layers=2)
    before = target.model.config._attn_implementation
    StaticTarget(target, batch_size=1, max_length=8).forward(torch.tensor([[5, 6]]), torch.tensor([[0, 1]]))
    assert target.model.config._attn_implementation == before


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_fused_projections_copy_no_weight_and_change_nothing(arch: str) -> None:
    """The layers' q/k/v and gate/up parameters become views of the fused matrices: same values, same
    model output, same weight hash, no second copy; a second runner shares the first one's matrices."""
    from dflash_train.target import target_fingerprint

    target = make_tiny_target(arch, num_layers=2, seed=3)
    ids = torch.randint(10, 200, (1, 9), generator=torch.Generator().manual_seed(1))
    before = {name: p.detach().clone() for name, p in target.model.named_parameters()}
    with torch.no_grad():
        logits = target.model(ids).logits
    fingerprint = target_fingerprint(target.model)
    runner = StaticTarget(target, batch_size=1, max_length=16)
    after = dict(target.model.named_parameters())
    assert after.keys() == before.keys() and all(torch.equal(after[n], before[n]) for n in before)
    with torch.no_grad():
        torch.testing.assert_close(target.model(ids).logits, logits, atol=1e-6, rtol=1e-6)
    assert target_fingerprint(target.model) == fingerprint
    attn, fused = target.decoder_layers[1].self_attn, runner.fused[1].weights
    assert attn.q_proj.weight.data_ptr() == fused["qkv"].data_ptr()
    assert attn.k_proj.weight.data_ptr() == fused["qkv"][attn.q_proj.out_features:].data_ptr()
    assert (attn.q_proj.bias is not None) == (fused["qkv_bias"] is not None) == (arch == "qwen2")
    second = StaticTarget(target, batch_size=1, max_length=16)
    assert second.fused[1].weights["gate_up"] is fused["gate_up"]
    # moved or cast after a runner: the next runner fuses the moved weights, not the stale matrices
    target.model.to(torch.float64)
    third = StaticTarget(target, batch_size=1, max_length=16)
    assert third.fused[1].weights["qkv"].dtype == torch.float64
    assert attn.v_proj.weight.data_ptr() == third.fused[1].weights["qkv"][-attn.v_proj.out_features:].data_ptr()


def test_deferred_residuals_change_no_output_and_reach_the_last_layer() -> None:
    """Each layer's last residual add done by the next layer (the default) or by the layer itself: the same
    logits and features, the last layer's output among them, in prefill and in a verify block."""
    target = make_tiny_target("qwen3", num_layers=4, seed=2)
    ids = torch.randint(10, 200, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        reference = target.model(ids).logits
    expected_features = capture_features(target, ids, [0, 3])
    outputs = {}
    for defer in (True, False):
        runner = StaticTarget(target, batch_size=2, max_length=16, defer_residual=defer)
        assert runner.defer_residual is defer
        prefill = runner.forward(ids[:, :8], torch.arange(8).expand(2, 8), feature_layer_ids=[0, 3])
        block = runner.forward(ids[:, 8:], torch.arange(8, 12).expand(2, 4), feature_layer_ids=[0, 3])
        outputs[defer] = (prefill, block)
        torch.testing.assert_close(block.logits, reference[:, 8:], atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(prefill.features, expected_features[:, :8], atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(block.features, expected_features[:, 8:], atol=1e-5, rtol=1e-4)
    for deferred, plain in zip(outputs[True], outputs[False], strict=True):
        torch.testing.assert_close(deferred.logits, plain.logits, atol=1e-6, rtol=0)
    assert not StaticTarget(target, 1, 8, fuse_projections=False).defer_residual  # Hugging Face's own layers


@pytest.mark.parametrize("prefetch_weights", [False, True])
def test_the_attention_kernel_is_handed_the_next_weight_when_asked(prefetch_weights: bool,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """With `prefetch_weights`, each fused layer's decode attention gets that layer's o_proj weight to ask of L2
    (the kernel here replaced by the brute-force reference, which records what it was given); the logits stay
    the model's own."""
    from dflash_train.kernels.static_attention import static_attention_reference
    from dflash_train.runtime import cache_attention

    given: list[torch.Tensor | None] = []
    counted: list[torch.Tensor | None] = []

    def recording(q, k, v, bounds, scale, prefetch=None, counters=None, sinks=None):  # noqa: ANN001, ANN202 (the kernel's)
        given.append(prefetch)
        counted.append(counters)
        return static_attention_reference(q, k, v, bounds, scale, sinks)

    monkeypatch.setattr(cache_attention, "static_attention_triton", recording)
    target = make_tiny_target("qwen3", num_layers=3, seed=2)
    ids = torch.randint(10, 200, (1, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        reference = target.model(ids).logits[0, -1]
    runner = StaticTarget(target, batch_size=1, max_length=16, kernels="triton", fuse_prologue=False,
                          skinny_matmul="off", prefetch_weights=prefetch_weights)
    runner.forward(ids[:, :7], torch.arange(7)[None], kv_len=7)  # a prompt this short fits the kernel too
    out = runner.forward(ids[:, 7:], torch.tensor([[7]]), kv_len=8)
    torch.testing.assert_close(out.logits[0, -1], reference, atol=1e-5, rtol=1e-4)
    o_proj = [layer.self_attn.o_proj.weight for layer in target.decoder_layers] * 2  # prefill, then decode
    if prefetch_weights:
        assert len(given) == 6 and all(g is w for g, w in zip(given, o_proj, strict=True))
    else:
        assert given == [None] * 6
    assert all(c is runner.attention_counters for c in counted)  # one zeroed buffer for every layer


def test_gpt_oss_hands_its_sinks_and_windows_to_the_attention_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """With kernels="triton", gpt-oss's decode and verify attention goes to the split-key kernel (replaced here
    by the brute-force reference, which records what it was given) with each layer's own sink logits and its
    window (sliding, full, sliding, full); the logits stay the model's own."""
    from dflash_train.kernels.static_attention import static_attention_reference
    from dflash_train.runtime import cache_attention
    from tests.helpers.static_target import tiny_target

    calls: list[tuple[torch.Tensor | None, torch.Tensor]] = []

    def recording(q, k, v, bounds, scale, prefetch=None, counters=None, sinks=None):  # noqa: ANN001, ANN202 (the kernel's)
        calls.append((sinks, bounds))
        return static_attention_reference(q, k, v, bounds, scale, sinks)

    monkeypatch.setattr(cache_attention, "static_attention_triton", recording)
    target = tiny_target("gpt_oss")
    ids = torch.randint(10, 200, (1, 14), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        reference = target.model(ids).logits[0]
    runner = StaticTarget(target, batch_size=1, max_length=32, kernels="triton")
    runner.forward(ids[:, :8], torch.arange(8)[None], kv_len=8)  # a prompt this short fits the kernel too
    out = runner.forward(ids[:, 8:], torch.arange(8, 14)[None])  # a verify block of 6
    torch.testing.assert_close(out.logits[0], reference[8:], atol=1e-5, rtol=1e-4)
    layers = target.decoder_layers
    assert len(calls) == 2 * len(layers)
    for (sinks, bounds), layer in zip(calls, [*layers, *layers], strict=True):
        assert sinks is layer.self_attn.sinks
        window = layer.self_attn.sliding_window
        assert bounds.dtype == torch.int32 and (window == 5) == bool((bounds[:, 0] > 0).any())
    # the verify block's third layer (sliding): positions 8..13 see from 4..9 on
    assert torch.equal(calls[-2][1][0, 0], torch.arange(4, 10, dtype=torch.int32))


@pytest.mark.parametrize("arch", ["gemma2", "gemma3_text", "cohere2", "exaone4", "granite"])
def test_own_layers_reach_the_attention_kernel_unless_it_lacks_what_they_ask(arch: str,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """With kernels="triton", the decode and verify attention of the models' own layers goes to the split-key
    kernel (replaced here by the brute-force reference, which records what it was given) with each layer's window
    and scale (Granite's attention multiplier); gemma2's soft-capped scores, which the kernel does not compute, go
    to the PyTorch path instead. The logits stay the model's own either way."""
    from dflash_train.kernels.static_attention import static_attention_reference
    from dflash_train.runtime import cache_attention
    from tests.helpers.static_target import tiny_target

    calls: list[tuple[torch.Tensor, float]] = []

    def recording(q, k, v, bounds, scale, prefetch=None, counters=None, sinks=None):  # noqa: ANN001, ANN202 (the kernel's)
        calls.append((bounds, scale))
        return static_attention_reference(q, k, v, bounds, scale, sinks)

    monkeypatch.setattr(cache_attention, "static_attention_triton", recording)
    target = tiny_target(arch)
    ids = torch.randint(10, 200, (1, 14), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        reference = target.model(ids).logits[0]
    runner = StaticTarget(target, batch_size=1, max_length=32, kernels="triton")
    runner.forward(ids[:, :8], torch.arange(8)[None], kv_len=8)
    out = runner.forward(ids[:, 8:], torch.arange(8, 14)[None])  # a verify block of 6
    torch.testing.assert_close(out.logits[0], reference[8:], atol=1e-5, rtol=1e-4)
    layers = target.decoder_layers
    if arch == "gemma2":
        assert calls == []
        return
    assert len(calls) == 2 * len(layers)
    for (bounds, scale), layer, window in zip(calls, [*layers, *layers], runner.windows * 2, strict=True):
        assert bounds.dtype == torch.int32 and (window == 5) == bool((bounds[:, 0] > 0).any())
        assert scale == layer.self_attn.scaling
    assert runner.windows.count(5) == (0 if arch == "granite" else 3)  # S S S F: the windows were checked


def test_the_attention_refuses_what_it_does_not_implement() -> None:
    """A keyword argument a layer hands the attention that it would otherwise drop is an error, not ignored."""
    from dflash_train.runtime.static_target import static_attention

    q, kv = torch.randn(1, 4, 3, 16), torch.randn(1, 2, 3, 16)
    mask = torch.ones(1, 1, 3, 3, dtype=torch.bool).tril()
    out, _ = static_attention(torch.nn.Module(), q, kv, kv, mask, sliding_window=4096, position_ids=None)
    assert out.shape == (1, 3, 4, 16)
    with pytest.raises(ValueError, match="does not implement chunk_size"):
        static_attention(torch.nn.Module(), q, kv, kv, mask, chunk_size=8)


def test_soft_capped_attention_on_bounds_equals_the_mask() -> None:
    """The Triton path's bounds, for a layer whose scores are soft-capped, become the mask of the same slots: the
    PyTorch path then gives what it gives with the mask, which is the capped softmax over those slots."""
    from dflash_train.kernels.static_attention import bounds_from_positions
    from dflash_train.runtime.static_target import static_attention

    gen = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(2, 4, 3, 16, generator=gen), torch.randn(2, 2, 10, 16, generator=gen), torch.randn(
        2, 2, 10, 16, generator=gen)
    positions = torch.tensor([[4, 5, 6], [7, 8, 9]])
    bounds = bounds_from_positions(positions, 3)
    slots = torch.arange(10)
    mask = ((slots <= positions[..., None]) & (slots > positions[..., None] - 3))[:, None]
    on_bounds, _ = static_attention(torch.nn.Module(), q, k, v, bounds, scaling=0.5, softcap=0.3)
    on_mask, _ = static_attention(torch.nn.Module(), q, k, v, mask, scaling=0.5, softcap=0.3)
    torch.testing.assert_close(on_bounds, on_mask)
    scores = 0.3 * torch.tanh(q @ k.repeat_interleave(2, dim=1).transpose(-1, -2) * 0.5 / 0.3)
    weights = scores.masked_fill(~mask, float("-inf")).softmax(-1)
    torch.testing.assert_close(on_mask, (weights @ v.repeat_interleave(2, dim=1)).transpose(1, 2))
