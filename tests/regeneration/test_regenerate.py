"""Regeneration: resume after a kill, rank split, and the OpenAI-compatible back end against a real HTTP
server on loopback (a tiny chat-completions server backed by a tiny transformers model, in this process).
The built-in back end's generation itself (the runtime) is tested in tests/regeneration/test_generation.py."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from dflash_train.data.chat import ChatTokenizer
from dflash_train.prompts.corpora import CorpusSpec
from dflash_train.regeneration.backends import LocalBackend, OpenAIBackend
from dflash_train.regeneration.regenerate import RegenerateConfig, regenerate
from dflash_train.runtime.config import EngineConfig
from dflash_train.shards import regenerated_files
from dflash_train.target import TargetModel
from tests.helpers.regeneration import WORDS, ChatCompletionsServer
from tests.helpers.tiny_models import make_tiny_target


def settings(temperature: float = 0.0, max_new: int = 12) -> EngineConfig:
    """The runtime for these tests: 4 rows decoded at once (units of 3 rows straddle them), refilled one
    prompt at a time."""
    return EngineConfig(batch_size=4, block_size=1, max_new_tokens=max_new, max_length=64, temperature=temperature,
                        stop_token_ids=(2,), kernels="torch")


@pytest.fixture(scope="module")
def tiny() -> TargetModel:
    return make_tiny_target("llama", num_layers=3)


# ------------------------------------------------------------------------------------------ resumable runs


def write_prompts(path: Path, n: int = 10) -> Path:
    rows = [{"prompt": " ".join(WORDS[(i * 3 + k) % len(WORDS)] for k in range(1 + i % 5)) + " ?"} for i in range(n)]
    rows.append({"prompt": rows[0]["prompt"]})  # a duplicate, dropped
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


class Killed(Exception):
    pass


def run_regen(target: TargetModel, source: Path, out: Path, temperature: float = 0.0, rank: int = 0,
              world: int = 1, kill_after: int | None = None, units_run: list[int] | None = None,
              decode_rows: int = 4) -> dict:
    config = RegenerateConfig([CorpusSpec(str(source))], max_new_tokens=10, temperature=temperature, seed=5,
                              batch_size=3)
    backend = LocalBackend(target, replace(settings(temperature, 10), batch_size=decode_rows), config.batch_size)

    def progress(done: int, total: int, rate: float) -> None:
        if units_run is not None and done == 0:
            units_run.append(total)
        if kill_after is not None and done == kill_after:
            raise Killed

    return regenerate(backend, ChatTokenizer(target.tokenizer), config, out, rank, world, progress)


def shard_texts(out: Path) -> dict[str, str]:
    return {path.name: path.read_text() for path in regenerated_files(out)}


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_resume_after_kill_equals_uninterrupted_run(tiny: TargetModel, tmp_path: Path, temperature: float) -> None:
    source = write_prompts(tmp_path / "prompts.jsonl")
    full = run_regen(tiny, source, tmp_path / "full", temperature)
    assert full["complete"] and full["num_rows"] == 10 and full["num_units"] == 4
    with pytest.raises(Killed):
        run_regen(tiny, source, tmp_path / "resumed", temperature, kill_after=2)
    assert len(regenerated_files(tmp_path / "resumed")) == 2
    (tmp_path / "resumed" / ".part-000002.jsonl.half.tmp").write_text('{"row_id": ')  # a write cut by the kill
    units_run: list[int] = []
    resumed = run_regen(tiny, source, tmp_path / "resumed", temperature, units_run=units_run)
    assert units_run == [2]  # only the two unfinished units ran again
    assert resumed["complete"] and shard_texts(tmp_path / "resumed") == shard_texts(tmp_path / "full")
    rows = [json.loads(line) for text in shard_texts(tmp_path / "full").values() for line in text.splitlines()]
    assert sorted(r["row_id"] for r in rows) == list(range(10))  # every row once
    assert all(r["messages"][-1]["role"] == "assistant" for r in rows)


def test_the_rows_decoded_at_once_do_not_change_the_shards(tiny: TargetModel, tmp_path: Path) -> None:
    """Sampled answers: one row at a time, or 7 rows refilled across units, write the same files."""
    source = write_prompts(tmp_path / "prompts.jsonl")
    run_regen(tiny, source, tmp_path / "one", temperature=0.9, decode_rows=1)
    run_regen(tiny, source, tmp_path / "seven", temperature=0.9, decode_rows=7)
    assert shard_texts(tmp_path / "seven") == shard_texts(tmp_path / "one")


def test_ranks_split_the_units(tiny: TargetModel, tmp_path: Path) -> None:
    source = write_prompts(tmp_path / "prompts.jsonl")
    run_regen(tiny, source, tmp_path / "full")
    first = run_regen(tiny, source, tmp_path / "split", rank=1, world=2)
    assert not first["complete"] and sorted(shard_texts(tmp_path / "split")) == ["part-000001.jsonl", "part-000003.jsonl"]
    assert run_regen(tiny, source, tmp_path / "split", rank=0, world=2)["complete"]
    assert shard_texts(tmp_path / "split") == shard_texts(tmp_path / "full")


def test_resume_with_other_settings_is_refused(tiny: TargetModel, tmp_path: Path) -> None:
    source = write_prompts(tmp_path / "prompts.jsonl")
    run_regen(tiny, source, tmp_path / "out")
    with pytest.raises(ValueError, match="other settings.*temperature"):
        run_regen(tiny, source, tmp_path / "out", temperature=0.5)


@pytest.mark.parametrize("damage", ["[1]", "{\"num_units\": ", ""])
def test_a_damaged_manifest_is_one_line_and_its_advice_resumes_keeping_the_shards(
        tiny: TargetModel, tmp_path: Path, damage: str) -> None:
    """A manifest that is not a JSON object failed with an AttributeError from its first `.get`. Now it is named
    with what to do, and doing it (remove the file, run again) reruns only the unfinished units."""
    source = write_prompts(tmp_path / "prompts.jsonl")
    full = run_regen(tiny, source, tmp_path / "full")
    with pytest.raises(Killed):
        run_regen(tiny, source, tmp_path / "out", kill_after=2)
    manifest = tmp_path / "out" / "regenerate.json"
    manifest.write_text(damage)
    with pytest.raises(ValueError, match=r"regenerate.json is damaged \(.*\); remove it and run the same "
                                         r"`dflash-train regenerate` command again \(its finished shards are kept\)"):
        run_regen(tiny, source, tmp_path / "out")
    manifest.unlink()
    units_run: list[int] = []
    assert run_regen(tiny, source, tmp_path / "out", units_run=units_run)["complete"] and units_run == [2]
    assert full["complete"] and shard_texts(tmp_path / "out") == shard_texts(tmp_path / "full")


# ------------------------------------------------------------------ OpenAI-compatible server on loopback


@pytest.fixture()
def server(tiny: TargetModel) -> Iterator[ChatCompletionsServer]:
    server = ChatCompletionsServer(tiny)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def test_openai_backend_matches_the_builtin_backend(tiny: TargetModel, server: ChatCompletionsServer,
                                                    tmp_path: Path) -> None:
    source = write_prompts(tmp_path / "prompts.jsonl")
    run_regen(tiny, source, tmp_path / "local")
    config = RegenerateConfig([CorpusSpec(str(source))], max_new_tokens=10, seed=5, batch_size=3)
    backend = OpenAIBackend(server.url, "tiny", max_new_tokens=10, concurrency=3)
    manifest = regenerate(backend, ChatTokenizer(tiny.tokenizer), config, tmp_path / "http")
    assert manifest["complete"] and len(server.requests) == 10
    assert {r["max_tokens"] for r in server.requests} == {10} and server.requests[0]["temperature"] == 0.0

    def answers(out: Path) -> dict[int, tuple[str, str]]:
        rows = [json.loads(line) for p in regenerated_files(out) for line in p.read_text().splitlines()]
        return {r["row_id"]: (r["messages"][-1]["content"], r["finish_reason"]) for r in rows}

    assert answers(tmp_path / "http") == answers(tmp_path / "local")


def test_openai_backend_sends_thinking_and_rebuilds_reasoning(server: ChatCompletionsServer) -> None:
    from dflash_train.regeneration.regenerate import PromptRow

    backend = OpenAIBackend(server.url, "tiny", max_new_tokens=4, thinking=False)
    backend.complete([PromptRow(0, [{"role": "user", "content": "hello"}], [1], "s", 0)], seed=0)
    assert server.requests[-1]["chat_template_kwargs"] == {"enable_thinking": False}


def test_openai_backend_unreachable_is_one_line(tmp_path: Path) -> None:
    from dflash_train.regeneration.regenerate import PromptRow

    backend = OpenAIBackend("http://127.0.0.1:9/v1", "x", max_new_tokens=4, retries=0)
    with pytest.raises(ValueError, match="is the server running"):
        backend.complete([PromptRow(0, [{"role": "user", "content": "hello"}], [1], "s", 0)], seed=0)
