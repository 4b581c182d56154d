"""Prompts written by the target itself: self-prompting, as in Magpie (arXiv 2406.08464).

An instruction-tuned model given only the opening of a user turn in its chat template (the system turn the
template adds, then the user header) continues with what a user would write to it, and ends the turn. Sampled
at temperature 1, one request per row and each from its own seed, these are prompts in the register the
target was tuned on, in any quantity: chat data for a drafter to learn the target's answers to, where the
chat corpora at hand are small (ShareGPT here holds ~10k distinct first turns) or off the target's register.

An opening (``Settings.opening``, e.g. "Here is a math word problem for you to solve:") starts every user turn
and the target writes the rest: prompts of one kind in the target's own words (its own math word problems,
say, where the math sources at hand are off the style a user's math question has). Such rows are labelled
``self-prompts:NAME``, so that training reports them as a source of their own. A request (``Settings.request``,
e.g. "Solve it step by step, then give the final answer in a box.") follows every kept prompt after a blank
line: it says what the answer should look like, which the target, writing as the user, rarely says itself.

A prompt is kept when the target ended the turn itself (finish "stop", not the token cap), it has
``MIN_WORDS`` to ``MAX_WORDS`` words and no special token, it repeats no earlier prompt (case and spacing
ignored), and it shares no word 13-gram with an eval set (`dflash_train.prompts.decontaminate`). Rows are drawn
in chunks until ``count`` prompts are kept; a chunk that adds fewer than ``MIN_NEW_FRACTION`` of its rows
ends the run with what it has (a model that keeps writing the same few prompts), as does ``MAX_DRAWS_PER_PROMPT``
× ``count`` rows drawn. Row ``i`` draws from seed (``seed``, i), so the same settings write the same file.

Several processes (one a GPU) share the work as ranks: rank r of W draws the rows r, r + W, r + 2W, ... (each
with its row's seed, as one process would) and keeps its share of the count, so no row is drawn twice. Each rank
drops the repeats of its own prompts; a repeat across ranks is dropped where their files are packed together
(`dflash_train.prompts.pack` keeps a first turn once over all its sources).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from dflash_train.atomic import write_atomically
from dflash_train.data.chat import ChatTokenizer
from dflash_train.prompts.decontaminate import DROP_REASON, EvalIndex
from dflash_train.quality import DataReport
from dflash_train.runtime.sampling import request_seed

SOURCE = "self-prompts"  # the rows' source label: training reports its validation per source
MIN_WORDS, MAX_WORDS = 3, 400
MIN_NEW_FRACTION = 0.01
MAX_DRAWS_PER_PROMPT = 20
_SENTINEL = "\u2063Self-Prompt\u2063"  # mixed case between invisible separators: a rewrite shows
_SPACES = re.compile(r"\s+")


class Generated(Protocol):
    token_ids: list[int]
    finish_reason: str


class Submitter(Protocol):
    """`dflash_train.regeneration.generation.Generator`'s contract: queue prompts with seeds, wait for them."""

    def submit(self, prompts: Sequence[Sequence[int]], seeds: Sequence[int]) -> Callable[[], Sequence[Generated]]: ...


@dataclass(frozen=True)
class Settings:
    count: int  # prompts to keep
    seed: int = 0
    chunk_rows: int = 4096  # rows drawn per chunk (one progress update each)
    opening: str = ""  # the start of every user turn, which the target continues (part of the kept prompt)
    request: str = ""  # appended to every kept prompt after a blank line (what the answer should look like)
    source: str = SOURCE  # the rows' label: SOURCE, or SOURCE:NAME (source_label)
    # One of `world` processes drawing together: this one draws the row ids rank, rank + world, ... (each row's
    # seed is its id's), so the ranks' draws are one run's, split, and never the same row twice.
    rank: int = 0
    world: int = 1

    def row_id(self, drawn: int) -> int:
        """The run-wide id of this process's `drawn`-th row."""
        return drawn * self.world + self.rank


def source_label(name: str | None) -> str:
    """The rows' source label: "self-prompts", or "self-prompts:NAME" for prompts of one kind."""
    if name is None:
        return SOURCE
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
        raise ValueError(f"--label {name!r}: use letters, digits, '_', '.' or '-' (it names a data source)")
    return f"{SOURCE}:{name}"


