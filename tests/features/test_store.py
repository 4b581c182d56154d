"""Offline feature store: equal to the online capture, fp8 error bound, resume after a kill, ranks,
verification, disk check, compatibility checks and the `extract` command."""

from __future__ import annotations

import itertools
import json
import shutil
from collections import namedtuple
from pathlib import Path

import datasets
import pytest
import torch

from dflash_train.cli import main
from dflash_train.data.prepared import tokenizer_hash
from dflash_train.features.capture import compute_features
from dflash_train.features.extract import (
    ExtractConfig,
    bytes_per_token,
    extract,
    micro_batches,
    plan_rows_per_shard,
    row_lengths,
)
from dflash_train.features.store import (
    FeatureStore,
    dequantize_fp8,
    quantize_fp8,
    shard_path,
)
from dflash_train.features.verify import verify_store
from dflash_train.target import TargetModel, target_fingerprint
from tests.helpers.tiny_models import make_tiny_target, make_tiny_tokenizer

LAYERS = [0, 2, 4]


@pytest.fixture(scope="module")
def tiny() -> TargetModel:
    return make_tiny_target("qwen3", num_layers=6)


def rows_dataset(n: int = 9, seed: int = 0) -> datasets.Dataset:
    g = torch.Generator().manual_seed(seed)
    lengths = [int(x) for x in torch.randint(3, 20, (n,), generator=g)]
    ids = [torch.randint(7, 256, (length,), generator=g).tolist() for length in lengths]
    masks = [[0] * (length // 2) + [1] * (length - length // 2) for length in lengths]
    return datasets.Dataset.from_dict({"input_ids": ids, "loss_mask": masks})


def run_extract(target: TargetModel, data: datasets.Dataset, out: Path, dtype: str = "bf16", budget: int = 1,
                rank: int = 0, world: int = 1, kill_after: int | None = None, shards_run: list[int] | None = None) -> dict:
    def progress(done: int, total: int, tokens: int, rate: float) -> None:
        if shards_run is not None and done == 0:
            shards_run.append(total)
        if kill_after is not None and done == kill_after:
            raise KeyboardInterrupt

    config = ExtractConfig(LAYERS, dtype, rows_per_shard=2, token_budget=budget, window_shards=4)
    settings = {"target": "tiny", "target_hash": target_fingerprint(target.model),
                "tokenizer_hash": tokenizer_hash(target.tokenizer)}
    return extract(target, data, out, config, settings, rank, world, progress)


def shard_bytes(out: Path) -> dict[str, tuple]:
    """Each shard's metadata and tensor bytes (safetensors does not fix the order of metadata keys)."""
    from safetensors import safe_open

    shards = {}
    for path in sorted(out.glob("features-*.safetensors")):
        with safe_open(str(path), "pt") as f:
            names = f.keys()  # safe_open is not iterable
            tensors = {k: (f.get_tensor(k).dtype, f.get_tensor(k).view(torch.uint8).numpy().tobytes()) for k in names}
            shards[path.name] = (f.metadata(), tensors)
    return shards


def test_offline_features_equal_online_capture_bit_for_bit(tiny: TargetModel, tmp_path: Path) -> None:
    data = rows_dataset()
    run_extract(tiny, data, tmp_path / "store")  # budget 1: one row per forward, as online with batch 1
    store = FeatureStore(tmp_path / "store")
    assert len(store) == len(data)
    for i in range(len(data)):
        ids = torch.tensor(data[i]["input_ids"])
        online = compute_features(tiny, ids[None], LAYERS)[0]
        row = store[i]
        assert row["features"].dtype == torch.bfloat16 and row["features"].shape == (len(ids), 3 * 64)
        assert torch.equal(row["features"], online)
        assert torch.equal(row["input_ids"], ids) and row["loss_mask"].tolist() == [bool(m) for m in data[i]["loss_mask"]]
    # the online capture itself is the contract's: outputs of layers 0, 2, 4 = hidden_states[1, 3, 5]
    with torch.no_grad():
        hidden = tiny.model(ids[None], output_hidden_states=True).hidden_states
    torch.testing.assert_close(online.float(), torch.cat([hidden[k + 1] for k in LAYERS], -1)[0].bfloat16().float())


def test_padded_micro_batches_match_single_rows(tiny: TargetModel, tmp_path: Path) -> None:
    data = rows_dataset()
    run_extract(tiny, data, tmp_path / "one", budget=1)
    run_extract(tiny, data, tmp_path / "batched", budget=64)  # right-padded groups of several rows
    one, batched = FeatureStore(tmp_path / "one"), FeatureStore(tmp_path / "batched")
    for i in range(len(data)):
        torch.testing.assert_close(batched[i]["features"].float(), one[i]["features"].float(), rtol=1.6e-2, atol=1e-2)


def test_micro_batches_respect_the_budget() -> None:
    lengths = [5, 17, 3, 17, 9, 1, 30]
    groups = micro_batches(lengths, 40)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for group in groups:
        assert len(group) == 1 or len(group) * max(lengths[i] for i in group) <= 40


def _grouping_cost(lengths: list[int], groups: list[list[int]], group_cost: int) -> int:
    return sum(len(g) * max(lengths[i] for i in g) + group_cost for g in groups)


def _cheapest_grouping_by_brute_force(lengths: list[int], budget: int, group_cost: int) -> int:
    """Every way to cut the length-sorted rows into runs (2^(n-1) of them), within the budget."""
    ordered = sorted(lengths, reverse=True)
    best = None
    for cuts in itertools.product([False, True], repeat=len(ordered) - 1):
        groups, current = [], [ordered[0]]
        for length, cut in zip(ordered[1:], cuts, strict=True):
            if cut:
                groups.append(current)
                current = []
            current.append(length)
        groups.append(current)
        if all(len(g) == 1 or len(g) * g[0] <= budget for g in groups):
            total = sum(len(g) * g[0] + group_cost for g in groups)
            best = total if best is None else min(best, total)
    assert best is not None
    return best


@pytest.mark.parametrize("seed", range(6))
def test_micro_batches_are_the_cheapest_grouping(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    lengths = [int(x) for x in torch.randint(1, 60, (11,), generator=g)]
    budget, group_cost = 120, int(torch.randint(0, 40, (1,), generator=g))
    groups = micro_batches(lengths, budget, group_cost)
    assert sorted(i for group in groups for i in group) == list(range(len(lengths)))
    assert all(len(group) == 1 or len(group) * max(lengths[i] for i in group) <= budget for group in groups)
    assert _grouping_cost(lengths, groups, group_cost) == _cheapest_grouping_by_brute_force(lengths, budget, group_cost)
    assert max(lengths[i] for i in groups[0]) == max(lengths)  # the widest forward first: out of memory early


def test_micro_batches_pad_less_than_filling_to_the_budget() -> None:
    lengths = [int(x) for x in torch.randint(256, 2049, (64,), generator=torch.Generator().manual_seed(0))]
    padded = sum(len(g) * max(lengths[i] for i in g) for g in micro_batches(lengths, 65536))
    assert padded < 1.2 * sum(lengths)  # filling each group to the budget pads to ~1.4x


def test_fp8_round_trip_error_bound() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 3 * 128, generator=g) * torch.logspace(-3, 2, 64)[:, None]
    x[:, 7] *= 300  # an outlier channel, as real hidden states have
    x = x.bfloat16()
    q, scales = quantize_fp8(x, 3)
    assert q.dtype == torch.float8_e4m3fn and scales.shape == (64, 3)
    back = dequantize_fp8(q, scales).float()
    # e4m3 keeps 3 mantissa bits (relative rounding <= 2^-4), values under the normal range round to
    # multiples of scale * 2^-9, and the bf16 output adds 2^-8 relative.
    bound = x.float().abs() * (2**-4 + 2**-8) + scales.repeat_interleave(128, dim=1) * 2**-10
    assert bool(((back - x.float()).abs() <= bound * 1.0001).all())
    assert float((back - x.float()).norm() / x.float().norm()) < 0.05


def test_fp8_store_is_within_the_bound_of_bf16(tiny: TargetModel, tmp_path: Path) -> None:
    data = rows_dataset(5)
    run_extract(tiny, data, tmp_path / "bf16")
    run_extract(tiny, data, tmp_path / "fp8", dtype="fp8")
    for a, b in zip(FeatureStore(tmp_path / "bf16"), FeatureStore(tmp_path / "fp8"), strict=True):
        exact, approx = a["features"].float(), b["features"].float()
        assert float((approx - exact).norm() / exact.norm()) < 0.05
    assert bytes_per_token(3, 64, "fp8") == 3 * 64 + 12 + 5 and bytes_per_token(3, 64, "bf16") == 3 * 128 + 5


def test_resume_after_kill_equals_uninterrupted(tiny: TargetModel, tmp_path: Path) -> None:
    data = rows_dataset()
    run_extract(tiny, data, tmp_path / "full", "fp8", budget=40)
    with pytest.raises(KeyboardInterrupt):
        run_extract(tiny, data, tmp_path / "resumed", "fp8", budget=40, kill_after=2)
    assert len(shard_bytes(tmp_path / "resumed")) == 2
    with pytest.raises(ValueError, match="incomplete.*run `dflash-train extract` again"):
        FeatureStore(tmp_path / "resumed")
    (tmp_path / "resumed" / ".features-000002.safetensors.x.tmp").write_bytes(b"partial")
    shards_run: list[int] = []
    run_extract(tiny, data, tmp_path / "resumed", "fp8", budget=40, shards_run=shards_run)
    assert shards_run == [3]  # only the missing shards were computed again
    assert shard_bytes(tmp_path / "resumed") == shard_bytes(tmp_path / "full")
    assert len(shard_bytes(tmp_path / "full")) == 5


@pytest.mark.parametrize("damage", ["[1]", "{\"format\": "])
def test_a_damaged_manifest_is_one_line_and_its_advice_resumes_keeping_the_shards(
        tiny: TargetModel, tmp_path: Path, damage: str) -> None:
    """A manifest that is not a JSON object ended in an AttributeError when the same command ran again; now it is
    named with what to do, and doing it (remove the file, run again) computes only the missing shards."""
    data = rows_dataset()
    run_extract(tiny, data, tmp_path / "full", "fp8", budget=40)
    with pytest.raises(KeyboardInterrupt):
        run_extract(tiny, data, tmp_path / "out", "fp8", budget=40, kill_after=2)
    manifest = tmp_path / "out" / "manifest.json"
    manifest.write_text(damage)
    with pytest.raises(ValueError, match=r"manifest.json is damaged \(.*\); remove it and run the same "
                                         r"`dflash-train extract` command again \(its finished shards are kept\)"):
        run_extract(tiny, data, tmp_path / "out", "fp8", budget=40)
    manifest.unlink()
    shards_run: list[int] = []
    run_extract(tiny, data, tmp_path / "out", "fp8", budget=40, shards_run=shards_run)
    assert shards_run == [3] and shard_bytes(tmp_path / "out") == shard_bytes(tmp_path / "full")


def test_ranks_split_the_shards_by_window(tiny: TargetModel, tmp_path: Path) -> None:
    data = rows_dataset()  # 9 rows: shards of 2 rows 0-4, windows of 2 shards [0, 1], [2, 3], [4]
    config = {"rows_per_shard": 2, "token_budget": 64, "window_shards": 2}  # rows of a window batched together
    extract_with(tiny, data, tmp_path / "full", **config)
    extract_with(tiny, data, tmp_path / "split", rank=1, world=2, **config)
    assert sorted(shard_bytes(tmp_path / "split")) == ["features-000002.safetensors", "features-000003.safetensors"]
    extract_with(tiny, data, tmp_path / "split", rank=0, world=2, **config)
    assert shard_bytes(tmp_path / "split") == shard_bytes(tmp_path / "full")


def test_verify_and_unreadable_shard(tiny: TargetModel, tmp_path: Path) -> None:
    data = rows_dataset()
    run_extract(tiny, data, tmp_path / "s")
    counts = verify_store(tmp_path / "s", data, tiny, recompute=3)
    assert counts == {"shards": 5, "rows": 9, "tokens": sum(len(r) for r in data["input_ids"])}
    with pytest.raises(ValueError, match="features-000000.safetensors: token ids or loss masks differ"):
        verify_store(tmp_path / "s", rows_dataset(seed=1))
    bad = shard_path(tmp_path / "s", 3)
    bad.write_bytes(bad.read_bytes()[:100])
    for check in (lambda: verify_store(tmp_path / "s"), lambda: FeatureStore(tmp_path / "s")[7]):
        with pytest.raises(ValueError, match=rf"{bad}: unreadable feature shard.*extract` again") as error:
            check()
        assert "\n" not in str(error.value)


def test_disk_too_small_is_refused_after_printing_the_size(tiny: TargetModel, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**9, 10**9, 1000))
    with pytest.raises(ValueError, match=r"need 0\.00 GiB but only 0\.00 GiB is free.*fp8"):
        run_extract(tiny, rows_dataset(), tmp_path / "s")
    tokens = sum(len(r) for r in rows_dataset()["input_ids"])
    assert f"{tokens:,} tokens in 5 shards, 389 bytes/token (bf16)" in capsys.readouterr().out
    assert not list((tmp_path / "s").glob("*.safetensors"))


def test_check_compatible(tiny: TargetModel, tmp_path: Path) -> None:
    run_extract(tiny, rows_dataset(3), tmp_path / "s")
    store = FeatureStore(tmp_path / "s")
    store.check_compatible(LAYERS, 64, target_fingerprint(tiny.model))
    with pytest.raises(ValueError, match="features of layers"):
        store.check_compatible([0, 2], 64)
    with pytest.raises(ValueError, match="hidden size"):
        store.check_compatible(LAYERS, 128)
    other = make_tiny_target("qwen3", num_layers=6, seed=1)
    with pytest.raises(ValueError, match="not the loaded target"):
        store.check_compatible(LAYERS, 64, target_fingerprint(other.model))
    store.check_compatible(LAYERS, 64, tokenizer_hash=tokenizer_hash(tiny.tokenizer))
    with pytest.raises(ValueError, match="another vocabulary"):
        store.check_compatible(LAYERS, 64, tokenizer_hash=tokenizer_hash(make_tiny_tokenizer(vocab_size=200)))
    assert store.manifest["target_layer_ids"] == LAYERS and store.manifest["hidden_size"] == 64


def test_extract_cli_end_to_end_and_tokenizer_mismatch(tiny: TargetModel, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    tiny.model.save_pretrained(tmp_path / "model")
    tiny.tokenizer.save_pretrained(tmp_path / "model")
    chats = [{"messages": [{"role": "user", "content": "who are you ?"},
                           {"role": "assistant", "content": "i am a helpful assistant ."}]}] * 3
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(c) + "\n" for c in chats))
    model = str(tmp_path / "model")
    assert main(["prepare", "--target", model, "--data", str(tmp_path / "in.jsonl"), "--out", str(tmp_path / "p"),
                 "--block-size", "2", "--keep-duplicates"]) == 0  # three rows of one chat
    args = ["extract", "--target", model, "--data", str(tmp_path / "p"), "--out", str(tmp_path / "f"),
            "--layer-ids", "0,2,4", "--target-dtype", "fp32", "--device", "cpu"]
    assert main(args) == 0
    assert main(["extract", "--verify", "--out", str(tmp_path / "f"), "--data", str(tmp_path / "p"),
                 "--target", model, "--recompute", "2", "--target-dtype", "fp32", "--device", "cpu"]) == 0
    assert "OK: 1 shards, 3 rows" in capsys.readouterr().out
    other = make_tiny_target("qwen3", num_layers=6)
    other.tokenizer.add_tokens(["zebra"])
    other.model.save_pretrained(tmp_path / "other")
    other.tokenizer.save_pretrained(tmp_path / "other")
    args[2] = str(tmp_path / "other")
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "dflash_data.json" in err and "prepare --target" in err


