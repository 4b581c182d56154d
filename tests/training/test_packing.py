"""Packed training end to end on a tiny target: validation equals the unpacked run's, the split of a
step into accumulation steps does not change it, offline features train like online ones."""

from __future__ import annotations

import dataclasses
import json
import pathlib

import pytest
import torch

from dflash_train.features.graphed import GraphedFeatures
from dflash_train.features.varlen import VARLEN
from dflash_train.training.config import load_config
from dflash_train.training.step_graph import GraphedDrafterStep
from dflash_train.training.tracking import read_metrics
from dflash_train.training.trainer import Trainer, run_training
from tests.helpers.training import overrides, save_tiny_prepared, save_tiny_target, train_losses

PACKED = {"data.pack_tokens": 160, "data.max_length": 64}


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, pathlib.Path]:
    root = tmp_path_factory.mktemp("packing_assets")
    return {"target": save_tiny_target(root / "target"), "data": save_tiny_prepared(root / "data", num_rows=40)}


@pytest.mark.parametrize("variant", [{}, {"training.soft_targets": True}, {"training.anchors": "partition"},
                                     {"training.target_attention": "flex"},
                                     {"training.target_attention": "flex", "training.soft_targets": True},
                                     {"training.target_attention": "varlen"},
                                     {"training.target_attention": "varlen", "training.soft_targets": True},
                                     {"training.loss": "tv", "training.loss_temperature": 0.7,
                                      "training.distill_weight": 0.5}])
def test_packed_validation_equals_unpacked(assets: dict[str, pathlib.Path], tmp_path: pathlib.Path,
                                           variant: dict[str, object]) -> None:
    """Validation draws each chat's anchors from a fixed seed: before any step, the packed run sees the same
    chats with the same anchors as the unpacked one, so the same loss and slot accuracies; with the target's
    attention over packed rows on flex attention too (its block mask keeps each chat to itself), and on varlen
    attention (each chat cut out of its row by its boundaries)."""
    results = {}
    for name, extra in {"unpacked": {}, "packed": PACKED}.items():
        trainer = Trainer(load_config(None, overrides(assets, tmp_path / name, **{
            "data.max_length": 64, "data.validation_fraction": 0.3, **variant, **extra})))
        results[name] = trainer.validate()
        # the attention asked for ran the packed target forward: no fallback to SDPA
        asked = variant.get("training.target_attention")
        if name == "packed" and asked in ("flex", "varlen"):
            assert trainer.features.attention == {"flex": "flex_attention", "varlen": "dflash_varlen"}[asked]
    assert results["packed"]["loss"] == pytest.approx(results["unpacked"]["loss"], rel=1e-5)
    assert results["packed"]["slot_accuracy"] == pytest.approx(results["unpacked"]["slot_accuracy"], abs=1e-5)


def test_a_packed_step_does_not_depend_on_its_split(assets: dict[str, pathlib.Path], tmp_path: pathlib.Path) -> None:
    """Two rows per micro-batch, or one row per micro-batch over two accumulation steps: micro-batches hold
    different numbers of chats, and each weighs by its share of the step's chats, so the losses agree."""
    whole, split = tmp_path / "whole", tmp_path / "split"
    run_training(load_config(None, overrides(assets, whole, **{**PACKED, "training.max_steps": 6})))
    run_training(load_config(None, overrides(assets, split, **{
        **PACKED, "training.max_steps": 6, "training.batch_size": 1, "training.gradient_accumulation_steps": 2})))
    one, two = train_losses(whole), train_losses(split)
    assert sorted(one) == list(range(1, 7))
    for step, loss in one.items():
        assert two[step] == pytest.approx(loss, rel=1e-5), step
    records = read_metrics(whole / "metrics.jsonl")["train"]
    assert all(0 < r["pack_token_fill"] <= 1 and 0 < r["pack_anchor_fill"] <= 1 for r in records)
    state = json.loads((whole / "checkpoints" / "step-00000006" / "trainer_state.json").read_text())
    assert 6 * 2 < state["sequences_seen"] <= 6 * 2 * 160 // 40  # chats, more than one per row
    # every logged step counts the chats so far, the same whatever the split, up to the checkpoint's count
    seen = [r["chats_seen"] for r in records]
    assert seen == [r["chats_seen"] for r in read_metrics(split / "metrics.jsonl")["train"]]
    assert all(b - a >= 2 for a, b in zip([0, *seen], seen, strict=False)) and seen[-1] == state["sequences_seen"]


