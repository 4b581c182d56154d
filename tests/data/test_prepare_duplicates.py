"""prepare drops a conversation identical to an earlier one (several sampled answers to one prompt can be the
same text), keeps the first copy whatever the number of workers, and keeps every copy when asked."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dflash_train.cli import main
from dflash_train.data import load_prepared
from dflash_train.data.prepare import PrepareConfig, prepare
from dflash_train.prompts.corpora import CorpusSpec
from tests.helpers.tiny_models import make_tiny_target, make_tiny_tokenizer

ANSWERS = ["paris is the capital of france and the largest city of the country .",
           "the capital of france is paris , on the seine , and its largest city ."]


def sampled(prompt: int, answer: int, index: int) -> dict:
    """One sampled answer to a prompt, labelled like regenerate's rows."""
    return {"messages": [{"role": "user", "content": f"question {prompt} about paris ?"},
                         {"role": "assistant", "content": ANSWERS[answer]}],
            "source": "sharegpt", "source_index": index}


ROWS = [sampled(0, 0, 0), sampled(0, 0, 1), sampled(0, 1, 2), sampled(1, 0, 3), sampled(0, 1, 4), sampled(0, 0, 5)]


def write_rows(path: Path) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    return path


@pytest.mark.parametrize("workers", [1, 2])
def test_repeated_conversations_are_dropped_after_their_first_copy(tmp_path: Path, workers: int) -> None:
    config = PrepareConfig([CorpusSpec(str(write_rows(tmp_path / "chats.jsonl")))], block_size=4,
                           target_name="tiny", workers=workers, parallel_min_rows=1)
    report = prepare(make_tiny_tokenizer(), config, tmp_path / "prepared")
    # by hand: (prompt 0, answer 0) at 0, 1, 5; (0, 1) at 2, 4; (1, 0) at 3 -> the first of each
    assert sorted(load_prepared(tmp_path / "prepared")["source_index"]) == [0, 2, 3]
    assert report.kept == 3 and report.dropped["duplicate_conversation"] == 3
    assert "keep_duplicates" not in json.loads((tmp_path / "prepared" / "dflash_data.json").read_text())


def test_a_second_corpus_repeating_the_first_is_dropped_too(tmp_path: Path) -> None:
    first, second = write_rows(tmp_path / "a.jsonl"), write_rows(tmp_path / "b.jsonl")
    config = PrepareConfig([CorpusSpec(str(first)), CorpusSpec(str(second))], block_size=4, target_name="tiny")
    report = prepare(make_tiny_tokenizer(), config, tmp_path / "prepared")
    assert report.kept == 3 and report.dropped["duplicate_conversation"] == 9


def test_keep_duplicates_keeps_every_copy(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "tok"
    tiny = make_tiny_target("llama", num_layers=1)
    tiny.model.save_pretrained(target)
    tiny.tokenizer.save_pretrained(target)
    source = write_rows(tmp_path / "chats.jsonl")
    common = ["prepare", "--target", str(target), "--data", str(source), "--block-size", "4"]
    assert main([*common, "--out", str(tmp_path / "deduped")]) == 0
    assert "duplicate_conversation" in capsys.readouterr().out
    assert main([*common, "--keep-duplicates", "--out", str(tmp_path / "all")]) == 0
    assert sorted(load_prepared(tmp_path / "all")["source_index"]) == [0, 1, 2, 3, 4, 5]
    assert json.loads((tmp_path / "all" / "dflash_data.json").read_text())["keep_duplicates"] is True
