"""`benchmarks/any_target.py` runs end to end on the toy Qwen3-MoE on a CPU (its GPU figures come from the real
shapes), writes every figure it promises, and counts a decode step's bytes as a hand count of the config does:
attention, norms, router, only the active experts, one embedding row and the head."""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest
import torch

from benchmarks.any_target import TINY_MOE, main

LAYERS = 2
FLOAT32 = 4


def layer_weights(experts: int) -> int:
    """Parameters of one toy Qwen3-MoE decoder layer whose experts count `experts` of them."""
    hidden, heads, kv_heads, head_dim = (TINY_MOE[key] for key in ("hidden_size", "num_attention_heads",
                                                                  "num_key_value_heads", "head_dim"))
    width = TINY_MOE["moe_intermediate_size"]
    attention = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim + 2 * head_dim  # q, o, k, v, q/k norms
    norms = 2 * hidden
    router = TINY_MOE["num_experts"] * hidden
    expert = 3 * hidden * width  # gate, up, down
    return attention + norms + router + experts * expert


def test_any_target_benchmark_on_the_tiny_moe(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DFLASH_BENCH_RESULTS", str(tmp_path))  # never the committed results
    main(["--shape", "tiny-moe", "--layers", str(LAYERS), "--batch", "1", "--batch", "2", "--new-tokens", "3",
          "--prompt-tokens", "8", "--block-size", "4", "--warmup", "0", "--iters", "2", "--repeats", "1",
          "--device", "cpu"])
    result = json.loads((tmp_path / "any_target-tiny-moe.json").read_text())
    assert result["layers"] == LAYERS and result["published_layers"] == TINY_MOE["num_hidden_layers"]
    assert result["complete"] and result["skipped"] == []
    for key in ("device", "date", "commit"):
        assert result[key]

    hidden, vocab = TINY_MOE["hidden_size"], TINY_MOE["vocab_size"]
    active = LAYERS * layer_weights(TINY_MOE["num_experts_per_tok"]) + hidden + hidden + vocab * hidden
    assert result["active_bytes_per_step"] == FLOAT32 * active  # layers, final norm, embedding row, lm_head
    total = LAYERS * layer_weights(TINY_MOE["num_experts"]) + hidden + 2 * vocab * hidden
    assert result["weight_bytes"] == FLOAT32 * total
    assert result["copy_bandwidth"] > 0
    assert result["floor_ms"] == pytest.approx(result["active_bytes_per_step"] / result["copy_bandwidth"] * 1e3)

    assert set(result["batches"]) == {"1", "2"}
    for rows, point in result["batches"].items():
        for key in ("hf_tokens_per_s", "engine_tokens_per_s", "engine_step_ms", "dflash_cycle_ms",
                    "floor_ms", "engine_step_over_floor", "dflash_cycle_over_engine_step"):
            assert point[key] > 0, (rows, key)
        # A difference of two calls' times: on a loaded CPU their noise can exceed it, and then it is left out
        assert point.get("hf_step_ms", 1) > 0 and ("hf_step_ms" in point) == ("hf_step_over_floor" in point)
        for name in ("hf", "engine", "dflash"):
            assert f"{name}_peak_bytes" in point  # None on a CPU
        assert point["engine_runner"] == point["dflash_runner"] == "HFCacheTarget"  # --runner hf, the default
    # two rows reach more experts than one
    assert result["batches"]["2"]["bytes_per_step"] > result["batches"]["1"]["bytes_per_step"]
    assert result["batches"]["1"]["bytes_per_step"] == result["active_bytes_per_step"]


def test_an_hf_step_lost_in_the_noise_is_left_out_not_negative(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """N tokens of `generate` timed no slower than one: the step (their difference) is not reported, the rest is."""
    from benchmarks import any_target

    times = iter([[5.0], [6.0]])  # the N-token call, then the one-token call
    monkeypatch.setattr(any_target, "time_calls", lambda *args, **kwargs: next(times))
    monkeypatch.setattr(any_target, "use_decode_experts", lambda *args, **kwargs: None)
    generated = types.SimpleNamespace(shape=(1, 8 + 3))
    target = types.SimpleNamespace(device=torch.device("cpu"),
                                   model=types.SimpleNamespace(generate=lambda *args, **kwargs: generated))
    point = any_target.measure_hf(target, [[5] * 8], types.SimpleNamespace(new_tokens=3, repeats=1))
    assert point["hf_tokens_per_s"] == pytest.approx(3 / 5.0 * 1e3) and "hf_step_ms" not in point
    assert "hf_step_over_floor" not in any_target.ratios({**point, "floor_ms": 1.0})


def test_budget_skips_the_measurements_left(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DFLASH_BENCH_RESULTS", str(tmp_path))
    assert main(["--shape", "tiny-moe", "--layers", str(LAYERS), "--budget-s", "0", "--device", "cpu"]) == []
    assert not (tmp_path / "any_target-tiny-moe.json").exists()


def test_a_hybrid_target_runs_on_the_static_runtime_in_the_benchmark(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The toy Qwen3-Next (Gated DeltaNet layers and gated attention, experts) with `--runner auto`: the target
    step and the DFlash cycle run on the static runtime's state rings, the reference on HF `generate`."""
    monkeypatch.setenv("DFLASH_BENCH_RESULTS", str(tmp_path))
    main(["--shape", "tiny-hybrid", "--runner", "auto", "--batch", "1", "--new-tokens", "3", "--prompt-tokens", "8",
          "--block-size", "4", "--warmup", "0", "--iters", "2", "--repeats", "1", "--device", "cpu"])
    point = json.loads((tmp_path / "any_target-tiny-hybrid.json").read_text())["batches"]["1"]
    assert point["engine_runner"] == point["dflash_runner"] == "StaticTarget"
    assert point["engine_step_ms"] > 0 and point["dflash_cycle_ms"] > 0 and point["hf_tokens_per_s"] > 0


def test_profile_writes_the_kernels_of_a_step_and_of_a_cycle(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`--profile`: a target step's and a DFlash cycle's heaviest operators, each in a file the JSON names."""
    monkeypatch.setenv("DFLASH_BENCH_RESULTS", str(tmp_path))
    main(["--shape", "tiny-moe", "--layers", str(LAYERS), "--batch", "1", "--new-tokens", "3", "--prompt-tokens", "8",
          "--block-size", "4", "--warmup", "0", "--iters", "2", "--repeats", "1", "--device", "cpu", "--profile"])
    point = json.loads((tmp_path / "any_target-tiny-moe.json").read_text())["batches"]["1"]
    for key in ("engine_profile", "dflash_profile"):
        assert (tmp_path / point[key]).read_text().strip(), key
    assert point["dflash_profile"].endswith("-cycle.profile.txt")
    reached = point["verify_experts_reached"]  # a block of 4 tokens, 2 experts each, of 8: 2..8 in each layer
    assert len(reached) == LAYERS and all(2 <= n <= 8 for n in reached), reached
    assert point["verify_experts_reached_even"] == pytest.approx(8 * (1 - (1 - 2 / 8) ** 4))


def test_the_latent_baseline_on_a_toy_moonlight(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`--latent-baseline` measures the engine and the cycle again with every cached slot expanded, on the static
    runner (`--runner auto`), beside the absorbed default, in the same run."""
    monkeypatch.setenv("DFLASH_BENCH_RESULTS", str(tmp_path))
    main(["--shape", "tiny-mla", "--runner", "auto", "--latent-baseline", "--batch", "1", "--new-tokens", "3",
          "--prompt-tokens", "8", "--block-size", "4", "--warmup", "0", "--iters", "1", "--repeats", "1",
          "--device", "cpu", "--measure", "engine", "--measure", "engine_expanded_latent",
          "--measure", "dflash_expanded_latent"])
    point = json.loads((tmp_path / "any_target-tiny-mla.json").read_text())["batches"]["1"]
    for key in ("engine_step_ms", "engine_expanded_latent_step_ms", "dflash_expanded_latent_cycle_ms"):
        assert point[key] > 0, key
    assert point["engine_runner"] == point["engine_expanded_latent_runner"] == "StaticTarget"
