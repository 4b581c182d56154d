"""Multi-turn regeneration: the later user turns of a conversation, answered one round at a time.

Round 1 answers every conversation's first user turn. Round t takes round t-1's rows (the conversation
so far, with the target's own answers), appends the conversation's t-th user turn and asks again. A
conversation with no t-th turn, whose last answer was cut at the length limit or empty, or whose history
has grown past ``max_prompt_tokens`` is carried into round t unchanged, so every round holds every
conversation and the last round is the whole corpus. Rounds 1..T-1 live in ``<out>/turns/turn-<t>``, the
last one in ``<out>`` itself, where `dflash-train prepare` reads it.

A round can only be planned once the previous round is complete; ranks wait for each other's shards
(polling the folder), and a rank that waits longer than ``turn_wait_seconds`` stops: running the same
command again continues.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dflash_train.data.loop_trim import UNFINISHED
from dflash_train.prompts.records import BadRecord, Message
from dflash_train.shards import regenerated_files

if TYPE_CHECKING:
    from dflash_train.data.chat import ChatTokenizer
    from dflash_train.quality import DataReport

POLL_SECONDS = 2.0


# Defined here rather than in `regenerate`, which runs the rounds: a round's rows are built here, and
# `regenerate` imports this module, not the other way round.
@dataclass
class PromptRow:
    """One conversation to answer in a round: its messages so far and their token ids."""

    row_id: int
    messages: list[Message]
    prompt_ids: list[int]
    source: str
    source_index: int
    later_turns: list[str] = field(default_factory=list)  # the user turns after the first (turns > 1)
    carried: dict[str, Any] | None = None  # a later round's row with nothing to answer: written as it was


def count_turns(rows: list[PromptRow], turns: int | None) -> int:
    """Rounds to run: the requested number of user turns, at most the longest conversation's."""
    longest = 1 + max((len(row.later_turns) for row in rows), default=0)
    return longest if turns is None else max(1, min(turns, longest))


def turn_directory(out_dir: Path, turn: int, rounds: int) -> Path:
    return out_dir if turn == rounds else out_dir / "turns" / f"turn-{turn}"


def wait_for_turn(directory: Path, num_units: int, wait_seconds: float) -> bool:
    """True once all ``num_units`` shards of a round exist (other ranks write theirs meanwhile)."""
    deadline, announced = time.monotonic() + wait_seconds, False
    while (finished := len(regenerated_files(directory))) < num_units:
        if time.monotonic() >= deadline:
            return False
        if not announced:
            print(f"regenerate: waiting for the other ranks' shards of {directory} ({finished} of {num_units})",
                  flush=True)
            announced = True
        time.sleep(POLL_SECONDS)
    return True


def read_turn(directory: Path) -> dict[int, dict[str, Any]]:
    """A finished round's rows by row id."""
    # Bytes, split on newlines only: str.splitlines() also splits at U+2028, U+0085 and other separators that
    # answers written with ensure_ascii=False carry raw, cutting such a row in two.
    rows = (json.loads(line) for path in regenerated_files(directory) for line in path.read_bytes().split(b"\n")
            if line.strip())
    return {row["row_id"]: row for row in rows}


def continue_conversations(chat: ChatTokenizer, max_prompt_tokens: int, first: list[PromptRow],
                           previous: dict[int, dict[str, Any]], turn: int, report: DataReport) -> list[PromptRow]:
    """Round ``turn``'s rows: previous answers plus the next user turn, or the previous row carried (also when
    the conversation so far would exceed ``max_prompt_tokens``)."""
    rows = []
    for start in first:
        before = previous[start.row_id]
        answered = sum(message["role"] == "assistant" for message in before["messages"])
        carried = PromptRow(start.row_id, before["messages"], [], start.source, start.source_index, carried=before)
        if answered != turn - 1 or len(start.later_turns) < turn - 1:
            rows.append(carried)  # stopped earlier, or no turn left
            continue
        if before["finish_reason"] in UNFINISHED or not before["messages"][-1]["content"].strip():
            why = {"length": "cut at the length limit", "loop": "ended in a loop"}.get(before["finish_reason"], "empty")
            report.totals[f"turn {turn}: not asked, previous answer {why}"] += 1
            rows.append(carried)
            continue
        messages = [*before["messages"], {"role": "user", "content": start.later_turns[turn - 2]}]
        try:
            ids = chat.encode_prompt(messages)
        except BadRecord as bad:
            report.totals[f"turn {turn}: not asked, {bad.reason}"] += 1
            rows.append(carried)
            continue
        if len(ids) > max_prompt_tokens:
            report.totals[f"turn {turn}: not asked, conversation over max_prompt_tokens"] += 1
            rows.append(carried)
            continue
        report.totals[f"turn {turn}: asked"] += 1
        rows.append(PromptRow(start.row_id, messages, ids, start.source, start.source_index, start.later_turns))
    return rows
