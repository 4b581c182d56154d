"""The ``word-problems`` source (`dflash_train.prompts.word_problems`): seeded, varied, answers that follow from
the question's own numbers, and none of the math eval set's problem types."""

from __future__ import annotations

import math
import re
from collections import Counter

import pytest

from dflash_train.prompts.corpora import CorpusSpec, open_corpus
from dflash_train.prompts.decontaminate import build_index
from dflash_train.prompts.math_eval_set import math_prompts
from dflash_train.prompts.word_problems import TEMPLATES, word_problem
from dflash_train.prompts.worked_math import STEPS_REQUEST


def numbers(text: str) -> list[int]:
    return [int(n) for n in re.findall(r"-?\d+", text)]


def test_a_problem_depends_on_its_index_and_seed_only() -> None:
    assert word_problem(123, seed=4) == word_problem(123, seed=4)
    assert word_problem(123, seed=4)["question"] != word_problem(123, seed=5)["question"]
    assert word_problem(0)["task"] == word_problem(len(TEMPLATES))["task"] != word_problem(1)["task"]


def test_problems_are_varied() -> None:
    problems = [str(word_problem(i)["question"]) for i in range(7000)]
    assert len(set(problems)) > 0.98 * len(problems)
    assert len(Counter(str(word_problem(i)["task"]) for i in range(70))) == len(TEMPLATES) == 35


# Answers recomputed from the numbers in the question, apart from the template's own arithmetic.
RECOMPUTED = {
    "garden_fence": lambda n: 2 * (n[0] + n[1]) * n[2],
    "paint_cans": lambda n: math.ceil(n[0] * n[1] / n[2]),
    "reading_plan": lambda n: n[2] * (5 * n[0] + 2 * n[1]),
    "bake_sale": lambda n: n[0] * n[1] + n[2] * n[3] - n[4],
    "coin_jar": lambda n: (25 * n[0] + 10 * n[1] + 5 * n[2]) / 100,
    "ribbon": lambda n: n[0] % n[1],
    "stamp_album": lambda n: n[0] + n[3] * (n[1] - n[2]),
    "bus_riders": lambda n: n[0] - n[1] + n[2] - n[3] + n[4],
    "ticket_mix": lambda n: (n[3] - n[1] * n[2]) // (n[0] - n[1]),
    "test_average": lambda n: 5 * n[4] - sum(n[:4]),
}


@pytest.mark.parametrize("task", sorted(RECOMPUTED))
def test_answers_follow_from_the_question(task: str) -> None:
    index = [t.__name__.lstrip("_") for t in TEMPLATES].index(task)
    for k in range(50):
        problem = word_problem(index + k * len(TEMPLATES), seed=k)
        assert problem["task"] == task
        assert RECOMPUTED[task](numbers(str(problem["question"]))) == pytest.approx(problem["answer"])


def test_no_problem_shares_an_eight_word_run_with_the_math_eval_set() -> None:
    """Stricter than `prepare`'s 13-word check: none of the eval's sentences reappears in a training problem."""
    eval_index = build_index({"math-synthetic": math_prompts(500)}, ngram=8)
    assert not any(eval_index.overlaps_text(str(word_problem(i)["question"])) for i in range(3500))


def test_the_source_asks_for_worked_solutions_with_the_steps_option() -> None:
    plain = open_corpus(CorpusSpec("word-problems", max_samples=40, shuffle_seed=2))
    steps = open_corpus(CorpusSpec("word-problems:steps", max_samples=40, shuffle_seed=2))
    assert len(plain) == len(steps) == 40
    for a, b in zip(plain, steps, strict=True):
        assert b["prompt"] == f"{a['prompt']}\n\n{STEPS_REQUEST}" and a["task"] == b["task"]
