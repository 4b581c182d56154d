"""Tokenising many rows at once changes nothing: `regenerate`'s planning, which tokenises its prompts in
batches, keeps the rows, order and drop counts of tokenising them one at a time (the reference below), and
`prepare` with a pool of worker processes writes the dataset and summary of one process."""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace
from pathlib import Path

import pytest

import dflash_train.data.prepare as prepare_module
import dflash_train.regeneration.regenerate as regenerate_module
from dflash_train.cli import main
from dflash_train.data import load_prepared
from dflash_train.data.chat import ChatTokenizer
from dflash_train.data.prepare import PrepareConfig, prepare
from dflash_train.prompts.corpora import CorpusSpec, open_corpus
from dflash_train.prompts.messages import iter_messages
from dflash_train.prompts.records import BadRecord, prompt_messages
from dflash_train.quality import DataReport
from dflash_train.regeneration.regenerate import RegenerateConfig, plan_prompts
from dflash_train.regeneration.turns import PromptRow
from tests.helpers.tiny_models import CHATML_TEMPLATE, make_tiny_tokenizer

# ChatML that refuses a system prompt starting with "no": the template_rejected drop.
PICKY_TEMPLATE = ("{% if messages[0]['role'] == 'system' and messages[0]['content'].startswith('no') %}"
                  "{{ raise_exception('no system prompt like that') }}{% endif %}" + CHATML_TEMPLATE)
WORDS = ["hello", "who", "are", "you", "the", "capital", "of", "france", "paris", "is", "what", "yes", "a"]


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows))
    return path


def conversation(i: int, turns: int = 2, system: str | None = None, words: int = 3) -> dict:
    """A conversation of ``turns`` user turns, each answered, different for each ``i``."""
    head = [{"role": "system", "content": system}] if system else []
    messages = []
    for t in range(turns):
        user = " ".join(WORDS[(i * 5 + t + k) % len(WORDS)] for k in range(words)) + f" w{i} ?"
        answer = " ".join(WORDS[(i + t * 3 + k) % len(WORDS)] for k in range(8 + i % 5)) + " ."
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
    return {"messages": head + messages, "finish_reason": "length" if i % 7 == 3 else "stop"}


# ------------------------------------------------------------------------------------- regenerate: planning


def prompt_rows() -> list:
    """Kept prompts, repeats (of kept and of too long ones), and one of each drop reason, several times."""
    rows: list = []
    for i in range(30):
        rows.append(conversation(i, turns=1 + i % 3, system="be brief ." if i % 4 == 0 else None))
        if i % 5 == 1:
            rows.append(conversation(i - 1, turns=1 + (i - 1) % 3, system="be brief ." if i % 4 == 1 else None))
        if i % 6 == 2:
            rows.append(conversation(i, words=40))  # prompt_too_long, twice: repeats of it are too long again
            rows.append(conversation(i, words=40))
        if i % 8 == 3:
            rows.append(conversation(i, system="no system ."))  # template_rejected
            rows.append({"messages": [{"role": "user", "content": "hello <|im_end|> you"}]})  # special_token_text
            rows.append("{broken")
    rows.append(conversation(0, system="be brief ."))  # a repeat at the very end
    return rows


def one_at_a_time(chat: ChatTokenizer, config: RegenerateConfig) -> tuple[list[PromptRow], DataReport]:
    """The plan with each prompt tokenised alone (``encode_prompt``), as planning used to work."""
    report = DataReport("regenerate: prompts")
    rows, seen = [], set()
    multi_turn = config.turns != 1
    for spec in config.sources:
        corpus = open_corpus(spec)
        for index, _, messages in iter_messages(corpus, spec, report, prompt_only=not multi_turn):
            prompt = prompt_messages(messages)
            later = [m["content"] for m in messages if m["role"] == "user"][1:] if multi_turn else []
            try:
                chat.check_no_special_text(prompt + [{"role": "user", "content": text} for text in later])
                ids = chat.encode_prompt(prompt)
            except BadRecord as bad:
                report.drop(bad.reason)
                continue
            key = hashlib.sha1(json.dumps([prompt, later], sort_keys=True).encode()).digest()
            if config.dedupe and key in seen:
                report.drop("duplicate_prompt")
            elif len(ids) > config.max_prompt_tokens:
                report.drop("prompt_too_long")
            else:
                seen.add(key)
                rows.append(PromptRow(len(rows), prompt, ids, corpus.name, index, later))
                report.kept += 1
    samples = config.samples_per_prompt
    if samples > 1:
        report.totals[f"rows: {samples} samples per prompt"] = len(rows) * samples
    return [replace(row, row_id=row.row_id * samples + k) for row in rows for k in range(samples)], report


