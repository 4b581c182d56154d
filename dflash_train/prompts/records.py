"""Turn one raw corpus record into OpenAI-style chat messages, or a reason to skip it.

Accepted formats (``fmt``):

- ``messages``: ``{"messages": [{"role": "system"|"user"|"assistant", "content": str}, ...]}``
- ``sharegpt``: ``{"conversations": [{"from": "human"|"gpt"|"system"|..., "value": str}, ...]}``
- ``alpaca``:   ``{"instruction": str, "input": str (optional), "output": str (optional)}``
- ``prompt``:   ``{"prompt": str}`` (a single user turn, no response yet)

Every format may carry a ``system`` column. The result alternates user/assistant turns after an optional
leading system turn; anything else is a :class:`BadRecord` with a short machine-readable reason that the
pipeline counts, so one malformed row never stops a long run.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

Message = dict[str, str]

FORMATS: tuple[str, ...] = ("messages", "sharegpt", "alpaca", "prompt")

# The column that identifies each format, in detection order.
_KEY_COLUMN = {"messages": "messages", "sharegpt": "conversations", "alpaca": "instruction", "prompt": "prompt"}

SHAREGPT_ROLES = {
    "human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "assistant": "assistant",
    "bard": "assistant", "bing": "assistant", "model": "assistant", "system": "system",
}


class BadRecord(Exception):
    """A record that cannot be used; ``reason`` is a short counter key such as ``empty_turn``."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


def detect_format(columns: list[str] | tuple[str, ...]) -> str:
    """The format whose key column is present, else a one-line error listing what would work."""
    for fmt, column in _KEY_COLUMN.items():
        if column in columns:
            return fmt
    raise ValueError(
        f"no known chat columns in {sorted(columns)}; expected one of {sorted(_KEY_COLUMN.values())} "
        f"(map yours with --columns, e.g. --columns messages=chat)"
    )


MISSING_MAPPED_COLUMN = "missing_mapped_column"  # the drop reason of a record without a column --columns names


def rename_columns(record: Mapping[str, Any], column_map: Mapping[str, str]) -> dict[str, Any]:
    """``column_map`` maps our name -> the corpus' column name. A record without one of those columns is dropped
    (read as is, its own standard column would be used in place of the one asked for, without a word)."""
    out = dict(record)
    for ours, theirs in column_map.items():
        if theirs not in record:
            raise BadRecord(MISSING_MAPPED_COLUMN, theirs)
        out[ours] = record[theirs]
    return out


def to_messages(record: Mapping[str, Any], fmt: str, prompt_only: bool = False) -> list[Message]:
    """The record as validated chat messages; raises :class:`BadRecord`. ``prompt_only`` keeps only the
    system turn and the first user turn (what regeneration answers), so later malformed turns do not count."""
    if fmt == "messages":
        messages = _from_openai(_required(record, "messages"))
    elif fmt == "sharegpt":
        messages = _from_sharegpt(_required(record, "conversations"))
    elif fmt == "alpaca":
        messages = _from_alpaca(record)
    elif fmt == "prompt":
        messages = [{"role": "user", "content": _text(_required(record, "prompt"))}]
    else:
        raise ValueError(f"unknown format {fmt!r}; use one of {', '.join(FORMATS)}")
    system = record.get("system")
    if system and fmt != "messages" and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": _text(system)})
    return validate_messages(prompt_messages(messages) if prompt_only else messages)


def _required(record: Mapping[str, Any], key: str) -> Any:
    value = record.get(key)
    if value is None:
        raise BadRecord("missing_field", key)
    return value


def _text(value: Any) -> str:
    """A turn's text: str, UTF-8 bytes, or OpenAI content parts of type text."""
    if isinstance(value, bytes):
        try:
            value = value.decode("utf-8")
        except UnicodeDecodeError as error:
            raise BadRecord("invalid_utf8", str(error)) from None
    if isinstance(value, list):  # [{"type": "text", "text": ...}, ...]
        if not all(isinstance(part, Mapping) and part.get("type") == "text" for part in value):
            raise BadRecord("non_text_content")
        value = "".join(str(part.get("text", "")) for part in value)
    if not isinstance(value, str):
        raise BadRecord("missing_field", f"content of type {type(value).__name__}")
    try:  # lone surrogates (legal JSON escapes such as "\ud800") are not encodable text
        value.encode("utf-8")
    except UnicodeEncodeError as error:
        raise BadRecord("invalid_utf8", str(error)) from None
    return value


def _from_openai(turns: Any) -> list[Message]:
    if not isinstance(turns, list):
        raise BadRecord("missing_field", "messages is not a list")
    messages = []
    for turn in turns:
        if not isinstance(turn, Mapping) or "role" not in turn or "content" not in turn:
            raise BadRecord("missing_field", "role/content")
        message = {"role": str(turn["role"]), "content": _text(turn["content"])}
        if turn.get("reasoning_content"):
            message["reasoning_content"] = _text(turn["reasoning_content"])
        messages.append(message)
    return messages


def _from_sharegpt(turns: Any) -> list[Message]:
    if not isinstance(turns, list):
        raise BadRecord("missing_field", "conversations is not a list")
    messages = []
    for turn in turns:
        if not isinstance(turn, Mapping) or "from" not in turn or "value" not in turn:
            raise BadRecord("missing_field", "from/value")
        role = SHAREGPT_ROLES.get(str(turn["from"]).lower())
        if role is None:
            raise BadRecord("wrong_role", str(turn["from"]))
        messages.append({"role": role, "content": _text(turn["value"])})
    return messages


def _from_alpaca(record: Mapping[str, Any]) -> list[Message]:
    prompt = _text(_required(record, "instruction"))
    extra = _text(record.get("input") or "")
    if extra.strip():
        prompt = f"{prompt}\n\n{extra}"
    messages = [{"role": "user", "content": prompt}]
    if record.get("output") is not None:
        messages.append({"role": "assistant", "content": _text(record["output"])})
    return messages


def validate_messages(messages: list[Message]) -> list[Message]:
    """Optional system first, then user/assistant alternating from a user turn; no empty turn."""
    if not messages:
        raise BadRecord("empty_conversation")
    for i, message in enumerate(messages):
        role = message["role"]
        if role not in ("system", "user", "assistant") or (role == "system" and i != 0):
            raise BadRecord("wrong_role", role)
        if not message["content"].strip():
            raise BadRecord("empty_turn", role)
    turns = messages[1:] if messages[0]["role"] == "system" else messages
    if not turns:
        raise BadRecord("no_user_turn")
    for i, message in enumerate(turns):
        if message["role"] != ("user" if i % 2 == 0 else "assistant"):
            raise BadRecord("roles_not_alternating", message["role"])
    return messages


def prompt_messages(messages: list[Message]) -> list[Message]:
    """The conversation up to its first user turn (plus the system turn): what regeneration answers."""
    first_user = next((i for i, message in enumerate(messages) if message["role"] == "user"), None)
    if first_user is None:
        raise BadRecord("no_user_turn")
    system = [dict(messages[0])] if messages[0]["role"] == "system" else []
    return system + [dict(messages[first_user])]
