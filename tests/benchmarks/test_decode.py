"""`benchmarks/decode.py` runs end to end on tiny CPU shapes (its GPU numbers come from the H200), and the
reference loop it compares against gives the fast loop's tokens and acceptance lengths; `--variants` measures
only the variants named, refuses unknown ones, and the JSON written after each variant survives a run cut
short."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from benchmarks import decode
from benchmarks.decode import main
from benchmarks.shapes import TINY_LLAMA

# Profiles of 2 calls (tests/benchmarks/conftest.py), for every test of the module.
pytestmark = pytest.mark.usefixtures("short_profiles")


def test_decode_benchmark_tiny_cpu(tmp_path: Path) -> None:
    out = tmp_path / "decode.json"
    main(["--tiny", "--device", "cpu", "--iters", "3", "--warmup", "1", "--max-new-tokens", "12", "--prompts", "2",
          "--profile", "--compile-variants", "--out", str(out)])
    result = json.loads(out.read_text())
    assert out.with_suffix(".png").is_file() and result["tiny"] is True
    profile = out.with_suffix(".profile.txt").read_text()
    assert "== target_step" in profile and "== dflash_cycle" in profile and "aten::" in profile
    assert "profiles" not in result["qwen3_8b"]
    qwen = result["qwen3_8b"]
    for name in ("frozen", "autotuned", "autotuned_matmuls", "tuned_launches"):  # CPU: uncompiled, the default
        assert qwen[f"target_step_{name}_ms"] > 0 and qwen[f"target_step_{name}_max_logit_diff"] == 0
        assert qwen[f"target_step_{name}_setup_s"] > 0
    assert qwen["target_step_attention"] == "sdpa" and "target_step_sdpa_attention_ms" not in qwen  # CPU: no kernel
    for key in ("target_step_ms", "target_step_no_graph_ms", "target_step_eager_ms", "dflash_cycle_ms", "hf_step_ms",
                "target_step_unfused_ms", "target_step_setup_s", "dflash_cycle_eager_setup_s"):
        assert qwen[key] > 0
    assert qwen["weight_bytes_per_step"] == 4 * (8 * (2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128 + 2 * 64 + 2 * 16)
                                                 + 64 + 512 * 64)  # layers + final norm + lm_head, fp32
    # the tiny 3-layer drafter's layers (the target's per layer), fc over 3 target layers, two norms; the head again
    assert qwen["draft_bytes_per_cycle"] == 4 * (3 * (2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128 + 2 * 64 + 2 * 16)
                                                 + 64 * 3 * 64 + 2 * 64 + 512 * 64)
    assert qwen["cycle_floor_over_floor"] == pytest.approx(
        (qwen["weight_bytes_per_step"] + qwen["draft_bytes_per_cycle"]) / qwen["weight_bytes_per_step"])
    assert qwen["cycle_over_cycle_floor"] == pytest.approx(qwen["dflash_cycle_ms"] / qwen["cycle_floor_ms"])
    smol = result["smollm2"]
    assert smol["prompts"] == 2 and smol["identical_tokens"] == 2 and smol["identical_acceptance"] == 2
    assert smol["lossless_vs_target_only"] == 2 and smol["ours_tokens_per_s"] > 0
    assert smol["decode_speedup_over_own_target_only"] > 0 and smol["ours_decode_tokens_per_s"] > 0
    assert smol["ours_cycle_ms"] > 0 and smol["ours_target_only_step_ms"] > 0
    assert smol["dtype"] == "float32" and smol["reference_loop_tau"] == pytest.approx(smol["tau"])


def test_decode_benchmark_refuses_an_unknown_compile_variant(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--tiny", "--device", "cpu", "--compile-variants", "autotuned,nope"])
    assert "unknown nope; choose from frozen, autotuned" in capsys.readouterr().err


TINY_QWEN3 = ["--tiny", "--device", "cpu", "--section", "qwen3-8b", "--iters", "2", "--warmup", "1"]


def test_decode_benchmark_measures_only_the_chosen_variants(tmp_path: Path) -> None:
    out = tmp_path / "decode.json"
    main([*TINY_QWEN3, "--variants", "default", "--out", str(out)])
    result = json.loads(out.read_text())
    qwen = result["qwen3_8b"]
    assert result["complete"] is True and qwen["variants"] == ["default"]
    for name in ("target_step", "dflash_cycle"):
        assert qwen[f"{name}_launches"] > 0 and qwen[f"{name}_kernel_ms"] > 0 and qwen[f"{name}_gap_ms"] >= 0
        assert qwen[f"{name}_busy_ms"] == pytest.approx(qwen[f"{name}_kernel_ms"] + qwen[f"{name}_gap_ms"])
        assert qwen[f"{name}_gap_per_launch_us"] == pytest.approx(qwen[f"{name}_gap_ms"] * 1e3
                                                                  / qwen[f"{name}_launches"])
        assert qwen[f"{name}_host_ms"] == pytest.approx(qwen[f"{name}_ms"] - qwen[f"{name}_busy_ms"])
        assert qwen[f"{name}_profiled_ms"] >= qwen[f"{name}_busy_ms"]
        categories = qwen[f"{name}_kernel_categories"]  # CPU: operators, the matmuls among them
        assert categories["matmul"]["ms"] > 0 and categories["matmul"]["launches"] > 0
        assert sum(entry["launches"] for entry in categories.values()) == pytest.approx(qwen[f"{name}_launches"])
    assert qwen["target_step_over_floor"] > 0 and qwen["cycle_over_target_step"] > 0
    skipped = ("layer_scope", "no_graph", "eager", "unfused", "hf_step", "over_step_scope", "setup_saved")
    assert not [key for key in qwen if any(part in key for part in skipped)]


def test_a_batch_of_rows_is_decoded_and_recorded(tmp_path: Path) -> None:
    """--batch: every row of the step holds a request at the context's end, and the batch is recorded."""
    out = tmp_path / "decode.json"
    main([*TINY_QWEN3, "--variants", "layer_scope,hf", "--batch", "4", "--out", str(out)])
    qwen = json.loads(out.read_text())["qwen3_8b"]
    assert qwen["batch"] == 4 and qwen["target_step_layer_scope_ms"] > 0 and qwen["dflash_cycle_layer_scope_ms"] > 0
    assert "hf_step_ms" not in qwen  # timed at batch 1 only
    batch_matmuls = qwen["target_step_layer_scope_kernel_categories"]["matmul"]["launches"]
    main([*TINY_QWEN3, "--variants", "layer_scope", "--out", str(out)])
    single = json.loads(out.read_text())["qwen3_8b"]
    assert single["batch"] == 1 and single["target_step_layer_scope_kernel_categories"]["matmul"]["launches"] == (
        batch_matmuls)  # the same step, wider


