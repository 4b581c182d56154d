"""`benchmarks/regenerate.py --quick` runs end to end on a CPU with a tiny target (its GPU figures come from
an H200), and every variant gives the same greedy answers in float32."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.regenerate import load_prompts, main, parse_args, random_prompts
from dflash_train.data.prompt_ids import prompt_ids
from tests.helpers.tiny_models import make_tiny_target


def test_quick_regeneration_benchmark_on_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = make_tiny_target("llama", num_layers=2)
    target.model.save_pretrained(tmp_path / "target")
    target.tokenizer.save_pretrained(tmp_path / "target")
    monkeypatch.setenv("DFLASH_BENCH_RESULTS", str(tmp_path / "results"))
    main(["--quick", "--target", str(tmp_path / "target"), "--device", "cpu"])
    result = json.loads((tmp_path / "results" / "regenerate.json").read_text())
    assert {"device", "date", "commit"} <= result.keys() and result["config"]["quick"] is True
    rows = {(r["variant"], r["rows"]): r for r in result["results"]}
    assert set(rows) == {("runtime (old default)", 2), ("runtime", 4), ("HF generate", 4), ("runtime", 8),
                         ("HF generate", 8)}
    for r in rows.values():
        assert r["tokens"] > 0 and r["tokens_per_s"] > 0 and r["same_answers"] == r["prompts"], r
    assert rows[("runtime", 8)]["prompts"] == 12 and rows[("HF generate", 8)]["prompts"] == 8
    assert rows[("runtime (old default)", 2)]["vs_hf"] is None and rows[("HF generate", 4)]["vs_hf"] == 1.0
    assert result["goal"] == ">= 120k tokens/s" and result["verdict"].startswith("goal >= 120k tokens/s: NOT met, ")


def test_quick_random_shape_benchmark_on_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    """The random-target mode: random-token prompts, no stop ids (every answer runs to the end), the runtime's
    answers equal `generate`'s token for token in float32, and each variant's ratio to `generate`."""
    monkeypatch.setenv("DFLASH_BENCH_RESULTS", str(tmp_path))
    main(["--random-shape", "tiny-qwen3", "--quick", "--device", "cpu", "--min-prompt", "4", "--max-prompt", "40"])
    result = json.loads((tmp_path / "regenerate-tiny-qwen3.json").read_text())
    assert result["goal"] == ">= 3x HF generate at equal batch" and result["config"]["random_shape"] == "tiny-qwen3"
    rows = {(r["variant"], r["rows"]): r for r in result["results"]}
    assert set(rows) == {("runtime (old default)", 2), ("runtime", 4), ("HF generate", 4), ("runtime", 8),
                         ("HF generate", 8)}
    for r in rows.values():
        assert r["tokens"] == 8 * r["prompts"] and r["same_answers"] == r["prompts"], r
    assert rows[("HF generate", 8)]["vs_hf"] == 1.0 and rows[("runtime (old default)", 2)]["vs_hf"] is None
    assert rows[("runtime", 4)]["vs_hf"] == rows[("runtime", 4)]["tokens_per_s"] / rows[("HF generate", 4)]["tokens_per_s"]
    out = capsys.readouterr().out
    assert "x HF" in out and out.rstrip().splitlines()[-1] == result["verdict"]
    assert result["verdict"].startswith("goal >= 3x HF generate at equal batch: ")


def test_random_shape_defaults_yield_to_the_command_line() -> None:
    args = parse_args(["--random-shape", "qwen3-8b", "--rows", "128"])
    assert (args.rows, args.prompts, args.max_new_tokens, args.hf_batches) == ("128", 256, 128, 1)
    args = parse_args([])
    assert (args.rows, args.prompts, args.max_new_tokens, args.random_shape) == ("256,512", 2048, 512, None)


def test_random_prompts_are_seeded_and_within_bounds() -> None:
    prompts = random_prompts(50, 512, 32, 40)
    assert prompts == random_prompts(50, 512, 32, 40)
    assert all(32 <= len(p) <= 40 and max(p) < 512 for p in prompts)


def test_a_pack_prompt_file_gives_its_first_user_turns(tmp_path: Path) -> None:
    """The benchmark answers the very prompts a regeneration would: a `pack` file's first user turns."""
    target = make_tiny_target("llama", num_layers=1)
    rows = [{"messages": [{"role": "user", "content": "first"}, {"role": "assistant", "content": "a"},
                          {"role": "user", "content": "second"}], "source": "sharegpt"},
            {"prompt": "plain"}]
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    expected = [prompt_ids(target.tokenizer, [{"role": "user", "content": text}], thinking=False)
                for text in ("first", "plain", "first (2)")]
    assert load_prompts(target, path, 3) == expected
    path.write_text(json.dumps({"messages": [{"role": "assistant", "content": "no user"}]}) + "\n")
    with pytest.raises(ValueError, match="neither a \"prompt\" string nor a user turn"):
        load_prompts(target, path, 1)


def test_loop_stopping_variants_count_answers_and_may_leave_out_generate(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """--stop-loops: the refilled runtime variants end answers inside a verbatim loop (a random tiny target
    loops), each such answer the start of the baseline's, which decodes to the cap; --hf-batches 0 leaves
    `generate` out."""
    target = make_tiny_target("llama", num_layers=2)
    target.model.save_pretrained(tmp_path / "target")
    target.tokenizer.save_pretrained(tmp_path / "target")
    monkeypatch.setenv("DFLASH_BENCH_RESULTS", str(tmp_path / "results"))
    main(["--target", str(tmp_path / "target"), "--device", "cpu", "--prompts", "12", "--max-new-tokens", "96",
          "--rows", "8", "--baseline-rows", "4", "--hf-batches", "0", "--stop-loops", "--no-compile"])
    result = json.loads((tmp_path / "results" / "regenerate.json").read_text())
    rows = {(r["variant"], r["rows"]): r for r in result["results"]}
    assert set(rows) == {("runtime (old default)", 4), ("runtime, loops stopped", 8)}
    stopped, baseline = rows[("runtime, loops stopped", 8)], rows[("runtime (old default)", 4)]
    assert stopped["finish_reasons"].get("loop", 0) > 0 and "loop" not in baseline["finish_reasons"]
    assert stopped["tokens"] < baseline["tokens"] and stopped["same_answers"] == stopped["prompts"] == 12
    assert stopped["answers_per_s"] == pytest.approx(12 / stopped["seconds"])
    assert result["verdict"].startswith("goal >= 120k tokens/s: NOT met, runtime ")