def user_turn_prefix(chat: ChatTokenizer) -> str:
    """The template's text before a first user message's content: what the target continues."""
    rendered = chat.render([{"role": "user", "content": _SENTINEL}])
    if rendered.count(_SENTINEL) != 1:
        raise ValueError("the target's chat template does not render a user message's content as given; "
                         "self-prompting needs a template that does (pass prompts from a corpus instead)")
    prefix = rendered[:rendered.index(_SENTINEL)]
    if not chat.render([{"role": "user", "content": "Hello there"}]).startswith(prefix):
        raise ValueError("the target's chat template renders the start of a user turn differently for different "
                         "messages; self-prompting needs one fixed opening (pass prompts from a corpus instead)")
    return prefix


def prompt_key(text: str) -> str:
    """What makes two prompts the same: their words, case and spacing ignored."""
    return _SPACES.sub(" ", text).strip().casefold()


def drop_reason(out: Generated, text: str, special_ids: frozenset[int]) -> str | None:
    """Why a generated user turn is not a prompt, or None when it is one."""
    if out.finish_reason != "stop":
        return "unfinished_turn"
    if any(token in special_ids for token in out.token_ids):
        return "special_token"
    words = len(text.split())
    if words < MIN_WORDS:
        return "too_few_words"
    return "too_many_words" if words > MAX_WORDS else None


def self_prompts(generator: Submitter, decode: Callable[[list[int]], str], prefix_ids: list[int],
                 special_ids: frozenset[int], settings: Settings, evals: EvalIndex | None, report: DataReport,
                 progress: Callable[[int, int], None] | None = None) -> list[dict]:
    """Up to ``settings.count`` prompt rows (OpenAI messages with the source label), kept as the module says;
    ``report`` counts rows drawn, kept and dropped by reason."""
    rows: list[dict] = []
    seen: set[str] = set()
    for first, outs in _chunks(generator, prefix_ids, settings):
        kept_before = len(rows)
        for drawn, out in enumerate(outs, first):
            report.read += 1
            written = decode(out.token_ids)  # its tokens carry their own leading spaces: joined as written
            text = (settings.opening + written).strip()
            reason = drop_reason(out, written.strip(), special_ids) or _repeat_or_overlap(text, seen, evals)
            if reason:
                report.drop(reason)
                continue
            if settings.request:
                text = f"{text}\n\n{settings.request}"
            rows.append({"messages": [{"role": "user", "content": text}], "source": settings.source,
                         "source_index": settings.row_id(drawn)})
            report.kept += 1
            if len(rows) == settings.count:
                break
        if progress:
            progress(len(rows), settings.count)
        if len(rows) == settings.count or len(rows) - kept_before < MIN_NEW_FRACTION * len(outs):
            break
    return rows


def _chunks(generator: Submitter, prefix_ids: list[int], settings: Settings) -> Iterator[tuple[int, Sequence[Generated]]]:
    """(first row id, outputs) of each chunk of rows. The next chunk is queued before this one is waited for,
    so the runtime refills the rows this chunk's shortest turns free with the next chunk's requests."""
    limit = MAX_DRAWS_PER_PROMPT * settings.count

    def submit(first: int) -> tuple[int, Callable[[], Sequence[Generated]]] | None:
        size = min(settings.chunk_rows, 2 * settings.count, limit - first)  # a small count draws small chunks
        if size <= 0:
            return None
        seeds = [request_seed(settings.seed, settings.row_id(first + i)) for i in range(size)]
        return size, generator.submit([prefix_ids] * size, seeds)

    first, pending = 0, submit(0)
    while pending is not None:
        size, wait = pending
        following = submit(first + size)
        yield first, wait()
        first, pending = first + size, following


def _repeat_or_overlap(text: str, seen: set[str], evals: EvalIndex | None) -> str | None:
    key = prompt_key(text)
    if key in seen:
        return "duplicate_prompt"
    seen.add(key)
    if evals is not None and evals.overlaps_text(text):
        return DROP_REASON
    return None


def write_rows(rows: list[dict], out: Path) -> None:
    """The rows as JSONL, written whole or not at all."""
    def write(tmp: Path) -> None:
        with tmp.open("w", encoding="utf-8") as file:
            file.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
    write_atomically(out, write)


def is_self_prompt_file(path: Path) -> bool:
    """Whether ``path`` holds rows this module wrote (an earlier run's, which --overwrite may replace)."""
    try:
        with path.open(encoding="utf-8") as file:
            first = file.readline()
        label = json.loads(first).get("source") if first.strip() else SOURCE
        return label == SOURCE or str(label).startswith(f"{SOURCE}:")
    except (OSError, ValueError, AttributeError):
        return False
