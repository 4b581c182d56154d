"""`benchmarks/decode.py` runs end to end on tiny CPU shapes (its GPU numbers come from the H200), and the
reference loop it compares against gives the fast loop's tokens and acceptance lengths."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.decode import main


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
