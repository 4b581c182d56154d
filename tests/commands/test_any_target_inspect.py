"""`inspect` on every architecture users train drafters for: the layer mix, the decode path and whether packed
rows are exact, in lines of their own, never a traceback."""

from __future__ import annotations

import pathlib

import pytest

from dflash_train.cli import main
from tests.helpers.tiny_models import TINY_EMBEDDING_ROWS, make_tiny_tokenizer
from tests.helpers.tiny_targets import TINY_TARGET_FAMILIES, TINY_TARGETS, build_tiny_target

STATIC_RUNTIME = ("llama", "qwen2", "qwen3", "qwen3_yarn", "mistral", "qwen3_moe", "mixtral", "gpt_oss", "glm4_moe",
                  "phi3", "olmo2", "granite", "smollm3", "gemma2", "gemma3_text", "cohere2", "exaone4",
                  "qwen3_next", "qwen3_5", "qwen3_5_moe", "lfm2", "nemotron_h",
                  "falcon_h1", "deepseek_v3", "deepseek_v3_yarn")


@pytest.mark.parametrize("name", TINY_TARGETS)
def test_inspect_names_the_layer_mix_the_decode_path_and_packing(
        name: str, tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    build_tiny_target(name, TINY_EMBEDDING_ROWS).save_pretrained(tmp_path)
    make_tiny_tokenizer().save_pretrained(tmp_path)
    assert main(["inspect", "--target", str(tmp_path), "--num-draft-layers", "1"]) == 0
    out = capsys.readouterr().out
    lines = dict(line.split("  ", 1) for line in out.splitlines() if "  " in line)
    kinds = lines["decoder layers"].strip()
    assert kinds[0] in "1234" and any(kind in kinds for kind in ("attention", "conv", "hybrid"))
    fast = name in STATIC_RUNTIME
    path = lines["decode path"].strip()
    if fast:  # what a row keeps, and how much: a KV cache, state rings (hybrids), or both
        assert path.startswith("static-cache runtime (") and "MiB a row at 4,096 positions" in path
        assert ("state rings" in path) == (name in TINY_TARGET_FAMILIES["hybrid"])
        assert "KV cache" in path  # every tiny target has attention layers
    else:
        assert path == "the model's own forward and caches (exact, slower)"
    recurrent = name in TINY_TARGET_FAMILIES["hybrid"]
    assert lines["packed training rows"].strip().startswith("refused" if recurrent else "exact")
    if name in TINY_TARGET_FAMILIES["moe"]:
        assert "MoE 4 experts, 2 active" in kinds
