"""`benchmarks/decode.py --variants skinny_matmul` (and `skinny_fused`): measured only where the runner has the Triton kernels (so
not on a CPU, where it would repeat the default), its bookkeeping on tiny CPU shapes when forced, and its
ratios against the default and the layer-scope step."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import decode
from benchmarks.decode import VARIANTS, ablation_applies, derived, main
from dflash_train.kernels import skinny_matmul
from dflash_train.runtime.static_target import StaticTarget
from tests.helpers.tiny_models import make_tiny_target

TINY_QWEN3 = ["--tiny", "--device", "cpu", "--section", "qwen3-8b", "--iters", "2", "--warmup", "1"]
# Profiles of 2 calls (tests/benchmarks/conftest.py), for every test of the module and its module-scoped run.
pytestmark = pytest.mark.usefixtures("short_profiles")


@pytest.mark.parametrize("variant", ["skinny_matmul", "skinny_fused", "skinny_fused_carried", "prefetch_o_proj"])
def test_the_variant_runs_only_with_the_triton_kernels(variant: str) -> None:
    assert variant in VARIANTS
    target = make_tiny_target("qwen3", num_layers=1)
    assert not ablation_applies(variant, StaticTarget(target, 1, 8))
    assert ablation_applies(variant, StaticTarget(target, 1, 8, kernels="triton"))


def test_ratios() -> None:
    result = {"floor_ms": 3.5, "target_step_ms": 5.0, "target_step_layer_scope_ms": 5.0,
              "target_step_skinny_matmul_ms": 4.0, "dflash_cycle_ms": 6.0, "dflash_cycle_skinny_matmul_ms": 5.0}
    ratios = derived(result)
    assert ratios["target_step_skinny_matmul_over_floor"] == pytest.approx(4.0 / 3.5)
    assert ratios["target_step_skinny_matmul_over_layer_scope"] == pytest.approx(0.8)
    assert ratios["dflash_cycle_skinny_matmul_over_default"] == pytest.approx(5.0 / 6.0)
    assert ratios["cycle_skinny_matmul_over_target_step_skinny_matmul"] == pytest.approx(1.25)
    assert "dflash_cycle_skinny_matmul_over_layer_scope" not in ratios  # no layer-scope cycle measured
    assert not any("skinny_fused" in key for key in ratios)  # not measured
    fused = derived({**result, "target_step_skinny_fused_ms": 3.5, "dflash_cycle_skinny_fused_ms": 4.2})
    assert fused["target_step_skinny_fused_over_floor"] == pytest.approx(1.0)
    assert fused["cycle_skinny_fused_over_target_step_skinny_fused"] == pytest.approx(1.2)
    assert fused["target_step_skinny_fused_over_layer_scope"] == pytest.approx(0.7)


def test_forced_on_a_cpu_it_records_what_ran(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a CPU the runner has no Triton kernels, so the variants run cuBLAS's place-holder (torch) and say so."""
    monkeypatch.setattr(decode, "ablation_applies", lambda label, runner: True)
    out = tmp_path / "decode.json"
    main([*TINY_QWEN3, "--variants", "skinny_matmul,skinny_fused,skinny_fused_carried", "--out", str(out)])
    qwen = json.loads(out.read_text())["qwen3_8b"]
    for loop in ("target_step", "dflash_cycle"):
        for variant in ("skinny_matmul", "skinny_fused", "skinny_fused_carried"):
            assert qwen[f"{loop}_{variant}_ms"] > 0 and qwen[f"{loop}_{variant}_setup_s"] > 0
            assert qwen[f"{loop}_{variant}_matmul"] == "torch" and qwen[f"{loop}_{variant}_compile_error"] is None
            assert qwen[f"{loop}_{variant}_kernel_categories"]["matmul"]["launches"] > 0
    assert qwen["target_step_skinny_fused_over_floor"] > 0 and "target_step_ms" not in qwen


