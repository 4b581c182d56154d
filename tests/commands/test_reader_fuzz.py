"""Seeded fuzzing of every input the project reads: chat corpora (.jsonl, .json, .parquet), a prepared
dataset, a feature store (shards and manifest), a drafter checkpoint and a training recipe.

Each small valid instance is damaged (truncated at a random offset, random bytes flipped, emptied, a
header field changed) and handed to the reading entry point that a user would run on it. The reader
either succeeds or fails with one line naming the problem (a command: a nonzero exit status and a last
line `dflash-train <command>: error: ...`; a library call: a single-line ValueError), never with a
traceback, and it never changes its input.
"""

from __future__ import annotations

import hashlib
import json
import random
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from dflash_train.checkpoint import load_draft
from dflash_train.cli import main
from dflash_train.data.prepare import PrepareConfig, prepare
from dflash_train.prompts.corpora import CorpusSpec
from dflash_train.training.config import load_config
from tests.helpers.checkpoints import export_tiny
from tests.helpers.tiny_models import make_tiny_target, save_tiny_target_dir

SEED = 20261130
RANDOM_CASES = 10  # per kind, plus the targeted ones
LAYER_IDS = "1,3"
HEADER_BYTES = 8  # safetensors: a little-endian u64 header length, then the JSON header

# ----------------------------------------------------------------------------------------------- damage


@dataclass(frozen=True)
class Damage:
    """One change to one file of an instance; `name` is the test id."""

    file: str  # relative to the instance's folder
    name: str
    apply: Callable[[bytes], bytes]


def truncation(file: str, fraction: float) -> Damage:
    return Damage(file, f"truncate-{file}@{fraction:.2f}", lambda data: data[: int(len(data) * fraction)])


def byte_flips(file: str, positions: Sequence[float], masks: Sequence[int], header_only: bool = False) -> Damage:
    """XOR the bytes at `positions` (fractions of the file, or of a safetensors file's header) with `masks`."""

    def apply(data: bytes) -> bytes:
        span = _safetensors_header_end(data) if header_only else len(data)
        out = bytearray(data)
        for position, mask in zip(positions, masks, strict=True):
            out[min(int(position * span), len(out) - 1)] ^= mask
        return bytes(out)

    where = "header-" if header_only else ""
    return Damage(file, f"flip-{where}{file}@{','.join(f'{p:.3f}' for p in positions)}", apply)


def _safetensors_header_end(data: bytes) -> int:
    return min(len(data), HEADER_BYTES + int.from_bytes(data[:HEADER_BYTES], "little"))


def emptied(file: str) -> Damage:
    return Damage(file, f"empty-{file}", lambda data: b"")


def replaced(file: str, name: str, old: bytes, new: bytes) -> Damage:
    """A targeted corruption: the first `old` in the file becomes `new` (a field changed, a key lost)."""

    def apply(data: bytes) -> bytes:
        assert old in data, f"{file} does not hold {old!r}"
        return data.replace(old, new, 1)

    return Damage(file, f"{name}-{file}", apply)


def written(file: str, name: str, content: bytes) -> Damage:
    return Damage(file, f"{name}-{file}", lambda data: content)


def random_damages(kind: str, files: Sequence[str], safetensors: Sequence[str] = ()) -> list[Damage]:
    """RANDOM_CASES seeded truncations and byte flips of `files`; flips in a safetensors file hit its
    header every other time (random bytes of tensor data are rarely anything but different numbers)."""
    rng = random.Random(f"{SEED}-{kind}")
    damages = []
    for i in range(RANDOM_CASES):
        file = rng.choice(list(files))
        if i % 2 == 0:
            damages.append(truncation(file, rng.random()))
            continue
        count = rng.randint(1, 4)
        positions = [rng.random() for _ in range(count)]
        masks = [rng.randint(1, 255) for _ in range(count)]
        damages.append(byte_flips(file, positions, masks, header_only=file in safetensors and i % 4 == 1))
    return damages


def damaged_copy(pristine: Path, damage: Damage, work: Path) -> Path:
    """A copy of the instance `pristine` (a file or a folder) with `damage` applied."""
    copy = work / pristine.name
    if pristine.is_dir():
        shutil.copytree(pristine, copy)
        target = copy / damage.file
    else:
        shutil.copy2(pristine, copy)
        target = copy
    target.write_bytes(damage.apply(target.read_bytes()))
    return copy


def fingerprint(*paths: Path) -> dict[str, str]:
    """sha256 of every file under `paths`: what a reader must leave as it found it."""
    files = [p for path in paths for p in ([path] if path.is_file() else sorted(path.rglob("*"))) if p.is_file()]
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