def test_decode_benchmark_refuses_an_unknown_variant_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main([*TINY_QWEN3, "--variants", "default,nope"])
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "--variants: unknown nope; choose from default, layer_scope, no_graph" in error


class CutShort(Exception):
    """Stands for a time limit that ends the run."""


def test_decode_benchmark_keeps_what_it_measured_when_cut_short(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    measure = decode.engine_step_ms
    calls: list[int] = []

    def first_only(*args: Any, **kwargs: Any) -> float:
        calls.append(1)
        if len(calls) > 1:  # the second variant never ends
            raise CutShort
        return measure(*args, **kwargs)

    monkeypatch.setattr(decode, "engine_step_ms", first_only)
    out = tmp_path / "decode.json"
    with pytest.raises(CutShort):
        main([*TINY_QWEN3, "--variants", "default,layer_scope", "--out", str(out)])
    result = json.loads(out.read_text())
    qwen = result["qwen3_8b"]
    assert result["complete"] is False and qwen["target_step_ms"] > 0 and qwen["target_step_gap_ms"] >= 0
    assert qwen["target_step_over_floor"] > 0 and "target_step_layer_scope_ms" not in qwen


def test_decode_benchmark_at_smollm2_shapes_builds_a_llama_of_that_shape(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    built: list[tuple[str, dict]] = []
    build = decode.random_target

    def recording(model_type: str, shape: dict, *args: Any) -> Any:
        built.append((model_type, shape))
        return build(model_type, shape, *args)

    monkeypatch.setattr(decode, "random_target", recording)
    out = tmp_path / "decode.json"
    main(["--tiny", "--device", "cpu", "--section", "random", "--shape", "smollm2", "--iters", "2", "--warmup", "1",
          "--variants", "default", "--out", str(out)])
    result = json.loads(out.read_text())
    assert "qwen3_8b" not in result and built == [("llama", TINY_LLAMA)]
    small = result["smollm2_shape"]
    assert small["shape_name"] == "smollm2" and small["shape"] == TINY_LLAMA
    # the floor counts tied embeddings once: every parameter of the model is read by a step
    target = build("llama", TINY_LLAMA, torch.device("cpu"), torch.float32)
    assert small["weight_bytes_per_step"] == sum(p.numel() * 4 for p in target.model.parameters())
    assert small["target_step_launches"] > 0 and small["cycle_over_target_step"] > 0
    assert "kernels" not in small


def test_the_deferred_residual_ablation_is_measured_beside_layer_scope(tmp_path: Path) -> None:
    out = tmp_path / "decode.json"
    main([*TINY_QWEN3, "--variants", "layer_scope,undeferred_residual", "--out", str(out)])
    qwen = json.loads(out.read_text())["qwen3_8b"]
    assert qwen["target_step_undeferred_residual_ms"] > 0 and "dflash_cycle_undeferred_residual_ms" not in qwen
    assert qwen["step_ms_saved_by_deferred_residual"] == pytest.approx(
        qwen["target_step_undeferred_residual_ms"] - qwen["target_step_layer_scope_ms"])
    assert "launches_per_layer_saved_by_deferred_residual" in qwen
