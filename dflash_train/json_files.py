"""Reading back the JSON files the package writes (run manifests, settings, reports): a file that cannot be read,
is not JSON or holds the wrong kind of value is one line naming it, what is wrong and what to do, never a
traceback from the first `.get` on a list."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def rerun_keeps_shards(command: str) -> str:
    """What to do about a damaged manifest of a run that resumes by its finished shards."""
    return f"remove it and run the same `dflash-train {command}` command again (its finished shards are kept)"


def read_json_object(path: Path, fix: str) -> dict[str, Any]:
    """The JSON object in `path`; otherwise a ValueError `<path> is damaged (<why>); <fix>`."""
    try:
        value = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{path} is damaged ({' '.join(str(error).split())}); {fix}") from error
    if not isinstance(value, dict):
        raise ValueError(f"{path} is damaged (a JSON {json_type(value)}, not an object); {fix}")
    return value


def json_object_or_none(path: Path) -> dict[str, Any] | None:
    """The JSON object in `path`, or None when there is none to read (missing, unreadable, not JSON, not an
    object): for files a command only checks whether it wrote (`read_json_object` says what is wrong)."""
    try:
        return read_json_object(path, "")
    except ValueError:
        return None


def object_field(value: dict[str, Any], key: str, kind: type | tuple[type, ...], path: Path, fix: str) -> Any:
    """`value[key]` when it is of `kind` (bool is no int here); otherwise `<path> is damaged (...); <fix>`."""
    field = value.get(key)
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if not isinstance(field, kinds) or (isinstance(field, bool) and bool not in kinds):
        wanted = " or ".join(json_type(k()) for k in kinds)
        found = "missing" if key not in value else f"a JSON {json_type(field)}"
        raise ValueError(f"{path} is damaged ({key!r} is {found}, not {wanted}); {fix}")
    return field


def json_type(value: Any) -> str:
    """JSON's name for the type of a parsed value."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    return {str: "string", list: "array", dict: "object"}.get(type(value), type(value).__name__)
