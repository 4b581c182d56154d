"""`dflash-train eval` end to end on a tiny target saved to disk: the report's fields, the figure, the
lossless check, MT-Bench's second turn, and user errors as one line with exit code 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dflash_train.cli import main
from tests.helpers.tiny_models import make_tiny_target

DATASET_FIELDS = {
    "source", "conversations", "requests", "skipped_rows", "skipped_too_long", "acceptance_length",
    "acceptance_length_cycle_weighted", "histogram", "per_slot_acceptance", "per_slot_conditional_acceptance",
    "requests_with_cycles", "cycles", "lossless", "lossless_requests", "mismatches", "new_tokens_with_draft",
    "new_tokens_target_only", "decode_seconds_with_draft", "decode_seconds_target_only", "tokens_per_s_with_draft",
    "tokens_per_s_target_only", "speedup", "skipped", "teacher_forced_slot_accuracy",
    "teacher_forced_acceptance_length", "decode_seconds_lossless_check", "acceptance_length_by_turn",
    "acceptance_length_by_category", "target_only_reused",
}


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("target")
    target = make_tiny_target("qwen3", num_layers=6, seed=1)
    target.model.config.max_position_embeddings = 96  # some MT-Bench second turns will not fit
    target.model.save_pretrained(path)
    target.tokenizer.save_pretrained(path)
    return path


def run_eval(target_dir: Path, out: Path, *extra: str) -> int:
    return main(["eval", "--target", str(target_dir), "--draft", "random", "--random-draft-layers", "2",
                 "--block-size", "4", "--max-new-tokens", "12", "--no-progress", "--out", str(out), *extra])


def test_report_fields_figure_and_lossless(target_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    prompts = tmp_path / "mine.jsonl"
    prompts.write_text('{"prompt": "hello who are you"}\n{"oops": 1}\n{"turns": ["what is the capital", "why"]}\n')
    out = tmp_path / "out" / "report.json"
    assert run_eval(target_dir, out, "--dataset", "mt-bench", "--dataset", str(prompts), "--num-prompts", "3",
                    "--batch-size", "2") == 0
    report = json.loads(out.read_text())
    assert out.with_suffix(".png").stat().st_size > 10_000
    assert set(report) >= {"target", "draft", "settings", "environment", "runner_check", "datasets", "definitions"}
    assert report["runner_check"]["argmax_agreement"] == 1.0
    assert list(report["datasets"]) == ["mt-bench", "mine"]
    for row in report["datasets"].values():
        assert set(row) >= DATASET_FIELDS
        assert row["lossless"] is True and row["lossless_requests"] == row["requests"]
        assert len(row["histogram"]) == 4 and sum(row["histogram"]) == row["cycles"]
        assert 1.0 <= row["acceptance_length"] <= 4.0
        assert len(row["teacher_forced_slot_accuracy"]) == 3 and 1.0 <= row["teacher_forced_acceptance_length"] <= 4.0
        assert row["new_tokens_with_draft"] == row["new_tokens_target_only"] > 0
        assert row["speedup"] == pytest.approx(row["tokens_per_s_with_draft"] / row["tokens_per_s_target_only"])
    mt_bench, mine = report["datasets"]["mt-bench"], report["datasets"]["mine"]
    # Three conversations, two turns each, turns that outgrow the 96-token context counted: one first turn
    # already does (so its second is never asked, and the conversation has no request), another's second.
    assert (mt_bench["requests"], mt_bench["skipped_too_long"], mt_bench["conversations"]) == (3, 2, 2)
    assert mine["requests"] == 3 and mine["skipped_rows"] == 1
    # τ by turn: two first turns and one second; τ over all requests is their request-weighted mean.
    assert mine["requests_with_cycles"] == 3 and len(mine["acceptance_length_by_turn"]) == 2
    first, second = mine["acceptance_length_by_turn"]
    assert mine["acceptance_length"] == pytest.approx((2 * first + second) / 3)
    assert mine["acceptance_length_by_category"] is None  # its rows name no category
    # MT-Bench's rows do: three conversations spread over its 80 (questions 0, 26, 53: writing, reasoning,
    # coding), the coding one outgrowing the context from its first turn
    assert set(mt_bench["acceptance_length_by_category"]) == {"writing", "reasoning"}
    assert "mt-bench" in capsys.readouterr().out


def test_tau_by_category_of_the_rows(target_dir: Path, tmp_path: Path) -> None:
    """Rows naming a category get τ per category, in first-seen order; a row without one is "uncategorised";
    τ over all requests is their request-weighted mean."""
    prompts = tmp_path / "cats.jsonl"
    prompts.write_text('{"prompt": "write a poem", "category": "writing"}\n{"prompt": "add 2 and 3", "category": "math"}\n'
                       '{"prompt": "write a story", "category": "writing"}\n{"prompt": "hello"}\n')
    out = tmp_path / "report.json"
    assert run_eval(target_dir, out, "--dataset", str(prompts), "--no-plot") == 0
    row = json.loads(out.read_text())["datasets"]["cats"]
    by_category = row["acceptance_length_by_category"]
    assert list(by_category) == ["writing", "math", "uncategorised"]
    weighted = (2 * by_category["writing"] + by_category["math"] + by_category["uncategorised"]) / 4
    assert row["acceptance_length"] == pytest.approx(weighted)


def test_sampling_report_has_no_lossless_claim(target_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    assert run_eval(target_dir, out, "--dataset", "math-synthetic", "--num-prompts", "2", "--temperature", "0.7",
                    "--no-plot") == 0
    row = json.loads(out.read_text())["datasets"]["math-synthetic"]
    assert row["lossless"] is None and row["requests"] == 2 and "GSM8K" in row["note"]


def test_engines_are_built_once_for_every_set_and_turn(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Sized up front for the longest conversation (answers at full length): no rebuild when MT-Bench's
    second turns or a later set need longer caches (a rebuild recompiles and recaptures on a GPU)."""
    from dflash_train.eval import run as run_module

    built: list[int] = []

    class CountingEngine(run_module.DecodeEngine):
        def __init__(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003
            super().__init__(*args, **kwargs)
            built.append(self.runner.max_length)

    monkeypatch.setattr(run_module, "DecodeEngine", CountingEngine)
    target = make_tiny_target("qwen3", num_layers=6, seed=1)
    target.model.config.max_position_embeddings = 1024  # a context long enough for second turns
    target.model.save_pretrained(tmp_path / "target")
    target.tokenizer.save_pretrained(tmp_path / "target")
    out = tmp_path / "report.json"
    # Short math prompts first (caches of 256 would do), then MT-Bench, whose second turns need 512.
    assert run_eval(tmp_path / "target", out, "--dataset", "math-synthetic", "--dataset", "mt-bench",
                    "--num-prompts", "2", "--max-new-tokens", "100", "--ignore-eos", "--no-plot") == 0
    report = json.loads(out.read_text())
    assert report["datasets"]["mt-bench"]["requests"] == 4  # second turns were asked
    assert built == [512, 512, 512]  # the speed baseline, the drafter engine and the lossless check's, once


def test_batch_is_capped_at_the_largest_prompt_set(target_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    assert run_eval(target_dir, out, "--dataset", "math-synthetic", "--num-prompts", "2", "--batch-size", "8",
                    "--no-plot") == 0
    report = json.loads(out.read_text())
    assert report["settings"]["batch_size"] == 2 and report["datasets"]["math-synthetic"]["requests"] == 2


@pytest.mark.parametrize(("extra", "message"), [
    (["--dataset", "nope"], "unknown dataset 'nope'"),
    (["--dataset", "humaneval", "--max-new-tokens", "0"], "--max-new-tokens: must be at least 1, not 0"),
    (["--dataset", "humaneval", "--num-prompts", "1", "--max-new-tokens", "500"], "no prompt of humaneval fits"),
    (["--dataset", "humaneval", "--max-autotune", "--no-compile"], "drop --no-compile or --max-autotune"),
    (["--dataset", "humaneval", "--target-cache", __file__], "is a file: give a folder"),
])
def test_user_errors_are_one_line(target_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                  extra: list[str], message: str) -> None:
    assert main(["eval", "--target", str(target_dir), "--draft", "random", "--random-draft-layers", "2",
                 "--no-progress", "--out", str(tmp_path / "r.json"), *extra]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]  # earlier lines: the model-loading progress bar
    assert last.startswith("dflash-train eval: error:") and message in last


def test_a_missing_drafter_fails_before_the_target_is_loaded(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    import dflash_train.commands.eval as eval_command

    def must_not_load(*args: object, **kwargs: object) -> None:
        raise AssertionError("the target was loaded before the drafter path was checked")

    monkeypatch.setattr(eval_command, "_load_target", must_not_load)
    code = main(["eval", "--target", "smollm2-135m-instruct", "--draft", str(tmp_path / "nowhere"),
                 "--dataset", "humaneval", "--no-progress", "--out", str(tmp_path / "r.json")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "No drafter checkpoint at" in err


def test_drafter_checkpoint_is_loaded_and_checked(target_dir: Path, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    checkpoint = pytest.importorskip("dflash_train.checkpoint", reason="drafter checkpoints not available")
    from dflash_train.models import DFlashConfig, DFlashDraftModel

    target = make_tiny_target("qwen3", num_layers=6, seed=1)
    config = DFlashConfig.from_target_config(target.config, mask_token_id=256, num_hidden_layers=2, block_size=4)
    config.hidden_size = 32  # does not fit the target
    checkpoint.save_draft(DFlashDraftModel(config), tmp_path / "draft")
    code = main(["eval", "--target", str(target_dir), "--draft", str(tmp_path / "draft"), "--dataset", "humaneval",
                 "--no-progress", "--out", str(tmp_path / "r.json")])
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 2 and last.startswith("dflash-train eval: error:") and "hidden size 32 != target hidden size 64" in last


def test_no_compile_reaches_the_engines(target_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    assert run_eval(target_dir, out, "--dataset", "math-synthetic", "--num-prompts", "1", "--no-compile",
                    "--no-plot") == 0
    assert json.loads(out.read_text())["environment"]["torch_compile"] is False
    from dflash_train.eval.run import EvalSettings, Evaluator
    from dflash_train.runtime.engine import EngineConfig
    from dflash_train.target import load_target

    target = load_target(str(target_dir))
    settings = EvalSettings(EngineConfig(block_size=4, compile=False))
    assert Evaluator(target, None, settings)._engine_config(4, 256).compile is False  # type: ignore[arg-type]
    default = EvalSettings(EngineConfig(block_size=4))
    assert Evaluator(target, None, default)._engine_config(4, 256).compile is None  # type: ignore[arg-type]


def test_max_autotune_and_compile_scope_reach_the_engines_and_the_report(target_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    assert run_eval(target_dir, out, "--dataset", "math-synthetic", "--num-prompts", "1", "--max-autotune",
                    "--compile-scope", "layer", "--no-plot") == 0
    environment = json.loads(out.read_text())["environment"]
    assert environment["compile_options"] == {"max_autotune": True, "coordinate_descent_tuning": True}
    assert environment["compile_scope"] == "layer"
    assert environment["target_attention"] == "sdpa"  # CPU: torch kernels


def test_draft_attention_reaches_the_engine_and_the_report(target_dir: Path, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "report.json"
    assert run_eval(target_dir, out, "--dataset", "math-synthetic", "--num-prompts", "1", "--no-compile",
                    "--draft-attention", "sdpa", "--no-plot") == 0
    assert json.loads(out.read_text())["environment"]["draft_attention"] == "sdpa"
    assert run_eval(target_dir, out, "--dataset", "math-synthetic", "--draft-attention", "flash") == 2
    assert "--draft-attention: invalid choice: 'flash'" in capsys.readouterr().err


def test_matmul_reaches_the_engine_and_the_report(target_dir: Path, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """On a CPU the runner has no Triton kernels, so what ran is torch's matmul, and the report says so; asking
    for the fused products with --kernels torch is a one-line error."""
    out = tmp_path / "report.json"
    assert run_eval(target_dir, out, "--dataset", "math-synthetic", "--num-prompts", "1", "--no-compile",
                    "--matmul", "fused", "--no-plot") == 0
    assert json.loads(out.read_text())["environment"]["matmul"] == "torch"
    assert run_eval(target_dir, out, "--dataset", "math-synthetic", "--kernels", "torch", "--matmul", "fused") == 2
    assert "--matmul fused runs on the Triton kernels" in capsys.readouterr().err


def test_target_cache_decodes_the_target_alone_once(target_dir: Path, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """--target-cache: a second eval of the same prompts reads the target-alone pass (answers and timing) the first
    one decoded, and still runs its own drafter pass and lossless check; other settings decode it again."""
    from dflash_train.eval import run as run_module

    labels: list[str] = []
    original = run_module.Evaluator._pass

    def recording(self, engine, requests, label, phase):  # noqa: ANN001, ANN202
        labels.append(label)
        return original(self, engine, requests, label, phase)

    monkeypatch.setattr(run_module.Evaluator, "_pass", recording)
    cache = tmp_path / "cache"
    reports = []
    for name, tokens in (("first", "12"), ("second", "12"), ("longer", "13")):
        labels.clear()
        out = tmp_path / f"{name}.json"
        assert run_eval(target_dir, out, "--dataset", "mt-bench", "--num-prompts", "2", "--max-new-tokens", tokens,
                        "--target-cache", str(cache), "--no-plot") == 0
        reports.append((json.loads(out.read_text()), list(labels)))
    (first, first_passes), (second, second_passes), (longer, longer_passes) = reports
    assert any("target only" in label for label in first_passes)
    assert not any("target only" in label for label in second_passes)  # read, not decoded
    assert any("dflash" in label for label in second_passes) and any("lossless" in label for label in second_passes)
    assert any("target only" in label for label in longer_passes)  # another --max-new-tokens: another key
    assert second["settings"]["target_cache"] == str(cache)
    one, two = first["datasets"]["mt-bench"], second["datasets"]["mt-bench"]
    assert not one["target_only_reused"] and two["target_only_reused"]
    assert not longer["datasets"]["mt-bench"]["target_only_reused"]
    for field in ("new_tokens_target_only", "decode_seconds_target_only", "requests", "acceptance_length",
                  "teacher_forced_acceptance_length"):
        assert one[field] == two[field], field  # same drafter (seeded random), same answers and turns
    assert two["lossless"] is True


def test_no_teacher_forced_leaves_its_fields_empty(target_dir: Path, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "report.json"
    assert run_eval(target_dir, out, "--dataset", "humaneval", "--num-prompts", "2", "--no-teacher-forced",
                    "--no-plot") == 0
    report = json.loads(out.read_text())
    row = report["datasets"]["humaneval"]
    assert row["teacher_forced_acceptance_length"] is None and row["teacher_forced_slot_accuracy"] is None
    assert row["acceptance_length"] >= 1.0 and report["settings"]["teacher_forced"] is False
    assert "teacher_forced" not in " ".join(report["phase_seconds"])  # the pass did not run
    assert "humaneval" in capsys.readouterr().out
