"""A `.jsonl` is read line by line whatever its first line holds; a `.json` array is the array. Dropped rows
are counted by reason and the summary names the first lines they came from."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dflash_train.cli import main
from dflash_train.prompts.corpora import CorpusSpec, open_corpus
from dflash_train.prompts.messages import iter_messages
from dflash_train.quality import DataReport
from tests.helpers.tiny_models import make_tiny_target

ANSWER = "paris is the capital of france ."


def chat(user: str) -> dict:
    return {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": ANSWER}]}


def read(path: Path) -> tuple[list[int], DataReport]:
    spec, report = CorpusSpec(str(path)), DataReport("t")
    return [index for index, _, _ in iter_messages(open_corpus(spec), spec, report)], report


def test_jsonl_whose_first_line_is_an_array_keeps_every_later_line(tmp_path: Path) -> None:
    path = tmp_path / "chats.jsonl"
    path.write_text("\n".join([json.dumps([chat("first")]), *(json.dumps(chat(f"q{i}")) for i in range(3))]) + "\n")
    kept, report = read(path)
    assert kept == [1, 2, 3]
    assert (report.read, dict(report.dropped)) == (4, {"invalid_json": 1})
    assert any("invalid_json" in line and "line 1" in line for line in report.lines())


def test_json_array_is_the_array_and_json_lines_in_a_json_file_still_read(tmp_path: Path) -> None:
    array = tmp_path / "chats.json"
    array.write_text(json.dumps([chat("a"), chat("b"), "not a record"], indent=2))
    kept, report = read(array)
    assert kept == [0, 1] and dict(report.dropped) == {"invalid_json": 1}
    assert any("record 3" in line for line in report.lines())
    lines = tmp_path / "lines.json"
    lines.write_text(json.dumps(chat("a")) + "\n" + json.dumps(chat("b")) + "\n")
    assert read(lines)[0] == [0, 1]


def test_dropped_line_numbers_count_blank_lines_and_stop_after_a_few(tmp_path: Path) -> None:
    path = tmp_path / "chats.jsonl"
    rows = [json.dumps(chat("ok")), "", "{broken", *["[1]"] * 6, json.dumps(chat("ok again"))]
    path.write_text("\n".join(rows) + "\n")
    kept, report = read(path)
    assert kept == [0, 8] and dict(report.dropped) == {"invalid_json": 7}
    line = next(line for line in report.lines() if "invalid_json" in line)
    assert "chats.jsonl line 3, 4, 5, ..." in line and "line 9" not in line


def test_prepare_summary_counts_every_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = make_tiny_target("llama", num_layers=4)
    target.model.save_pretrained(tmp_path / "model")
    target.tokenizer.save_pretrained(tmp_path / "model")
    path = tmp_path / "chats.jsonl"
    path.write_text("\n".join([json.dumps([chat("hello")]), json.dumps(chat("hello")), json.dumps(chat("who ?"))]))
    argv = ["prepare", "--target", str(tmp_path / "model"), "--data", str(path), "--out", str(tmp_path / "out"),
            "--block-size", "2", "--max-length", "64"]
    assert main(argv) == 0
    rows = {line.split("  ")[1].strip(): line for line in capsys.readouterr().out.splitlines() if line.startswith("  ")}
    assert rows["rows read"].split()[-1] == "3" and rows["rows kept"].split()[-1] == "2"
    assert rows["dropped: invalid_json"].endswith("1  (chats.jsonl line 1)")
