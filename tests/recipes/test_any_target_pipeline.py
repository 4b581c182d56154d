"""The README's pipeline, its commands and flags unchanged but for sizes, on a tiny random target of each family
the package claims to train drafters for: experts on the static-cache runtime (qwen3_moe), sliding windows with
attention sinks, experts and YaRN on it too (gpt_oss), latent attention with experts (deepseek_v3) and hybrid
linear attention (qwen3_5) through the model's own forward and caches, and every other architecture of the
matrix, all in the fast tier (a few seconds each).

For each, in-process, every stage reading what the one before it wrote: `inspect` names the layer mix;
`regenerate` has the target answer a few chat prompts; `prepare` tokenises the answers; `train` (the CPU recipe)
lowers the drafter's loss in 8 steps on online features of unpacked rows; `eval` of the trained drafter on the
same prompts is lossless; `export` writes a drafter that `check` passes against the target. Packed rows: gpt-oss
also trains on them with the varlen target attention (no fallback), and a linear-attention target's packed run
is refused in one line naming `data.pack_tokens`.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dflash_train.cli import main
from dflash_train.train import main as train_module_main  # `python -m dflash_train.train`
from tests.helpers.byte_tokenizer import byte_tokenizer
from tests.helpers.paths import CPU_RECIPE
from tests.helpers.tiny_models import TINY_EMBEDDING_ROWS, make_tiny_tokenizer
from tests.helpers.tiny_targets import TINY_TARGET_FAMILIES, TINY_TARGETS, build_tiny_target
from tests.helpers.training import train_losses

# Only words of the tiny tokenizer, so no prompt holds <unk>; distinct, so regenerate keeps all eight.
PROMPTS = (
    "hello who are you ?", "what is the capital of france ?", "is paris the capital of france ?", "who am i ?",
    "be brief : what is paris ?", "are you a helpful assistant ?", "hello , is it paris ?", "what is it ? yes , no ?",
)
STEPS = 8
EVAL_PROMPTS = 4  # of the 8 it trained on: enough for the lossless check, at half the decoding
# The README's training command (the CPU recipe), at the drafter's tiny size: 1 layer, block 4 (whose decay
# gamma has no default), short rows, every sample trained on (no validation split), a high learning rate.
TRAIN_OVERRIDES = (
    "model.num_draft_layers=1", "model.block_size=4", "training.loss_decay_gamma=4", "data.max_length=64",
    "data.validation_fraction=0", f"training.max_steps={STEPS}", "training.batch_size=2", "training.num_anchors=8",
    "training.learning_rate=3e-3", "training.log_every=1", "training.eval_every=0", f"training.save_every={STEPS}",
)
# A second run on packed rows: True, it trains (the trainer itself refuses, at setup, packed features that
# differ from each chat's alone); False, it is refused.
PACKED = ("data.pack_tokens=128", "training.target_attention=varlen")
PACKED_RUN = {name: name not in TINY_TARGET_FAMILIES["hybrid"] for name in TINY_TARGETS}
# What `inspect` says of each target's decoder layers (its "decoder layers" line).
LAYER_MIX = {
    "qwen3_moe": ("4 full_attention", "MoE 4 experts, 2 active"),
    "gpt_oss": ("2 sliding_attention, 2 full_attention", "window 32", "MoE 4 experts, 2 active", "attention sinks"),
    "deepseek_v3": ("4 full_attention", "MoE 4 experts, 2 active", "latent attention (MLA)"),
    "qwen3_5": ("3 linear_attention, 1 full_attention",),
}
FAMILY_EXAMPLES = tuple(LAYER_MIX)  # one target of each family: these also train on packed rows
# For these model types transformers loads any tokenizer as its own Qwen2-style class, rebuilt from the saved
# vocabulary and merges: the tiny word-level tokenizer would come back joining words without spaces, so these
# targets get the byte-level Qwen3 tokenizer (its chat template and special tokens), which that class rebuilds
# exactly.
BYTE_LEVEL_TOKENIZER = ("qwen2", "qwen3_5_moe")
CASES = [*FAMILY_EXAMPLES, *(name for name in TINY_TARGETS if name not in FAMILY_EXAMPLES)]


def save_target(path: Path, name: str) -> Path:
    """The tiny target of `name` with its 320-row vocabulary (the mask token resolves to a row the tokenizer
    never uses), embeddings and head scaled up as in tests/helpers/training.py: a peaked head makes
    answers a 1-layer drafter learns in a few steps."""
    model = build_tiny_target(name, TINY_EMBEDDING_ROWS)
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(25.0)
        head = model.get_output_embeddings().weight
        if head is not model.get_input_embeddings().weight:
            head.mul_(25.0)
    model.save_pretrained(path)
    tokenizer = byte_tokenizer("qwen3") if name in BYTE_LEVEL_TOKENIZER else make_tiny_tokenizer()
    tokenizer.save_pretrained(path)
    return path


def train_argv(target: Path, prepared: Path, out: Path, *extra: str) -> list[str]:
    return ["--config", str(CPU_RECIPE), f"model.target={target}", f"data.prepared={prepared}",
            f"training.output_dir={out}", *TRAIN_OVERRIDES, *extra]


def check_packed_run(name: str, target: Path, prepared: Path, out: Path,
                     capsys: pytest.CaptureFixture[str]) -> None:
    capsys.readouterr()
    code = train_module_main(train_argv(target, prepared, out, *PACKED))
    said = capsys.readouterr()
    if PACKED_RUN[name]:
        assert code == 0, said.err[-2000:]
        assert "attention failed for the target" not in said.out + said.err  # no fallback to SDPA
        losses = train_losses(out)
        assert sorted(losses) == list(range(1, STEPS + 1)) and losses[STEPS] < losses[1], losses
    else:
        assert code == 2, said.err[-2000:]
        error = said.err.strip().splitlines()[-1]  # earlier lines: the target's loading progress
        assert error.startswith("dflash-train train: error:") and "data.pack_tokens" in error, said.err
        assert "Traceback" not in said.err
        assert not (out / "metrics.jsonl").exists()


@pytest.mark.parametrize("name", CASES)
def test_the_readme_pipeline_trains_evaluates_and_exports_a_drafter(
        name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)  # nothing is written into the repository
    target = save_target(tmp_path / "target", name)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": prompt}) + "\n" for prompt in PROMPTS))
    runs, outputs = tmp_path / "runs", tmp_path / "outputs"

    # inspect: the layer mix, and the layer the 1-layer drafter will read (L // 2 of 4 layers)
    assert main(["inspect", "--target", str(target), "--num-draft-layers", "1", "--block-size", "4"]) == 0
    lines = dict(line.split("  ", 1) for line in capsys.readouterr().out.splitlines() if "  " in line)
    assert all(part in lines["decoder layers"] for part in LAYER_MIX.get(name, ())), lines["decoder layers"]
    assert lines["target_layer_ids"].strip() == "[2]"

    # regenerate: the target answers every prompt
    assert main(["regenerate", "--target", str(target), "--data", str(prompts), "--max-new-tokens", "24",
                 "--max-prompt-tokens", "64", "--out", str(runs / "regen")]) == 0
    answers = [json.loads(line) for shard in sorted((runs / "regen").glob("part-*.jsonl"))
               for line in shard.read_text().splitlines()]
    assert len(answers) == len(PROMPTS) and all(row["messages"][-1]["role"] == "assistant" for row in answers)

    # prepare: rows of at least 2 x block 4 supervised tokens are kept
    assert main(["prepare", "--target", str(target), "--data", str(runs / "regen"), "--out", str(runs / "prepared"),
                 "--block-size", "4"]) == 0
    capsys.readouterr()

    # train: online features, one chat a row; the loss falls
    out = outputs / "drafter"
    assert main(["train", *train_argv(target, runs / "prepared", out)]) == 0
    losses = train_losses(out)
    assert sorted(losses) == list(range(1, STEPS + 1))
    assert losses[STEPS] < losses[1], f"{name}: the loss did not fall: {losses}"
    checkpoint = out / "checkpoints" / f"step-{STEPS:08d}"

    # packed rows, through `python -m dflash_train.train`: gpt-oss's sliding windows and sinks are kept per chat
    # by the varlen attention; linear attention's state would run on into the next chat of a row
    if name in FAMILY_EXAMPLES or name in TINY_TARGET_FAMILIES["hybrid"]:
        check_packed_run(name, target, runs / "prepared", outputs / "packed", capsys)

    # eval: the trained drafter's output is the target's own
    report_path = runs / "eval" / "report.json"
    assert main(["eval", "--target", str(target), "--draft", str(checkpoint / "draft"), "--dataset", str(prompts),
                 "--num-prompts", str(EVAL_PROMPTS), "--max-new-tokens", "12", "--block-size", "4", "--no-progress",
                 "--out", str(report_path)]) == 0
    row = json.loads(report_path.read_text())["datasets"]["prompts"]
    assert row["lossless"] is True and row["requests"] == EVAL_PROMPTS and row["new_tokens_with_draft"] > 0

    # export, then check the export against the target
    export = runs / "exports" / name
    assert main(["export", str(checkpoint), "--out", str(export), "--target", str(target),
                 "--eval-report", str(report_path)]) == 0
    assert main(["check", str(export), "--target", str(target)]) == 0
    config = json.loads((export / "config.json").read_text())["dflash_config"]
    # The mask token: the first embedding row past the tokenizer's vocabulary (256 words, or 261 byte-level ids).
    first_unused_row = 261 if name in BYTE_LEVEL_TOKENIZER else 256
    assert config["target_layer_ids"] == [2] and config["mask_token_id"] == first_unused_row
