"""Mistakes typed at a terminal (a device this machine lacks, a size of 0, an output path that cannot be written,
data with nothing to keep, a target without a usable tokenizer): each is one line that says what to do, given
before a model loads or a long run starts, and no input changes."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch

from dflash_train.cli import main
from dflash_train.commands import eval as eval_command
from dflash_train.commands import regenerate as regenerate_command
from dflash_train.commands import self_prompt
from tests.helpers.training import save_tiny_prepared, save_tiny_target


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("inputs")
    chats = root / "chats.jsonl"  # one chat whose answer is too short to train a drafter of block size 16
    chats.write_text(json.dumps({"messages": [{"role": "user", "content": "hello"},
                                              {"role": "assistant", "content": "yes"}]}) + "\n")
    (root / "empty.jsonl").write_text("")
    return {"root": root, "target": save_tiny_target(root / "target"), "chats": chats, "empty": root / "empty.jsonl",
            "prepared": save_tiny_prepared(root / "prepared", num_rows=4)}


def contents(root: Path) -> dict[str, str]:
    return {str(path.relative_to(root)): hashlib.sha256(path.read_bytes()).hexdigest()
            for path in sorted(root.rglob("*")) if path.is_file()}


def one_line_error(capsys: pytest.CaptureFixture[str], after_progress: bool = False) -> str:
    """The error line; `after_progress`: the one after a model's loading bar (a command that got that far)."""
    lines = capsys.readouterr().err.strip().splitlines()
    if after_progress:
        lines = [line for line in lines if not line.startswith("Loading weights")]
    assert len(lines) == 1, lines
    return lines[0]


def with_device(name: str, inputs: dict[str, Path], out: Path, device: str) -> list[str]:
    target = str(inputs["target"])
    if name == "regenerate":
        return ["regenerate", "--target", target, "--data", str(inputs["chats"]), "--out", str(out), "--device", device]
    if name == "extract":
        return ["extract", "--target", target, "--data", str(inputs["prepared"]), "--out", str(out), "--device", device]
    if name == "self-prompt":
        return ["self-prompt", "--target", target, "--num-prompts", "2", "--out", str(out / "p.jsonl"),
                "--device", device]
    return ["eval", "--target", target, "--draft", "random", "--dataset", "humaneval", "--out",
            str(out / "report.json"), "--device", device]


@pytest.mark.parametrize("name", ["regenerate", "extract", "self-prompt", "eval"])
@pytest.mark.parametrize(("device", "cuda_devices", "message"), [
    ("tpu", 0, "'tpu' is not a device; use cpu, cuda or cuda:N"),
    ("cuda", 0, "cuda requested but no CUDA device is visible; use --device cpu"),
    ("cuda:3", 2, "cuda:3: this machine has 2 CUDA device(s); use cuda:0 to cuda:1"),
])
def test_a_device_this_machine_lacks_is_one_line_before_anything_loads(
        name: str, device: str, cuda_devices: int, message: str, inputs: dict[str, Path], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Torch refused these deep inside the run, in a traceback (an unknown device type, CUDA not compiled in)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda_devices > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: cuda_devices)
    before = contents(inputs["root"])
    out = tmp_path / "out"
    assert main(with_device(name, inputs, out, device)) == 2
    assert one_line_error(capsys) == (f"dflash-train {name}: error: argument --device: {message} "
                                      f"(see dflash-train {name} --help)")
    assert not out.exists() and contents(inputs["root"]) == before


