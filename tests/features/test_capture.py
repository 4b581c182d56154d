"""The capture calls: a target's decoder-layer outputs as features, the same as Hugging Face's hidden states
(before the final norm for the last layer), with the forward stopped after the deepest layer, no hooks left
behind, during full forwards with a KV cache, and with the final hidden states of distillation."""

from __future__ import annotations

import inspect

import pytest
import torch
from torch import nn
from transformers.utils import ModelOutput

from dflash_train.features.capture import capture_features, capture_features_and_final_states, feature_hooks
from dflash_train.target import TargetModel
from tests.helpers.features import LAYER_IDS, reference_features
from tests.helpers.tiny_models import TINY_ARCHS, make_tiny_target, tiny_batch


def left_padded_batch(pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    input_ids = tiny_batch(batch=2, seq_len=12, seed=1)
    attention_mask = torch.ones_like(input_ids)
    input_ids[1, :4] = pad_id
    attention_mask[1, :4] = 0
    return input_ids, attention_mask


def count_calls(modules: dict[str, nn.Module]) -> tuple[dict[str, int], list]:
    counts = dict.fromkeys(modules, 0)

    def counter(name: str):
        def hook(module: nn.Module, args: object) -> None:
            counts[name] += 1

        return hook

    handles = [module.register_forward_pre_hook(counter(name)) for name, module in modules.items()]
    return counts, handles


def test_capture_matches_hidden_states(tiny: TargetModel) -> None:
    input_ids = tiny_batch()
    features = capture_features(tiny, input_ids, LAYER_IDS)
    assert features.shape == (2, 12, len(LAYER_IDS) * tiny.hidden_size)
    assert features.dtype == tiny.dtype
    torch.testing.assert_close(features, reference_features(tiny, input_ids, LAYER_IDS), rtol=0, atol=0)


def test_capture_with_left_padding(tiny: TargetModel) -> None:
    input_ids, attention_mask = left_padded_batch(tiny.tokenizer.pad_token_id)
    features = capture_features(tiny, input_ids, LAYER_IDS, attention_mask=attention_mask)
    expected = reference_features(tiny, input_ids, LAYER_IDS, attention_mask=attention_mask)
    torch.testing.assert_close(features, expected, rtol=0, atol=0, equal_nan=True)
    # The real tokens of the padded row see only each other, as if the row were unpadded; only the RoPE
    # offset of the shifted positions differs, at float rounding level.
    alone = capture_features(tiny, input_ids[1:, 4:], LAYER_IDS)
    torch.testing.assert_close(features[1:, 4:], alone, rtol=1e-4, atol=1e-4)


def test_capture_runs_nothing_after_the_deepest_layer(tiny: TargetModel) -> None:
    modules = {f"layer{i}": layer for i, layer in enumerate(tiny.decoder_layers)}
    modules |= {"norm": tiny.model.model.norm, "lm_head": tiny.lm_head}
    counts, handles = count_calls(modules)
    try:
        capture_features(tiny, tiny_batch(), LAYER_IDS)
    finally:
        for handle in handles:
            handle.remove()
    assert counts == {
        "layer0": 1,
        "layer1": 1,
        "layer2": 1,
        "layer3": 1,
        "layer4": 1,
        "layer5": 0,
        "norm": 0,
        "lm_head": 0,
    }


def test_capture_does_not_ask_for_all_hidden_states() -> None:
    target = make_tiny_target("llama")
    seen: list[dict] = []
    target.model.model.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(kwargs), with_kwargs=True
    )
    capture_features(target, tiny_batch(), LAYER_IDS)
    assert not seen[0].get("output_hidden_states") and seen[0].get("use_cache") is False


def layer_hooks(target: TargetModel) -> list[list[int]]:
    # transformers installs hooks of its own once hidden states were requested; those stay.
    return [list(layer._forward_hooks) for layer in target.decoder_layers]