def test_store_pickles_for_data_loader_workers(tiny: TargetModel, tmp_path: Path) -> None:
    import pickle

    data = rows_dataset(5)
    run_extract(tiny, data, tmp_path / "s")
    store = FeatureStore(tmp_path / "s")
    first = store[4]
    copy = pickle.loads(pickle.dumps(store))
    assert torch.equal(copy[4]["features"], first["features"]) and len(copy) == 5


def extract_with(target: TargetModel, data: datasets.Dataset, out: Path, rank: int = 0, world: int = 1,
                 **config: object) -> dict:
    settings = {"target": "tiny", "target_hash": target_fingerprint(target.model),
                "tokenizer_hash": tokenizer_hash(target.tokenizer)}
    return extract(target, data, out, ExtractConfig(LAYERS, **config), settings, rank, world)  # type: ignore[arg-type]


def test_shards_written_four_at_a_time_equal_one_at_a_time(tiny: TargetModel, tmp_path: Path) -> None:
    data = rows_dataset()
    extract_with(tiny, data, tmp_path / "one", rows_per_shard=2, token_budget=64, write_threads=1)
    extract_with(tiny, data, tmp_path / "four", rows_per_shard=2, token_budget=64, write_threads=4)
    assert len(shard_bytes(tmp_path / "one")) > 4 and shard_bytes(tmp_path / "four") == shard_bytes(tmp_path / "one")