@pytest.mark.parametrize(("turns", "samples", "dedupe"), [(1, 1, True), (None, 3, True), (1, 2, False)])
def test_batched_planning_equals_one_prompt_at_a_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      turns: int | None, samples: int, dedupe: bool) -> None:
    monkeypatch.setattr(regenerate_module, "PLAN_BATCH", 4)  # many batches: repeats and drops straddle them
    first = write_jsonl(tmp_path / "a.jsonl", prompt_rows())
    second = write_jsonl(tmp_path / "b.jsonl", prompt_rows()[::-2])  # repeats across sources too
    config = RegenerateConfig([CorpusSpec(str(first)), CorpusSpec(str(second))], temperature=0.7,
                              max_prompt_tokens=30, turns=turns, samples_per_prompt=samples, dedupe=dedupe)
    chat = ChatTokenizer(make_tiny_tokenizer(chat_template=PICKY_TEMPLATE))
    rows, report = plan_prompts(chat, config)
    expected_rows, expected = one_at_a_time(chat, config)
    assert rows == expected_rows
    assert report.lines() == expected.lines()
    reasons = {"duplicate_prompt", "prompt_too_long", "template_rejected", "special_token_text", "invalid_json"}
    assert set(report.dropped) == reasons - ({"duplicate_prompt"} if not dedupe else set())
    assert len(rows) == report.kept * samples and report.kept > 20


# ------------------------------------------------------------------------------------- prepare: a worker pool


def chat_rows() -> list:
    """Rows written, and rows dropped for each reason prepare has, spread over the input."""
    rows: list = []
    for i in range(40):
        rows.append(conversation(i, turns=1 + i % 3))
        if i % 9 == 4:
            rows.append({"messages": [{"role": "user", "content": "hello"}]})  # no_assistant_turn
            rows.append("{broken")  # invalid_json
            rows.append(conversation(i, words=60))  # too_long
            rows.append({"messages": [{"role": "user", "content": "hello"},
                                      {"role": "assistant", "content": "yes ."}]})  # too_few_supervised_tokens
            rows.append({"messages": [{"role": "user", "content": "a <|im_start|> b"},
                                      {"role": "assistant", "content": "yes ."}]})  # special_token_text
    return rows


def prepared(tmp_path: Path, name: str, workers: int, source: Path) -> tuple[DataReport, Path]:
    config = PrepareConfig([CorpusSpec(str(source))], max_length=64, block_size=4, target_name="tiny",
                           workers=workers, parallel_min_rows=8)
    return prepare(make_tiny_tokenizer(), config, tmp_path / name), tmp_path / name


def test_prepare_with_workers_writes_the_rows_and_summary_of_one_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(prepare_module, "POOL_CHUNK", 3)  # many tasks, more than are ever in flight
    pools, in_pool = [], prepare_module._in_pool

    def counted(*args: object) -> object:
        pools.append(args)
        return in_pool(*args)

    monkeypatch.setattr(prepare_module, "_in_pool", counted)
    source = write_jsonl(tmp_path / "in.jsonl", chat_rows())
    serial, serial_dir = prepared(tmp_path, "serial", 1, source)
    pooled, pooled_dir = prepared(tmp_path, "pooled", 2, source)
    assert len(pools) == 1  # the second run only
    assert pooled.lines()[1:] == serial.lines()[1:]  # all but the title, which names the folder
    assert set(serial.dropped) == {"no_assistant_turn", "invalid_json", "too_long", "too_few_supervised_tokens",
                                   "special_token_text", "duplicate_conversation"}  # the bad rows come 4 times
    assert serial.kept == 40 and serial.totals["rows truncated"] > 0
    assert load_prepared(pooled_dir).to_list() == load_prepared(serial_dir).to_list()
    arrow = sorted(path.name for path in serial_dir.glob("*.arrow"))
    assert arrow and all((pooled_dir / name).read_bytes() == (serial_dir / name).read_bytes() for name in arrow)
    metadata = [json.loads((folder / "dflash_data.json").read_text()) for folder in (serial_dir, pooled_dir)]
    assert metadata[0] == metadata[1]


def test_a_workers_template_error_is_the_same_one_line_error(tmp_path: Path) -> None:
    tokenizer = make_tiny_tokenizer(chat_template="{% for m in messages %}{{ m.role }}{% endfor %}")
    source = write_jsonl(tmp_path / "in.jsonl", [conversation(i) for i in range(12)])
    config = PrepareConfig([CorpusSpec(str(source))], block_size=2, target_name="t", workers=2, parallel_min_rows=4)
    with pytest.raises(ValueError, match="does not render assistant turns") as error:
        prepare(tokenizer, config, tmp_path / "out")
    assert "\n" not in str(error.value)


def test_small_inputs_are_tokenised_without_a_pool(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_pool(*args: object) -> None:
        raise AssertionError("a pool was started for a small input")

    monkeypatch.setattr(prepare_module, "_in_pool", no_pool)
    source = write_jsonl(tmp_path / "in.jsonl", [conversation(i) for i in range(5)])
    config = PrepareConfig([CorpusSpec(str(source))], block_size=2, target_name="t", workers=4, parallel_min_rows=6)
    assert prepare(make_tiny_tokenizer(), config, tmp_path / "out").kept == 5


def test_prepare_refuses_zero_workers(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = write_jsonl(tmp_path / "in.jsonl", [conversation(0)])
    assert main(["prepare", "--target", "t", "--data", str(source), "--out", str(tmp_path / "o"), "--workers", "0"]) == 2
    assert "argument --workers: must be at least 1, not 0" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
