"""Reading back the package's own JSON files: a damaged one is one line naming it, why, and what to do."""

from __future__ import annotations

from pathlib import Path

import pytest

from dflash_train.json_files import (
    json_object_or_none,
    json_type,
    object_field,
    read_json_object,
    rerun_keeps_shards,
)


@pytest.mark.parametrize(("text", "why"), [
    ("[1]", "a JSON array, not an object"),
    ("2.5", "a JSON number, not an object"),
    ("null", "a JSON null, not an object"),
    ('{"a": ', "Expecting value: line 1 column 7 (char 6)"),
    ("", "Expecting value: line 1 column 1 (char 0)"),
])
def test_anything_but_an_object_is_named_with_why_and_what_to_do(tmp_path: Path, text: str, why: str) -> None:
    path = tmp_path / "manifest.json"
    path.write_text(text)
    with pytest.raises(ValueError) as error:
        read_json_object(path, "run it again")
    assert str(error.value) == f"{path} is damaged ({why}); run it again"


def test_bytes_that_are_not_utf8_and_a_folder_are_damaged_too(tmp_path: Path) -> None:
    (tmp_path / "bytes.json").write_bytes(b'{"a": "\xff"}')
    with pytest.raises(ValueError, match=r"bytes.json is damaged \(.*can't decode byte 0xff.*\); fix"):
        read_json_object(tmp_path / "bytes.json", "fix")
    (tmp_path / "folder.json").mkdir()
    with pytest.raises(ValueError, match=r"folder.json is damaged \(.*Is a directory.*\); fix"):
        read_json_object(tmp_path / "folder.json", "fix")


def test_the_optional_reader_is_none_where_the_reader_would_say_damaged(tmp_path: Path) -> None:
    """`json_object_or_none`, for files a command only checks (did it write them?): None for each file
    `read_json_object` refuses, and the object otherwise."""
    for name, content in [("list.json", b"[1]"), ("cut.json", b'{"a": '), ("bytes.json", b'{"a": "\xff"}')]:
        (tmp_path / name).write_bytes(content)
        assert json_object_or_none(tmp_path / name) is None
    assert json_object_or_none(tmp_path / "missing.json") is None
    (tmp_path / "good.json").write_text('{"a": 1}')
    assert json_object_or_none(tmp_path / "good.json") == {"a": 1}


def test_an_object_is_returned_as_it_is(tmp_path: Path) -> None:
    (tmp_path / "m.json").write_text('{"num_units": 4, "nested": {"x": [1, 2]}}')
    assert read_json_object(tmp_path / "m.json", "fix") == {"num_units": 4, "nested": {"x": [1, 2]}}


@pytest.mark.parametrize(("value", "why"), [
    ({}, "'num_units' is missing, not number"),
    ({"num_units": "two"}, "'num_units' is a JSON string, not number"),
    ({"num_units": True}, "'num_units' is a JSON boolean, not number"),
    ({"num_units": None}, "'num_units' is a JSON null, not number"),
])
def test_a_field_of_the_wrong_kind_is_damage(value: dict, why: str) -> None:
    with pytest.raises(ValueError) as error:
        object_field(value, "num_units", int, Path("out/regenerate.json"), "fix")
    assert str(error.value) == f"out/regenerate.json is damaged ({why}); fix"
    assert object_field({"num_units": 3}, "num_units", int, Path("x"), "fix") == 3


def test_json_type_names_and_the_rerun_advice() -> None:
    assert [json_type(v) for v in (None, True, 1, 1.5, "s", [], {})] == [
        "null", "boolean", "number", "number", "string", "array", "object"]
    assert rerun_keeps_shards("extract") == ("remove it and run the same `dflash-train extract` command again "
                                             "(its finished shards are kept)")