def test_rows_per_shard_follows_the_shard_size_and_a_resume_keeps_the_stores(tiny: TargetModel,
                                                                              tmp_path: Path) -> None:
    assert plan_rows_per_shard([100, 300], per_token=1000, shard_bytes=1 << 20) == 5  # 2^20 / 200,000 bytes
    assert plan_rows_per_shard([10_000], per_token=40_965, shard_bytes=1 << 30) == 2  # Qwen3-8B-wide rows
    assert plan_rows_per_shard([10**7], per_token=10**4, shard_bytes=1) == 1
    data = rows_dataset()
    per_row = sum(row_lengths(data)) / len(data) * bytes_per_token(len(LAYERS), tiny.hidden_size, "bf16")
    manifest = extract_with(tiny, data, tmp_path / "store", shard_bytes=int(3.5 * per_row))
    assert manifest["rows_per_shard"] == 3
    # the same command with another shard size resumes into the store with the store's own shard size
    again = extract_with(tiny, data, tmp_path / "store", shard_bytes=int(10 * per_row))
    assert again["rows_per_shard"] == 3
    assert len(FeatureStore(tmp_path / "store")) == len(data)


def test_shards_micro_batched_together_hold_the_same_rows_as_one_by_one(tiny: TargetModel, tmp_path: Path) -> None:
    data = rows_dataset(n=11, seed=3)
    extract_with(tiny, data, tmp_path / "alone", rows_per_shard=2, token_budget=64, window_shards=1)
    extract_with(tiny, data, tmp_path / "window", rows_per_shard=2, token_budget=64, window_shards=4)
    alone, window = FeatureStore(tmp_path / "alone"), FeatureStore(tmp_path / "window")
    assert len(window) == len(alone) == len(data)
    for i in range(len(data)):
        assert torch.equal(window[i]["input_ids"], alone[i]["input_ids"])
        assert torch.equal(window[i]["loss_mask"], alone[i]["loss_mask"])
        torch.testing.assert_close(window[i]["features"].float(), alone[i]["features"].float(), rtol=1.6e-2, atol=1e-2)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_right_padded_rows_need_no_mask_for_any_architecture(arch: str, tmp_path: Path) -> None:
    """Extraction runs right-padded micro-batches without an attention mask: every real token's features
    equal those of its row run alone, also with biases (qwen2) and a sliding window shorter than the rows."""
    from tests.helpers.tiny_models import make_tiny_target

    target = make_tiny_target(arch, num_layers=6)
    if arch == "mistral":
        target.model.config.sliding_window = 4
    data = rows_dataset(n=7, seed=5)
    run_extract(target, data, tmp_path / "one", budget=1)
    run_extract(target, data, tmp_path / "batched", budget=128)
    one, batched = FeatureStore(tmp_path / "one"), FeatureStore(tmp_path / "batched")
    for i in range(len(data)):
        torch.testing.assert_close(batched[i]["features"].float(), one[i]["features"].float(), rtol=1.6e-2, atol=1e-2)


