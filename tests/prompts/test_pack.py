"""Packing prompts for an offline machine: first turns, deduplicated across sources, capped, readable back."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dflash_train.prompts.corpora import CorpusSpec, open_corpus
from dflash_train.prompts.pack import main


def test_pack_takes_unique_first_turns_up_to_the_count(tmp_path: Path) -> None:
    convo = [{"from": "human", "value": "q{}"}, {"from": "gpt", "value": "a"}, {"from": "human", "value": "again"}]
    rows = [{"conversations": [{**convo[0], "value": f"q{i % 5}"}, *convo[1:]]} for i in range(12)]
    sharegpt = tmp_path / "a.jsonl"
    sharegpt.write_text("".join(json.dumps(r) + "\n" for r in rows))
    alpaca = tmp_path / "b.jsonl"
    alpaca.write_text(json.dumps({"instruction": "q1", "input": "", "output": "x"}) + "\n"
                      + json.dumps({"instruction": "new", "input": "", "output": "y"}) + "\n")
    out = tmp_path / "packed.jsonl"
    assert main(["--source", f"{sharegpt}=4", "--source", f"{alpaca}=10", "--out", str(out)]) == 0
    packed = [json.loads(line) for line in out.read_text().splitlines()]
    prompts = [row["messages"] for row in packed]
    assert all(len(p) == 1 and p[0]["role"] == "user" for p in prompts)  # the first user turn only
    texts = [p[0]["content"] for p in prompts]
    assert len(texts) == len(set(texts)) == 5 and texts[-1] == "new"  # 4 from a; q1 again in b is a duplicate
    corpus = open_corpus(CorpusSpec(str(out)))
    assert len(corpus) == 5 and corpus.record(0)["messages"] == prompts[0]


def test_bad_source_argument_is_a_usage_error(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        main(["--source", "sharegpt", "--out", str(tmp_path / "x.jsonl")])


def test_exclude_leaves_out_the_prompts_of_earlier_packs(tmp_path: Path) -> None:
    rows = [{"prompt": f"question {i}"} for i in range(10)]
    source = tmp_path / "prompts.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    first, held, rest = tmp_path / "first.jsonl", tmp_path / "held.jsonl", tmp_path / "rest.jsonl"
    assert main(["--source", f"{source}=4", "--out", str(first)]) == 0
    assert main(["--source", f"{source}=2", "--exclude", str(first), "--out", str(held)]) == 0
    assert main(["--source", f"{source}=100", "--exclude", str(first), "--exclude", str(held), "--out", str(rest)]) == 0
    texts = {name: [json.loads(line)["messages"][0]["content"] for line in path.read_text().splitlines()]
             for name, path in (("first", first), ("held", held), ("rest", rest))}
    assert len(texts["first"]) == 4 and len(texts["held"]) == 2 and len(texts["rest"]) == 4
    everything = texts["first"] + texts["held"] + texts["rest"]
    assert sorted(everything) == sorted(r["prompt"] for r in rows)  # each prompt in exactly one pack
    with pytest.raises(SystemExit, match="no such file"):
        main(["--source", f"{source}=1", "--exclude", str(tmp_path / "missing.jsonl"), "--out", str(rest)])


def test_exclude_reads_prompts_with_unicode_line_separators(tmp_path: Path) -> None:
    source = tmp_path / "prompts.jsonl"
    source.write_text(json.dumps({"prompt": "a\u2028b"}) + "\n" + json.dumps({"prompt": "c"}) + "\n")
    first, rest = tmp_path / "first.jsonl", tmp_path / "rest.jsonl"
    assert main(["--source", f"{source}=1", "--out", str(first)]) == 0  # written with ensure_ascii=False
    assert main(["--source", f"{source}=5", "--exclude", str(first), "--out", str(rest)]) == 0
    assert len(rest.read_text().strip().split("\n")) == 1
    (tmp_path / "bad.jsonl").write_text('{"prompt": "no messages"}\n')
    with pytest.raises(SystemExit, match="line 1: not a row of a pack"):
        main(["--source", f"{source}=1", "--exclude", str(tmp_path / "bad.jsonl"), "--out", str(rest)])


def test_whole_conversations_keep_every_turn_and_exclude_by_first_turn(tmp_path: Path) -> None:
    def convo(first: str) -> dict:
        return {"conversations": [{"from": "human", "value": first}, {"from": "gpt", "value": "a"},
                                  {"from": "human", "value": "and then?"}, {"from": "gpt", "value": "b"}]}

    source = tmp_path / "chats.jsonl"
    source.write_text("".join(json.dumps(convo(f"q{i}")) + "\n" for i in range(6)))
    first_turns, whole = tmp_path / "first.jsonl", tmp_path / "whole.jsonl"
    assert main(["--source", f"{source}=2", "--out", str(first_turns)]) == 0
    assert main(["--source", f"{source}=10", "--whole-conversations", "--exclude", str(first_turns),
                 "--out", str(whole)]) == 0
    rows = [json.loads(line)["messages"] for line in whole.read_text().splitlines()]
    assert len(rows) == 4 and all([m["role"] for m in r] == ["user", "assistant", "user", "assistant"] for r in rows)
    firsts = {json.loads(line)["messages"][0]["content"] for line in first_turns.read_text().splitlines()}
    assert not firsts & {r[0]["content"] for r in rows}  # excluded by the first turn
    again = tmp_path / "again.jsonl"  # a whole-conversation pack excludes by its first turns too
    assert main(["--source", f"{source}=10", "--exclude", str(whole), "--exclude", str(first_turns),
                 "--out", str(again)]) == 0
    assert again.read_text() == ""


def test_interleave_mixes_the_sources_and_keeps_the_same_prompts(tmp_path: Path) -> None:
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text("".join(json.dumps({"prompt": f"Question a{i} about apples."}) + "\n" for i in range(30)))
    b.write_text("".join(json.dumps({"prompt": f"Question b{i} about boats."}) + "\n" for i in range(30)))
    plain, mixed = tmp_path / "plain.jsonl", tmp_path / "mixed.jsonl"
    assert main(["--source", f"{a}=30", "--source", f"{b}=30", "--out", str(plain)]) == 0
    assert main(["--source", f"{a}=30", "--source", f"{b}=30", "--interleave", "--out", str(mixed)]) == 0

    def prompts(path: Path) -> list[str]:
        return [json.loads(line)["messages"][-1]["content"] for line in path.read_text().splitlines()]

    assert sorted(prompts(mixed)) == sorted(prompts(plain))
    assert all("a" in p.split()[1] for p in prompts(plain)[:30])  # without it, one source after the other
    first_half = prompts(mixed)[:30]
    assert 5 < sum("apples" in p for p in first_half) < 25  # with it, any prefix holds both


def test_a_repack_keeps_the_source_labels_its_rows_carry(tmp_path: Path) -> None:
    labelled = tmp_path / "mix.jsonl"
    labelled.write_text(
        json.dumps({"messages": [{"role": "user", "content": "from sharegpt"}], "source": "sharegpt",
                    "source_index": 41}) + "\n"
        + json.dumps({"messages": [{"role": "user", "content": "written by the target"}], "source": "self-prompts",
                      "source_index": True}) + "\n")
    plain = tmp_path / "plain.jsonl"
    plain.write_text(json.dumps({"prompt": "no label here"}) + "\n")
    out = tmp_path / "repacked.jsonl"
    assert main(["--source", f"{labelled}=2", "--source", f"{plain}=1", "--out", str(out)]) == 0
    labels = [(row["source"], row["source_index"]) for row in map(json.loads, out.read_text().splitlines())]
    assert labels == [("sharegpt", 41), ("self-prompts", 1), (str(plain), 0)]  # a JSON true is no index
