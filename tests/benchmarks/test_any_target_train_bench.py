"""`benchmarks/any_target_train.py` runs the trainer's step end to end on the toy Qwen3-MoE on a CPU (its GPU
figures come from the real shapes), unpacked as the Qwen3-30B-A3B recipe trains and packed as the gpt-oss one
does, writes every figure it promises, and counts the target pass's FLOPs as a hand count of the config does."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from benchmarks.any_target import TINY_MOE
from benchmarks.any_target_train import causal_pairs, main

RECIPES = Path(__file__).parents[2] / "recipes"
TIMES = ("step_ms", "target_ms", "drafter_ms", "tokens_per_s", "tokens_per_step", "drafter_tflop_per_step",
         "target_tflop_per_step")
MEMORY = ("resident_bytes", "peak_bytes", "step_bytes", "warmup_peak_bytes", "full_depth_peak_estimate_bytes")
PHASES = {"target_features", "drafter_and_loss", "backward", "optimizer", "metrics_copy"}


def run(tmp_path: Path, *extra: str) -> dict[str, Any]:
    (result,) = main(["--shape", "tiny-moe", "--device", "cpu", "--warmup", "1", "--iters", "2", *extra])
    written = json.loads((tmp_path / "any_target_train-tiny-moe.json").read_text())
    assert written["step_ms"] == result["step_ms"]
    return written


def active_flops_per_token() -> int:
    """2 per weight a token multiplies in one toy layer: q/k/v/o, q/k norms, two norms, router, 2 of 8 experts."""
    hidden, heads, kv_heads, head_dim = (TINY_MOE[key] for key in ("hidden_size", "num_attention_heads",
                                                                  "num_key_value_heads", "head_dim"))
    attention = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim + 2 * head_dim
    experts = TINY_MOE["num_experts_per_tok"] * 3 * hidden * TINY_MOE["moe_intermediate_size"]
    return 2 * (attention + 2 * hidden + TINY_MOE["num_experts"] * hidden + experts)


def check_common(result: dict[str, Any]) -> None:
    assert result["status"] == "ok" and result["skipped"] == [] and result["timed_steps"] == 2
    for key in ("device", "date", "commit"):
        assert result[key]
    for key in TIMES:
        assert math.isfinite(result[key]) and result[key] > 0, key
    assert result["target_ms"] < result["step_ms"]
    assert all(math.isfinite(loss) for loss in result["losses"])
    assert set(result["phase_ms"]) == PHASES and all(ms > 0 for ms in result["phase_ms"].values())
    # one drafter layer reads layer 2 of the toy's 4: the pass stops after it
    assert (result["layers"], result["layers_in_pass"], result["target_layer_ids"]) == (4, 3, [2])
    assert result["experts_implementation"] == "grouped_mm" and result["model_type"] == "qwen3_moe"
    assert result["draft_layers"] == 1 and result["block_size"] == 16
    assert result["target_weight_bytes"] > result["draft_param_bytes"] > 0
    assert result["optimizer_state_bytes"] >= 2 * result["draft_param_bytes"]  # AdamW's two moments
    for key in MEMORY:
        assert result[key] is None, key  # no CUDA allocator on a CPU
    assert result["drafter_mfu"] is None  # no peak rate known for a CPU


def test_the_unpacked_recipe_step_on_the_tiny_moe(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DFLASH_BENCH_RESULTS", str(tmp_path))  # never the committed results
    result = run(tmp_path)
    check_common(result)
    assert not result["packed"] and result["row_tokens"] == 96 and result["tokens_per_step"] == 96
    assert "training.compile=false" in result["settings"] and result["recipe"].endswith("qwen3-30b-a3b-dflash-b16.yaml")
    layers, tokens, width = 3, 96, TINY_MOE["num_attention_heads"] * TINY_MOE["head_dim"]
    hand = layers * (tokens * active_flops_per_token() + 4 * width * tokens * (tokens + 1) // 2)
    assert result["target_tflop_per_step"] * 1e12 == pytest.approx(hand)


def test_the_packed_recipe_step_on_the_tiny_moe(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DFLASH_BENCH_RESULTS", str(tmp_path))
    result = run(tmp_path, "--recipe", str(RECIPES / "gpt-oss-20b-dflash-b16-packed.yaml"),
                 "--set", "training.learning_rate=1e-4")
    check_common(result)
    assert result["packed"] and result["row_tokens"] == 192 and result["anchors_per_row"] > 0
    assert result["target_attention"] == "dflash_varlen"  # the recipe's varlen pass (per chat on a CPU)
    assert 96 < result["tokens_per_step"] <= 192  # several chats share the row
    assert result["settings"][-1] == "training.learning_rate=1e-4"  # --set comes last


def test_the_budget_skips_the_shapes_left(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DFLASH_BENCH_RESULTS", str(tmp_path))
    assert main(["--shape", "tiny-moe", "--device", "cpu", "--budget-s", "0"]) == []
    assert not (tmp_path / "any_target_train-tiny-moe.json").exists()


@pytest.mark.parametrize("length, window", [(1, None), (7, None), (7, 3), (3, 7), (128, 128), (300, 128)])
def test_causal_pairs_count_each_query_keys(length: int, window: int | None) -> None:
    assert causal_pairs(length, window) == sum(min(i + 1, window or length) for i in range(length))