def test_packed_offline_features_train_like_online(assets: dict[str, pathlib.Path], tmp_path: pathlib.Path) -> None:
    from dflash_train.cli import main as cli

    store = tmp_path / "features"
    assert cli(["extract", "--out", str(store), "--data", str(assets["data"]), "--target", str(assets["target"]),
                "--layer-ids", "1,3", "--target-dtype", "bf16", "--device", "cpu", "--rows-per-shard", "9"]) == 0
    online, offline = tmp_path / "online", tmp_path / "offline"
    extra = {**PACKED, "training.max_steps": 4, "model.target_layer_ids": "[1, 3]", "model.target_dtype": "bfloat16"}
    run_training(load_config(None, overrides(assets, online, **extra)))
    offline_args = [o for o in overrides(assets, offline, **extra) if not o.startswith("data.prepared=")]
    run_training(load_config(None, [*offline_args, f"data.features={store}"]))
    # Online, a chat's bf16 features come from its packed row; offline from its own row: rounding apart.
    expected = train_losses(online)
    assert train_losses(offline) == pytest.approx(expected, rel=2e-3)


def test_anchor_capacity_below_the_largest_chat_is_refused(assets: dict[str, pathlib.Path], tmp_path: pathlib.Path) -> None:
    with pytest.raises(ValueError, match="anchors_per_row=4 is below the 8 anchors of the largest chat"):
        Trainer(load_config(None, overrides(assets, tmp_path / "run", **{**PACKED, "training.anchors_per_row": 4})))