def test_a_resumed_window_is_computed_whole(tiny: TargetModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Shards 0-1 written, 2-3 missing: the resumed run batches all four shards' rows again (and writes only
    2 and 3), so that every shard comes from the same micro-batches as in an uninterrupted run."""
    import dflash_train.features.extract as extract_module

    data = rows_dataset()  # 9 rows, shards of 2: windows of 4 shards [0-3], [4]
    with pytest.raises(KeyboardInterrupt):
        run_extract(tiny, data, tmp_path / "store", budget=40, kill_after=2)
    written = {k: shard_path(tmp_path / "store", k).stat().st_mtime_ns for k in (0, 1)}
    calls: list[int] = []
    run = extract_module._ShardBuilder.run
    monkeypatch.setattr(extract_module._ShardBuilder, "run", lambda self, shards: calls.append(len(shards)) or run(self, shards))
    run_extract(tiny, data, tmp_path / "store", budget=40)
    assert calls == [4, 1]
    assert {k: shard_path(tmp_path / "store", k).stat().st_mtime_ns for k in (0, 1)} == written  # not rewritten


def test_extract_command_defaults_are_the_library_defaults() -> None:
    """The command parses its flags without importing torch; its defaults must still be ExtractConfig's."""
    import argparse

    from dflash_train.commands.extract import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--out", "x"])
    defaults = ExtractConfig(layer_ids=[0])
    assert (args.token_budget, args.window_shards, args.write_threads) == \
        (defaults.token_budget, defaults.window_shards, defaults.write_threads)
    assert int(args.shard_gb * 1e9) == pytest.approx(defaults.shard_bytes, rel=0.1)


