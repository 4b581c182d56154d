"""Multi-turn regeneration (`--turns`): every later user turn is answered after the target's own earlier
answers — checked against a plain turn-by-turn loop over Hugging Face `generate` — and a killed run, or
ranks that take turns, end with the same files as one uninterrupted process."""

from __future__ import annotations

import json
import threading
from collections import Counter
from pathlib import Path

import pytest

from dflash_train.data.chat import ChatTokenizer
from dflash_train.prompts.corpora import CorpusSpec
from dflash_train.regeneration.backends import LocalBackend
from dflash_train.regeneration.generation import Generator, hf_generate
from dflash_train.regeneration.regenerate import RegenerateConfig, regenerate
from dflash_train.regeneration.turns import read_turn
from dflash_train.runtime.config import EngineConfig
from dflash_train.shards import regenerated_files
from dflash_train.target import TargetModel
from tests.helpers.regeneration import WORDS, ChatCompletionsServer
from tests.helpers.tiny_models import make_tiny_target

MAX_NEW = 8


@pytest.fixture(scope="module")
def tiny() -> TargetModel:
    return make_tiny_target("llama", num_layers=2)


def conversations() -> list[list[dict[str, str]]]:
    """User turns 1, 2 and 3 (with source answers that regeneration replaces)."""
    convs = []
    for i in range(9):
        turns = [" ".join(WORDS[(i * 5 + k * 3 + j) % len(WORDS)] for j in range(2 + (i + k) % 4)) + " ?"
                 for k in range(1 + i % 3)]
        messages = []
        for text in turns:
            messages += [{"role": "user", "content": text}, {"role": "assistant", "content": "old answer"}]
        convs.append(messages)
    return convs


@pytest.fixture(scope="module")
def stop_id(tiny: TargetModel) -> int:
    """A token the tiny model emits often but never among an answer's first two: most answers end on it
    after a few tokens, a few run to the length limit."""
    chat = ChatTokenizer(tiny.tokenizer)
    prompts = [chat.encode_prompt(c[:1]) for c in conversations()]
    outs = Generator(tiny, generation(None)).generate(prompts, [0] * len(prompts))
    early = {t for out in outs for t in out.token_ids[:2]}
    return Counter(t for out in outs for t in out.token_ids if t not in early).most_common(1)[0][0]


def generation(stop: int | None) -> EngineConfig:
    """The runtime for these tests: 3 rows at once, caches for prompts of up to 200 tokens."""
    return EngineConfig(batch_size=3, block_size=1, max_new_tokens=MAX_NEW, max_length=200 + MAX_NEW + 1,
                        stop_token_ids=() if stop is None else (stop,), kernels="torch")


def run(tiny: TargetModel, stop: int, source: Path, out: Path, turns: int | None, rank: int = 0, world: int = 1,
        wait: float = 0.0, kill_after: int | None = None) -> dict:
    config = RegenerateConfig([CorpusSpec(str(source))], max_new_tokens=MAX_NEW, batch_size=2, turns=turns,
                              turn_wait_seconds=wait, max_prompt_tokens=200)
    backend = LocalBackend(tiny, generation(stop), config.batch_size)
    calls = []

    def progress(done: int, total: int, rate: float) -> None:
        calls.append(done)
        if kill_after is not None and len([c for c in calls if c]) == kill_after:
            raise KeyboardInterrupt  # a kill, in the middle of a later turn

    return regenerate(backend, ChatTokenizer(tiny.tokenizer), config, out, rank, world, progress)


def write_source(path: Path) -> Path:
    path.write_text("".join(json.dumps({"messages": c}) + "\n" for c in conversations()))
    return path


def rows_of(out: Path) -> list[dict]:
    rows = [json.loads(line) for path in regenerated_files(out) for line in path.read_text().splitlines()]
    return sorted(rows, key=lambda row: row["row_id"])


def texts(out: Path) -> dict[str, str]:
    return {str(p.relative_to(out)): p.read_text() for p in sorted(out.rglob("part-*.jsonl"))}


def reference(tiny: TargetModel, stop: int, conversation: list[dict[str, str]], turns: int) -> list[dict]:
    """Turn by turn with HF `generate`: answer, then ask the next user turn unless the answer was cut
    (or empty)."""
    chat, history = ChatTokenizer(tiny.tokenizer), []
    for text in [m["content"] for m in conversation if m["role"] == "user"][:turns]:
        history.append({"role": "user", "content": text})
        (out,) = hf_generate(tiny.model, [chat.encode_prompt(history)], generation(stop))
        history.append({"role": "assistant", "content": tiny.tokenizer.decode(out.token_ids, skip_special_tokens=True)})
        if out.finish_reason == "length" or not history[-1]["content"].strip():
            break
    return history


@pytest.mark.parametrize("turns", [None, 2])
def test_every_turn_is_answered_after_the_targets_own_answers(tiny: TargetModel, stop_id: int, tmp_path: Path,
                                                              turns: int | None) -> None:
    source = write_source(tmp_path / "chats.jsonl")
    manifest = run(tiny, stop_id, source, tmp_path / "out", turns)
    rounds = 3 if turns is None else 2
    assert manifest["complete"] and manifest["turn"] == manifest["rounds"] == rounds
    rows = rows_of(tmp_path / "out")
    assert len(rows) == 9  # every conversation once, in the last round's folder
    for row, conversation in zip(rows, conversations(), strict=True):
        assert row["messages"] == reference(tiny, stop_id, conversation, rounds), row["row_id"]
    answered = Counter(sum(m["role"] == "assistant" for m in row["messages"]) for row in rows)
    assert answered[rounds] >= 2 and len(answered) > 1  # later turns were really asked, and some stopped
    assert sorted(p.name for p in (tmp_path / "out" / "turns").iterdir()) == [f"turn-{t}" for t in range(1, rounds)]


