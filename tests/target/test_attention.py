"""`attention_implementation`: a target's attention switched for a `with` block and restored after it, also
when the block raises; None changes nothing."""

from __future__ import annotations

import pathlib

import pytest

from dflash_train.target.attention import attention_implementation
from dflash_train.target.loading import attention_choice
from tests.helpers.tiny_models import make_tiny_target
from tests.helpers.tiny_targets import build_tiny_target


def layer_choices(model: object) -> set[str]:
    return {layer.self_attn.config._attn_implementation for layer in model.model.layers}


def test_switched_inside_and_restored_after() -> None:
    model = make_tiny_target("llama", num_layers=2).model
    before = model.config._attn_implementation
    with attention_implementation(model, "flex_attention"):
        assert model.config._attn_implementation == "flex_attention"
        assert layer_choices(model) == {"flex_attention"}
    assert model.config._attn_implementation == before and layer_choices(model) == {before}
    with attention_implementation(model, None):
        assert model.config._attn_implementation == before
    with pytest.raises(RuntimeError, match="inside"), attention_implementation(model, "flex_attention"):
        raise RuntimeError("inside")
    assert model.config._attn_implementation == before


@pytest.mark.parametrize(("arch", "choice"), [("gemma2", {"attn_implementation": "eager"}), ("qwen3", {}),
                                              ("gemma3_text", {})])
def test_a_soft_capped_target_loads_on_the_eager_attention(arch: str, choice: dict[str, str],
                                                           tmp_path: pathlib.Path) -> None:
    """Gemma-2's soft-capped scores exist on the eager attention only (SDPA drops the cap, and some transformers
    versions choose it): `load_target` asks for eager there, and for nothing elsewhere."""
    build_tiny_target(arch, 256).save_pretrained(tmp_path)
    assert attention_choice(str(tmp_path)) == choice
