"""Packed training rows on every architecture: each chat's features as if it were alone (sliding windows,
soft-capping and sinks kept in the packed attention), or the run refused in one line before it trains on
wrong features (layers whose state runs on into the next chat; a packed pass that mixes chats)."""

from __future__ import annotations

import pytest
import torch

from dflash_train.features.online import OnlineFeatures
from dflash_train.features.packed_attention import packed_target_attention
from dflash_train.target import TargetModel
from dflash_train.training.config import load_config
from dflash_train.training.setup import check_packed_features, check_packing_fits_target
from tests.helpers.tiny_targets import TINY_TARGET_FAMILIES, TINY_TARGETS, build_tiny_target

ATTENTION_ONLY = [name for name in TINY_TARGETS if name not in TINY_TARGET_FAMILIES["hybrid"]]
LAYER_IDS = [0, 1, 2]


def features(target: TargetModel, attention: str) -> OnlineFeatures:
    return OnlineFeatures(target, LAYER_IDS, packed_target_attention(attention, target.device), soft_targets=False,
                          whole_rows=False, say=print)


@pytest.mark.parametrize("name", ATTENTION_ONLY)
def test_varlen_packed_rows_equal_each_chat_alone(name: str) -> None:
    """Chats of 48 and 43 tokens, longer than the 32-token windows, so an ignored window would show."""
    target = TargetModel(build_tiny_target(name, 256), None)
    assert features(target, "varlen").packing_error(256, (48, 43), target.device) < 1e-4


def config(*extra: str):  # noqa: ANN201 - the config type is the loader's
    return load_config(None, ["data.prepared=unused", "data.pack_tokens=128", "data.max_length=128", *extra])


@pytest.mark.parametrize("name", TINY_TARGET_FAMILIES["hybrid"])
def test_packing_a_recurrent_target_is_refused_in_one_line(name: str) -> None:
    target = TargetModel(build_tiny_target(name, 256), None)
    with pytest.raises(ValueError, match="state would run on from one packed chat into the next") as error:
        check_packing_fits_target(config(), target)
    assert "\n" not in str(error.value) and "data.features" in str(error.value)
    check_packing_fits_target(config("data.pack_tokens=null"), target)  # unpacked rows: one chat each


def test_a_packed_pass_that_mixes_chats_is_refused_and_varlen_passes() -> None:
    """gpt-oss through the model's own attention over packed rows gives the second chat other features."""
    target = TargetModel(build_tiny_target("gpt_oss", 256), None)
    with pytest.raises(ValueError, match="training.target_attention=varlen"):
        check_packed_features(config("training.target_attention=sdpa"), target, features(target, "sdpa"))
    check_packed_features(config("training.target_attention=varlen"), target, features(target, "varlen"))


def test_flex_is_not_probed_but_refused_where_the_attention_has_sinks() -> None:
    """Flex compiles for the training rows' shape: no probe of another shape; gpt-oss's sinks refuse it."""
    target = TargetModel(build_tiny_target("gpt_oss", 256), None)
    with pytest.raises(ValueError, match="sink logits"):
        check_packed_features(config("training.target_attention=flex"), target, features(target, "flex"))
    qwen = TargetModel(build_tiny_target("qwen3_moe", 256), None)
    check_packed_features(config("training.target_attention=flex"), qwen, features(qwen, "flex"))


def test_a_packed_pass_that_ignores_the_window_is_refused_with_varlen(monkeypatch: pytest.MonkeyPatch) -> None:
    """Varlen with the layers' windows dropped: chats longer than the window see too far back; the probe names
    the fix that is left (packing off), not the attention already in use."""
    from dflash_train.features import varlen

    target = TargetModel(build_tiny_target("mistral", 256), None)
    real = varlen.Extras
    monkeypatch.setattr(varlen, "Extras", lambda window=None, softcap=None, sinks=None: real(None, softcap, sinks))
    with pytest.raises(ValueError, match="unset data.pack_tokens") as error:
        check_packed_features(config("training.target_attention=varlen"), target, features(target, "varlen"))
    assert "use training.target_attention=varlen" not in str(error.value)


def test_the_probe_feeds_each_layer_its_inputs_alone() -> None:
    """A deep bf16 MoE drifts from rounding alone (an expert chosen otherwise for some token), which the features
    compared end to end take for a packing error; each attention fed the inputs it had alone stays at rounding."""
    from dflash_train.features.online import OnlineFeatures as Online

    model = build_tiny_target("gpt_oss", 256, dtype=torch.bfloat16, num_hidden_layers=8)
    target = TargetModel(model, None)
    probe = Online(target, [1, 6], packed_target_attention("varlen", target.device), soft_targets=False,
                   whole_rows=False, say=print)
    assert probe.packing_error(256, (48, 43), target.device) < 0.02
