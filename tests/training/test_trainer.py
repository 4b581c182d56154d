"""The training loop end to end on a tiny target: it learns, checkpoints, resumes exactly after a
SIGKILL, refuses foreign checkpoints, fine-tunes from a drafter, and matches across processes."""

from __future__ import annotations

import json
import os
import pathlib
import random
import signal
import sys
import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from dflash_train.checkpoint.io import load_draft
from dflash_train.target.model import find_decoder_layers
from dflash_train.training.config import load_config
from dflash_train.training.flops import target_pass_cost
from dflash_train.training.tracking import read_metrics
from dflash_train.training.trainer import run_training
from tests.helpers.paths import REPO
from tests.helpers.training import (
    failure_report,
    launch,
    overrides,
    save_tiny_target,
    train_losses,
    train_on_two_cpu_processes,
)


def test_run_learns_and_writes_checkpoints(assets: dict[str, pathlib.Path], tmp_path: pathlib.Path) -> None:
    out = tmp_path / "run"
    result = run_training(load_config(None, overrides(assets, out, **{"training.max_steps": 40})))
    losses = train_losses(out)
    assert result.steps == 40 and sorted(losses) == list(range(1, 41))
    assert sum(losses[s] for s in range(36, 41)) < 0.8 * sum(losses[s] for s in range(1, 6)), losses
    kept = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert kept == ["step-00000039", "step-00000040"]  # keep_last=2, no leftover *.tmp
    assert (out / "training_curves.png").stat().st_size > 10_000
    assert read_metrics(out / "metrics.jsonl")["validation"][-1]["step"] == 40
    draft = load_draft(out / "checkpoints" / "step-00000040" / "draft")
    assert draft.config.block_size == 4 and len(draft.layers) == 2
    state = json.loads((out / "checkpoints" / "step-00000040" / "trainer_state.json").read_text())
    assert state["step"] == 40 and state["block_size"] == 4


def test_sigkill_and_resume_reproduce_the_uninterrupted_run(assets: dict[str, pathlib.Path], tmp_path: pathlib.Path) -> None:
    steps = 30
    reference = tmp_path / "reference"
    run_training(load_config(None, overrides(assets, reference, **{"training.max_steps": steps})))
    expected = train_losses(reference)

    killed = tmp_path / "killed"
    args = [sys.executable, "-m", "dflash_train.train", "--config", str(REPO / "recipes/smollm2-135m-dflash-b16-cpu.yaml"),
            *overrides(assets, killed, **{"training.max_steps": steps})]
    kill_at = random.Random(os.getpid()).randint(5, 20)  # of 35 metrics lines
    proc = launch(args)
    metrics = killed / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        if metrics.is_file() and len(metrics.read_text().splitlines()) >= kill_at:
            proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.01)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, proc.stdout.read().decode()[-2000:]
    resumed = launch(args)
    output = resumed.communicate(timeout=300)[0].decode()
    assert resumed.returncode == 0, failure_report(output)
    assert "resumed from" in output
    got = train_losses(killed)
    assert sorted(got) == list(range(1, steps + 1))
    for step in range(1, steps + 1):
        assert got[step] == pytest.approx(expected[step], rel=1e-6, abs=1e-6), (step, kill_at)


def test_foreign_checkpoint_is_refused(assets: dict[str, pathlib.Path], tmp_path: pathlib.Path) -> None:
    out = tmp_path / "run"
    run_training(load_config(None, overrides(assets, out, **{"training.max_steps": 3})))
    config = load_config(None, overrides(assets, out, **{"training.max_steps": 6, "model.block_size": 8}))
    with pytest.raises(ValueError, match="block_size: checkpoint has 4, this run has 8"):
        run_training(config)


def test_a_deepspeed_checkpoint_is_refused_without_deepspeed(assets: dict[str, pathlib.Path],
                                                             tmp_path: pathlib.Path) -> None:
    out = tmp_path / "run"
    run_training(load_config(None, overrides(assets, out, **{"training.max_steps": 3})))
    marker = out / "checkpoints" / "step-00000003" / "trainer_state.json"
    state = json.loads(marker.read_text())
    assert state["distributed_type"] == "NO" and state["num_processes"] == 1
    marker.write_text(json.dumps({**state, "distributed_type": "DEEPSPEED", "num_processes": 8}))
    config = load_config(None, overrides(assets, out, **{"training.max_steps": 6}))
    with pytest.raises(ValueError, match=r"written under DeepSpeed on 8 processes and this run uses NO: .*"
                                         r"model.init_from=.*step-00000003/draft"):
        run_training(config)


