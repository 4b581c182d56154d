"""`dflash-train export` and `dflash-train check` from the command line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dflash_train.checkpoint import save_draft
from dflash_train.cli import main
from tests.helpers.checkpoints import tiny_draft_for, write_zlab_checkpoint
from tests.helpers.tiny_models import make_tiny_target


@pytest.fixture
def target_dir(tmp_path: Path) -> Path:
    target = make_tiny_target("qwen3", num_layers=6, seed=1)
    target.model.save_pretrained(tmp_path / "target")
    target.tokenizer.save_pretrained(tmp_path / "target")
    save_draft(tiny_draft_for(target), tmp_path / "train", dtype=torch.float32)
    return tmp_path / "target"


def test_export_then_check_with_target(tmp_path: Path, target_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    report = tmp_path / "eval.json"
    report.write_text(json.dumps({"rows": [{"dataset": "humaneval", "tau": 3.2512, "speedup": 2.5}]}))
    out = tmp_path / "out"
    assert main(["export", str(tmp_path / "train"), "--out", str(out), "--target", str(target_dir),
                 "--repo-id", "my-org/tiny-dflash", "--training-data", "ShareGPT prompts, 1k",
                 "--eval-report", str(report)]) == 0
    assert "passes dflash-train check" in capsys.readouterr().out
    card = (out / "README.md").read_text()
    assert "| dataset | tau | speedup |" in card and "| humaneval | 3.25 | 2.5 |" in card
    assert "ShareGPT prompts, 1k" in card and '"model": "my-org/tiny-dflash"' in card
    assert main(["check", str(out), "--target", str(target_dir)]) == 0
    assert capsys.readouterr().out.strip() == f"{out}: OK"


def test_check_prints_one_line_per_problem(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_zlab_checkpoint(tmp_path / "zlab", prefix="model.")
    config = json.loads((tmp_path / "zlab" / "config.json").read_text())
    config["eagle_aux_hidden_state_layer_ids"] = [1, 3]
    (tmp_path / "zlab" / "config.json").write_text(json.dumps(config))
    assert main(["check", str(tmp_path / "zlab")]) == 1
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 4 and all(line.startswith(f"{tmp_path / 'zlab'}: ") for line in lines)
    text = "\n".join(lines)
    for fragment in ("missing dflash.py", "missing README.md", "eagle_aux_hidden_state_layer_ids", "'model.' prefix"):
        assert fragment in text


def test_export_of_a_missing_checkpoint_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["export", str(tmp_path / "nope"), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("dflash-train export: error: No drafter checkpoint") and "\n" not in err


def test_export_against_a_wrong_target_is_one_line(
    tmp_path: Path, target_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    other = make_tiny_target("qwen3", num_layers=8, seed=1)
    other.model.save_pretrained(tmp_path / "other")
    capsys.readouterr()  # drop save_pretrained's progress bar
    assert main(["export", str(tmp_path / "train"), "--out", str(tmp_path / "out"), "--target",
                 str(tmp_path / "other")]) == 2
    err = capsys.readouterr().err.strip()
    assert "num_target_layers 6 != the target's 8" in err and "\n" not in err
    assert not (tmp_path / "out").exists()


def test_eval_reports_become_the_cards_table(tmp_path: Path, target_dir: Path) -> None:
    report = {"target": "t", "draft": "d", "settings": {"temperature": 0.0, "max_new_tokens": 256, "dtype": "bfloat16"},
              "environment": {"device": "NVIDIA H200"},
              "datasets": {"humaneval": {"requests": 164, "acceptance_length": 6.5012, "speedup": 5.14,
                                         "acceptance_length_cycle_weighted": 6.9, "lossless": True,
                                         "histogram": [1, 2, 3]}}}
    (tmp_path / "report.json").write_text(json.dumps(report))
    out = tmp_path / "out"
    assert main(["export", str(tmp_path / "train"), "--out", str(out), "--eval-report",
                 str(tmp_path / "report.json")]) == 0
    card = (out / "README.md").read_text()
    assert ("| dataset | requests | τ (acceptance length) | τ cycle-weighted | speedup | lossless | temperature | "
            "max new tokens | device | dtype |") in card
    assert "| humaneval | 164 | 6.5 | 6.9 | 5.14 | True | 0 | 256 | NVIDIA H200 | bfloat16 |" in card


def test_card_names_the_target_recorded_by_training(tmp_path: Path) -> None:
    draft = tiny_draft_for(make_tiny_target("qwen3", num_layers=6, seed=1))
    save_draft(draft, tmp_path / "step", extra_config={"dflash_train": {"step": 120, "target": "Qwen/Qwen3-8B"}})
    assert main(["export", str(tmp_path / "step"), "--out", str(tmp_path / "out")]) == 0
    card = (tmp_path / "out" / "README.md").read_text()
    assert "base_model: Qwen/Qwen3-8B\n" in card and "trained for 120 optimizer steps" in card
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["dflash_train"] == {"step": 120, "target": "Qwen/Qwen3-8B"}


def test_training_data_is_text_or_a_file_and_a_missing_file_is_refused(tmp_path: Path) -> None:
    """`--training-data notes.md` put the path itself in the card's Training data section."""
    from dflash_train.commands.export import training_data_text

    notes = tmp_path / "notes.md"
    notes.write_text("## Data\n\n150k regenerated chats.\n")
    assert training_data_text(str(notes)) == "## Data\n\n150k regenerated chats."
    assert training_data_text("ShareGPT prompts, 1k") == "ShareGPT prompts, 1k"
    assert training_data_text("regenerated answers, listed in data.md") == "regenerated answers, listed in data.md"
    assert training_data_text(None) is None
    with pytest.raises(ValueError, match=r"--training-data .*missing.md: no such file; give the file"):
        training_data_text(str(tmp_path / "missing.md"))
