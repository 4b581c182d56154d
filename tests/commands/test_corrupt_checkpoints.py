"""A truncated or corrupt safetensors file is one line naming the file and what to do, everywhere one is
read: `check`, `export`, `eval`, `init_from`, a local target directory, and training resume (where
`resume: auto` falls back to the newest whole checkpoint)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from dflash_train.checkpoint import load_draft, save_draft
from dflash_train.cli import main
from dflash_train.safetensors_io import DamagedFileError, safetensors_damage
from dflash_train.target import load_target
from dflash_train.training import resume as ckpt
from dflash_train.training.config import TrainConfig
from dflash_train.training.setup import build_draft
from tests.helpers.checkpoints import export_tiny, tiny_draft_for
from tests.helpers.tiny_models import make_tiny_target, save_tiny_target_dir

WEIGHTS = "model.safetensors"


def truncate(path: Path, keep: float = 0.5) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


def one_line_error(capsys: pytest.CaptureFixture[str], command: str) -> str:
    err = capsys.readouterr().err.strip()
    last = err.splitlines()[-1]  # earlier lines: model-loading progress bars
    assert last.startswith(f"dflash-train {command}: error:") and "Traceback" not in err
    return last


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_target_dir(tmp_path_factory.mktemp("target"))


@pytest.fixture
def draft_dir(tmp_path: Path) -> Path:
    return save_draft(tiny_draft_for(make_tiny_target("qwen3", num_layers=6, seed=1)), tmp_path / "draft")


# ---------------------------------------------------------------------------------------------- the one reader


@pytest.mark.parametrize(("damage", "expected"), [
    (lambda p: truncate(p), "truncated"),
    (lambda p: truncate(p, keep=0.0001), "truncated"),
    (lambda p: p.write_bytes(b""), "truncated"),
    (lambda p: p.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!"), "corrupt header"),
    (lambda p: p.write_bytes(p.read_bytes() + b"junk"), "past its last tensor"),
])
def test_damage_is_named(tmp_path: Path, damage, expected: str) -> None:  # noqa: ANN001
    path = tmp_path / WEIGHTS
    save_file({"a": torch.ones(64, 64)}, str(path))
    assert safetensors_damage(path) is None
    damage(path)
    assert expected in (safetensors_damage(path) or "")


def test_load_draft_names_the_damaged_file(draft_dir: Path) -> None:
    truncate(draft_dir / WEIGHTS)
    with pytest.raises(DamagedFileError, match=r"model\.safetensors is damaged \(truncated: [\d,]+ of [\d,]+ bytes\)"):
        load_draft(draft_dir)


# ---------------------------------------------------------------------------------------------- commands


def test_check_reports_a_truncated_export(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    export = export_tiny(tmp_path, make_tiny_target("qwen3", num_layers=6, seed=1), block_size=4)
    truncate(export / WEIGHTS)
    assert main(["check", str(export)]) == 1
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1 and f"{export / WEIGHTS} is damaged (truncated: " in lines[0]


def test_check_reports_a_damaged_shard_and_a_corrupt_index(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sharded = save_draft(tiny_draft_for(make_tiny_target("qwen3", num_layers=6, seed=1)), tmp_path / "sharded",
                         max_shard_bytes=20_000)
    shard = sorted(sharded.glob("model-*-of-*.safetensors"))[1]
    truncate(shard)
    with pytest.raises(DamagedFileError, match=shard.name):
        load_draft(sharded)
    assert main(["check", str(sharded)]) == 1
    assert f"{shard} is damaged (truncated: " in capsys.readouterr().out
    (sharded / "model.safetensors.index.json").write_text("{not json")
    assert main(["check", str(sharded)]) == 1  # still a report of problems, not an error
    assert "model.safetensors.index.json is not a valid safetensors index" in capsys.readouterr().out


def test_export_of_a_truncated_checkpoint(tmp_path: Path, draft_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    truncate(draft_dir / WEIGHTS)
    assert main(["export", str(draft_dir), "--out", str(tmp_path / "out")]) == 2
    line = one_line_error(capsys, "export")
    assert str(draft_dir / WEIGHTS) in line and "copy or export that checkpoint again" in line
    assert not (tmp_path / "out").exists()


def test_eval_of_a_truncated_drafter(tmp_path: Path, target_dir: Path, draft_dir: Path,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    truncate(draft_dir / WEIGHTS)
    assert main(["eval", "--target", str(target_dir), "--draft", str(draft_dir), "--dataset", "humaneval",
                 "--device", "cpu", "--no-progress", "--out", str(tmp_path / "r.json")]) == 2
    assert str(draft_dir / WEIGHTS) in one_line_error(capsys, "eval")


def test_init_from_a_truncated_drafter(draft_dir: Path) -> None:
    truncate(draft_dir / WEIGHTS)
    config = TrainConfig()
    config.model.init_from = str(draft_dir)
    with pytest.raises(ValueError, match=r"model\.init_from=.*model\.safetensors is damaged") as error:
        build_draft(config, make_tiny_target("qwen3", num_layers=6, seed=1))
    assert "\n" not in str(error.value)


def test_target_directory_with_a_truncated_weights_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = make_tiny_target("qwen3", num_layers=6, seed=1)
    target.model.save_pretrained(tmp_path / "target")
    target.tokenizer.save_pretrained(tmp_path / "target")
    truncate(tmp_path / "target" / WEIGHTS)
    with pytest.raises(ValueError, match=r"model\.safetensors is damaged \(truncated.*download or copy the target"):
        load_target(str(tmp_path / "target"))
    assert main(["eval", "--target", str(tmp_path / "target"), "--draft", "random", "--dataset", "humaneval",
                 "--device", "cpu", "--no-progress", "--out", str(tmp_path / "r.json")]) == 2
    assert str(tmp_path / "target" / WEIGHTS) in one_line_error(capsys, "eval")


# ---------------------------------------------------------------------------------------------- resume


def fake_checkpoint(output_dir: Path, step: int) -> Path:
    """A checkpoint directory as the trainer lays it out: drafter weights, accelerate state, trainer state."""
    path = ckpt.checkpoint_root(output_dir) / f"step-{step:08d}"
    (path / "draft").mkdir(parents=True)
    (path / "state").mkdir()
    save_file({"w": torch.full((32, 32), float(step))}, str(path / "draft" / WEIGHTS))
    save_file({"w": torch.full((32, 32), float(step))}, str(path / "state" / WEIGHTS))
    torch.save({"step": step, "moments": torch.ones(256)}, path / "state" / "optimizer.bin")
    (path / "trainer_state.json").write_text(json.dumps({"step": step}))
    return path


def test_auto_resume_skips_a_damaged_latest_checkpoint(tmp_path: Path) -> None:
    first, second, third = (fake_checkpoint(tmp_path, step) for step in (10, 20, 30))
    truncate(third / "state" / WEIGHTS)
    said: list[str] = []
    assert ckpt.resolve_resume("auto", tmp_path, said.append) == second
    assert len(said) == 1 and "step-00000030" in said[0] and "state/model.safetensors" in said[0]
    assert "resuming from step-00000020" in said[0]
    truncate(second / "state" / "optimizer.bin")
    said.clear()
    assert ckpt.resolve_resume("auto", tmp_path, said.append) == first
    assert "optimizer.bin" in said[0]
    assert third.is_dir() and second.is_dir()  # nothing is deleted


def test_auto_resume_with_only_damaged_checkpoints_is_one_line(tmp_path: Path) -> None:
    truncate(fake_checkpoint(tmp_path, 10) / "draft" / WEIGHTS)
    with pytest.raises(ValueError, match=r"every checkpoint .* is damaged .*training\.resume=none"):
        ckpt.resolve_resume("auto", tmp_path, print)


def test_explicit_resume_of_a_damaged_checkpoint_is_one_line(tmp_path: Path) -> None:
    path = fake_checkpoint(tmp_path, 10)
    assert ckpt.resolve_resume(str(path), tmp_path) == path
    truncate(path / "state" / WEIGHTS)
    with pytest.raises(ValueError, match=r"training\.resume=.*damaged \(state/model\.safetensors: truncated") as error:
        ckpt.resolve_resume(str(path), tmp_path)
    assert "\n" not in str(error.value)


def test_saving_after_resuming_past_a_damaged_checkpoint_keeps_the_whole_ones(tmp_path: Path) -> None:
    # Resumed from step 20 past a damaged step 30: saving step 25 with keep_last 2 must keep 20, not 30.
    for step in (10, 20, 30):
        fake_checkpoint(tmp_path, step)
    tmp, final = ckpt.staging_dir(tmp_path, 25)
    tmp.mkdir()
    ckpt.finalize(tmp, final, {"step": 25}, keep_last=2)
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["step-00000020", "step-00000025", "step-00000030"]