@pytest.mark.parametrize("size", ["0", "-1", "nan"])
def test_export_refuses_a_shard_size_that_is_not_positive(size: str, inputs: dict[str, Path], tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """0 or less wrote a shard file per tensor (thousands for a real drafter); nan failed in a float conversion."""
    out = tmp_path / "out"
    assert main(["export", str(inputs["prepared"]), "--out", str(out), f"--max-shard-gb={size}"]) == 2
    assert one_line_error(capsys) == (f"dflash-train export: error: argument --max-shard-gb: must be > 0, not {size} "
                                      "(see dflash-train export --help)")
    assert not out.exists()


@pytest.mark.parametrize(("flag", "value"), [("--block-size", "0"), ("--num-draft-layers", "-2")])
def test_inspect_refuses_a_count_below_one_naming_the_flag(flag: str, value: str, inputs: dict[str, Path],
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", "--target", str(inputs["target"]), flag, value]) == 2
    assert one_line_error(capsys) == (f"dflash-train inspect: error: argument {flag}: must be at least 1, not {value} "
                                      "(see dflash-train inspect --help)")


def _never(*args: object, **kwargs: object) -> None:
    raise AssertionError("the command went on to load the target")


@pytest.mark.parametrize("where", ["folder", "under a file"])
def test_eval_refuses_a_report_path_it_cannot_write_before_evaluating(
        where: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """The report is written last: such a path failed only after the whole evaluation, naming a hidden temp file."""
    monkeypatch.setattr(eval_command, "_load_target", _never)
    (tmp_path / "results").mkdir()
    (tmp_path / "notes.txt").write_text("mine")
    out = tmp_path / "results" if where == "folder" else tmp_path / "notes.txt" / "report.json"
    assert main(["eval", "--target", "t", "--draft", "random", "--dataset", "humaneval", "--device", "cpu",
                 "--out", str(out)]) == 2
    expected = (f"--out {out} is a folder; give the path of the file to write" if where == "folder" else
                f"--out {out}: {tmp_path / 'notes.txt'} is a file, not a folder; pick another --out")
    assert one_line_error(capsys) == f"dflash-train eval: error: {expected}"
    assert (tmp_path / "notes.txt").read_text() == "mine" and not any((tmp_path / "results").iterdir())


def test_eval_refuses_a_report_folder_it_may_not_write_in(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(eval_command, "_load_target", _never)
    monkeypatch.setattr("os.access", lambda path, mode: False)  # as for another user's folder (tests run as root)
    out = tmp_path / "report.json"
    assert main(["eval", "--target", "t", "--draft", "random", "--dataset", "humaneval", "--device", "cpu",
                 "--out", str(out)]) == 2
    assert one_line_error(capsys) == (f"dflash-train eval: error: --out {out}: cannot write in {tmp_path}; check its "
                                      "permissions or pick another --out")


def test_self_prompt_refuses_an_out_under_a_file_before_generating(
        inputs: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(self_prompt, "load_target", _never)
    (tmp_path / "notes.txt").write_text("mine")
    out = tmp_path / "notes.txt" / "prompts.jsonl"
    assert main(["self-prompt", "--target", str(inputs["target"]), "--num-prompts", "2", "--out", str(out)]) == 2
    assert one_line_error(capsys) == (f"dflash-train self-prompt: error: --out {out}: {tmp_path / 'notes.txt'} is a "
                                      "file, not a folder; pick another --out")
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_prepare_and_regenerate_say_why_nothing_was_kept(inputs: dict[str, Path], tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """An empty file read `no usable rows in [...]: {}`, every row dropped a dict of counts, with no fix; and
    regenerate said so only after loading the target's weights."""
    before = contents(inputs["root"])
    target, empty, chats = str(inputs["target"]), str(inputs["empty"]), str(inputs["chats"])
    assert main(["prepare", "--target", target, "--data", empty, "--out", str(tmp_path / "p1")]) == 2
    assert one_line_error(capsys) == (f"dflash-train prepare: error: no rows in {empty}: it holds no records (an "
                                      "empty file or folder); check --data")
    assert main(["prepare", "--target", target, "--data", chats, "--out", str(tmp_path / "p2")]) == 2
    assert one_line_error(capsys) == (
        f"dflash-train prepare: error: no usable rows in {chats}: all 1 read were dropped (too_few_supervised_tokens "
        "1 (chats.jsonl line 1): their answers are shorter than 2 x --block-size tokens; a smaller --block-size "
        "keeps them)")
    def never(*args: object, **kwargs: object) -> None:
        raise AssertionError("the target's weights loaded for a corpus with no prompt")

    monkeypatch.setattr(regenerate_command, "load_target", never)
    assert main(["regenerate", "--target", target, "--data", empty, "--device", "cpu", "--out",
                 str(tmp_path / "r")]) == 2
    assert one_line_error(capsys) == (
        f"dflash-train regenerate: error: no prompts in {empty}: it holds no records (an empty file or folder); "
        "check --data")
    assert not (tmp_path / "p1").exists() and not (tmp_path / "p2").exists()
    assert contents(inputs["root"]) == before


@pytest.mark.parametrize("damage", ["removed", "not JSON", "another model type"])
@pytest.mark.parametrize("command", ["inspect", "prepare"])
def test_a_target_without_a_usable_tokenizer_is_one_line(damage: str, command: str, inputs: dict[str, Path],
                                                         tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Without tokenizer files transformers loads a tokenizer of special tokens only, which failed later as a
    chat template without an end of turn; a damaged tokenizer.json was a JSON or Rust error naming no file."""
    target = shutil.copytree(inputs["target"], tmp_path / "target")
    tokenizer = target / "tokenizer.json"
    if damage == "removed":
        tokenizer.unlink()
        (target / "tokenizer_config.json").unlink()
    elif damage == "not JSON":
        tokenizer.write_text(tokenizer.read_text()[:3000])
    else:
        content = json.loads(tokenizer.read_text())
        content["model"]["type"] = "Nope"
        tokenizer.write_text(json.dumps(content))
    before = contents(target)
    argv = ["inspect", "--target", str(target)] if command == "inspect" else \
        ["prepare", "--target", str(target), "--data", str(inputs["chats"]), "--show", "1"]
    assert main(argv) == 2
    error = one_line_error(capsys, after_progress=command == "inspect")  # the weights load first
    if damage == "removed":
        assert error == (f"dflash-train {command}: error: '{target}' has no tokenizer: no tokenizer.json, "
                         "tokenizer.model or vocabulary file beside its config.json; download or copy the target "
                         "again, tokenizer files included")
    else:
        assert error.startswith(f"dflash-train {command}: error: cannot load the tokenizer of '{target}' (")
        assert error.endswith("); its tokenizer files (tokenizer.json, tokenizer_config.json, ...) are missing or "
                              "damaged: download or copy the target again")
    assert contents(target) == before


@pytest.mark.parametrize("name", ["regenerate", "self-prompt", "eval"])
@pytest.mark.parametrize("value", ["nan", "inf", "-1", "hot"])
def test_a_temperature_that_is_not_a_number_to_sample_at(name: str, value: str, inputs: dict[str, Path],
                                                         tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """nan or inf would sample from a broken distribution (self-prompt wrote an empty file): refused as the
    arguments are read, before the target loads."""
    assert main([*with_device(name, inputs, tmp_path / "out", "cpu"), f"--temperature={value}"]) == 2
    line = one_line_error(capsys)
    expected = "takes a number > 0" if name == "self-prompt" else "takes a number >= 0 (0: greedy)"
    assert line.startswith(f"dflash-train {name}: error: argument --temperature: {expected}") and value in line
    assert not (tmp_path / "out").exists()


def test_the_training_module_refuses_a_bad_command_line_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    """`python -m dflash_train.train` (what `accelerate launch -m` runs) printed its whole usage text first."""
    from dflash_train import train

    assert train.main(["--config", "recipe.yaml", "--bogus"]) == 2
    assert one_line_error(capsys) == ("python -m dflash_train.train: error: unrecognized arguments: --bogus "
                                      "(see python -m dflash_train.train --help)")


def eval_argv(out: Path, *extra: str, dataset: str = "humaneval") -> list[str]:
    return ["eval", "--target", "t", "--draft", "random", "--dataset", dataset, "--device", "cpu", "--out", str(out),
            *extra]


def test_eval_never_writes_its_report_over_an_input_or_a_file_of_another_kind(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """`--out` equal to the prompt file replaced the prompts with the report; a training run's curves file (and the
    figure beside it) were replaced the same way. Each is refused before anything loads, and nothing changes."""
    monkeypatch.setattr(eval_command, "_load_target", _never)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"turns": ["hello"]}) + "\n")
    curves, figure = tmp_path / "training_curves.json", tmp_path / "training_curves.png"
    curves.write_text('{"steps": [1, 2]}')
    figure.write_bytes(b"\x89PNG mine")
    lonely = tmp_path / "plot.png"
    lonely.write_bytes(b"\x89PNG also mine")
    before = contents(tmp_path)
    cases = [
        (eval_argv(prompts, dataset=str(prompts)), f"--out {prompts} is one of this evaluation's inputs; pick another --out"),
        (eval_argv(curves), f"--out {curves} exists and is not an eval report (an earlier report is replaced); move it "
                            "or pick another --out"),
        (eval_argv(tmp_path / "plot.json"), f"--out {tmp_path / 'plot.json'} would replace {lonely}, which no eval "
                                            "report beside it owns; move it, pick another --out or pass --no-plot"),
        (eval_argv(lonely), f"--out {lonely}: the report is JSON and its figure goes next to it as .png; give a "
                            ".json path"),
    ]
    for argv, expected in cases:
        assert main(argv) == 2
        assert one_line_error(capsys) == f"dflash-train eval: error: {expected}"
    assert contents(tmp_path) == before


def test_eval_replaces_an_earlier_report_and_its_figure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Evaluating again into the same `--out` is the usual way to refresh a report: it passes the checks."""
    monkeypatch.setattr(eval_command, "_load_target", _never)
    out = tmp_path / "report.json"
    out.write_text(json.dumps({"settings": {}, "definitions": {}, "datasets": {}}))
    out.with_suffix(".png").write_bytes(b"\x89PNG earlier")
    with pytest.raises(AssertionError, match="went on to load the target"):
        main(eval_argv(out))
    no_plot = tmp_path / "other.json"
    (tmp_path / "other.png").write_bytes(b"\x89PNG not a report's")
    with pytest.raises(AssertionError, match="went on to load the target"):
        main(eval_argv(no_plot, "--no-plot"))  # the figure is not written, so it is not in the way


def test_a_drafter_given_as_the_target_is_named_as_such(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """An exported drafter as --target printed transformers' load report, then said it had no tokenizer."""
    from dflash_train.checkpoint.io import save_draft
    from dflash_train.models import DFlashConfig, DFlashDraftModel
    from tests.helpers.tiny_models import make_tiny_target

    target = make_tiny_target("qwen3", num_layers=4)
    config = DFlashConfig.from_target_config(target.config, mask_token_id=5, num_hidden_layers=1, block_size=4)
    draft = save_draft(DFlashDraftModel(config), tmp_path / "draft", dtype=torch.float32)
    assert main(["inspect", "--target", str(draft)]) == 2
    assert one_line_error(capsys) == (f"dflash-train inspect: error: {draft} is a DFlash drafter, not a target: pass "
                                      "it as --draft (or model.init_from), and the model it drafts for as the target")


def test_train_names_missing_data_before_loading_the_target(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    import dflash_train.training.trainer as trainer_module

    monkeypatch.setattr(trainer_module, "build_target", _never)
    missing = tmp_path / "missing"
    assert main(["train", "--config", "recipes/smollm2-135m-dflash-b16-cpu.yaml", f"data.prepared={missing}",
                 f"training.output_dir={tmp_path / 'out'}", "tracking.report_to=none"]) == 2
    assert str(missing) in one_line_error(capsys)
