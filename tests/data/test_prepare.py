"""`prepare`: tokenised rows with loss masks, drops counted by reason, metadata, and one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dflash_train.cli import main
from dflash_train.data import load_prepared
from dflash_train.data.prepare import PrepareConfig, prepare
from dflash_train.data.prepared import METADATA_FILE, check_tokenizer, tokenizer_hash
from dflash_train.prompts.corpora import CorpusSpec
from tests.helpers.tiny_models import make_tiny_target, make_tiny_tokenizer

ANSWER = "paris is the capital of france ."  # 7 words


def chat(user: str, answer: str | None = ANSWER) -> dict:
    turns = [{"role": "user", "content": user}]
    return {"messages": turns + ([{"role": "assistant", "content": answer}] if answer else [])}


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows))
    return path


def test_prepare_rows_masks_counts_and_metadata(tmp_path: Path) -> None:
    tokenizer = make_tiny_tokenizer()
    rows = [
        chat("what is the capital of france ?"),
        chat("hello", "yes ."),  # 2 supervised + end of turn: too few for block size 4
        chat("hello", None),  # no assistant turn
        "{broken",
        chat("capital " * 40),  # prompt alone exceeds max_length: too long
    ]
    source = write_jsonl(tmp_path / "in.jsonl", rows)
    config = PrepareConfig([CorpusSpec(str(source))], max_length=48, block_size=4, target_name="tiny")
    report = prepare(tokenizer, config, tmp_path / "out")
    assert (report.read, report.kept) == (5, 1)
    assert dict(report.dropped) == {"too_few_supervised_tokens": 1, "no_assistant_turn": 1, "invalid_json": 1,
                                    "too_long": 1}
    data = load_prepared(tmp_path / "out")
    row = data[0]
    assert set(data.column_names) >= {"input_ids", "loss_mask", "num_supervised", "source", "source_index"}
    # The mask is exactly the answer's words and <|im_end|>, the last two real tokens... before the newline,
    # which the word-level tokenizer drops.
    expected = tokenizer(ANSWER + "<|im_end|>", add_special_tokens=False)["input_ids"]
    masked = [t for t, m in zip(row["input_ids"], row["loss_mask"], strict=True) if m]
    assert masked == expected and row["input_ids"][-len(expected):] == expected
    assert row["num_supervised"] == 8 and row["source_index"] == 0
    meta = json.loads((tmp_path / "out" / METADATA_FILE).read_text())
    assert meta["tokenizer_hash"] == tokenizer_hash(tokenizer) and meta["max_length"] == 48
    assert meta["counts"]["kept"] == 1 and meta["target"] == "tiny"


def test_load_prepared_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="dflash_data.json missing"):
        load_prepared(tmp_path / "missing")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / METADATA_FILE).write_text("{")
    with pytest.raises(ValueError, match=r"dflash_data.json is damaged \(.*\); run `dflash-train prepare` again"):
        load_prepared(tmp_path / "bad")
    (tmp_path / "bad" / METADATA_FILE).write_text("{}")
    with pytest.raises(ValueError, match="cannot read the prepared dataset"):
        load_prepared(tmp_path / "bad")


def test_tokenizer_mismatch_names_the_file(tmp_path: Path) -> None:
    source = write_jsonl(tmp_path / "in.jsonl", [chat("hello")])
    prepare(make_tiny_tokenizer(), PrepareConfig([CorpusSpec(str(source))], block_size=2, target_name="a"),
            tmp_path / "out")
    check_tokenizer(tmp_path / "out", make_tiny_tokenizer(), "a")
    other = make_tiny_tokenizer(vocab_size=200)
    with pytest.raises(ValueError, match=rf"{tmp_path / 'out' / METADATA_FILE}.*prepare --target b") as error:
        check_tokenizer(tmp_path / "out", other, "b")
    assert "\n" not in str(error.value)


def test_prepare_cli_on_a_model_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = make_tiny_target("llama", num_layers=4)
    target.model.save_pretrained(tmp_path / "model")
    target.tokenizer.save_pretrained(tmp_path / "model")
    source = write_jsonl(tmp_path / "in.jsonl", [chat("hello"), chat("who are you ?")])
    argv = ["prepare", "--target", str(tmp_path / "model"), "--data", str(source), "--out", str(tmp_path / "out"),
            "--block-size", "2", "--max-length", "64"]
    assert main(argv) == 0
    assert "rows kept" in capsys.readouterr().out and len(load_prepared(tmp_path / "out")) == 2
    assert main([*argv[:-4], "--thinking", "on"]) == 2  # the ChatML template has no thinking switch
    assert "no thinking switch" in capsys.readouterr().err
    empty = write_jsonl(tmp_path / "empty.jsonl", ["{"])
    assert main(["prepare", "--target", str(tmp_path / "model"), "--data", str(empty), "--out", str(tmp_path / "o2")]) == 2
    assert "no usable rows" in capsys.readouterr().err


def test_template_error_inside_the_generator_stays_one_line(tmp_path: Path) -> None:
    tokenizer = make_tiny_tokenizer(chat_template="{% for m in messages %}{{ m.role }}{% endfor %}")
    source = write_jsonl(tmp_path / "in.jsonl", [chat("hello")])
    with pytest.raises(ValueError, match="does not render assistant turns"):
        prepare(tokenizer, PrepareConfig([CorpusSpec(str(source))], block_size=2, target_name="t"), tmp_path / "o")


def test_regenerated_data_must_use_its_template(tmp_path: Path) -> None:
    from dflash_train.data.chat import template_hash

    tokenizer = make_tiny_tokenizer()
    regen = tmp_path / "regen"
    regen.mkdir()
    row = {**chat("what is the capital of france ?"), "finish_reason": "stop", "row_id": 0}
    (regen / "part-000000.jsonl").write_text(json.dumps(row) + "\n")
    manifest = {"chat_template_hash": template_hash(tokenizer), "thinking": None, "num_units": 1}
    (regen / "regenerate.json").write_text(json.dumps(manifest))
    config = PrepareConfig([CorpusSpec(str(regen))], block_size=2, target_name="tiny")
    assert prepare(tokenizer, config, tmp_path / "ok").kept == 1
    other = make_tiny_tokenizer(chat_template="{% for m in messages %}<|im_start|>{{ m.content }}<|im_end|>{% endfor %}")
    with pytest.raises(ValueError, match="regenerate.json: responses generated with another chat template"):
        prepare(other, config, tmp_path / "bad")
    (regen / "regenerate.json").write_text(json.dumps({**manifest, "num_units": 2}))
    with pytest.raises(ValueError, match="regeneration unfinished .1 of 2 shards"):
        prepare(tokenizer, config, tmp_path / "unfinished")
    partial = PrepareConfig([CorpusSpec(str(regen), allow_unfinished=True)], block_size=2, target_name="tiny")
    assert prepare(tokenizer, partial, tmp_path / "partial").kept == 1  # the one finished shard, on request
    advice = r"; remove it and run the same `dflash-train regenerate` command again \(its finished shards are kept\)"
    for damage, why in (("[1]", "a JSON array, not an object"),
                        (json.dumps({**manifest, "num_units": "two"}), "'num_units' is a JSON string, not number")):
        (regen / "regenerate.json").write_text(damage)  # an AttributeError, or "1 of two shards" and a rerun
        with pytest.raises(ValueError, match=r"regenerate.json is damaged \(" + why + r"\)" + advice):
            prepare(tokenizer, config, tmp_path / "damaged")
