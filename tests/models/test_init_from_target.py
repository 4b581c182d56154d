"""model.init_layers_from_target: the drafter's layers start as copies of target layers (tiny Llama and
Qwen3 targets), the rest keeps its initialisation, the drafter runs, and what cannot fit is refused."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dflash_train.models import DFlashDraftModel
from dflash_train.models.init_from_target import init_layers_from_target
from dflash_train.objective.masks import dense_mask
from dflash_train.target import TargetModel
from dflash_train.training.config import TrainConfig, load_config
from dflash_train.training.setup import build_draft
from tests.helpers.tiny_models import make_tiny_target

COPIED = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
          "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
          "input_layernorm.weight", "post_attention_layernorm.weight")


def config(**model: object) -> TrainConfig:
    values = {"model.num_draft_layers": 2, "model.block_size": 4, "model.mask_token_id": 5,
              "training.loss_decay_gamma": 4, **model}
    return load_config(None, ["data.prepared=unused", *(f"{k}={v}" for k, v in values.items())])


def build(target: TargetModel, seed: int = 0, **model: object) -> DFlashDraftModel:
    torch.manual_seed(seed)
    return build_draft(config(**model), target)


def target_tensor(target: TargetModel, layer: int, name: str) -> torch.Tensor:
    return dict(target.decoder_layers[layer].named_parameters())[name]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_the_last_target_layers_are_copied(arch: str) -> None:
    target = make_tiny_target(arch, num_layers=6)
    draft = build(target, **{"model.init_layers_from_target": "true"})
    fresh = build(target)  # the same seed without the option: today's initialisation
    for index, layer_id in enumerate((4, 5)):
        layer = dict(draft.layers[index].named_parameters())
        for name in COPIED:
            assert torch.equal(layer[name], target_tensor(target, layer_id, name)), (arch, index, name)
        for name in ("self_attn.q_norm.weight", "self_attn.k_norm.weight"):
            want = target_tensor(target, layer_id, name) if arch == "qwen3" else torch.ones(16)
            assert torch.equal(layer[name], want), (arch, index, name)
    for name in ("fc.weight", "hidden_norm.weight", "norm.weight"):
        assert torch.equal(draft.state_dict()[name], fresh.state_dict()[name]), name
    assert {n for n, _ in draft.named_parameters()} == {n for n, _ in fresh.named_parameters()}


def test_qwen3_norms_differ_from_ones_so_the_copy_is_seen() -> None:
    target = make_tiny_target("qwen3", num_layers=6)
    with torch.no_grad():
        for layer in target.decoder_layers:
            layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
    draft = build(target, **{"model.init_layers_from_target": "true", "model.init_layer_ids": "[1, 3]"})
    assert torch.equal(draft.layers[1].self_attn.q_norm.weight, target.decoder_layers[3].self_attn.q_norm.weight)
    assert torch.equal(draft.layers[0].mlp.down_proj.weight, target.decoder_layers[1].mlp.down_proj.weight)
    assert not torch.equal(draft.layers[1].self_attn.q_norm.weight, torch.ones(16))


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_the_initialised_drafter_runs(arch: str) -> None:
    target = make_tiny_target(arch, num_layers=6)
    draft = build(target, **{"model.init_layers_from_target": "true"})
    context = 10
    anchors, valid = torch.tensor([[2, 6]]), torch.tensor([[True, True]])
    positions = (anchors[:, :, None] + torch.arange(4)).flatten(1)
    embeds = target.embed_tokens(torch.randint(7, 200, (1, 8)))
    features = torch.randn(1, context, len(draft.config.target_layer_ids) * 64)
    hidden = draft(embeds, positions, features, torch.arange(context)[None], dense_mask(anchors, valid, context, 4))
    assert hidden.shape == (1, 8, 64) and torch.isfinite(hidden).all()
    hidden.sum().backward()
    assert draft.layers[0].self_attn.q_proj.weight.grad is not None


def test_off_by_default_leaves_todays_initialisation() -> None:
    target = make_tiny_target("llama", num_layers=6)
    draft = build(target, seed=3)
    torch.manual_seed(3)
    today = DFlashDraftModel(draft.config)
    for (name, got), want in zip(draft.state_dict().items(), today.state_dict().values(), strict=True):
        assert torch.equal(got, want), name
    assert not torch.equal(draft.layers[1].mlp.up_proj.weight, target.decoder_layers[5].mlp.up_proj.weight)


def test_a_target_with_other_layers_is_refused() -> None:
    qwen2 = make_tiny_target("qwen2", num_layers=6)  # q/k/v biases the drafter has no place for
    with pytest.raises(ValueError, match=r"init_layers_from_target: .*self_attn.q_proj.bias has no place"):
        build(qwen2, **{"model.init_layers_from_target": "true"})
    llama = make_tiny_target("llama", num_layers=6)
    narrow = DFlashDraftModel(dataclasses.replace(build(llama).config, intermediate_size=96))
    with pytest.raises(ValueError, match=r"intermediate_size 96 != target's 128; target layer 4 mlp.gate_proj"):
        init_layers_from_target(narrow, llama.config, llama.decoder_layers)
    with pytest.raises(ValueError, match=r"model.init_layer_ids=\[0, 6\] must name 2 of the target's layers 0..5"):
        build(llama, **{"model.init_layers_from_target": "true", "model.init_layer_ids": "[0, 6]"})


@pytest.mark.parametrize(("overrides", "message"), [
    ({"model.init_layers_from_target": "true", "model.init_from": "some/drafter"}, "both set the drafter's layers"),
    ({"model.init_layer_ids": "[1, 2]"}, "applies only with model.init_layers_from_target: true"),
    ({"model.init_layers_from_target": "true", "model.init_layer_ids": "[1]"}, "has 1 ids for model.num_draft_layers=2"),
])
def test_config_refusals(overrides: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        config(**overrides)
