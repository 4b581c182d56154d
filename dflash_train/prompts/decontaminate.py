"""Keep the evaluation prompts out of the training data: word n-gram overlap with every eval set.

A training conversation overlaps an eval set when one of its prompt turns (system or user) shares a word
13-gram with an eval prompt, the usual decontamination rule: long enough that common phrases do not match,
short enough that an eval prompt pasted into a longer message, or lightly edited, still does. Text is
normalised first: lowercase, runs of letters and digits are words, everything else (punctuation, markup,
underscores) separates them; an n-gram of numbers alone is not used (a list of 0s and 1s in a test is no
sign of copied text). An eval prompt shorter than 13 words is matched whole when it has at least
``MIN_WORDS`` words; shorter ones (MT-Bench follow-ups such as "What is its area?") are too generic to show
that a row was copied, and are not used.

The eval sets are those ``dflash_train.prompts.eval_sets`` knows (HumanEval, MT-Bench, the generated math set,
AlpacaEval and IFEval when their package is installed); the fixed wording the harness wraps around a prompt
(HumanEval's request line, the math set's answer-format line) is not eval content and is removed first, so
a training prompt that shares only that wording is kept. Sets that cannot be read here are listed as
unavailable in what :meth:`EvalIndex.describe` returns, which ``prepare`` records in the dataset's metadata.

Matching is a set lookup per word position: each eval word is coded as one character, an n-gram is the
string of its words' characters, and a word that is in no eval prompt ends the run that is scanned.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from dflash_train.prompts.eval_sets import DATASETS, HUMANEVAL_FORMAT
from dflash_train.prompts.math_eval_set import SUFFIX

NGRAM = 13
MIN_WORDS = 8
PROMPT_ROLES = ("system", "user")
DROP_REASON = "overlaps_eval_set"

_WORD = re.compile(r"[^\W_]+")


def words(text: str) -> list[str]:
    """The normalised words of ``text``: lowercase runs of letters and digits."""
    return _WORD.findall(text.lower())


@dataclass
class EvalIndex:
    """The word n-grams of a collection of eval prompts, each word coded as one character (so an n-gram is a
    short string: sliced and hashed in C, which keeps a scan near the cost of finding the words)."""

    sets: dict[str, int]  # eval set -> prompt turns indexed
    unavailable: dict[str, str] = field(default_factory=dict)  # eval set -> why it could not be read
    ngram: int = NGRAM
    min_words: int = MIN_WORDS
    codes: dict[str, str] = field(default_factory=dict)  # eval word -> its character ("\0": any other word)
    grams: set[str] = field(default_factory=set)
    prefixes: set[str] = field(default_factory=set)  # the first ``min_words`` words of each n-gram
    lengths: tuple[int, ...] = ()  # the n-gram lengths in ``grams``, longest first
    too_short: int = 0  # eval prompt turns under ``min_words`` words, not used

    def __post_init__(self) -> None:
        self._runs = re.compile(f"[^\\0]{{{self.min_words},}}")  # runs of eval words long enough to match

    def add(self, text: str) -> None:
        tokens = words(text)
        if len(tokens) < self.min_words:
            self.too_short += 1
            return
        code = "".join(self.codes.setdefault(token, chr(len(self.codes) + 1)) for token in tokens)
        n = min(self.ngram, len(code))
        # A sequence of numbers alone (a test's list of 0s and 1s, say) is no sign of copied text: left out.
        words_only = [not token.isdigit() for token in tokens]
        new = {code[i: i + n] for i in range(len(code) - n + 1) if any(words_only[i: i + n])}
        self.grams |= new
        self.prefixes |= {gram[: self.min_words] for gram in new}
        self.lengths = tuple(sorted({*self.lengths, n}, reverse=True))

    def overlaps_text(self, text: str) -> bool:
        code = "".join([self.codes.get(token, "\0") for token in words(text)])
        # No eval n-gram holds a word outside the eval prompts: only the runs between such words are scanned.
        return any(self._run_overlaps(run.group()) for run in self._runs.finditer(code))

    def _run_overlaps(self, run: str) -> bool:
        k = self.min_words
        for i in range(len(run) - k + 1):
            if run[i: i + k] in self.prefixes:  # cheap first test: most positions stop here
                for n in self.lengths:
                    if i + n <= len(run) and run[i: i + n] in self.grams:
                        return True
        return False

    def overlaps(self, messages: Iterable[Mapping[str, Any]]) -> bool:
        """Whether a prompt turn (system or user) of the conversation shares an n-gram with an eval prompt."""
        return any(m.get("role") in PROMPT_ROLES and self.overlaps_text(str(m.get("content", ""))) for m in messages)

    def summary(self) -> str:
        """One line naming the eval sets used and those not available here."""
        used = ", ".join(f"{name} ({n:,} prompts)" for name, n in self.sets.items())
        line = f"decontaminated against {used}: prompts sharing a {self.ngram}-word sequence with them are left out"
        return line + (f"; not available here: {', '.join(self.unavailable)}" if self.unavailable else "")

    def describe(self) -> dict[str, Any]:
        """What the index holds, for the metadata of a dataset filtered with it."""
        return {"ngram_words": self.ngram, "min_words": self.min_words, "eval_sets": dict(self.sets),
                "eval_prompts_too_short": self.too_short, "unavailable": dict(self.unavailable)}


def build_index(texts: Mapping[str, Iterable[str]], unavailable: Mapping[str, str] | None = None,
                ngram: int = NGRAM, min_words: int = MIN_WORDS) -> EvalIndex:
    """An index of the prompts of each named eval set."""
    index = EvalIndex({}, dict(unavailable or {}), ngram, min_words)
    for name, prompts in texts.items():
        count = 0
        for text in prompts:
            index.add(text)
            count += 1
        index.sets[name] = count
    return index


def eval_set_texts() -> tuple[dict[str, list[str]], dict[str, str]]:
    """The prompt turns of every eval set ``dflash_train.prompts.eval_sets`` knows, without the harness's fixed
    wording; and the sets that cannot be read here, with the reason."""
    wrappers = [tuple(HUMANEVAL_FORMAT.split("{}")), ("", SUFFIX)]
    texts, unavailable = {}, {}
    for name, load in DATASETS.items():
        try:
            prompt_set = load()
        except ValueError as error:  # a package or data file missing here
            unavailable[name] = str(error)
            continue
        turns = [turn for conversation in prompt_set.conversations
                 for turn in [*(m["content"] for m in conversation.prefix), *conversation.turns]]
        texts[name] = [_unwrapped(turn, wrappers) for turn in turns]
    return texts, unavailable


def _unwrapped(text: str, wrappers: list[tuple[str, ...]]) -> str:
    for prefix, suffix in wrappers:
        if text.startswith(prefix) and text.endswith(suffix):
            return text[len(prefix): len(text) - len(suffix)]
    return text


@lru_cache(maxsize=1)
def project_eval_index() -> EvalIndex:
    """The index of the project's eval sets (built once per process)."""
    texts, unavailable = eval_set_texts()
    return build_index(texts, unavailable)
