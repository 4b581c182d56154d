"""The `:steps` option of the generated math sources: answer-format sentences give way to a request for a
worked solution, the problems themselves stay those of the plain source, and none overlaps the math eval."""

from __future__ import annotations

import importlib.util
import re

import pytest

from dflash_train.prompts.corpora import MATH_GENERATORS, CorpusSpec, open_corpus
from dflash_train.prompts.decontaminate import build_index
from dflash_train.prompts.math_eval_set import math_prompts
from dflash_train.prompts.worked_math import STEPS_REQUEST, worked_solution_prompt

needs_reasoning_gym = pytest.mark.skipif(importlib.util.find_spec("reasoning_gym") is None,
                                         reason="pip install reasoning-gym")


@pytest.mark.parametrize("problem, expected", [
    ("Solve the following multiplication: 914 * 807. Give only the result as your final answer.",
     "Solve the following multiplication: 914 * 807."),
    # a sentence glued to the previous one, and two format sentences in a row
    ("What is the remaining angle (in degrees)?Return only the angle as your answer.Do not give the units.",
     "What is the remaining angle (in degrees)?"),
    # sentences with digits carry the problem's data and stay, format wording or not
    ("Compute 245.8^5. Return your final answer correct to 3 significant figures.",
     "Compute 245.8^5. Return your final answer correct to 3 significant figures."),
    # paragraphs stay paragraphs; a line holding only a format sentence goes
    ("Count the legs.\n\nHow many legs do 3 crabs have?\nAnswer with a number.",
     "Count the legs.\n\nHow many legs do 3 crabs have?"),
    ("Find the LCM of 60, 100", "Find the LCM of 60, 100"),
])
def test_format_sentences_are_dropped_and_the_request_appended(problem: str, expected: str) -> None:
    assert worked_solution_prompt(problem) == f"{expected}\n\n{STEPS_REQUEST}"


@needs_reasoning_gym
def test_steps_keeps_the_plain_sources_problems_in_order() -> None:
    count = 2 * len(MATH_GENERATORS)
    plain = list(open_corpus(CorpusSpec("reasoning-gym-math", max_samples=count, shuffle_seed=4)))
    steps = list(open_corpus(CorpusSpec("reasoning-gym-math:steps", max_samples=count, shuffle_seed=4)))
    assert [(r["answer"], r["task"]) for r in steps] == [(r["answer"], r["task"]) for r in plain]
    assert [r["prompt"] for r in steps] == [worked_solution_prompt(r["prompt"]) for r in plain]
    asks_for_bare_result = [r for r in plain if "Give only" in r["prompt"] or "Only reply" in r["prompt"]]
    assert asks_for_bare_result  # the reason for the option: the plain source does ask for bare results
    assert not any("Give only" in r["prompt"] or "Only reply" in r["prompt"] for r in steps)


@needs_reasoning_gym
@pytest.mark.parametrize("source", ["gsm-symbolic:steps", "reasoning-gym-math:steps"])
def test_worked_math_never_overlaps_the_math_eval_set(source: str) -> None:
    # The eval set appends its own step-by-step request: ours is worded apart so that no 13-word run is shared
    # (prepare would drop every such row as contaminated).
    eval_only = build_index({"math-synthetic": math_prompts()})
    prompts = [record["prompt"] for record in open_corpus(CorpusSpec(source, max_samples=300, shuffle_seed=0))]
    assert not any(map(eval_only.overlaps_text, prompts))


@pytest.mark.parametrize("source, message", [
    ("reasoning-gym-math:cot", "a generated source takes one option, reasoning-gym-math:steps"),
    ("code-prompts:steps", "code-prompts takes one option, code-prompts:stub"),
    ("sharegpt:stub", "only openai-evals (openai-evals:PER_TASK), code-prompts:stub and the generated sources"),
])
def test_an_unknown_option_is_one_line(source: str, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        open_corpus(CorpusSpec(source, max_samples=4))
