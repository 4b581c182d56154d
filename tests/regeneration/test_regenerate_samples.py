"""Several sampled answers per prompt (`regenerate --samples-per-prompt K`): K rows per prompt with ids
prompt * K + sample, each answer the one its prompt gets alone from its own seed (checked by generating every
row again on its own), K different answers, a killed run resumed to the same files, multi-turn conversations
continued per sample, and the settings that make no sense refused."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import pytest

from dflash_train.data.chat import ChatTokenizer
from dflash_train.prompts.corpora import CorpusSpec
from dflash_train.regeneration.backends import LocalBackend
from dflash_train.regeneration.generation import Generator
from dflash_train.regeneration.regenerate import RegenerateConfig, regenerate
from dflash_train.runtime.config import EngineConfig
from dflash_train.runtime.sampling import request_seed
from dflash_train.shards import regenerated_files
from dflash_train.target import TargetModel
from tests.helpers.tiny_models import make_tiny_target

WORDS = ["hello", "who", "are", "you", "the", "capital", "of", "france", "paris", "is", "what", "yes", "no"]
SEED, MAX_NEW, UNIT_ROWS = 7, 10, 4


@pytest.fixture(scope="module")
def tiny() -> TargetModel:
    return make_tiny_target("llama", num_layers=2)


def engine(temperature: float, stops: tuple[int, ...] = (2,)) -> EngineConfig:
    return EngineConfig(batch_size=3, block_size=1, max_new_tokens=MAX_NEW, max_length=128, temperature=temperature,
                        stop_token_ids=stops, kernels="torch")


def write_prompts(path: Path, n: int = 5) -> Path:
    rows = [{"prompt": " ".join(WORDS[(i * 4 + k) % len(WORDS)] for k in range(2 + i % 3)) + " ?"} for i in range(n)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


class Killed(Exception):
    pass


def run(tiny: TargetModel, source: Path, out: Path, samples: int, temperature: float = 0.9,
        kill_after: int | None = None, turns: int | None = 1, stops: tuple[int, ...] = (2,)) -> dict:
    config = RegenerateConfig([CorpusSpec(str(source))], max_new_tokens=MAX_NEW, temperature=temperature, seed=SEED,
                              batch_size=UNIT_ROWS, samples_per_prompt=samples, turns=turns, max_prompt_tokens=100,
                              turn_wait_seconds=0.0)

    def progress(done: int, total: int, rate: float) -> None:
        if kill_after is not None and done == kill_after:
            raise Killed

    backend = LocalBackend(tiny, engine(temperature, stops), config.batch_size)
    return regenerate(backend, ChatTokenizer(tiny.tokenizer), config, out, progress=progress)


def shard_rows(out: Path) -> dict[int, list[dict]]:
    return {int(path.stem.split("-")[1]): [json.loads(line) for line in path.read_text().splitlines()]
            for path in regenerated_files(out)}


def test_each_sample_is_its_prompt_answered_alone_from_its_own_seed(tiny: TargetModel, tmp_path: Path) -> None:
    source, samples = write_prompts(tmp_path / "prompts.jsonl"), 3
    manifest = run(tiny, source, tmp_path / "out", samples)
    assert manifest["num_rows"] == 5 * samples and manifest["samples_per_prompt"] == samples
    units = shard_rows(tmp_path / "out")
    rows = {row["row_id"]: (unit, row) for unit, unit_rows in units.items() for row in unit_rows}
    assert sorted(rows) == list(range(5 * samples))
    prompts = [json.loads(line)["prompt"] for line in source.read_text().splitlines()]
    chat, alone = ChatTokenizer(tiny.tokenizer), Generator(tiny, engine(0.9), pad_id=0)
    answers: dict[int, list[str]] = defaultdict(list)
    for row_id, (unit, row) in sorted(rows.items()):
        prompt = row_id // samples
        assert row["messages"][0] == {"role": "user", "content": prompts[prompt]} and row["source_index"] == prompt
        # The reference: the prompt decoded on its own, from the seed of its unit and row id.
        (out,) = alone.generate([chat.encode_prompt(row["messages"][:1])], [request_seed(SEED + unit, row_id)])
        assert row["messages"][-1]["content"] == tiny.tokenizer.decode(out.token_ids, skip_special_tokens=True)
        answers[prompt].append(row["messages"][-1]["content"])
    assert all(len(set(texts)) == samples for texts in answers.values())  # K different answers to each prompt


def test_a_killed_sampled_run_resumes_to_the_same_files(tiny: TargetModel, tmp_path: Path) -> None:
    source = write_prompts(tmp_path / "prompts.jsonl")
    run(tiny, source, tmp_path / "full", samples=2)
    with pytest.raises(Killed):
        run(tiny, source, tmp_path / "resumed", samples=2, kill_after=1)
    assert len(regenerated_files(tmp_path / "resumed")) == 1
    assert run(tiny, source, tmp_path / "resumed", samples=2)["complete"]
    assert shard_rows(tmp_path / "resumed") == shard_rows(tmp_path / "full")


def test_one_sample_per_prompt_is_the_plain_run(tiny: TargetModel, tmp_path: Path) -> None:
    source = write_prompts(tmp_path / "prompts.jsonl")
    manifest = run(tiny, source, tmp_path / "one", samples=1)
    assert "samples_per_prompt" not in manifest  # runs started before the setting existed still resume
    rows = [row for unit in shard_rows(tmp_path / "one").values() for row in unit]
    assert sorted(row["row_id"] for row in rows) == list(range(5))


def test_samples_of_a_conversation_continue_with_their_own_answers(tiny: TargetModel, tmp_path: Path) -> None:
    turns = [[f"{WORDS[i]} {WORDS[i + 1]} ?", f"and {WORDS[i + 2]} ?"] for i in range(3)]
    source = tmp_path / "chats.jsonl"
    source.write_text("".join(json.dumps({"messages": [{"role": "user", "content": a}, {"role": "assistant", "content": "x"},
                                                       {"role": "user", "content": b}]}) + "\n" for a, b in turns))
    stops = tuple(range(20, 80))  # a quarter of the tiny vocabulary: most answers end before the length limit
    run(tiny, source, tmp_path / "out", samples=2, turns=None, stops=stops)
    rounds = [shard_rows(tmp_path / "out" / "turns" / "turn-1"), shard_rows(tmp_path / "out")]
    chat, alone = ChatTokenizer(tiny.tokenizer), Generator(tiny, engine(0.9, stops), pad_id=0)
    asked_twice = 0
    for turn, units in enumerate(rounds, 1):
        for unit, rows in units.items():
            for row in rows:
                messages, (first, second) = row["messages"], turns[row["row_id"] // 2]
                if turn == 2 and len(messages) == 2:  # carried: its first answer was cut or empty
                    assert row["finish_reason"] == "length" or not messages[1]["content"]
                    continue
                assert messages[0]["content"] == first and messages[2:3] in ([], [{"role": "user", "content": second}])
                asked_twice += turn == 2
                # The reference: this conversation so far, answered alone from the seed of its round, unit and row.
                seed = request_seed(SEED + (turn - 1) * 1_000_003 + unit, row["row_id"])
                (out,) = alone.generate([chat.encode_prompt(messages[:-1])], [seed])
                assert messages[-1]["content"] == tiny.tokenizer.decode(out.token_ids, skip_special_tokens=True)
    assert asked_twice >= 3  # the second turn was asked in most conversations, after each sample's own answer


def test_samples_need_sampling_and_a_positive_count(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="needs --temperature > 0"):
        RegenerateConfig([CorpusSpec("x.jsonl")], temperature=0.0, samples_per_prompt=2)
    with pytest.raises(ValueError, match="give 1 or more"):
        RegenerateConfig([CorpusSpec("x.jsonl")], temperature=0.7, samples_per_prompt=0)
