"""The main job end to end on the real SmolLM2-135M-Instruct, through the stages `make demo` runs, at tiny
sizes: regenerate 6 prompts → prepare → train 3 steps → eval (1 HumanEval, 1 two-turn MT-Bench prompt) →
export → check, then a re-run that must skip every finished stage."""

from __future__ import annotations

import json
import shutil
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from dflash_train.checkpoint import check_checkpoint, load_draft
from dflash_train.demo import CPU_SIZES, TARGET, DemoResult, DemoSizes, run_demo
from dflash_train.target import load_target_config
from tests.helpers.markers import needs_smollm2

# The demo on the real 135M target, every stage: among the longest CPU tests, so in the slow tier; the fast tier
# keeps the real target's conversion, features and decoding (tests/target/test_model.py) and the pipeline on
# tiny targets (test_any_target_pipeline.py, test_drafter_accepts.py).
pytestmark = [needs_smollm2, pytest.mark.slow]

TINY = DemoSizes(
    recipe=CPU_SIZES.recipe, regen_dtype="fp32", max_samples=6, max_new_tokens=48, regen_batch_size=6,
    max_length=256,
    train_overrides=("training.max_steps=3", "training.batch_size=2", "training.num_anchors=16",
                     "training.save_every=3", "training.eval_every=0", "training.log_every=1"),
    # 12 tokens: the eval's three decodes of each request (target alone, drafted, lossless check) took 33 s
    # at 24; the reference-loop test below decodes 24 on its own.
    eval_prompts=1, eval_max_new_tokens=12,
)
REPORT_FIELDS = ("acceptance_length", "acceptance_length_cycle_weighted", "histogram", "per_slot_acceptance",
                 "lossless", "lossless_requests", "tokens_per_s_with_draft", "tokens_per_s_target_only", "speedup")


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> DemoResult:
    return run_demo(tmp_path_factory.mktemp("demo"), TINY, "cpu")


@pytest.fixture(scope="module")
def target_config() -> Any:
    """Read once for the module: it parses the GGUF's metadata (5 s)."""
    return load_target_config(TARGET)


def test_training_ran_on_regenerated_chats(demo: DemoResult) -> None:
    assert demo.train_steps == 3 and 1 <= demo.train_samples <= 6
    metrics = [json.loads(line) for line in (demo.out_dir / "train" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics if m["split"] == "train"] == [1, 2, 3]
    regenerated = [json.loads(line) for path in sorted((demo.out_dir / "regen").glob("part-*.jsonl"))
                   for line in path.read_text().splitlines()]
    assert len(regenerated) == 6 and all(row["messages"][-1]["role"] == "assistant" for row in regenerated)


def test_every_evaluated_request_is_lossless_and_the_report_is_complete(demo: DemoResult) -> None:
    datasets = demo.report["datasets"]
    assert set(datasets) == {"humaneval", "mt-bench"}
    assert datasets["humaneval"]["requests"] == 1 and datasets["mt-bench"]["requests"] == 2  # both turns
    for row in datasets.values():
        assert all(field in row for field in REPORT_FIELDS)
        assert row["lossless"] is True and row["lossless_requests"] == row["requests"] and not row["mismatches"]
        assert row["new_tokens_with_draft"] == row["new_tokens_target_only"] > 0
        assert 1.0 <= row["acceptance_length"] <= 16.0
        histogram = row["histogram"]  # cycles with a+1 = 1..16: its mean is the cycle-weighted τ
        assert len(histogram) == 16 and sum(histogram) == row["cycles"] > 0
        weighted = sum((k + 1) * n for k, n in enumerate(histogram)) / sum(histogram)
        assert weighted == pytest.approx(row["acceptance_length_cycle_weighted"])
    assert (demo.report_path.with_suffix(".png")).is_file()


def test_export_passes_check_and_holds_the_trained_weights_in_bf16(demo: DemoResult, target_config: Any) -> None:
    assert check_checkpoint(demo.export, target_config) == []
    assert {"config.json", "model.safetensors", "dflash.py", "README.md"} <= {p.name for p in demo.export.iterdir()}
    config = json.loads((demo.export / "config.json").read_text())
    assert config["dflash_config"]["mask_token_id"] == 16 and config["dflash_config"]["target_layer_ids"] == [
        1, 8, 14, 20, 27]
    exported = load_draft(demo.export).state_dict()
    # The trainer's own fp32 weights, as accelerate saved them: a path that shares no code with the export.
    trained = load_file(demo.checkpoint / "state" / "model.safetensors")
    assert set(exported) == set(trained)
    for name, weight in trained.items():
        assert exported[name].dtype == torch.bfloat16
        assert torch.equal(exported[name], weight.to(torch.bfloat16)), name


def test_exported_drafter_decodes_as_the_target_alone_in_the_reference_loop(demo: DemoResult) -> None:
    """Independent of the eval's loop: the plain verify loop with the export vs Hugging Face greedy `generate`."""
    from dflash_train.data.prompt_ids import prompt_ids
    from dflash_train.prompts.eval_sets import load_prompt_set
    from dflash_train.runtime.reference_loop import generate_greedy
    from dflash_train.target import load_target

    target = load_target(TARGET, dtype=torch.float32)
    turn = load_prompt_set("humaneval", 1).conversations[0].turns[0]
    ids = torch.tensor([prompt_ids(target.tokenizer, [{"role": "user", "content": turn}], False)])
    expected = target.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False,
                                     eos_token_id=None, pad_token_id=2)[0, ids.shape[1]:]
    result, _ = generate_greedy(target, load_draft(demo.export, dtype=torch.float32), ids, max_new_tokens=24)
    assert result.new_tokens[:24].tolist() == expected.tolist()
    assert all(1 <= a <= 16 for a in result.acceptance_lengths)


def test_rerun_skips_finished_stages_and_redoes_a_missing_one(demo: DemoResult, target_config: Any) -> None:
    again = run_demo(demo.out_dir, TINY, "cpu")
    assert again.skipped == ["regenerate", "prepare", "train", "eval", "export"]
    assert again.report == demo.report and again.checkpoint == demo.checkpoint
    shutil.rmtree(demo.export)
    redone = run_demo(demo.out_dir, TINY, "cpu")
    assert redone.skipped == ["regenerate", "prepare", "train", "eval"]
    assert check_checkpoint(demo.export, target_config) == []

