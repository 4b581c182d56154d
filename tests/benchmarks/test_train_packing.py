"""`benchmarks/train_packing.py` end to end on a tiny Llama and short chats on a CPU (its figures come from the
H200): each variant runs the real trainer in its own process, the recipe and `--set` reach the trainer, and
`--profile` accounts for a step's time (on a CPU, top-level operators stand in for kernels)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from benchmarks.profiling import kernel_category
from benchmarks.shapes import SMOLLM2_135M
from benchmarks.train_packing import TRAINING_CATEGORIES, error_lines, main, save_word_tokenizer


def test_train_packing_profiles_a_tiny_packed_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("DFLASH_BENCH_RESULTS", str(tmp_path / "results"))
    monkeypatch.setenv("DFLASH_PEAK_TFLOPS", "0.5")  # a peak for the CPU, so MFU is reported here too
    recipe = Path(__file__).parents[2] / "recipes" / "smollm2-135m-dflash-b16-packed.yaml"
    main(["--tiny", "--chats", "64", "--steps", "2", "--num-anchors", "8", "--variants", "packed,padded", "--profile",
          "--recipe", str(recipe), "--set", "training.learning_rate=1e-4", "--workdir", str(tmp_path / "work")])
    out = capsys.readouterr().out
    result = json.loads((tmp_path / "results" / "train_packing.json").read_text())
    packed, padded = result["results"]
    assert (packed["variant"], padded["variant"]) == ("packed", "padded")
    # The packed recipe (and the tiny settings) set data.pack_tokens: the padded baseline must not inherit it.
    assert padded["chats_per_step"] == 2  # the tiny settings' 2 rows, one chat each
    # the ratio of a variant measured before the padded one is filled in once the padded one has run
    assert packed["chat_passes_vs_padded"] == pytest.approx(packed["chat_passes_per_min"] / padded["chat_passes_per_min"])
    assert packed["queued_chat_passes_vs_padded"] == pytest.approx(  # as `fit` runs the steps
        packed["queued_chat_passes_per_min"] / padded["queued_chat_passes_per_min"])
    assert padded["queued_chat_passes_vs_padded"] == pytest.approx(1.0)
    assert packed["variant"] == "packed" and packed["chats_per_step"] > 2  # several chats share a row
    assert packed["load_s_median"] > 0  # the loader thread's time for a step's data
    # the same number of steps queued as `fit` runs them, waited for once
    assert packed["queued_step_s"] > 0 and packed["queued_chat_passes_per_min"] > 0
    # MFU against the trainer's own denominator, for the timed steps and for the queued ones
    assert packed["flops_per_step"] > 0 and packed["mfu"] > 0
    assert packed["queued_mfu"] == pytest.approx(packed["flops_per_step"] / packed["queued_step_s"] / 0.5e12)
    # online features: the target's pass adds to the step's FLOPs, and its MFU is the same rate over more work
    assert packed["step_flops_per_step"] > packed["flops_per_step"]
    assert packed["queued_step_mfu"] == pytest.approx(packed["step_flops_per_step"] / packed["queued_step_s"] / 0.5e12)
    assert packed["mfu_median_step"] > 0 and packed["step_graphs_captured"] is None  # no step graphs asked for
    # `benchmarks.step_flops` lays out the same steps on the host without running a model: the same counts
    # (in its own process, as a benchmark runs: a trainer here would meet the accelerate state of earlier tests)
    subprocess.run([sys.executable, "-m", "benchmarks.step_flops", "--tiny", "--chats", "64", "--steps", "2",
                    "--num-anchors", "8", "--variants", "packed", "--recipe", str(recipe),
                    "--workdir", str(tmp_path / "work")], check=True, cwd=Path(__file__).parents[2],
                   env={**os.environ, "DFLASH_BENCH_RESULTS": str(tmp_path / "results")}, capture_output=True)
    (counted,) = json.loads((tmp_path / "results" / "step_flops.json").read_text())["results"]
    assert counted["drafter_flops_per_step"] == pytest.approx(packed["flops_per_step"], rel=1e-12)
    assert counted["step_flops_per_step"] == pytest.approx(packed["step_flops_per_step"], rel=1e-12)
    profile = packed["profile"]
    assert profile["steps"] == 3 and profile["launches"] > 0 and profile["wall_ms"] > 0
    assert sum(entry["launches"] for entry in profile["categories"].values()) == pytest.approx(profile["launches"])
    assert profile["categories"]["matmul"]["ms"] > 0  # the CPU's aten::mm / addmm / linear operators
    heaviest = list(profile["kernels"].values())
    assert heaviest and all(a["ms"] >= b["ms"] for a, b in zip(heaviest, heaviest[1:], strict=False))
    assert "packed: step" in out and "matmul" in out
    phases = profile["host_ms"]  # the host's time in the phases the trainer marks, within the step's wall time
    assert set(phases) == {"train/target_features", "train/drafter_and_loss", "train/backward", "train/optimizer",
                           "train/metrics_copy"}
    # means per step of ranges nested in each step's: at most the mean wall time (the median may be less when
    # one step is slow, as on a busy machine)
    assert all(ms > 0 for ms in phases.values()) and sum(phases.values()) <= profile["wall_mean_ms"] * 1.001
    # the same phases on the device's timeline (here the host's clock), in unprofiled steps: nested in those steps,
    # together they fit in their mean (timed in the same steps: a step of another run may be faster on a busy
    # machine); a sum over the steps instead of a mean would be about 3x it
    device = profile["device_ms"]
    assert set(device) == set(phases) and all(ms > 0 for ms in device.values())
    assert sum(device.values()) <= profile["device_step_ms"] * 1.001
    assert "device ms by phase" in out


def test_train_packing_says_so_when_no_variant_finished(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("DFLASH_BENCH_RESULTS", str(tmp_path / "results"))
    with pytest.raises(SystemExit, match="no variant finished"):  # 5 draft layers cannot read a 6-layer target
        main(["--tiny", "--chats", "16", "--steps", "1", "--variants", "packed", "--set", "model.num_draft_layers=5",
              "--workdir", str(tmp_path / "work")])
    failure = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("packed: failed"))
    assert "Error" in failure.split("): ", 1)[1]  # the exception itself, not only the stderr's tail
    # and in the results file, where a log cut short cannot lose it
    (recorded,) = json.loads((tmp_path / "results" / "train_packing.json").read_text())["failed"]
    assert recorded["variant"] == "packed" and recorded["exit"] != 0
    assert any("Error" in line for line in recorded["errors"]) and recorded["errors"][0] in failure


def test_error_lines_finds_the_exception_above_a_graph_dump() -> None:
    stderr = ("Traceback (most recent call last):\n  File \"x.py\", line 1\n"
              "torch._inductor.exc.InductorError: LoweringException: AssertionError: block sizes\n"
              "  target: flex_attention_backward\n  args[0]: TensorBox(...)\n" + "  Found from : ...\n" * 50)
    assert error_lines(stderr) == ["torch._inductor.exc.InductorError: LoweringException: AssertionError: block sizes"]
    assert error_lines("Warning: deprecated\nloss 1.0\n") == []


@pytest.mark.parametrize(("name", "category"), [
    ("_cross_entropy_kernel", "cross-entropy"),
    ("triton_tem_fused_flex_attention_backward_transpose_view_5", "attention"),
    ("void at::native::multi_tensor_apply_kernel<FusedAdamMathFunctor>", "optimizer"),
    ("triton_red_fused__to_copy_mean_pow_rsqrt_0", "norm"),
    ("nvjet_tst_128x256_64x4_2x1_v_bz_coopA_NNT", "matmul"),
    ("aten::addmm", "matmul"),
    ("void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda>", "copy/cast"),
    ("triton_poi_fused_add_mul_silu_3", "other fused"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::exp_kernel>", "other"),
])
def test_training_kernels_fall_in_their_categories(name: str, category: str) -> None:
    assert kernel_category(name, TRAINING_CATEGORIES) == category


def test_the_synthetic_target_tokenizer_covers_the_whole_vocabulary(tmp_path: Path) -> None:
    """The synthetic chats draw ids up to the vocabulary's size; a 1,000-word tokenizer made the trainer refuse
    them as damaged data at SmolLM2 shapes."""
    save_word_tokenizer(tmp_path, SMOLLM2_135M["vocab_size"])
    assert max(AutoTokenizer.from_pretrained(tmp_path).get_vocab().values()) + 1 >= SMOLLM2_135M["vocab_size"]


@pytest.mark.slow  # a SmolLM2-sized model on a CPU: 20-60 s
def test_train_packing_runs_at_smollm2_shapes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU run's shapes (a SmolLM2-135M-shaped target, its vocabulary, chats drawn from all of it) with
    short rows and one step, on a CPU: what `--tiny` changes is what broke an H200 run once."""
    monkeypatch.setenv("DFLASH_BENCH_RESULTS", str(tmp_path / "results"))
    main(["--chats", "24", "--steps", "1", "--num-anchors", "8", "--variants", "packed",
          "--set", "data.max_length=512", "--set", "data.pack_tokens=1024", "--set", "training.batch_size=1",
          "--set", "training.compile=false", "--set", "training.compile_target=false",
          "--set", "training.mixed_precision=no", "--workdir", str(tmp_path / "work")])
    (packed,) = json.loads((tmp_path / "results" / "train_packing.json").read_text())["results"]
    assert packed["chats_per_step"] >= 1 and packed["step_s_median"] > 0
