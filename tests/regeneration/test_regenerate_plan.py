"""The regeneration plan and the rows' labels: units sorted by length only within windows of consecutive input
rows (a run stopped early has answered a prefix of the input, in its mix of sources), a run planned otherwise
refused in one line, and a prompt's own `source`/`source_index` (as `pack` writes them) kept through
regenerate, its later turns, and prepare. The answers come from a back end that answers every prompt alike:
generation itself is tested in tests/regeneration/test_regenerate.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dflash_train.data import load_prepared
from dflash_train.data.chat import ChatTokenizer
from dflash_train.data.prepare import PrepareConfig, prepare
from dflash_train.prompts.corpora import CorpusSpec
from dflash_train.quality import DataReport
from dflash_train.regeneration.regenerate import (
    PLAN_WINDOW_UNITS,
    Completion,
    PromptRow,
    RegenerateConfig,
    fan_out,
    plan_units,
    regenerate,
)
from dflash_train.shards import REGEN_MANIFEST, regenerated_files
from tests.helpers.regeneration import WORDS
from tests.helpers.tiny_models import make_tiny_tokenizer

ANSWER = "paris is the capital of france ."


class SameAnswer:
    """A back end that answers every prompt with ``ANSWER``."""

    def complete(self, rows: list[PromptRow], seed: int) -> list[Completion]:
        return [Completion(ANSWER, "stop", len(ANSWER.split())) for _ in rows]


def interleaved(n: int) -> list[PromptRow]:
    """``n`` rows alternating between a source of long prompts and one of short prompts (lengths vary within
    each), as `pack --interleave` writes a mix."""
    rows = []
    for i in range(n):
        long = i % 2 == 0
        length = (20 + i % 7) if long else (2 + i % 5)
        rows.append(PromptRow(i, [{"role": "user", "content": "x"}], [1] * length, "long" if long else "short", i))
    return rows


def test_units_follow_the_input_in_windows_sorted_by_length() -> None:
    rows, batch, window_units = interleaved(64), 4, 2
    units = plan_units(rows, batch, window_units)
    assert sorted(i for unit in units for i in unit) == list(range(64))  # every row once
    window = batch * window_units
    for k, unit in enumerate(units):
        assert len(unit) == batch and all(i // window == k // window_units for i in unit)  # its window's rows
        lengths = [len(rows[i].prompt_ids) for i in unit]
        assert lengths == sorted(lengths, reverse=True)  # longest first within a unit
    # A run stopped after 4 of 16 units has answered the first 16 rows: both sources, in the input's proportion.
    done = [rows[i].source for unit in units[:4] for i in unit]
    assert sorted(i for unit in units[:4] for i in unit) == list(range(16))
    assert done.count("long") == done.count("short") == 8
    # Sorting every row at once (one window) would have answered the long prompts only.
    assert {rows[i].source for unit in plan_units(rows, batch, len(units))[:4] for i in unit} == {"long"}


def test_the_default_window_and_a_short_last_window() -> None:
    rows = interleaved(3 * 8 * PLAN_WINDOW_UNITS + 5)
    units = plan_units(rows, 3)
    assert [len(u) for u in units] == [3] * (len(rows) // 3) + [2]
    assert sorted(i for unit in units for i in unit) == list(range(len(rows)))
    assert set(units[-1]) | set(units[-2]) == set(range(len(rows) - 5, len(rows)))  # the tail is its own window
    assert plan_units(rows, 3) == units  # the plan depends on the rows and settings alone


def test_a_prompts_samples_share_a_unit() -> None:
    samples = 2
    rows = fan_out(interleaved(20), samples, DataReport("test"))
    for unit in plan_units(rows, 4, 2):
        prompts = [rows[i].row_id // samples for i in unit]
        assert all(prompts.count(p) == samples for p in prompts)


# ------------------------------------------------------------------------------------------ resumed runs


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def prompt(i: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": " ".join(WORDS[(i * 3 + k) % len(WORDS)] for k in range(1 + i % 5)) + " ?"}]


def run(source: Path, out: Path, turns: int | None = 1, window_units: int = PLAN_WINDOW_UNITS) -> dict:
    config = RegenerateConfig([CorpusSpec(str(source))], batch_size=2, turns=turns, turn_wait_seconds=0.0,
                              plan_window_units=window_units)
    return regenerate(SameAnswer(), ChatTokenizer(make_tiny_tokenizer()), config, out)


def test_a_run_planned_otherwise_is_refused_in_one_line(tmp_path: Path) -> None:
    source = write_jsonl(tmp_path / "prompts.jsonl", [{"messages": prompt(i)} for i in range(10)])
    assert run(source, tmp_path / "out")["plan_window_units"] == PLAN_WINDOW_UNITS
    manifest_path = tmp_path / "out" / REGEN_MANIFEST
    with pytest.raises(ValueError, match=r"other settings \(plan_window_units\)") as error:
        run(source, tmp_path / "out", window_units=1)
    assert "\n" not in str(error.value)
    # A manifest written before the plan was recorded: its units were cut from one sort of all rows.
    manifest = json.loads(manifest_path.read_text())
    del manifest["plan_window_units"]
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match=r"other settings \(plan_window_units\); use the same settings") as error:
        run(source, tmp_path / "out")
    assert "\n" not in str(error.value)


# ------------------------------------------------------------------------------------------ row labels


def packed_rows(answer: bool = False) -> list[dict]:
    """Rows as `pack` writes them (two named sources in one file, each with its own index), and one unlabelled."""
    reply = [{"role": "assistant", "content": ANSWER}] if answer else []
    rows = [{"messages": prompt(i) + reply, "source": "sharegpt" if i % 2 else "math", "source_index": 100 + i}
            for i in range(6)]
    return [*rows, {"messages": [{"role": "user", "content": "hello who are you ?"}, *reply]}]


def labels(rows: list[dict]) -> list[tuple[str, int]]:
    return sorted((row["source"], row["source_index"]) for row in rows)


def expected_labels(source: Path) -> list[tuple[str, int]]:
    named = [("sharegpt" if i % 2 else "math", 100 + i) for i in range(6)]
    return sorted([*named, (str(source), 6)])  # the unlabelled row: the file and its index, as before


def test_regenerate_and_prepare_keep_each_prompts_own_source(tmp_path: Path) -> None:
    source = write_jsonl(tmp_path / "prompts.jsonl", packed_rows())
    assert run(source, tmp_path / "regen")["complete"]
    rows = [json.loads(line) for path in regenerated_files(tmp_path / "regen") for line in path.read_text().splitlines()]
    assert labels(rows) == expected_labels(source)
    config = PrepareConfig([CorpusSpec(str(tmp_path / "regen"))], block_size=2, target_name="tiny")
    prepare(make_tiny_tokenizer(), config, tmp_path / "prepared")
    assert labels(list(load_prepared(tmp_path / "prepared"))) == expected_labels(source)


def test_later_turns_keep_the_conversations_source(tmp_path: Path) -> None:
    chats = [{**row, "messages": [*row["messages"], {"role": "assistant", "content": "old"},
                                  {"role": "user", "content": "and what is paris ?"}]} for row in packed_rows()]
    source = write_jsonl(tmp_path / "chats.jsonl", chats)
    manifest = run(source, tmp_path / "regen", turns=None)
    assert manifest["complete"] and manifest["rounds"] == 2
    rows = [json.loads(line) for path in regenerated_files(tmp_path / "regen") for line in path.read_text().splitlines()]
    assert all(len(row["messages"]) == 4 for row in rows) and labels(rows) == expected_labels(source)


@pytest.mark.parametrize("workers", [1, 2])
def test_prepare_keeps_each_records_own_source(tmp_path: Path, workers: int) -> None:
    source = write_jsonl(tmp_path / "chats.jsonl", packed_rows(answer=True))
    config = PrepareConfig([CorpusSpec(str(source))], block_size=2, target_name="tiny", workers=workers,
                           parallel_min_rows=1)  # with 2 workers, the rows are tokenised in a pool
    prepare(make_tiny_tokenizer(), config, tmp_path / "prepared")
    assert labels(list(load_prepared(tmp_path / "prepared"))) == expected_labels(source)


def test_a_source_without_its_own_index_gets_the_records(tmp_path: Path) -> None:
    rows = [{"messages": prompt(i) + [{"role": "assistant", "content": ANSWER}], "source": "math",
             "source_index": True} for i in range(2)]  # no usable index: the record's own is used
    source = write_jsonl(tmp_path / "chats.jsonl", [*rows, {**rows[0], "source": 3, "source_index": 9}])
    config = PrepareConfig([CorpusSpec(str(source))], block_size=2, target_name="tiny", dedupe=False)  # row 0 twice
    prepare(make_tiny_tokenizer(), config, tmp_path / "prepared")
    assert labels(list(load_prepared(tmp_path / "prepared"))) == sorted([("math", 0), ("math", 1), (str(source), 2)])