# ----------------------------------------------------------------------------------------------- outcomes


def run_command(argv: list[str], capsys: pytest.CaptureFixture[str], names: str,
                failure_codes: Sequence[int] = (2,)) -> int:
    """`dflash-train argv`: exit status 0, or one of `failure_codes` with no traceback; status 2 with one
    error line that `names` the damaged input."""
    try:
        code = main(argv)
    except Exception as error:  # any escaping exception is the traceback this test hunts
        pytest.fail(f"dflash-train {argv[0]} ended in a traceback: {type(error).__name__}: {error}")
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    assert code == 0 or code in failure_codes, f"exit status {code}"
    if code == 1:  # `check`: one line per problem, each naming the directory
        assert all(line.startswith(f"{names}: ") for line in out.strip().splitlines()), out
    if code == 2:
        last = err.strip().splitlines()[-1]  # earlier lines: progress bars, library warnings
        assert last.startswith(f"dflash-train {argv[0]}: error: ") and names in last, err
    return code


def call_reader(read: Callable[[], object], names: str = "") -> object | None:
    """`read()`'s result, or None after a one-line ValueError that `names` the damaged input; anything else
    fails the test."""
    try:
        return read()
    except ValueError as error:
        message = str(error)
        assert "\n" not in message and names in message, message
        return None
    except Exception as error:  # any other exception is a traceback for the user
        pytest.fail(f"reader ended in a traceback: {type(error).__name__}: {error}")


def check_unchanged(before: dict[str, str], *paths: Path) -> None:
    assert fingerprint(*paths) == before, "the reader changed its input"


# ----------------------------------------------------------------------------------------------- instances

ANSWERS = ("paris is the capital of france .", "yes , i am a helpful assistant .", "no , it is not .")
QUESTIONS = ("what is the capital of france ?", "who are you ?", "is it brief ?")


def chats() -> list[dict]:
    return [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}
            for q, a in zip(QUESTIONS * 2, ANSWERS * 2, strict=True)]


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_target_dir(tmp_path_factory.mktemp("target"))


