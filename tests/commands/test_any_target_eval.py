"""`dflash-train eval` end to end on targets the static runner does not run (latent attention, linear attention):
it decodes through the model's own forward and caches, says so once, and the drafted output equals the target's
own greedy output; and on two it runs through their adapters (experts with a dense first layer; sliding windows
with soft-capping as the model's own layers), saying nothing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dflash_train.cli import main
from dflash_train.runtime import engine
from tests.helpers.tiny_models import TINY_EMBEDDING_ROWS, make_tiny_tokenizer
from tests.helpers.tiny_targets import build_tiny_target


@pytest.mark.parametrize(("name", "overrides"), [
    ("glm4_moe", {}), ("gemma2", {}), ("deepseek_v3", {}), ("qwen3_5", {}), ("falcon_h1", {}),
    ("llama", {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}}),  # refused
])
def test_eval_is_lossless_and_says_which_path_ran(name: str, overrides: dict[str, object], tmp_path: Path,
                                                  caplog: pytest.LogCaptureFixture,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine, "_announced", set())  # said once per process: forget earlier tests' targets
    target_dir = tmp_path / "target"
    build_tiny_target(name, TINY_EMBEDDING_ROWS, **overrides).save_pretrained(target_dir)
    make_tiny_tokenizer().save_pretrained(target_dir)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "hello who are you"}\n{"turns": ["what is the capital", "why"]}\n')
    out = tmp_path / "report.json"
    with caplog.at_level("WARNING"):
        code = main(["eval", "--target", str(target_dir), "--draft", "random", "--random-draft-layers", "1",
                     "--block-size", "4", "--max-new-tokens", "10", "--no-progress", "--dataset", str(prompts),
                     "--out", str(out)])
    assert code == 0
    row = json.loads(out.read_text())["datasets"]["prompts"]
    assert row["lossless"] is True and row["requests"] == 3 and row["new_tokens_with_draft"] > 0
    said = [r.getMessage() for r in caplog.records if "does not run" in r.getMessage()]
    if not overrides:  # on the static-cache runtime (qwen3_5, falcon_h1: on its state rings; deepseek_v3: latents)
        assert said == []
    else:
        assert len(said) == 1 and "model's own forward and caches" in said[0]
