"""Decontamination: word 13-gram overlap with the eval sets, against a brute-force reference; an eval prompt
pasted into a chat is dropped by `prepare` (counted as overlaps_eval_set, the eval sets in the metadata) and
by `pack`, a paraphrase is kept, and the generated math eval set cannot coincide with the training math."""

from __future__ import annotations

import gzip
import importlib.util
import json
import random
import re
from pathlib import Path

import pytest

from dflash_train.cli import main as cli_main
from dflash_train.data import load_prepared
from dflash_train.data.prepare import PrepareConfig, prepare
from dflash_train.data.prepared import METADATA_FILE
from dflash_train.prompts.corpora import CorpusSpec, open_corpus
from dflash_train.prompts.decontaminate import MIN_WORDS, build_index, project_eval_index, words
from dflash_train.prompts.math_eval_set import math_prompts
from dflash_train.prompts.pack import main as pack_main
from tests.helpers.paths import REPO
from tests.helpers.tiny_models import make_tiny_target, make_tiny_tokenizer

ANSWER = "paris is the capital of france ."


def reference_words(text: str) -> list[str]:
    """Lowercase letters and digits; anything else separates words (written apart from the module)."""
    return "".join(c if c.isalnum() else " " for c in text.lower()).split()


def reference_overlap(text: str, eval_texts: list[str], n: int = 13, least: int = 8) -> bool:
    """Brute force: every n-gram of every eval text (the whole text when shorter, none under `least` words),
    without those made of numbers only, against every window of `text`."""
    grams = set()
    for eval_text in eval_texts:
        words = reference_words(eval_text)
        if len(words) < least:
            continue
        k = min(n, len(words))
        grams |= {tuple(words[i: i + k]) for i in range(len(words) - k + 1) if not all(w.isdigit() for w in words[i: i + k])}
    words = reference_words(text)
    return any(tuple(words[i: i + len(g)]) == g for g in grams for i in range(len(words) - len(g) + 1))


def humaneval_prompts() -> list[str]:
    with gzip.open(REPO / "data" / "eval" / "humaneval.jsonl.gz", "rt", encoding="utf-8") as rows:
        return [json.loads(line)["prompt"] for line in rows]


def mt_bench_turns() -> list[str]:
    rows = (REPO / "data" / "eval" / "mt_bench.jsonl").read_text().splitlines()
    return [turn for line in rows for turn in json.loads(line)["turns"]]


def chat(user: str, answer: str = ANSWER, system: str | None = None) -> dict:
    messages = [{"role": "system", "content": system}] if system else []
    return {"messages": [*messages, {"role": "user", "content": user}, {"role": "assistant", "content": answer}]}


# ---------------------------------------------------------------------------------------------- the index


def test_overlap_equals_a_brute_force_reference_on_random_texts() -> None:
    rng = random.Random(0)
    vocabulary = [*"abcdefgh", "The", "1", "22", "x_y", "naïve"]

    def words(length: int) -> list[str]:
        return [rng.choice(vocabulary) for _ in range(length)]

    def near(eval_text: str) -> str:
        """A window of an eval text (maybe with one word changed) between random words and punctuation."""
        window = reference_words(eval_text)
        start = rng.randrange(len(window))
        window = window[max(0, start - 10): start + rng.randint(9, 18)]
        if rng.random() < 0.3:
            window[rng.randrange(len(window))] = rng.choice(vocabulary)
        return ", ".join([" ".join(words(rng.randint(0, 5))), " ".join(window), " ".join(words(rng.randint(0, 5)))])

    eval_texts = [" ".join(words(rng.randint(3, 30))) + "?" for _ in range(12)] + ["1 22 " * 8]
    index = build_index({"set": eval_texts})
    checks = [near(rng.choice(eval_texts)) for _ in range(500)] + [" ".join(words(40)) for _ in range(50)]
    found = [index.overlaps_text(t) for t in checks]
    assert found == [reference_overlap(t, eval_texts) for t in checks]
    assert 100 < sum(found) < 450  # both outcomes are exercised


def test_normalisation_short_prompts_and_numbers() -> None:
    long = "Write a function that returns the sum of the squares of all odd numbers in a list"  # 17 words
    short = "Rewrite your previous response using only ten words"  # 8 words: matched whole
    tiny = "What is its area?"  # 4 words: too generic, not used
    index = build_index({"set": [long, short, tiny, " ".join(["0", "1"] * 10)]})
    assert index.overlaps_text("Please: WRITE a function, that returns the sum of the squares of all odd numbers!")
    assert not index.overlaps_text("Write a function that returns the sum of the squares of all even numbers in a list")
    assert index.overlaps_text("ok. rewrite your previous response -- using only ten words, thanks")
    assert not index.overlaps_text("rewrite your previous response using only nine words")
    assert not index.overlaps_text("What is its area?")
    assert not index.overlaps_text("array: " + ", ".join(["0", "1"] * 12))  # numbers alone are no sign of copying
    assert index.describe()["eval_prompts_too_short"] == 1 and index.describe()["eval_sets"] == {"set": 4}


def test_only_prompt_turns_count() -> None:
    question = mt_bench_turns()[0]
    index = project_eval_index()
    assert index.overlaps(chat("hello", system=f"Context: {question}")["messages"])
    assert not index.overlaps(chat("hello", answer=question)["messages"])  # an answer is not a prompt