@pytest.fixture(scope="module")
def cycle_ablations(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One tiny run of both cycle ablations beside the layer-scope cycle, forced on a CPU (where the drafter's
    attention is SDPA and the state update unfused either way)."""
    out = tmp_path_factory.mktemp("cycle-ablations") / "decode.json"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(decode, "engine_ablation_applies", lambda runner: True)
        main([*TINY_QWEN3, "--variants", "layer_scope,sdpa_draft_attention,torch_state_update,torch_draft_argmax",
              "--out", str(out)])
    return json.loads(out.read_text())["qwen3_8b"]


def test_the_drafter_attention_ablation_measures_the_cycle_on_sdpa(cycle_ablations: dict) -> None:
    """The cycle's figures under their own key, what ran, and the difference against the layer-scope cycle."""
    assert "sdpa_draft_attention" in VARIANTS
    target = make_tiny_target("qwen3", num_layers=1)
    assert not decode.engine_ablation_applies(StaticTarget(target, 1, 8))
    assert decode.engine_ablation_applies(StaticTarget(target, 1, 8, kernels="triton"))
    qwen = cycle_ablations
    assert qwen["dflash_cycle_sdpa_draft_attention_ms"] > 0
    assert qwen["dflash_cycle_sdpa_draft_attention_draft_attention"] == "sdpa"
    assert qwen["dflash_cycle_layer_scope_draft_attention"] == "sdpa"  # a CPU runner has no Triton kernels
    assert "target_step_sdpa_draft_attention_ms" not in qwen  # the cycle only
    assert qwen["cycle_ms_saved_by_draft_attention_kernel"] == pytest.approx(
        qwen["dflash_cycle_sdpa_draft_attention_ms"] - qwen["dflash_cycle_layer_scope_ms"])


def test_the_state_update_ablation_measures_the_cycle_unfused(cycle_ablations: dict) -> None:
    """The cycle's figures under their own key, whether the update ran fused, and the difference against the
    layer-scope cycle."""
    assert "torch_state_update" in VARIANTS
    qwen = cycle_ablations
    assert qwen["dflash_cycle_torch_state_update_ms"] > 0
    assert qwen["dflash_cycle_torch_state_update_fused_state_update"] is False
    assert qwen["dflash_cycle_layer_scope_fused_state_update"] is False  # a CPU runner has no Triton kernels
    assert qwen["cycle_ms_saved_by_fused_state_update"] == pytest.approx(
        qwen["dflash_cycle_torch_state_update_ms"] - qwen["dflash_cycle_layer_scope_ms"])


def test_the_draft_argmax_ablation_measures_the_cycle_on_torch_argmax(cycle_ablations: dict) -> None:
    """The cycle with torch.argmax for its drafts, what picked them, and the difference against the layer-scope
    cycle, waited for and queued."""
    assert "torch_draft_argmax" in VARIANTS
    qwen = cycle_ablations
    assert qwen["dflash_cycle_torch_draft_argmax_draft_argmax"] == "torch"
    assert qwen["dflash_cycle_layer_scope_draft_argmax"] == "torch"  # a CPU runner has no Triton kernels
    for timing in ("", "_queued"):
        assert qwen[f"cycle{timing}_ms_saved_by_draft_argmax_kernel"] == pytest.approx(
            qwen[f"dflash_cycle_torch_draft_argmax{timing}_ms"] - qwen[f"dflash_cycle_layer_scope{timing}_ms"])


def test_cycles_are_timed_queued_as_the_loop_runs_them(cycle_ablations: dict) -> None:
    """Every measured call has its queued time beside the waited-for one, and the cycle's queued cost in steps
    is their ratio."""
    qwen = cycle_ablations
    for key in ("target_step_layer_scope", "dflash_cycle_layer_scope", "dflash_cycle_torch_state_update"):
        assert qwen[f"{key}_queued_ms"] > 0
    assert qwen["queued_layer_scope_cycle_over_target_step"] == pytest.approx(
        qwen["dflash_cycle_layer_scope_queued_ms"] / qwen["target_step_layer_scope_queued_ms"])


def test_swept_tilings_replace_the_table(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`--skinny-configs` puts a sweep's best tiling per product in the kernel's table (a product the sweep did not
    reach keeps the default); a file without swept tilings, or no file, is one line."""
    monkeypatch.setattr(skinny_matmul, "CONFIGS", {})
    sweep = tmp_path / "sweep.json"
    sweep.write_text(json.dumps({"products": {
        "o_proj": {"n": 576, "k": 576, "best_config": [16, 64, 2, 2, 4]},
        "qkv": {"n": 960, "k": 576}}}))  # timed, not swept
    assert decode.use_swept_tilings(sweep) == {"576,576": [16, 64, 2, 2, 4]}
    assert skinny_matmul.config_for(576, 576) == skinny_matmul.Config(16, 64, 2, 2, split_k=4)
    assert skinny_matmul.config_for(960, 576) == skinny_matmul.default_config(960, 576)
    sweep.write_text(json.dumps({"products": {}}))
    with pytest.raises(SystemExit, match="holds no swept tilings"):
        decode.use_swept_tilings(sweep)
    with pytest.raises(SystemExit):
        main([*TINY_QWEN3, "--skinny-configs", str(tmp_path / "missing.json")])
