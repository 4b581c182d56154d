"""Answers that end in a verbatim loop (`dflash_train.data.loop_trim`, `prepare --trim-loops`): the loop is found
however the cap cut its last copy, cut to two copies, and only in answers the token cap stopped."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from dflash_train.data import load_prepared
from dflash_train.data.loop_trim import trim_tail_loop
from dflash_train.data.prepare import PrepareConfig, prepare
from dflash_train.prompts.corpora import CorpusSpec
from tests.helpers.tiny_models import make_tiny_tokenizer


@pytest.mark.parametrize(("text", "expected"), [
    ("intro: " + "ab, " * 10, "intro: ab, ab, "),
    ("no loop at all here.", "no loop at all here."),
    ("x: " + "yes no " * 2, "x: " + "yes no " * 2),  # two copies are not yet a loop
    ("start " + "yes no " * 5 + "ye", "start yes no yes no ye"),  # the cap cut the last copy: a rotation
    ("wait" + "!" * 9, "wait!!"),  # the shortest period wins
    ("a " + "x" * 130 + "x" * 130, "a xx"),
])
def test_a_tail_loop_is_cut_to_two_copies(text: str, expected: str) -> None:
    assert trim_tail_loop(text) == expected


def test_a_period_longer_than_the_limit_is_no_loop() -> None:
    paragraph = "".join(random.Random(0).choices("abcdefghij ", k=150))  # no period of its own
    assert trim_tail_loop("head " + paragraph * 4) == "head " + paragraph * 4


def rows(path: Path, loop: str, unfinished: str = "length") -> Path:
    def row(answer: str, finish: str) -> dict:
        return {"messages": [{"role": "user", "content": "what is the capital of france ?"},
                             {"role": "assistant", "content": answer}], "finish_reason": finish}
    records = [row("paris is the capital ." + loop, unfinished), row("paris is the capital ." + loop, "stop")]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.mark.parametrize("unfinished", ["length", "loop"])  # the token cap, or regenerate --stop-loops
def test_prepare_cuts_only_answers_the_target_did_not_end(tmp_path: Path, unfinished: str) -> None:
    tokenizer = make_tiny_tokenizer()
    source = rows(tmp_path / "in.jsonl", " yes no ." * 12, unfinished)
    config = PrepareConfig([CorpusSpec(str(source))], max_length=256, block_size=4, target_name="tiny")
    plain = prepare(tokenizer, config, tmp_path / "plain")
    trimmed = prepare(tokenizer, PrepareConfig(**{**config.__dict__, "trim_loops": True}), tmp_path / "trimmed")
    assert plain.totals["answers cut at a tail loop"] == 0 and trimmed.totals["answers cut at a tail loop"] == 1
    before, after = load_prepared(tmp_path / "plain"), load_prepared(tmp_path / "trimmed")
    supervised = lambda data: [r["num_supervised"] for r in data]  # noqa: E731
    # "paris is the capital ." + two copies of " yes no .": 5 + 6 words; the capped answer has no end of turn
    assert supervised(after) == [11, supervised(before)[1]] and supervised(before)[0] == 5 + 36
    meta = json.loads((tmp_path / "trimmed" / "dflash_data.json").read_text())
    assert meta["trim_loops"] is True and "trim_loops" not in json.loads((tmp_path / "plain" / "dflash_data.json").read_text())
