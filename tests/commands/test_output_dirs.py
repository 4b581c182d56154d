"""Output folders are never deleted as a whole: a folder that is (or holds) an input is refused, a folder
holding other files is refused unless --overwrite, and --overwrite replaces only what the command wrote."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from dflash_train.checkpoint import save_draft
from dflash_train.cli import main
from dflash_train.data.prepare import PrepareConfig, prepare
from dflash_train.data.prepared import METADATA_FILE
from dflash_train.demo import StageRunner, plan_stages
from dflash_train.outputs import EXPORTED, FEATURES, PREPARED, REGENERATED, TRAINING, claim_training_dir
from dflash_train.prompts.corpora import CorpusSpec
from dflash_train.training.config import load_config
from tests.helpers.checkpoints import tiny_draft_for
from tests.helpers.paths import CPU_RECIPE
from tests.helpers.tiny_models import make_tiny_target, make_tiny_tokenizer
from tests.helpers.training import save_tiny_prepared

ANSWER = "paris is the capital of france ."
RECIPE = CPU_RECIPE


def write_chats(path: Path, n: int = 3) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    questions = ["what is the capital of france ?", "who are you ?", "hello", "what is paris ?"]
    turns = [[{"role": "user", "content": questions[i % 4]}, {"role": "assistant", "content": ANSWER}]
             for i in range(n)]
    path.write_text("".join(json.dumps({"messages": t}) + "\n" for t in turns))
    return path


def prepare_into(out: Path, source: Path, overwrite: bool = False, max_length: int = 48) -> None:
    config = PrepareConfig([CorpusSpec(str(source))], max_length=max_length, block_size=2, target_name="tiny")
    prepare(make_tiny_tokenizer(), config, out, overwrite)


def one_line_error(capsys: pytest.CaptureFixture[str]) -> str:
    """The error line, which must be the last of stderr (progress bars may come before it) and the only one."""
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and err.count(": error: ") == 1, err
    last = err.splitlines()[-1]
    assert ": error: " in last, err
    return last


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("model") / "target"
    target = make_tiny_target("qwen3", num_layers=6, seed=1)
    target.model.save_pretrained(path)
    target.tokenizer.save_pretrained(path)
    save_draft(tiny_draft_for(target), path.parent / "draft", dtype=torch.float32)
    return path


# ------------------------------------------------------------------------------------------------- prepare


def test_prepare_refuses_a_folder_that_is_or_holds_its_input(tmp_path: Path) -> None:
    source = write_chats(tmp_path / "runs" / "chats.jsonl")
    for out in (tmp_path / "runs", tmp_path):
        with pytest.raises(ValueError, match=r"holds the input .*chats.jsonl; write to a folder of its own"):
            prepare_into(out, source, overwrite=True)
    prepare_into(tmp_path / "runs" / "prepared", source)
    with pytest.raises(ValueError, match="is the input"):  # a prepared dataset read back into itself
        prepare(make_tiny_tokenizer(), PrepareConfig([CorpusSpec(str(tmp_path / "runs" / "prepared"))],
                                                     block_size=2), tmp_path / "runs" / "prepared", True)
    assert source.is_file() and (tmp_path / "runs" / "prepared" / METADATA_FILE).is_file()


def test_prepare_keeps_other_files_and_replaces_only_its_own(tmp_path: Path) -> None:
    source, out = write_chats(tmp_path / "chats.jsonl"), tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match=rf"^{out} is not empty and holds files prepare did not write \(notes.txt\); "
                                         r"pass --overwrite"):
        prepare_into(out, source)
    prepare_into(out, source, overwrite=True)
    prepare_into(out, source)  # its own dataset from the same inputs: replaced
    with pytest.raises(ValueError, match="holds a prepared dataset made from other inputs.*--overwrite"):
        prepare_into(out, source, max_length=64)
    assert json.loads((out / METADATA_FILE).read_text())["max_length"] == 48
    prepare_into(out, source, overwrite=True, max_length=64)
    assert json.loads((out / METADATA_FILE).read_text())["max_length"] == 64
    assert (out / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in out.iterdir() if not PREPARED.owns(p.name)) == ["notes.txt"]


def test_prepare_never_replaces_a_dataset_it_did_not_write(tmp_path: Path) -> None:
    source, out = write_chats(tmp_path / "chats.jsonl"), tmp_path / "theirs"
    save_tiny_prepared(out, num_rows=2)
    (out / METADATA_FILE).unlink()  # a plain `save_to_disk` folder: the same file names, not ours
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(ValueError, match=r"holds .*state.json.* without dflash_data.json: files prepare would replace"):
        prepare_into(out, source, overwrite=True)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_prepare_cli_error_is_one_line(tmp_path: Path, model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = write_chats(tmp_path / "runs" / "chats.jsonl")
    assert main(["prepare", "--target", str(model_dir), "--data", str(source), "--out", str(tmp_path / "runs"),
                 "--block-size", "2", "--overwrite"]) == 2
    assert "holds the input" in one_line_error(capsys) and source.is_file()


# ---------------------------------------------------------------------------------------------- regenerate


def regenerate(model_dir: Path, source: Path, out: Path, *extra: str) -> int:
    return main(["regenerate", "--target", str(model_dir), "--data", str(source), "--out", str(out),
                 "--max-new-tokens", "3", "--batch-size", "2", "--device", "cpu", "--dtype", "fp32", *extra])


def test_regenerate_refuses_other_files_and_overwrites_only_an_earlier_run(
        tmp_path: Path, model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source, out = write_chats(tmp_path / "data" / "chats.jsonl"), tmp_path / "regen"
    assert regenerate(model_dir, source, tmp_path / "data") == 2
    assert "holds the input" in one_line_error(capsys)
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert regenerate(model_dir, source, out) == 2
    assert "holds files regenerate did not write (notes.txt); pass --overwrite" in one_line_error(capsys)
    assert not list(out.glob("part-*"))
    assert regenerate(model_dir, source, out, "--overwrite") == 0
    assert regenerate(model_dir, source, out) == 0  # its own finished run: resumed, nothing to do
    assert regenerate(model_dir, source, out, "--temperature", "0.5") == 2
    assert "other settings (temperature)" in one_line_error(capsys)
    assert regenerate(model_dir, source, out, "--temperature", "0.5", "--overwrite") == 0
    capsys.readouterr()
    assert json.loads((out / "regenerate.json").read_text())["temperature"] == 0.5
    assert (out / "notes.txt").read_text() == "mine"


# ------------------------------------------------------------------------------------------------- extract


def test_extract_refuses_a_folder_holding_other_files_before_loading_the_target(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data, out = save_tiny_prepared(tmp_path / "prepared", num_rows=2), tmp_path / "store"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    argv = ["extract", "--target", str(tmp_path / "no-such-model"), "--data", str(data), "--device", "cpu"]
    assert main([*argv, "--out", str(out)]) == 2
    assert "holds files extract did not write (notes.txt); pass --overwrite" in one_line_error(capsys)
    assert main([*argv, "--out", str(tmp_path)]) == 2
    assert "holds the input" in one_line_error(capsys)
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]


# -------------------------------------------------------------------------------------------------- export


def test_export_never_deletes_the_checkpoint_or_other_files(
        tmp_path: Path, model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    checkpoint = run / "checkpoints" / "step-1"
    save_draft(tiny_draft_for(make_tiny_target("qwen3", num_layers=6, seed=1)), checkpoint, dtype=torch.float32)
    assert main(["export", str(checkpoint), "--out", str(run), "--overwrite"]) == 2
    assert "holds the input" in one_line_error(capsys) and (checkpoint / "config.json").is_file()
    out = tmp_path / "export"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert main(["export", str(checkpoint), "--out", str(out)]) == 2
    assert "pass --overwrite" in one_line_error(capsys)
    assert main(["export", str(checkpoint), "--out", str(out), "--overwrite", "--target", str(model_dir)]) == 0
    assert main(["export", str(checkpoint), "--out", str(out)]) == 2
    assert "holds an earlier export; pass --overwrite" in one_line_error(capsys)
    assert main(["export", str(checkpoint), "--out", str(out), "--overwrite"]) == 0
    assert (out / "notes.txt").read_text() == "mine" and (out / "dflash.py").is_file()
    assert main(["check", str(out), "--target", str(model_dir)]) == 0
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no scratch folder left


# --------------------------------------------------------------------------------------------------- train


def train_config(tmp_path: Path, out: Path, *extra: str) -> list[str]:
    data = tmp_path / "prepared"
    if not data.exists():
        save_tiny_prepared(data, num_rows=2)
    return ["--config", str(RECIPE), f"data.prepared={data}", f"training.output_dir={out}", *extra]


def test_train_refuses_an_output_dir_holding_its_data_or_other_files(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", *train_config(tmp_path, tmp_path, "training.max_steps=1")]) == 2
    assert re.search(r"training.output_dir .* holds the input .*prepared", one_line_error(capsys))
    out = tmp_path / "run"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    config = load_config(None, train_config(tmp_path, out)[2:])
    with pytest.raises(ValueError, match="holds files train did not write.*pick another training.output_dir"):
        claim_training_dir(config, overwrite=False)
    claim_training_dir(config, overwrite=True)  # trains beside them
    (out / "metrics.jsonl").write_text("")
    claim_training_dir(config, overwrite=False)  # a run there: resumed
    fresh = load_config(None, [*train_config(tmp_path, out)[2:], "training.resume=none"])
    with pytest.raises(ValueError, match="holds a training run, which training.resume=none would train over"):
        claim_training_dir(fresh, overwrite=False)
    claim_training_dir(fresh, overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]


# ---------------------------------------------------------------------------------------------------- demo


def test_demo_stage_that_starts_over_removes_only_what_it_wrote(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    from dflash_train.demo import CPU_SIZES

    stage = next(s for s in plan_stages(tmp_path, CPU_SIZES, "cpu") if s.name == "prepare")
    stage.output.mkdir(parents=True)
    for name in (METADATA_FILE, "data-00000-of-00001.arrow", "state.json", "notes.txt"):
        (stage.output / name).write_text("x")
    (tmp_path / "demo_state.json").write_text(json.dumps({"prepare": {"argv": ["older"], "done": True}}))
    ran: list[list[str]] = []
    monkeypatch.setattr("dflash_train.demo.cli_main", lambda argv: ran.append(argv) or 0)
    StageRunner(tmp_path).run(stage, 2, 6)
    assert ran == [stage.argv] and sorted(p.name for p in stage.output.iterdir()) == ["notes.txt"]


# ------------------------------------------------------------------------------------------------ the names


def test_the_known_names_are_those_the_writers_use(tmp_path: Path) -> None:
    from dflash_train.checkpoint.check import CARD_FILE
    from dflash_train.checkpoint.hf_format import REMOTE_CODE_FILE
    from dflash_train.checkpoint.io import CONFIG_FILE
    from dflash_train.checkpoint.weights import INDEX_FILE, SINGLE_FILE
    from dflash_train.features.store import MANIFEST, shard_path
    from dflash_train.shards import REGEN_MANIFEST, regenerated_shard_path

    assert PREPARED.marker == METADATA_FILE and REGENERATED.marker == REGEN_MANIFEST and FEATURES.marker == MANIFEST
    assert REGENERATED.owns(regenerated_shard_path(tmp_path, 3).name) and REGENERATED.owns(".part-000003.jsonl.x.tmp")
    assert FEATURES.owns(shard_path(tmp_path, 3).name) and FEATURES.owns(".features-000003.safetensors.x.tmp")
    assert all(EXPORTED.owns(name) for name in (CARD_FILE, REMOTE_CODE_FILE, CONFIG_FILE, INDEX_FILE, SINGLE_FILE,
                                                "model-00001-of-00002.safetensors"))
    assert EXPORTED.marker == REMOTE_CODE_FILE and TRAINING.owns("checkpoints")
