"""`prepare` with templates that render history differently: rows kept, their own drop reason, a warning line
when a reason drops many rows, and `prepare --show` to check a template's masks by eye."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dflash_train.cli import main
from dflash_train.data import load_prepared
from dflash_train.data.chat import ChatTokenizer, marked_text
from dflash_train.data.prepare import PrepareConfig, prepare, tokenized_rows
from dflash_train.prompts.corpora import CorpusSpec
from dflash_train.quality import DataReport
from tests.helpers.byte_tokenizer import byte_tokenizer, two_turns
from tests.helpers.sentencepiece_tokenizer import ANSWER1, sentencepiece_tokenizer
from tests.helpers.tiny_models import make_tiny_target


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_prepare_keeps_mistral_v3_conversations_with_a_system_prompt(tmp_path: Path) -> None:
    source = write_jsonl(tmp_path / "in.jsonl", [{"messages": two_turns(f"Be brief {i}.")} for i in range(4)])
    config = PrepareConfig([CorpusSpec(str(source))], block_size=2, target_name="mistral-v3")
    report = prepare(byte_tokenizer("mistral_v3"), config, tmp_path / "out")
    assert (report.read, report.kept, dict(report.dropped)) == (4, 4, {})
    assert report.totals["rows written"] == 8  # each turn after the prompt it answered, system prompt included
    data = load_prepared(tmp_path / "out")
    assert sorted(data["source_index"]) == [0, 0, 1, 1, 2, 2, 3, 3]
    texts = [byte_tokenizer("mistral_v3").decode(ids) for ids in data["input_ids"]]
    assert all("[INST] Be brief" in text for text in texts)


def test_template_that_never_shows_answers_after_their_prompt_is_its_own_drop_reason(tmp_path: Path) -> None:
    tokenizer = byte_tokenizer("qwen3")
    tokenizer.chat_template = (
        "{% for m in messages %}<|im_start|>{{ 'bot' if m.role == 'assistant' else m.role }}:{{ m.content }}"
        "<|im_end|>{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant:{% endif %}")
    source = write_jsonl(tmp_path / "in.jsonl", [{"messages": two_turns()}] * 3)
    report = DataReport("t")
    config = PrepareConfig([CorpusSpec(str(source))], block_size=2, target_name="t", dedupe=False)  # 3 copies
    assert list(tokenized_rows(ChatTokenizer(tokenizer), config, report)) == []
    assert dict(report.dropped) == {"template_not_prefix_stable": 3}  # not "too_few_supervised_tokens"
    assert any(line.startswith("WARNING: 3 of 3 rows (100%) dropped as template_not_prefix_stable: the chat "
                               "template") for line in report.lines())


def test_summary_warns_when_one_reason_drops_more_than_5_percent() -> None:
    report = DataReport("t", read=40, kept=37)
    report.dropped.update({"too_long": 2, "too_few_supervised_tokens": 1})  # 5 % and 2.5 %: below the line
    assert not any(line.startswith("WARNING") for line in report.lines())
    report.dropped["too_long"] += 1
    assert [line for line in report.lines() if line.startswith("WARNING")] == [
        "WARNING: 3 of 40 rows (8%) dropped as too_long: their prompt alone fills --max-length; raise it"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("model")
    target = make_tiny_target("llama", num_layers=4)
    target.model.save_pretrained(path)
    target.tokenizer.save_pretrained(path)
    return path


def chat(user: str, answer: str) -> dict:
    return {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]}


def test_prepare_summary_prints_the_warning(tmp_path: Path, model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rows = [chat("hello", "paris is the capital of france .")] * 9 + [chat("hello", "yes .")]
    source = write_jsonl(tmp_path / "in.jsonl", rows)
    argv = ["prepare", "--target", str(model_dir), "--data", str(source), "--out", str(tmp_path / "out"),
            "--block-size", "4"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "WARNING: 1 of 10 rows (10%) dropped as too_few_supervised_tokens" in out


def test_show_prints_rows_with_marked_supervised_text_and_writes_nothing(
        tmp_path: Path, model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = write_jsonl(tmp_path / "in.jsonl", [chat("hello", "yes ."), chat("who are you ?", "i am paris ."),
                                                 chat("hello", "no .")])
    before = sorted(tmp_path.iterdir())
    argv = ["prepare", "--target", str(model_dir), "--data", str(source), "--block-size", "1", "--show", "1"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert f"── row 1: {source} #0, 9 tokens, 3 supervised in 1 span ──" in out and "row 2" not in out
    assert "⟦yes.<|im_end|>⟧" in out.replace(" ", "")  # the word-level tokenizer decodes with spaces
    assert "rows read" in out and sorted(tmp_path.iterdir()) == before


def test_prepare_without_out_or_show_is_a_one_line_error(model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["prepare", "--target", str(model_dir), "--data", "x.jsonl"]) == 2
    assert "prepare needs --out DIR (or --show N" in capsys.readouterr().err


def test_marked_text_keeps_the_answers_leading_space_inside_the_marks() -> None:
    tokenizer = sentencepiece_tokenizer("mistral_v1.jinja", [])
    messages = [{"role": "user", "content": "Where is Paris?"}, {"role": "assistant", "content": ANSWER1}]
    (row,) = ChatTokenizer(tokenizer).tokenize(messages).samples
    assert marked_text(tokenizer, row.input_ids, row.loss_mask) == (
        f"<s> [INST] Where is Paris? [/INST]⟦ {ANSWER1}</s>⟧")