def test_a_run_killed_in_a_later_turn_resumes_to_the_same_files(tiny: TargetModel, stop_id: int,
                                                                tmp_path: Path) -> None:
    source = write_source(tmp_path / "chats.jsonl")
    run(tiny, stop_id, source, tmp_path / "full", None)
    with pytest.raises(KeyboardInterrupt):
        run(tiny, stop_id, source, tmp_path / "killed", None, kill_after=7)  # 5 units of turn 1, 2 of turn 2
    assert not (tmp_path / "killed" / "regenerate.json").exists() or not rows_of(tmp_path / "killed")
    assert run(tiny, stop_id, source, tmp_path / "killed", None)["complete"]
    assert texts(tmp_path / "killed") == texts(tmp_path / "full")


def test_ranks_wait_for_each_others_turns(tiny: TargetModel, stop_id: int, tmp_path: Path) -> None:
    source = write_source(tmp_path / "chats.jsonl")
    run(tiny, stop_id, source, tmp_path / "full", None)
    # Taking turns without waiting: a rank stops where the other's shards of a turn are missing, and the
    # same command picks up from there.
    alone = run(tiny, stop_id, source, tmp_path / "turns", None, rank=1, world=2)
    assert not alone["complete"] and alone["turn"] == 1
    for _ in range(6):
        finished = [run(tiny, stop_id, source, tmp_path / "turns", None, rank=r, world=2)["complete"] for r in (0, 1)]
        if any(finished):
            break
    assert texts(tmp_path / "turns") == texts(tmp_path / "full")
    # Side by side, as under torchrun: each rank waits for the other's shards of every turn.
    results: dict[int, dict] = {}
    threads = [threading.Thread(target=lambda r=r: results.update(
        {r: run(tiny, stop_id, source, tmp_path / "together", None, rank=r, world=2, wait=120)})) for r in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert set(results) == {0, 1} and any(r["complete"] for r in results.values())
    assert texts(tmp_path / "together") == texts(tmp_path / "full")


def test_another_turns_setting_is_refused_on_resume(tiny: TargetModel, stop_id: int, tmp_path: Path) -> None:
    source = write_source(tmp_path / "chats.jsonl")
    run(tiny, stop_id, source, tmp_path / "out", 2)
    with pytest.raises(ValueError, match="other settings"):
        run(tiny, stop_id, source, tmp_path / "out", None)


def test_prepare_trains_on_every_regenerated_turn(tiny: TargetModel, stop_id: int, tmp_path: Path) -> None:
    from dflash_train.data.prepare import PrepareConfig, prepare

    source = write_source(tmp_path / "chats.jsonl")
    run(tiny, stop_id, source, tmp_path / "out", None)
    prepare(tiny.tokenizer, PrepareConfig([CorpusSpec(str(tmp_path / "out"))], max_length=512, block_size=1),
            tmp_path / "prepared")
    import datasets

    prepared = datasets.load_from_disk(str(tmp_path / "prepared"))
    answered = {row["row_id"]: sum(m["role"] == "assistant" for m in row["messages"]) for row in rows_of(tmp_path / "out")}
    spans = []
    for mask in prepared["loss_mask"]:  # supervised runs: one per assistant turn
        spans.append(sum(1 for i, m in enumerate(mask) if m and (i == 0 or not mask[i - 1])))
    assert sorted(spans) == sorted(answered.values()) and max(spans) == 3


def test_turns_flag() -> None:
    import argparse

    from dflash_train.commands.regenerate import _turns

    assert _turns("all") is None and _turns("3") == 3
    for bad in ("0", "-1", "two"):
        with pytest.raises(argparse.ArgumentTypeError, match="a number >= 1 or all"):
            _turns(bad)


def test_a_server_back_end_answers_every_turn_like_the_builtin_one(tiny: TargetModel, stop_id: int,
                                                                 tmp_path: Path) -> None:
    from dflash_train.regeneration.backends import OpenAIBackend

    source = write_source(tmp_path / "chats.jsonl")
    run(tiny, stop_id, source, tmp_path / "local", None)
    server = ChatCompletionsServer(tiny, stop_ids=(stop_id,))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        config = RegenerateConfig([CorpusSpec(str(source))], max_new_tokens=MAX_NEW, batch_size=2, turns=None,
                                  max_prompt_tokens=200)
        backend = OpenAIBackend(server.url, "tiny", max_new_tokens=MAX_NEW, concurrency=2)
        assert regenerate(backend, ChatTokenizer(tiny.tokenizer), config, tmp_path / "http")["complete"]
    finally:
        server.shutdown()
        server.server_close()
    assert any(len(request["messages"]) == 3 for request in server.requests)  # a second turn, with its history
    assert [r["messages"] for r in rows_of(tmp_path / "http")] == [r["messages"] for r in rows_of(tmp_path / "local")]


def test_read_turn_keeps_answers_with_unicode_line_separators(tmp_path: Path) -> None:
    """Shards are written with ensure_ascii=False, so U+2028, U+0085 and form feeds appear raw inside a row;
    only a newline ends a row."""
    rows = [{"row_id": 0, "messages": [{"role": "assistant", "content": "a\u2028b\x85c\x0cd"}]},
            {"row_id": 1, "messages": [{"role": "assistant", "content": "plain"}]}]
    (tmp_path / "part-000000.jsonl").write_text(
        "\n".join(json.dumps(row, ensure_ascii=False) for row in rows) + "\n", encoding="utf-8")
    assert read_turn(tmp_path) == {0: rows[0], 1: rows[1]}