def test_a_failing_flex_target_falls_back_to_sdpa(assets: dict[str, pathlib.Path], tmp_path: pathlib.Path,
                                                  monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """An attention Hugging Face cannot run for the target: one line says so, and packed rows go through SDPA
    from then on, with the same validation as a run that asked for SDPA."""
    settings = {**PACKED, "data.validation_fraction": 0.3}
    expected = Trainer(load_config(None, overrides(assets, tmp_path / "sdpa", **{
        **settings, "training.target_attention": "sdpa"}))).validate()
    monkeypatch.setattr("dflash_train.features.packed_attention.FLEX", "no_such_attention")
    trainer = Trainer(load_config(None, overrides(assets, tmp_path / "flex", **{
        **settings, "training.target_attention": "flex"})))
    assert trainer.features.attention == "no_such_attention"
    result = trainer.validate()
    assert trainer.features.attention is None and result["loss"] == pytest.approx(expected["loss"], rel=1e-6)
    out = capsys.readouterr().out
    assert out.count("no_such_attention attention failed for the target") == 1
    assert "training.target_attention=sdpa" in out


def test_the_graphed_target_pass_trains_like_the_uncaptured_one(
        assets: dict[str, pathlib.Path], tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    """training.target_cuda_graphs off CUDA: a note, and the target runs uncaptured. The trainer with the graphs'
    CPU stand-in (the same buffers replayed) takes the same steps as without them."""
    varlen = {**PACKED, "training.target_attention": "varlen", "training.target_cuda_graphs": True}
    plain = Trainer(load_config(None, overrides(assets, tmp_path / "plain", **varlen)))
    assert plain.features.graphs is None and "the target runs uncaptured" in capsys.readouterr().out
    graphed = Trainer(load_config(None, overrides(assets, tmp_path / "graphed", **varlen)))
    t = graphed.config.training
    graphed.features.graphs = GraphedFeatures(
        lambda ids, positions: graphed.features.target_pass(ids, positions, VARLEN), t.batch_size,
        graphed.config.data.pack_tokens, torch.device("cpu"), eager=True)
    losses = [(plain.train_step()["loss"], graphed.train_step()["loss"]) for _ in range(3)]
    assert graphed.features.graphs is not None and graphed.features.graphs.graphs  # replayed, never turned off
    for uncaptured, replayed in losses:
        assert replayed == pytest.approx(uncaptured, rel=1e-6)


class _FailsInBackward(torch.autograd.Function):
    """The loss as it is, whose backward raises: a compiler that builds the forward's kernel but not the
    backward's (what inductor's flex lowering does with 64-token kernel tiles on some releases)."""

    @staticmethod
    def forward(ctx: object, loss: torch.Tensor) -> torch.Tensor:
        return loss.clone()

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("LoweringException: NoValidChoicesError in flex_attention_backward\nfull graph dump follows")


@pytest.mark.parametrize("where", ["forward", "backward"])
@pytest.mark.parametrize("graphed", [False, True])
def test_small_flex_tiles_that_fail_fall_back_to_the_default(
        assets: dict[str, pathlib.Path], tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch, where: str, graphed: bool) -> None:
    """A compiler that cannot build the 64-token tiles' kernel, for the forward or only for the backward, costs
    the run its speed-up, not the run: one message, the default tiles from then on, and the same steps as a run
    that asked for them. With the drafter's step captured (the graphs' CPU stand-in), the graphs stay on."""
    default = Trainer(load_config(None, overrides(assets, tmp_path / "default", **PACKED)))
    small = Trainer(load_config(None, overrides(assets, tmp_path / "small", **PACKED, **{"training.flex_tile": 64})))
    if graphed:
        params = [p for p in small.model.parameters() if p.requires_grad]
        small.step_graph = GraphedDrafterStep(
            lambda inputs: small._drafter_loss(inputs.batch, inputs.features, inputs.blocks, inputs.teacher),
            params, small.accelerator.device, eager=True)
    call = type(small.objective).__call__

    def fails_at_64(objective: object, *args: object, **kwargs: object) -> object:
        out = call(objective, *args, **kwargs)
        if objective.flex_tile != 64:  # type: ignore[attr-defined]
            return out
        if where == "forward":
            raise RuntimeError("LoweringException: no kernel for these tiles\nfull graph dump follows")
        return dataclasses.replace(out, loss=_FailsInBackward.apply(out.loss))

    monkeypatch.setattr(type(small.objective), "__call__", fails_at_64)
    losses = [(default.train_step()["loss"], small.train_step()["loss"]) for _ in range(2)]
    assert small.objective.flex_tile == 128
    assert (small.step_graph is not None and len(small.step_graph.graphs) > 0) == graphed
    for expected, fell_back in losses:
        assert fell_back == pytest.approx(expected, rel=1e-6)
    out = capsys.readouterr().out
    assert out.count("training.flex_tile=64 failed in the drafter (RuntimeError: LoweringException") == 1
    assert "128-token tiles from now on" in out
    assert "CUDA graphs of the drafter's step failed" not in out


def test_small_flex_tiles_that_build_are_kept(assets: dict[str, pathlib.Path], tmp_path: pathlib.Path) -> None:
    """Once the small tiles have been through a forward and a backward, a later failure is not theirs: it is
    raised, not taken for a tile failure."""
    small = Trainer(load_config(None, overrides(assets, tmp_path / "small", **PACKED, **{"training.flex_tile": 64})))
    small.train_step()
    assert small.flex_tile_built and small.objective.flex_tile == 64
    call = type(small.objective).__call__

    def fails(objective: object, *args: object, **kwargs: object) -> object:
        raise RuntimeError("out of memory")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(type(small.objective), "__call__", fails)
        with pytest.raises(RuntimeError, match="out of memory"):
            small.train_step()
    assert small.objective.flex_tile == 64 and call is type(small.objective).__call__


def test_a_resume_packed_otherwise_says_so(assets: dict[str, pathlib.Path], tmp_path: pathlib.Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    """The checkpoint keeps how its rows were packed; a run resumed with the same packing resumes quietly, one
    with other anchor slots a row (or from a checkpoint that does not say) says in one line that its steps now
    hold other chats."""
    out = tmp_path / "run"
    first = Trainer(load_config(None, overrides(assets, out, **PACKED)))
    first.train_step()
    saved = first.save_checkpoint()
    state = json.loads((saved / "trainer_state.json").read_text())
    per_row = first.packed.anchors_per_row  # type: ignore[union-attr]
    assert state["packing"]["anchors_per_row"] == per_row and "balanced" in state["packing"]["rule"]
    capsys.readouterr()
    Trainer(load_config(None, overrides(assets, out, **PACKED))).maybe_resume()
    assert "packed otherwise" not in capsys.readouterr().out
    Trainer(load_config(None, overrides(assets, out, **PACKED, **{
        "training.anchors_per_row": per_row + 16}))).maybe_resume()
    line = [x for x in capsys.readouterr().out.splitlines() if "packed otherwise" in x]
    assert len(line) == 1 and f"'anchors_per_row': {per_row + 16}" in line[0]
    del state["packing"]  # a checkpoint from before the record
    (saved / "trainer_state.json").write_text(json.dumps(state))
    Trainer(load_config(None, overrides(assets, out, **PACKED))).maybe_resume()
    assert "packed otherwise (not recorded;" in capsys.readouterr().out