@pytest.fixture(scope="module")
def corpora(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The same chats as OpenAI messages (.jsonl), ShareGPT (.json array) and Alpaca (.parquet)."""
    import datasets

    folder = tmp_path_factory.mktemp("corpora")
    (folder / "chats.jsonl").write_text("".join(json.dumps(chat) + "\n" for chat in chats()))
    sharegpt = [{"conversations": [{"from": "human", "value": m[0]["content"]},
                                   {"from": "gpt", "value": m[1]["content"]}]} for m in (c["messages"] for c in chats())]
    (folder / "chats.json").write_text(json.dumps(sharegpt, indent=1))
    alpaca = {"instruction": list(QUESTIONS * 2), "output": list(ANSWERS * 2)}
    datasets.Dataset.from_dict(alpaca).to_parquet(str(folder / "chats.parquet"))
    return {path.suffix: path for path in folder.iterdir()}


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory, corpora: dict[str, Path], target_dir: Path) -> Path:
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("prepared") / "prepared"
    config = PrepareConfig([CorpusSpec(str(corpora[".jsonl"]))], max_length=64, block_size=2,
                           target_name=str(target_dir))
    prepare(AutoTokenizer.from_pretrained(target_dir), config, out)
    return out


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory, prepared: Path, target_dir: Path) -> Path:
    out = tmp_path_factory.mktemp("store") / "store"
    assert main(extract_argv(prepared, target_dir, out)) == 0
    return out


def extract_argv(data: Path, target: Path, out: Path) -> list[str]:
    return ["extract", "--data", str(data), "--target", str(target), "--out", str(out), "--layer-ids", LAYER_IDS,
            "--target-dtype", "fp32", "--device", "cpu", "--rows-per-shard", "2", "--write-threads", "1"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return export_tiny(tmp_path_factory.mktemp("checkpoint"), make_tiny_target("qwen3", num_layers=6, seed=1))


RECIPE = """\
model:
  target: smollm2-135m-instruct
  target_dtype: float32
  num_draft_layers: 2
  block_size: 4
  target_layer_ids: [1, 3]
data:
  prepared: runs/prepared
  max_length: 64
training:
  output_dir: runs/train
  max_steps: 3
  batch_size: 2
  learning_rate: 6.0e-4
  adam_betas: [0.9, 0.999]
  mixed_precision: "no"
tracking:
  report_to: none
"""


@pytest.fixture(scope="module")
def recipe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("recipe") / "recipe.yaml"
    path.write_text(RECIPE)
    return path


@pytest.fixture(autouse=True)
def _private_datasets_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # `datasets` caches what it loads from a .parquet file; a damaged copy must be read afresh.
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-datasets-cache")


# ----------------------------------------------------------------------------------------------- corpora

CORPUS_DAMAGES = {
    ".jsonl": [
        *random_damages("jsonl", ["chats.jsonl"]),
        emptied("chats.jsonl"),
        replaced("chats.jsonl", "not-a-list", b'[{"role": "user"', b'{"x": [{"role": "user"'),
        replaced("chats.jsonl", "lone-surrogate", b"paris", b"\\ud800is"),
        # Nesting deeper than Python's recursion limit, after a good row (so that something is kept).
        written("chats.jsonl", "deep-nesting", json.dumps(chats()[0]).encode() + b"\n" + b"[" * 100_000 + b"\n"),
    ],
    ".json": [
        *random_damages("json", ["chats.json"]),
        emptied("chats.json"),
        written("chats.json", "bracket-only", b"["),
        written("chats.json", "deep-nesting", b"[" + json.dumps(chats()[0]).encode() + b", " + b"[" * 100_000),
        replaced("chats.json", "not-an-object", b"{\n", b"7, {\n"),
    ],
    ".parquet": [
        *random_damages("parquet", ["chats.parquet"]),
        emptied("chats.parquet"),
        replaced("chats.parquet", "wrong-magic", b"PAR1", b"PAR2"),
    ],
}


@pytest.mark.parametrize(("suffix", "damage"), [(suffix, damage) for suffix, cases in CORPUS_DAMAGES.items()
                                                for damage in cases],
                         ids=[damage.name for cases in CORPUS_DAMAGES.values() for damage in cases])
def test_prepare_reads_a_damaged_corpus(suffix: str, damage: Damage, corpora: dict[str, Path], target_dir: Path,
                                        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from dflash_train.data import load_prepared

    source = damaged_copy(corpora[suffix], damage, tmp_path)
    before = fingerprint(source, target_dir)
    argv = ["prepare", "--target", str(target_dir), "--data", str(source), "--out", str(tmp_path / "out"),
            "--block-size", "2", "--max-length", "64"]
    if run_command(argv, capsys, source.name) == 0:  # the rows that survived, each a whole chat
        assert 1 <= len(load_prepared(tmp_path / "out")) <= len(chats())
    check_unchanged(before, source, target_dir)


# ----------------------------------------------------------------------------------------------- prepared data

ARROW = "data-00000-of-00001.arrow"
PREPARED_FILES = (ARROW, "dataset_info.json", "state.json", "dflash_data.json")
PREPARED_DAMAGES = [
    *random_damages("prepared", PREPARED_FILES),
    emptied(ARROW),
    emptied("dflash_data.json"),
    written("dflash_data.json", "not-an-object", b"[]"),
    replaced("state.json", "other-data-file", b'"data-00000', b'"data-00009'),
    replaced("dflash_data.json", "other-tokenizer", b'"tokenizer_hash": "', b'"tokenizer_hash": "0'),
]


@pytest.mark.parametrize("damage", PREPARED_DAMAGES, ids=[damage.name for damage in PREPARED_DAMAGES])
def test_extract_reads_a_damaged_prepared_dataset(damage: Damage, prepared: Path, target_dir: Path, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    data = damaged_copy(prepared, damage, tmp_path)
    before = fingerprint(data, target_dir)
    out = tmp_path / "store"
    if run_command(extract_argv(data, target_dir, out), capsys, str(data)) == 0:  # the store holds the data's rows
        assert run_command(["extract", "--verify", "--out", str(out), "--data", str(data)], capsys, str(out)) == 0
    check_unchanged(before, data, target_dir)


# ----------------------------------------------------------------------------------------------- feature store

SHARD = "features-000000.safetensors"
STORE_DAMAGES = [
    *random_damages("store", ("manifest.json", SHARD, "features-000001.safetensors"), safetensors=(SHARD,)),
    emptied(SHARD),
    emptied("manifest.json"),
    written("manifest.json", "not-an-object", b"[1, 2]"),
    replaced("manifest.json", "key-lost", b'"num_units"', b'"num_unit"'),
    replaced("manifest.json", "target-lost", b'"target_hash"', b'"target_hush"'),
    replaced("manifest.json", "ids-not-a-list", b'"target_layer_ids": [', b'"target_layer_ids": 1, "x": ['),
    replaced("manifest.json", "dtype-changed", b'"dtype": "bf16"', b'"dtype": "fp8"'),
    replaced("manifest.json", "rows-changed", b'"num_rows": ', b'"num_rows": 1'),
    replaced(SHARD, "dtype-changed", b'"dtype":"I64"', b'"dtype":"I32"'),
    replaced(SHARD, "tensor-renamed", b'"offsets"', b'"offsetz"'),
]


@pytest.mark.parametrize("damage", STORE_DAMAGES, ids=[damage.name for damage in STORE_DAMAGES])
def test_verify_reads_a_damaged_feature_store(damage: Damage, store: Path, prepared: Path, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    from dflash_train.features.store import MANIFEST, FeatureStore

    damaged = damaged_copy(store, damage, tmp_path)
    before = fingerprint(damaged, prepared)
    run_command(["extract", "--verify", "--out", str(damaged), "--data", str(prepared)], capsys, str(damaged))
    # Training checks the store against its target and reads it row by row, whether or not anyone verified it.
    features = call_reader(lambda: FeatureStore(damaged), str(damaged))
    if isinstance(features, FeatureStore):
        made_for = json.loads((store / MANIFEST).read_text())
        call_reader(lambda: features.check_compatible(made_for["target_layer_ids"], made_for["hidden_size"],
                                                      made_for["target_hash"]), str(damaged))
        for i in range(len(features)):
            call_reader(lambda i=i: features[i], str(damaged))
    check_unchanged(before, damaged, prepared)


# ----------------------------------------------------------------------------------------------- checkpoint

WEIGHTS = "model.safetensors"
CHECKPOINT_DAMAGES = [
    *random_damages("checkpoint", ("config.json", WEIGHTS), safetensors=(WEIGHTS,)),
    emptied(WEIGHTS),
    emptied("config.json"),
    written("config.json", "not-an-object", b'"a drafter"'),
    replaced("config.json", "size-as-text", b'"hidden_size": 64', b'"hidden_size": "64"'),
    replaced("config.json", "size-zero", b'"hidden_size": 64', b'"hidden_size": 0'),
    replaced("config.json", "layers-negative", b'"num_hidden_layers": 2', b'"num_hidden_layers": -2'),
    replaced("config.json", "ids-not-a-list", b'"target_layer_ids": [', b'"target_layer_ids": 7, "x": ['),
    replaced(WEIGHTS, "dtype-changed", b'"dtype":"BF16"', b'"dtype":"F32"'),
    replaced(WEIGHTS, "tensor-renamed", b'"norm.weight"', b'"norm.weigh7"'),
]


@pytest.mark.parametrize("damage", CHECKPOINT_DAMAGES, ids=[damage.name for damage in CHECKPOINT_DAMAGES])
def test_check_and_load_read_a_damaged_checkpoint(damage: Damage, checkpoint: Path, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    directory = damaged_copy(checkpoint, damage, tmp_path)
    before = fingerprint(directory)
    run_command(["check", str(directory)], capsys, str(directory), failure_codes=(1, 2))
    draft = call_reader(lambda: load_draft(directory), str(directory))  # what eval and model.init_from read
    if isinstance(draft, torch.nn.Module):  # a whole drafter, or none
        assert draft.state_dict().keys() == load_draft(checkpoint).state_dict().keys()
    check_unchanged(before, directory)


# ----------------------------------------------------------------------------------------------- recipe

RECIPE_DAMAGES = [
    *random_damages("recipe", ("recipe.yaml",)),
    emptied("recipe.yaml"),
    replaced("recipe.yaml", "tab-indent", b"  max_steps", b"\tmax_steps"),
    replaced("recipe.yaml", "number-key", b"max_steps:", b"3:"),
    replaced("recipe.yaml", "list-key", b"max_steps:", b"? [a]\n  :"),
    replaced("recipe.yaml", "invalid-utf8", b"runs/train", b"runs/\xff\xfe"),
    replaced("recipe.yaml", "section-as-list", b"tracking:\n  report_to: none", b"tracking:\n  - none"),
]


@pytest.mark.parametrize("damage", RECIPE_DAMAGES, ids=[damage.name for damage in RECIPE_DAMAGES])
def test_load_config_reads_a_damaged_recipe(damage: Damage, recipe: Path, tmp_path: Path) -> None:
    from dflash_train.training.config import TrainConfig

    path = damaged_copy(recipe, damage, tmp_path)
    before = fingerprint(path)
    # A syntax error names the file; a bad key or value its dotted key (which an override may hold too).
    config = call_reader(lambda: load_config(path))
    assert config is None or isinstance(config, TrainConfig)
    check_unchanged(before, path)