def test_capture_leaves_no_hooks_and_no_grad(tiny: TargetModel) -> None:
    before = layer_hooks(tiny)
    features = capture_features(tiny, tiny_batch(), LAYER_IDS)
    assert not features.requires_grad and not features.is_inference()
    assert layer_hooks(tiny) == before
    out_of_vocab = torch.full((1, 4), tiny.vocab_size + 5)
    with pytest.raises(IndexError):
        capture_features(tiny, out_of_vocab, LAYER_IDS)
    assert layer_hooks(tiny) == before


def test_capture_validates_layer_ids(tiny: TargetModel) -> None:
    with pytest.raises(ValueError, match="out of range"):
        capture_features(tiny, tiny_batch(), [1, tiny.num_layers])
    with pytest.raises(ValueError, match="sorted"):
        capture_features(tiny, tiny_batch(), [3, 1])


def test_last_layer_is_taken_before_the_final_norm() -> None:
    target = make_tiny_target("llama")
    input_ids = tiny_batch()
    last = capture_features(target, input_ids, [target.num_layers - 1])
    with torch.no_grad():
        out = target.model(input_ids=input_ids, output_hidden_states=True)
        normed = target.model.model.norm(last)
    # Hugging Face's last hidden state is after the norm; ours is the layer output feeding it.
    torch.testing.assert_close(normed, out.hidden_states[-1], rtol=1e-6, atol=1e-6)
    assert not torch.allclose(last, out.hidden_states[-1])


def test_feature_hooks_during_a_full_forward(tiny: TargetModel) -> None:
    input_ids = tiny_batch()
    before = layer_hooks(tiny)
    with feature_hooks(tiny, LAYER_IDS) as store, torch.no_grad():
        out = tiny.model(input_ids=input_ids, output_hidden_states=True)
        features = store.features()
    assert out.logits.shape == (2, 12, tiny.vocab_size)
    expected = torch.cat([out.hidden_states[k + 1] for k in LAYER_IDS], dim=-1)
    torch.testing.assert_close(features, expected, rtol=0, atol=0)
    assert layer_hooks(tiny) == before


def cache_kwargs(target: TargetModel, previous: ModelOutput) -> dict[str, object]:
    # transformers 5 renamed `past_key_values` to `cache`.
    if "cache" in inspect.signature(target.model.forward).parameters:
        return {"cache": previous["cache"]}
    return {"past_key_values": previous["past_key_values"]}


def test_feature_hooks_with_a_kv_cache(tiny: TargetModel) -> None:
    input_ids = tiny_batch()
    full = capture_features(tiny, input_ids, LAYER_IDS)
    with feature_hooks(tiny, LAYER_IDS) as store, torch.no_grad():
        # Shorter sequences may take other matmul kernels, hence the float-rounding tolerance.
        prefill = tiny.model(input_ids=input_ids[:, :8], use_cache=True)
        torch.testing.assert_close(store.features(), full[:, :8], rtol=1e-5, atol=1e-5)
        # The verification pass over the next block sees only its own positions.
        tiny.model(input_ids=input_ids[:, 8:], use_cache=True, **cache_kwargs(tiny, prefill))
        torch.testing.assert_close(store.features(), full[:, 8:], rtol=1e-5, atol=1e-5)


def test_feature_store_before_any_forward() -> None:
    target = make_tiny_target("qwen3")
    with feature_hooks(target, [1]) as store, pytest.raises(RuntimeError, match="No output captured"):
        store.features()


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_final_states_give_the_targets_own_logits_and_the_same_features(arch: str) -> None:
    target = make_tiny_target(arch, num_layers=4)
    ids = tiny_batch()
    mask = torch.ones_like(ids)
    mask[1, -3:] = 0  # right padding, as in training batches
    features, final = capture_features_and_final_states(target, ids, [0, 2], mask)
    assert torch.equal(features, capture_features(target, ids, [0, 2], mask))
    with torch.no_grad():
        logits = target.model(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(final @ target.lm_head.weight.T, logits, atol=1e-5, rtol=1e-5)
