"""prepare's report per source label: which of a mix's sources it keeps and which it drops, and why."""

from __future__ import annotations

import json
from pathlib import Path

from dflash_train.cli import main
from dflash_train.data import load_prepared
from dflash_train.data.prepare import PrepareConfig, prepare
from dflash_train.prompts.corpora import CorpusSpec
from tests.helpers.tiny_models import make_tiny_target, make_tiny_tokenizer

LONG = "paris is the capital of france and the largest city of the country ."


def chat(i: int, answer: str, source: str) -> dict:
    return {"messages": [{"role": "user", "content": f"question {i} about paris ?"},
                         {"role": "assistant", "content": answer}], "source": source, "source_index": i}


def test_the_report_counts_kept_and_dropped_records_per_source(tmp_path: Path) -> None:
    rows = [chat(0, LONG, "sharegpt"), chat(1, LONG, "sharegpt"), chat(2, "four", "math"), chat(3, LONG, "math"),
            chat(4, "two", "math")]
    source = tmp_path / "chats.jsonl"
    source.write_text("".join(json.dumps(row) + "\n" for row in rows))
    config = PrepareConfig([CorpusSpec(str(source))], block_size=4, target_name="tiny")  # keeps >= 8 tokens
    report = prepare(make_tiny_tokenizer(), config, tmp_path / "prepared")
    assert report.as_dict()["by_source"] == {"math": {"kept": 1, "too_few_supervised_tokens": 2},
                                             "sharegpt": {"kept": 2}}
    lines = report.lines()
    at = lines.index("  by source:")
    assert lines[at + 1:at + 3] == ["    math      kept 1 of 3; too_few_supervised_tokens 2 (67%)",
                                    "    sharegpt  kept 2 of 2"]


def test_one_source_adds_no_breakdown(tmp_path: Path) -> None:
    source = tmp_path / "chats.jsonl"
    source.write_text("".join(json.dumps(chat(i, LONG, "sharegpt")) + "\n" for i in range(2)))
    report = prepare(make_tiny_tokenizer(), PrepareConfig([CorpusSpec(str(source))], block_size=4, target_name="tiny"),
                     tmp_path / "prepared")
    assert "by_source" not in report.as_dict() and "  by source:" not in report.lines()


def test_an_excluded_source_is_left_out_and_counted_without_a_warning(tmp_path: Path) -> None:
    rows = [chat(0, LONG, "sharegpt"), chat(1, LONG, "math"), chat(2, LONG, "sharegpt"), chat(3, LONG, "math")]
    source = tmp_path / "chats.jsonl"
    source.write_text("".join(json.dumps(row) + "\n" for row in rows))
    config = PrepareConfig([CorpusSpec(str(source))], block_size=4, target_name="tiny", exclude_sources=("math",))
    report = prepare(make_tiny_tokenizer(), config, tmp_path / "prepared")
    assert report.as_dict()["by_source"] == {"math": {"excluded_source": 2}, "sharegpt": {"kept": 2}}
    assert report.kept == 2 and report.dropped["excluded_source"] == 2
    assert not [line for line in report.lines() if line.startswith("WARNING")]  # asked for: half the rows, no warning
    written = load_prepared(tmp_path / "prepared")
    assert sorted(written["source_index"]) == [0, 2] and set(written["source"]) == {"sharegpt"}
    meta = json.loads((tmp_path / "prepared" / "dflash_data.json").read_text())
    assert meta["exclude_sources"] == ["math"]


def test_the_flag_reaches_prepare(tmp_path: Path, capsys) -> None:  # noqa: ANN001
    rows = [chat(0, LONG, "sharegpt"), chat(1, LONG, "math")]
    source = tmp_path / "chats.jsonl"
    source.write_text("".join(json.dumps(row) + "\n" for row in rows))
    target = tmp_path / "tok"
    tiny = make_tiny_target("llama", num_layers=1)
    tiny.model.save_pretrained(target)
    tiny.tokenizer.save_pretrained(target)
    assert main(["prepare", "--target", str(target), "--data", str(source), "--block-size", "4",
                 "--exclude-source", "math", "--exclude-source", "other", "--out", str(tmp_path / "out")]) == 0
    assert list(load_prepared(tmp_path / "out")["source"]) == ["sharegpt"]
    out = capsys.readouterr().out
    assert "excluded_source" in out
    # a name no record carries (a typo) excluded nothing without a word: now the summary says so
    assert ("WARNING: --exclude-source other names no source of the data (its sources: math, sharegpt); it changed "
            "nothing") in out.splitlines()
    assert "--exclude-source math names" not in out


def test_a_cap_on_a_source_no_record_has_is_a_warning(tmp_path: Path) -> None:
    source = tmp_path / "chats.jsonl"
    source.write_text(json.dumps(chat(0, LONG, "sharegpt")) + "\n")
    config = PrepareConfig([CorpusSpec(str(source))], block_size=4, target_name="tiny", source_caps=(("foo", 3),))
    report = prepare(make_tiny_tokenizer(), config, tmp_path / "prepared")
    assert report.kept == 1
    assert [line for line in report.lines() if line.startswith("WARNING")] == [
        "WARNING: --cap-source foo names no source of the data (its sources: sharegpt); it changed nothing"]


def test_a_capped_source_keeps_its_first_records_and_counts_the_rest(tmp_path: Path) -> None:
    """--cap-source math=2: the first two math records in input order go on (a repeat of one of them does not
    use up the room), the others are counted as over the cap without a warning; other sources are untouched."""
    rows = [chat(0, LONG, "math"), chat(1, LONG, "sharegpt"), chat(0, LONG, "math"), chat(2, LONG, "math"),
            chat(3, LONG, "math"), chat(4, LONG, "sharegpt"), chat(5, LONG, "math")]
    source = tmp_path / "chats.jsonl"
    source.write_text("".join(json.dumps(row) + "\n" for row in rows))
    config = PrepareConfig([CorpusSpec(str(source))], block_size=4, target_name="tiny", source_caps=(("math", 2),))
    report = prepare(make_tiny_tokenizer(), config, tmp_path / "prepared")
    assert report.as_dict()["by_source"] == {"math": {"kept": 2, "duplicate_conversation": 1, "over_source_cap": 2},
                                             "sharegpt": {"kept": 2}}
    assert not [line for line in report.lines() if line.startswith("WARNING") and "over_source_cap" in line]
    written = load_prepared(tmp_path / "prepared")
    assert sorted(zip(written["source"], written["source_index"], strict=True)) == [
        ("math", 0), ("math", 2), ("sharegpt", 1), ("sharegpt", 4)]
    assert json.loads((tmp_path / "prepared" / "dflash_data.json").read_text())["source_caps"] == {"math": 2}


def test_a_cap_is_a_source_and_a_count(tmp_path: Path, capsys) -> None:  # noqa: ANN001
    from dflash_train.commands.prepare import source_cap

    assert source_cap("word-problems:steps=6000") == ("word-problems:steps", 6000)
    for wrong in ("math", "math=0", "=5", "math=two"):
        assert main(["prepare", "--target", "x", "--data", "y", "--cap-source", wrong, "--out", str(tmp_path / "o")]) == 2
        error = capsys.readouterr().err.strip().splitlines()
        assert len(error) == 1 and "--cap-source" in error[0] and "give a source and a count" in error[0]
