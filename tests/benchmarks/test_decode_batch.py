"""`benchmarks/decode_batch.py` on the CPU: the acceptance replay draws a+1 from the requested distribution,
the engine replays those draws cycle by cycle and commits the target's own tokens; the quick mode runs
end to end; the crossing of 1x is located; launches per step are counted (`benchmarks/profiling.py`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from benchmarks.decode_batch import Acceptance, ReplayEngine, crossing, main, measuring_order
from benchmarks.decode_timing import random_draft
from benchmarks.profiling import launches_per_step
from dflash_train.runtime.engine import EngineConfig
from tests.helpers.tiny_models import make_tiny_target


def test_geometric_acceptance_has_the_requested_mean() -> None:
    for tau in (1.0, 1.8, 6.0, 16.0):
        acceptance = Acceptance.geometric(tau, 16)
        assert acceptance.tau == pytest.approx(tau, abs=1e-9)
        assert sum(acceptance.probabilities) == pytest.approx(1.0) and len(acceptance.probabilities) == 16
    rates = Acceptance.geometric(6.0, 16).probabilities
    assert all(a > b for a, b in zip(rates[:14], rates[1:15], strict=True))  # P(a+1 = k) falls with k below B
    with pytest.raises(ValueError, match="tau must lie"):
        Acceptance.geometric(17.0, 16)


def test_draws_follow_the_distribution() -> None:
    acceptance = Acceptance.from_counts([1, 3, 2, 0, 4], 8, "counts")
    assert acceptance.probabilities == (0.1, 0.3, 0.2, 0.0, 0.4, 0.0, 0.0, 0.0)
    draws = acceptance.draws(50, 400, seed=3)
    assert draws.shape == (50, 400) and draws.dtype == torch.int64
    frequencies = torch.bincount(draws.flatten(), minlength=9)[1:].double() / draws.numel()
    torch.testing.assert_close(frequencies, torch.tensor(acceptance.probabilities, dtype=torch.float64), atol=0.012,
                               rtol=0)
    assert torch.equal(draws, acceptance.draws(50, 400, seed=3))  # seeded


def test_parse_reads_a_tau_counts_or_an_eval_json(tmp_path: Path) -> None:
    assert Acceptance.parse("6", 16).tau == pytest.approx(6.0)
    assert Acceptance.parse("0,1", 4).probabilities == (0.0, 1.0, 0.0, 0.0)
    report = tmp_path / "eval.json"
    report.write_text(json.dumps({"datasets": {"humaneval": {"acceptance_length": 2.5, "histogram": [1, 1, 2]}}}))
    parsed = Acceptance.parse(str(report), 4)
    assert parsed.probabilities == (0.25, 0.25, 0.5, 0.0) and parsed.source == str(report)
    (tmp_path / "other.json").write_text("{}")
    with pytest.raises(ValueError, match="no acceptance"):
        Acceptance.parse(str(tmp_path / "other.json"), 4)
    with pytest.raises(ValueError, match="or fewer"):
        Acceptance.parse("1,2,3,4,5", 4)


def test_replayed_cycles_follow_the_draws_and_commit_the_targets_own_tokens() -> None:
    target = make_tiny_target("qwen3", num_layers=6, seed=2)
    draft = random_draft(target, 2, 8, target.vocab_size - 1)
    acceptance = Acceptance.from_counts([2, 1, 1, 1, 1, 1, 1, 2], 8, "counts")
    config = EngineConfig(batch_size=3, block_size=8, max_new_tokens=40, max_length=96, kernels="torch")
    engine = ReplayEngine(target, draft, config, acceptance, seed=5)
    engine.prepare()  # its warm-up cycle (idle rows) goes before the spy
    verified: list[torch.Tensor] = []  # the target's argmax on each cycle's block, [b, B]
    forward = engine.runner.forward

    def spy(input_ids: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        out = forward(input_ids, *args, **kwargs)
        if kwargs.get("row_index") is None:  # a cycle (prefills name their rows)
            verified.append(out.logits.argmax(-1))
        return out

    engine.runner.forward = spy  # type: ignore[method-assign]
    prompts = [[12, 40, 7, 99, 23], [61, 5, 18], [7, 7, 30, 31]]
    outputs, _ = engine.generate(prompts)
    for row, output in enumerate(outputs):  # all rows free at the start: request i decodes in row i
        lengths = output.acceptance_lengths
        assert lengths == engine.replay[row, : len(lengths)].tolist()
        committed = [token for cycle, a in enumerate(lengths) for token in verified[cycle][row, :a].tolist()]
        assert output.tokens[1:] == committed[: len(output.tokens) - 1]  # the first token comes from the prefill
        assert len(output.tokens) == 40
    assert max(max(o.acceptance_lengths) for o in outputs) > 1  # drafts "accepted", though random


def test_without_a_drafter_the_replay_is_off() -> None:
    target = make_tiny_target("llama", num_layers=2)
    engine = ReplayEngine(target, None, EngineConfig(max_new_tokens=4, max_length=32), Acceptance.geometric(3, 16))
    assert engine.replay is None
    outputs, _ = engine.generate([[5, 6, 7]])
    assert outputs[0].acceptance_lengths == [1, 1, 1]


def test_crossing_is_located_between_measured_batches() -> None:
    found = crossing({1: 2.0, 4: 1.5, 16: 0.5, 64: 0.3})
    assert found["batch"] == pytest.approx(8.0) and found["crossings"][0]["between"] == [4, 16]
    assert "falls below 1x between batch 4 (1.50x) and 16 (0.50x)" in found["statement"]
    assert crossing({1: 2.0, 64: 1.2})["statement"] == "above 1x at every measured batch (1, 64)"
    assert crossing({1: 0.8, 4: 0.9})["batch"] is None
    assert crossing({})["statement"] == "nothing measured"
    assert measuring_order([16, 1, 4, 64]) == [1, 64, 4, 16] and measuring_order([4]) == [4]


def test_quick_mode_runs_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "decode_batch.json"
    main(["--quick", "--out", str(out)])
    result = json.loads(out.read_text())
    assert out.with_suffix(".png").is_file() and result["quick"] and not result["skipped"]
    assert result["acceptance"]["tau"] == pytest.approx(6.0)
    for name in ("qwen3-8b", "smollm2"):
        section = result["shapes"][name]
        assert [(p["batch"], p["drafter"]) for p in section["points"]] == [
            (b, d) for b in (1, 2, 4) for d in (False, True)]
        for point in section["points"]:
            assert point["tokens_per_s"] > 0 and point["cycle_ms"] > 0 and point["compile_s"] >= 0
            assert point["capture_s"] == 0 and not point["cuda_graph"]  # CPU: no graph
            assert point["tokens_per_cycle"] == (pytest.approx(6.0) if point["drafter"] else 1.0)
            assert point["replayed_tokens_per_cycle"] >= 1.0
        assert set(section["speedup"]) == {"1", "2", "4"} and section["crossing"]["statement"]
    assert result["table"][0].startswith("| shape | batch | drafter") and len(result["table"]) == 2 + 12
    assert "compile s | capture s" in result["table"][0]


def test_points_past_the_budget_are_skipped(tmp_path: Path) -> None:
    out = tmp_path / "decode_batch.json"
    main(["--quick", "--budget-s", "0", "--shapes", "smollm2", "--batches", "1,2", "--out", str(out)])
    result = json.loads(out.read_text())
    assert result["skipped"] == [{"shape": "smollm2", "batch": 1}, {"shape": "smollm2", "batch": 2}]
    assert result["shapes"]["smollm2"]["points"] == [] and out.with_suffix(".png").is_file()


def test_launches_per_step_counts_operators_on_the_cpu() -> None:
    def step() -> None:
        torch.ones(3).add(1).mul(2)

    assert launches_per_step(step, torch.device("cpu")) == 3  # aten::ones, aten::add, aten::mul