def test_an_fsdp_launch_on_cpu_processes_is_refused(assets: dict[str, pathlib.Path], tmp_path: pathlib.Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    # What `accelerate launch` with an FSDP config sets; on CPU processes accelerate would run DDP instead.
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    config = load_config(None, overrides(assets, tmp_path / "run", **{"training.max_steps": 1}))
    with pytest.raises(ValueError, match="FSDP needs CUDA devices.*cpu_2proc.yaml"):
        run_training(config)
    assert not (tmp_path / "run").exists()


def test_init_from_an_existing_drafter(assets: dict[str, pathlib.Path], tmp_path: pathlib.Path) -> None:
    first = tmp_path / "first"
    run_training(load_config(None, overrides(assets, first, **{"training.max_steps": 6})))
    source = first / "checkpoints" / "step-00000006" / "draft"
    tuned = tmp_path / "tuned"
    config = load_config(None, overrides(assets, tuned, **{
        "training.max_steps": 2, "model.init_from": source, "model.freeze": '["layers."]'}))
    run_training(config)
    before, after = load_draft(source), load_draft(tuned / "checkpoints" / "step-00000002" / "draft")
    for name, tensor in before.state_dict().items():
        if name.startswith("layers."):
            assert torch.equal(tensor, after.state_dict()[name]), name  # frozen
    assert not torch.equal(before.fc.weight, after.fc.weight)
    wrong = load_config(None, overrides(assets, tmp_path / "wrong", **{"model.init_from": source, "model.block_size": 8}))
    with pytest.raises(ValueError, match="block size 4 != model.block_size 8"):
        run_training(wrong)


def test_two_processes_match_one_with_the_same_global_batch(assets: dict[str, pathlib.Path], tmp_path: pathlib.Path) -> None:
    """`accelerate launch` with 2 CPU processes (gloo, batch 1 each) == 1 process with batch 2, validating one
    sample: the rank without one still joins every collective forward (it used to wait in the reduce while the
    other waited in DDP's forward, for ever)."""
    single, double = tmp_path / "single", tmp_path / "double"
    settings = {"training.max_steps": 6, "training.eval_every": 2, "data.validation_max_samples": 1}
    run_training(load_config(None, overrides(assets, single, **settings)))
    train_on_two_cpu_processes(overrides(assets, double, **settings, **{"training.batch_size": 1}), port_base=29500)
    one, two = read_metrics(single / "metrics.jsonl"), read_metrics(double / "metrics.jsonl")
    assert [r["step"] for r in two["validation"]] == [2, 4, 6]
    for split in ("train", "validation"):
        assert [r["step"] for r in one[split]] == [r["step"] for r in two[split]]
        for a, b in zip(one[split], two[split], strict=True):
            assert b["loss"] == pytest.approx(a["loss"], rel=1e-5), (split, a["step"])
            assert b["slot_accuracy"] == a["slot_accuracy"]
    # chats so far count every rank's: two sequences a step either way
    assert [r["chats_seen"] for r in two["train"]] == [r["chats_seen"] for r in one["train"]] == [2 * r["step"] for r in one["train"]]


def test_wandb_offline_run_records_config_and_commit(assets: dict[str, pathlib.Path], tmp_path: pathlib.Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc login: auto mode must pick offline
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "run"
    run_training(load_config(None, overrides(assets, out, **{
        "training.max_steps": 2, "tracking.report_to": "wandb", "tracking.run_name": "tiny"})))
    runs = list((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, list((out / "wandb").iterdir())
    record = next(runs[0].glob("run-*.wandb")).read_bytes()  # offline runs keep config and history here
    for expected in (b"num_anchors", b"git_commit", b"train/loss", b"validation/expected_acceptance_length"):
        assert expected in record, expected


@pytest.mark.parametrize("pad_to", [1, 96])
def test_offline_features_train_exactly_like_online(assets: dict[str, pathlib.Path], tmp_path: pathlib.Path,
                                                    pad_to: int) -> None:
    """`dflash-train extract` then training on the store == training with features computed online, also
    when batches are padded to one shape (online, the target then runs on the real length only)."""
    from dflash_train.cli import main as cli

    store = tmp_path / "features"
    assert cli(["extract", "--out", str(store), "--data", str(assets["data"]), "--target", str(assets["target"]),
                "--layer-ids", "1,3", "--target-dtype", "bf16", "--device", "cpu", "--rows-per-shard", "7"]) == 0
    online, offline = tmp_path / "online", tmp_path / "offline"
    extra = {"training.max_steps": 5, "model.target_layer_ids": "[1, 3]", "model.target_dtype": "bfloat16",
             "data.pad_to_multiple": pad_to, "data.max_length": 96}
    run_training(load_config(None, overrides(assets, online, **extra)))
    offline_args = [o for o in overrides(assets, offline, **extra) if not o.startswith("data.prepared=")]
    run_training(load_config(None, [*offline_args, f"data.features={store}"]))
    # Real-token features are the same bf16 values; padded rows differ (zeros offline) but are masked,
    # which leaves at most float rounding in the loss.
    expected = train_losses(online)
    assert train_losses(offline) == pytest.approx(expected, rel=1e-6)
    # The step's FLOPs: offline, the drafter's alone; online, the target's pass through layers 0..3 added.
    steps_online, steps_offline = (read_metrics(run / "metrics.jsonl")["train"] for run in (online, offline))
    assert all(r["step_flops"] == r["flops"] for r in steps_offline)
    target = AutoModelForCausalLM.from_pretrained(assets["target"])
    cost = target_pass_cost(target.config, find_decoder_layers(target), 4, reads_distribution=False)
    for record in steps_online:
        added = record["step_flops"] - record["flops"]
        attention_most = sum(p for p, _ in cost.pair_costs) * 96 * record["tokens"]  # no chat past max_length
        assert cost.per_token * record["tokens"] < added <= cost.per_token * record["tokens"] + attention_most


def test_init_from_for_a_new_target_relearns_the_context_fusion(assets: dict[str, pathlib.Path], tmp_path: pathlib.Path) -> None:
    first = tmp_path / "first"
    run_training(load_config(None, overrides(assets, first, **{"training.max_steps": 3})))
    source = first / "checkpoints" / "step-00000003" / "draft"
    other_target = save_tiny_target(tmp_path / "other", num_layers=4, seed=5)  # 4 layers: ids [1, 3] don't fit
    base = {"model.target": other_target, "model.init_from": source, "training.max_steps": 1}
    with pytest.raises(ValueError, match=r"layer id 3 is the last layer of a 4-layer target.*use ids in 0\.\.2"):
        run_training(load_config(None, overrides(assets, tmp_path / "a", **base)))
    tuned = tmp_path / "b"
    run_training(load_config(None, overrides(assets, tuned, **{
        **base, "model.target_layer_ids": "[0, 2]", "model.reinit": '["fc.", "hidden_norm."]',
        "model.freeze": '["layers.", "norm."]', "training.learning_rate": 1e-9})))
    after = load_draft(tuned / "checkpoints" / "step-00000001" / "draft")
    before = load_draft(source)
    assert after.config.target_layer_ids == [0, 2] and after.config.num_target_layers == 4
    assert torch.equal(after.layers[0].mlp.up_proj.weight, before.layers[0].mlp.up_proj.weight)
    assert not torch.allclose(after.fc.weight.float(), before.fc.weight.float(), atol=1e-3)
    assert abs(float(after.fc.weight.float().std()) - 0.02) < 0.005  # freshly initialised, barely trained
    with pytest.raises(ValueError, match="reads 2 layers; give 2 ids"):
        run_training(load_config(None, overrides(assets, tmp_path / "c", **{**base, "model.target_layer_ids": "[0, 1, 2]"})))


def test_padding_to_a_fixed_shape_leaves_the_run_unchanged(assets: dict[str, pathlib.Path], tmp_path: pathlib.Path) -> None:
    runs = {}
    for multiple in (1, 64):
        out = tmp_path / f"pad{multiple}"
        run_training(load_config(None, overrides(assets, out, **{"training.max_steps": 6,
                                                                 "data.pad_to_multiple": multiple})))
        runs[multiple] = (train_losses(out), read_metrics(out / "metrics.jsonl")["validation"][-1]["loss"])
    for step, loss in runs[1][0].items():
        assert runs[64][0][step] == pytest.approx(loss, rel=1e-5, abs=1e-6), step
    assert runs[64][1] == pytest.approx(runs[1][1], rel=1e-5, abs=1e-6)


def test_compiled_flex_attention_sees_one_padded_shape() -> None:
    """On CUDA with flex attention every batch is padded to max_length (a new length per batch would
    recompile flex attention every step); elsewhere to the longest sample, unless set explicitly."""
    from dflash_train.training.data import collate
    from dflash_train.training.trainer import padding_multiple

    config = load_config(None, ["data.prepared=x", "data.max_length=96", "training.attention=auto"])
    assert padding_multiple(config, torch.device("cuda")) == 96
    assert padding_multiple(config, torch.device("cpu")) == 1
    dense = load_config(None, ["data.prepared=x", "data.max_length=96", "training.attention=dense"])
    assert padding_multiple(dense, torch.device("cuda")) == 1
    explicit = load_config(None, ["data.prepared=x", "data.max_length=96", "data.pad_to_multiple=32"])
    assert padding_multiple(explicit, torch.device("cuda")) == 32
    samples = [{"input_ids": torch.arange(n), "loss_mask": torch.ones(n, dtype=torch.bool)} for n in (5, 40, 71)]
    shapes = {collate(samples[i : i + 1], 96)["input_ids"].shape for i in range(3)}
    assert shapes == {torch.Size([1, 96])}
    assert collate(samples, 32)["input_ids"].shape == (3, 96) and collate(samples)["input_ids"].shape == (3, 71)


def test_soft_targets_train_online_and_are_refused_offline(assets: dict[str, pathlib.Path], tmp_path: pathlib.Path) -> None:
    hard, soft = tmp_path / "hard", tmp_path / "soft"
    run_training(load_config(None, overrides(assets, hard, **{"training.max_steps": 12})))
    run_training(load_config(None, overrides(assets, soft, **{"training.max_steps": 12,
                                                              "training.soft_targets": True})))
    hard_losses, soft_losses = train_losses(hard), train_losses(soft)
    assert hard_losses.keys() == soft_losses.keys() and hard_losses != soft_losses
    assert sum(soft_losses[s] for s in (10, 11, 12)) < sum(soft_losses[s] for s in (1, 2, 3))  # it learns
    with pytest.raises(ValueError, match="soft_targets needs the target's final states, computed online"):
        load_config(None, ["data.features=store", "training.soft_targets=true"])


def test_the_cold_first_step_is_kept_in_every_checkpoint(assets: dict[str, pathlib.Path], tmp_path: pathlib.Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """trainer_state.json records the run's first step (0 -> 1) as measured by the loop's own clock, and a
    resumed run carries it on: its own first step is warm and not the run's cold start."""
    import dflash_train.training.trainer as trainer_module

    clock = iter(range(0, 10_000, 7))  # every step takes 7 "seconds" by this clock
    monkeypatch.setattr(trainer_module.time, "perf_counter", lambda: float(next(clock)))
    out = tmp_path / "run"
    run_training(load_config(None, overrides(assets, out, **{"training.max_steps": 2, "training.eval_every": 0})))
    state = json.loads((out / "checkpoints" / "step-00000002" / "trainer_state.json").read_text())
    assert state["first_step_seconds"] == 7.0
    clock = iter(range(0, 10_000, 3))
    run_training(load_config(None, overrides(assets, out, **{"training.max_steps": 4, "training.eval_every": 0})))
    state = json.loads((out / "checkpoints" / "step-00000004" / "trainer_state.json").read_text())
    assert state["first_step_seconds"] == 7.0 and state["step"] == 4
