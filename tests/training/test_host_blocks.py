"""Blocks built on the host by the loader: the same step as blocks built from the seeds in the forward, and a
step whose loss never counts its supervised rows on the device (a host sync on a GPU)."""

from __future__ import annotations

import copy
import dataclasses
import pathlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dflash_train.objective.blocks import IGNORE_INDEX
from dflash_train.training.config import load_config
from dflash_train.training.trainer import HOST_ONLY, Trainer, anchor_seed
from tests.helpers.training import overrides

PACKED = {"data.pack_tokens": 160, "data.max_length": 64}
# Ops that make a GPU wait for the host to learn a count or a value: a boolean-mask index or nonzero, .item().
SYNCING_OPS = {"nonzero", "_local_scalar_dense", "masked_select", "index_put_"}


class OpNames(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("layout", [{}, PACKED], ids=["unpacked", "packed"])
def test_loader_blocks_equal_blocks_from_the_step_seeds(assets: dict[str, pathlib.Path], tmp_path: pathlib.Path,
                                                        layout: dict[str, object]) -> None:
    """The loader draws step n's anchors with the seeds the step itself would use: the same blocks, and the
    same loss and gradients as the forward building them from those seeds."""
    trainer = Trainer(load_config(None, overrides(assets, tmp_path / "run", **layout)))
    indices, batch = trainer._load_step(3)[0]
    built = batch["blocks"]
    seeds = [anchor_seed(trainer.config.training.seed, 3, i) for i in indices]
    again = trainer._host_blocks({k: v for k, v in batch.items() if k != "blocks"}, seeds)
    for name in ("anchors", "valid", "input_ids", "positions", "labels", "supervised_rows"):
        assert torch.equal(getattr(built, name), getattr(again, name)), name
    supervised = (built.labels != IGNORE_INDEX).flatten().nonzero().squeeze(1)
    assert torch.equal(built.supervised_rows, supervised)  # the flat indices a boolean mask would pick
    losses, grads = [], []
    for cpu_batch in (batch, {k: v for k, v in batch.items() if k != "blocks"}):
        model = copy.deepcopy(trainer.model)
        trainer_copy = copy.copy(trainer)
        trainer_copy.model = model
        out, _ = trainer_copy._forward(indices, seeds, cpu_batch)
        out.loss.backward()
        losses.append(float(out.loss.detach()))
        grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
    assert losses[0] == losses[1]
    assert all(torch.equal(a, b) for a, b in zip(grads[0], grads[1], strict=True))


def test_the_loss_never_counts_rows_on_the_device(assets: dict[str, pathlib.Path], tmp_path: pathlib.Path) -> None:
    """With the loader's blocks, the objective's forward and loss, with the slot decay and with D-PACE, run no
    op that needs a device-to-host sync; without them (blocks found on demand) the count is one nonzero. Dense
    attention: the op recorder cannot enter flex attention (CUDA's default), whose kernel has no such op."""
    for weighting in ("decay", "dpace"):
        trainer = Trainer(load_config(None, overrides(assets, tmp_path / weighting, **{
            **PACKED, "training.position_weighting": weighting, "training.attention": "dense"})))
        _, cpu_batch = trainer._load_step(0)[0]
        device = trainer.accelerator.device  # moved as the trainer's forward moves it (a GPU run: CUDA)
        batch = {k: v.to(device) for k, v in cpu_batch.items() if k not in HOST_ONLY}
        features, _ = trainer.features(batch, batch["input_ids"].shape[1], cpu_batch["position_ids"])
        blocks = cpu_batch["blocks"].to(device)
        ops = OpNames()
        with ops:
            out = trainer.objective(trainer.model, trainer.target.embed_tokens, trainer.target.lm_head.weight,
                                    batch["input_ids"], batch["loss_mask"], features, blocks=blocks,
                                    context_positions=batch["position_ids"])
        assert not SYNCING_OPS & set(ops.names), (weighting, SYNCING_OPS & set(ops.names))
        assert out.num_supervised == blocks.supervised_rows.numel() > 0
        on_demand = OpNames()
        with on_demand:
            trainer.objective.loss_from_hidden(torch.zeros(*blocks.labels.shape, trainer.draft_config.hidden_size,
                                                           device=device),
                                               trainer.target.lm_head.weight,
                                               dataclasses.replace(blocks, supervised_rows=None))
        assert on_demand.names.count("nonzero") == 1


def test_a_step_copies_its_metrics_to_the_host_once(assets: dict[str, pathlib.Path], tmp_path: pathlib.Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """`train_step` reads its metrics (loss, tokens, FLOPs, slot hits and counts, gradient norm) from one
    device tensor copied to the host once; their values are those of the parts they come from."""
    trainer = Trainer(load_config(None, overrides(assets, tmp_path / "run", **PACKED)))
    forward, losses = trainer._forward, []

    def recording_forward(*args: object, **kwargs: object) -> tuple[object, dict[str, float]]:
        out, stats = forward(*args, **kwargs)
        losses.append((float(out.loss.detach()), out.slot_count.sum().item(), stats))
        return out, stats

    monkeypatch.setattr(trainer, "_forward", recording_forward)
    copies = []
    real_cpu = torch.Tensor.cpu
    monkeypatch.setattr(torch.Tensor, "cpu", lambda self, *a, **k: copies.append(self.shape) or real_cpu(self, *a, **k))
    metrics = trainer.train_step()
    assert len(copies) == 1, copies
    (loss, slots, stats), = losses
    assert metrics["loss"] == pytest.approx(loss, rel=1e-6) and metrics["supervised_slots"] == slots
    assert (metrics["tokens"], metrics["flops"]) == (stats["tokens"], stats["flops"])
    assert metrics["grad_norm"] > 0


def test_compile_target_compiles_the_target_layers_for_online_features(assets: dict[str, pathlib.Path],
                                                                       tmp_path: pathlib.Path) -> None:
    """training.compile_target hands the target's decoder layers to torch.compile (their forward only); off by
    default. The features it then computes are those of the eager target (tests/features/test_capture.py)."""
    plain = Trainer(load_config(None, overrides(assets, tmp_path / "plain", **PACKED)))
    assert not any(hasattr(layer.forward, "_torchdynamo_orig_callable") for layer in plain.target.decoder_layers)
    compiled = Trainer(load_config(None, overrides(assets, tmp_path / "compiled", **{
        **PACKED, "training.compile_target": True})))
    assert all(hasattr(layer.forward, "_torchdynamo_orig_callable") for layer in compiled.target.decoder_layers)


def test_compiled_target_layers_are_compiled_in_the_first_step_only(assets: dict[str, pathlib.Path],
                                                                   tmp_path: pathlib.Path) -> None:
    """Packed rows on the varlen attention with training.compile_target: the chats' boundaries and the rows'
    used length change every step, so the layers get whole rows and the attention runs outside their graph;
    the graphs compiled in the first step serve the next ones (before, every step compiled a new one)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    trainer = Trainer(load_config(None, overrides(assets, tmp_path / "run", **{
        **PACKED, "training.compile_target": True, "training.target_attention": "varlen"})))
    graphs = []
    for _ in range(3):
        trainer.train_step()
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[0] > 0 and graphs == [graphs[0]] * 3, graphs