def test_the_project_index_holds_every_readable_eval_set() -> None:
    from dflash_train.prompts.eval_sets import DATASETS

    index = project_eval_index()
    assert set(index.sets) | set(index.unavailable) == set(DATASETS)
    assert {"humaneval", "mt-bench", "math-synthetic"} <= set(index.sets)
    assert index.sets["humaneval"] == 164 and index.sets["mt-bench"] == 160
    assert all(index.overlaps_text(p) for p in humaneval_prompts())
    # Every MT-Bench turn of MIN_WORDS words or more is found; the shorter follow-ups are not used.
    short = sum(len(words(turn)) < MIN_WORDS for turn in mt_bench_turns())
    assert 0 < short < 160
    assert sum(map(index.overlaps_text, mt_bench_turns())) == 160 - short


def test_the_harness_wording_alone_is_not_eval_content() -> None:
    from dflash_train.prompts.eval_sets import HUMANEVAL_FORMAT

    ours = HUMANEVAL_FORMAT.format("def add(a, b):\n    '''Add two numbers.'''\n")
    assert not project_eval_index().overlaps_text(ours)
    assert project_eval_index().overlaps_text(HUMANEVAL_FORMAT.format(humaneval_prompts()[5]))


# ------------------------------------------------------------------- prepare drops, counts and records


def contaminated_rows() -> tuple[list[dict], int]:
    prompt = humaneval_prompts()[0]
    paraphrase = ("Given a list of floats and a threshold, tell me whether any two of the numbers lie closer "
                  "together than the threshold.")
    assert not reference_overlap(paraphrase, [prompt])  # the paraphrase shares no 13-word sequence
    rows = [chat(f"Can you solve this?\n{prompt}\nThanks."), chat(paraphrase), chat("what is the capital of france ?"),
            chat("hello", system=mt_bench_turns()[2])]
    return rows, 2


def test_prepare_drops_eval_prompts_and_keeps_a_paraphrase(tmp_path: Path) -> None:
    rows, contaminated = contaminated_rows()
    source = tmp_path / "chats.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = PrepareConfig([CorpusSpec(str(source))], max_length=512, block_size=2, target_name="tiny")
    report = prepare(make_tiny_tokenizer(), config, tmp_path / "out")
    assert report.dropped["overlaps_eval_set"] == contaminated and report.kept == len(rows) - contaminated
    assert report.dropped_at["overlaps_eval_set"] == ["chats.jsonl line 1", "chats.jsonl line 4"]
    assert "dropped: overlaps_eval_set" in "\n".join(report.lines())
    meta = json.loads((tmp_path / "out" / METADATA_FILE).read_text())
    assert meta["counts"]["dropped"]["overlaps_eval_set"] == contaminated
    used = meta["decontamination"]
    assert used["ngram_words"] == 13 and {"humaneval", "mt-bench", "math-synthetic"} <= set(used["eval_sets"])
    kept = PrepareConfig([CorpusSpec(str(source))], max_length=512, block_size=2, target_name="tiny",
                         decontaminate=False)
    assert prepare(make_tiny_tokenizer(), kept, tmp_path / "all").kept == len(rows)
    assert json.loads((tmp_path / "all" / METADATA_FILE).read_text())["decontamination"] is None


def test_prepare_cli_decontaminates_by_default(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = make_tiny_target("llama", num_layers=2)
    target.model.save_pretrained(tmp_path / "model")
    target.tokenizer.save_pretrained(tmp_path / "model")
    rows, contaminated = contaminated_rows()
    source = tmp_path / "chats.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    argv = ["prepare", "--target", str(tmp_path / "model"), "--data", str(source), "--block-size", "2",
            "--max-length", "512"]
    assert cli_main([*argv, "--out", str(tmp_path / "out")]) == 0
    printed = capsys.readouterr().out
    assert re.search(rf"dropped: overlaps_eval_set\s+{contaminated}\b", printed) and "decontaminated against" in printed
    assert len(load_prepared(tmp_path / "out")) == len(rows) - contaminated
    assert cli_main([*argv, "--out", str(tmp_path / "all"), "--no-decontaminate"]) == 0
    assert "overlaps_eval_set" not in capsys.readouterr().out and len(load_prepared(tmp_path / "all")) == len(rows)


def test_pack_leaves_eval_prompts_out(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rows, contaminated = contaminated_rows()
    source = tmp_path / "chats.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert pack_main(["--source", f"{source}=100", "--out", str(tmp_path / "packed.jsonl")]) == 0
    assert f"left out: overlaps_eval_set {contaminated})" in capsys.readouterr().out
    assert len((tmp_path / "packed.jsonl").read_text().splitlines()) == len(rows) - contaminated
    assert pack_main(["--source", f"{source}=100", "--no-decontaminate", "--out", str(tmp_path / "all.jsonl")]) == 0
    assert len((tmp_path / "all.jsonl").read_text().splitlines()) == len(rows)


# ------------------------------------------------------------------------------- generated math


def test_the_math_eval_set_is_caught_if_a_training_source_drew_it() -> None:
    index = project_eval_index()
    assert all(index.overlaps_text(p) for p in math_prompts())  # the eval draws themselves
    # the same generator with other seeds shares the templates' wording: a training source built on it would
    # lose its rows, so none is; the eval set's seeds are not reused anywhere
    assert sum(map(index.overlaps_text, math_prompts(200, seed=1))) > 100


@pytest.mark.skipif(importlib.util.find_spec("reasoning_gym") is None, reason="pip install reasoning-gym")
@pytest.mark.parametrize("source", ["gsm-symbolic", "reasoning-gym-math", "word-problems", "word-problems:steps"])
def test_training_math_never_coincides_with_the_math_eval_set(source: str) -> None:
    eval_only = build_index({"math-synthetic": math_prompts()})
    for seed in (0, 1):
        problems = open_corpus(CorpusSpec(source, max_samples=400, shuffle_seed=seed))
        prompts = [record["prompt"] for record in problems]
        assert not any(map(eval_only.overlaps_text, prompts))
        assert not set(prompts) & set(math_prompts())