def test_pinning_failure_is_a_one_line_error_naming_the_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    from dflash_train.features.extract import pinned_empty

    def refuse(*args, pin_memory: bool = False, **kwargs):
        raise RuntimeError("CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported")

    monkeypatch.setattr(torch, "empty", refuse)
    with pytest.raises(ValueError, match=r"could not pin 0\.50 GiB .*out of memory\); lower --window-shards") as error:
        pinned_empty(torch.Size([1 << 17, 2048]), torch.bfloat16)
    assert "\n" not in str(error.value)


def test_the_next_window_computes_while_the_last_one_is_written(tiny: TargetModel, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A window has more shards than there are writers: its writes must not hold back the next window's
    forwards (the GPU would idle while the disk works). Each write of window 0 waits until window 1 has
    started computing; if the main thread waited for those writes first, they would time out."""
    import threading

    import dflash_train.features.extract as extract_module

    second_window, waited_out = threading.Event(), []
    run, save = extract_module._ShardBuilder.run, extract_module._save_shard
    starts: list[int] = []

    def spy_run(self, shards):
        starts.append(len(starts))
        if len(starts) == 2:
            second_window.set()
        return run(self, shards)

    def slow_save(path, parts, unit):
        if not second_window.wait(timeout=5):
            waited_out.append(unit)
        save(path, parts, unit)

    monkeypatch.setattr(extract_module._ShardBuilder, "run", spy_run)
    monkeypatch.setattr(extract_module, "_save_shard", slow_save)
    data = datasets.Dataset.from_dict({"input_ids": [[5 + i % 7] * 6 for i in range(16)],
                                       "loss_mask": [[0, 0, 1, 1, 1, 1]] * 16})
    config = ExtractConfig(LAYERS, "bf16", rows_per_shard=2, token_budget=64, window_shards=4, write_threads=2)
    extract(tiny, data, tmp_path / "store", config, {"target": "tiny"})
    assert starts == [0, 1] and waited_out == []
    assert len(FeatureStore(tmp_path / "store")) == 16
