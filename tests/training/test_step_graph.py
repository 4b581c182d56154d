"""The drafter's step replayed from graphs (`training/step_graph.py`), on the CPU stand-in that replays by
running the step again on the same buffers: every step's inputs reach the graph through its buffers, padded to
fixed shapes, and leave the loss, metrics and gradients of the plain step; the trainer's steps on it equal its
plain steps. The capture itself runs on CUDA only (tests/training/test_step_graph_gpu.py)."""

from __future__ import annotations

import pathlib
from collections.abc import Callable

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dflash_train.features.capture import packed_features_and_final_states
from dflash_train.features.packed_rows import chat_layout, collate_packed
from dflash_train.objective import DFlashObjective
from dflash_train.objective.distill import Distillation
from dflash_train.objective.masks import packed_flex_mask
from dflash_train.objective.objective import ObjectiveOutput
from dflash_train.target import TargetModel
from dflash_train.training.config import load_config
from dflash_train.training.step_graph import GraphedDrafterStep, StepInputs
from dflash_train.training.trainer import Trainer
from tests.helpers.packing import LAYERS, PACK, chats, drafter
from tests.helpers.tiny_models import make_tiny_target
from tests.helpers.training import on_two_cpu_processes, overrides

PACKED = {"data.pack_tokens": 160, "data.max_length": 64}


@pytest.fixture(scope="module")
def target() -> TargetModel:
    return make_tiny_target("qwen3", num_layers=5)


def step_inputs(target: TargetModel, objective: DFlashObjective, seed: int) -> StepInputs:
    rows = chats(seed, len(LAYERS) * target.hidden_size)
    batch = collate_packed(rows, PACK, len(rows))
    features, teacher = packed_features_and_final_states(target, batch["input_ids"], batch["position_ids"], LAYERS)
    layout = chat_layout(batch)
    blocks = objective.seeded_blocks(batch, layout, [31 * seed + i for i in range(len(layout))])
    read = {k: batch[k] for k in ("input_ids", "loss_mask", "position_ids")}
    return StepInputs(read, features, teacher, blocks, torch.tensor(0.5), layout)


def test_replayed_steps_give_the_plain_steps_loss_metrics_and_gradients(target: TargetModel) -> None:
    """Three batches of other chats through one graph: each replay reads the new batch from the buffers and
    writes its gradients into the same `.grad` tensors, zeroed first (no accumulation across steps)."""
    objective = DFlashObjective(block_size=4, mask_token_id=4, num_anchors=6, mask_kind="dense", anchors_per_row=16,
                                position_weighting="dpace", distillation=Distillation("kl", 1.0, 1.0))
    graphed_draft, plain_draft = drafter(target), drafter(target)

    def loss_of(draft: torch.nn.Module, inputs: StepInputs) -> object:
        return objective(draft, target.embed_tokens, target.lm_head.weight, inputs.batch["input_ids"],
                         inputs.batch["loss_mask"], inputs.features, blocks=inputs.blocks,
                         teacher_states=inputs.teacher, context_positions=inputs.batch["position_ids"])

    params = list(graphed_draft.parameters())
    step = GraphedDrafterStep(lambda inputs: loss_of(graphed_draft, inputs), params, torch.device("cpu"), eager=True)
    grads = None
    for seed in range(3):
        inputs = step_inputs(target, objective, seed)
        out = step(inputs)
        plain_draft.zero_grad(set_to_none=True)
        plain = loss_of(plain_draft, inputs)
        (plain.loss * 0.5).backward()
        torch.testing.assert_close(out.loss, plain.loss.detach() * 0.5, rtol=1e-6, atol=1e-7)
        assert out.num_supervised == plain.num_supervised
        assert torch.equal(out.slot_correct, plain.slot_correct) and torch.equal(out.slot_count, plain.slot_count)
        for (name, param), graphed in zip(plain_draft.named_parameters(), params, strict=True):
            torch.testing.assert_close(graphed.grad, param.grad, rtol=1e-5, atol=1e-8, msg=name)
        grads = grads or [param.grad for param in params]
        assert all(g is param.grad for g, param in zip(grads, params, strict=True))
    assert len(step.graphs) < 3  # the batches share buckets: a graph is replayed, not captured per step


def test_a_replay_that_differs_from_the_uncaptured_step_stops_the_graphs(target: TargetModel) -> None:
    """The first replay of a new graph is checked: a step whose replay gives another loss is refused."""
    objective = DFlashObjective(block_size=4, mask_token_id=4, num_anchors=6, loss_decay_gamma=3.0, mask_kind="dense",
                                anchors_per_row=16)
    draft, calls = drafter(target), []

    def drifting(inputs: StepInputs) -> object:
        calls.append(1)
        out = objective(draft, target.embed_tokens, target.lm_head.weight, inputs.batch["input_ids"],
                        inputs.batch["loss_mask"], inputs.features, blocks=inputs.blocks,
                        context_positions=inputs.batch["position_ids"])
        out.loss = out.loss * (1.0 + 0.1 * len(calls))  # each run another loss, as a stale capture would give
        return out

    step = GraphedDrafterStep(drifting, list(draft.parameters()), torch.device("cpu"), eager=True)
    with pytest.raises(RuntimeError, match="differ from the uncaptured step"):
        step(step_inputs(target, objective, 0))


def stand_in_graphs(trainer: Trainer) -> GraphedDrafterStep:
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    return GraphedDrafterStep(
        lambda inputs: trainer._drafter_loss(inputs.batch, inputs.features, inputs.blocks, inputs.teacher),
        params, trainer.accelerator.device, eager=True)


def plain_and_graphed(assets: dict[str, pathlib.Path], tmp_path: pathlib.Path, steps: int, settings: dict[str, object],
                      graphs: Callable[[Trainer], GraphedDrafterStep] = stand_in_graphs) -> list[tuple[object, ...]]:
    """(losses, final weights, trainer) of `steps` plain steps, then of as many on `graphs`."""
    runs = []
    for name in ("plain", "graphed"):
        trainer = Trainer(load_config(None, overrides(assets, tmp_path / name, **settings)))
        if name == "graphed":
            trainer.step_graph = graphs(trainer)
        losses = [trainer.train_step()["loss"] for _ in range(steps)]
        runs.append((losses, {k: v.clone() for k, v in trainer.model.state_dict().items()}, trainer))
    return runs


def assert_same_training(runs: list[tuple[object, ...]]) -> None:
    (plain_losses, plain_weights, _), (losses, weights, _) = runs
    assert losses == pytest.approx(plain_losses, rel=1e-5)
    for name, value in plain_weights.items():
        torch.testing.assert_close(weights[name], value, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("accumulation", [1, 2])
def test_the_trainer_on_replayed_steps_trains_as_on_plain_ones(assets: dict[str, pathlib.Path],
                                                               tmp_path: pathlib.Path, accumulation: int) -> None:
    """Optimizer steps of the packed trainer with its drafter's step on the stand-in graphs (blocks padded by the
    loader, gradients never set to None; with accumulation, a graph that adds to them after the first
    micro-batch) equal plain steps: losses and the drafter's weights."""
    runs = plain_and_graphed(assets, tmp_path, 4 // accumulation,
                             {**PACKED, "training.gradient_accumulation_steps": accumulation})
    graphed = runs[1][2]
    assert graphed.step_graph is not None and graphed.step_graph.graphs
    # every resolved step logs the shapes captured so far, which the run's summary reports
    assert graphed.train_step()["step_graphs"] == len(graphed.step_graph.graphs)
    assert "step_graphs" not in runs[0][2].train_step()
    assert sorted({key[-1] for key in graphed.step_graph.graphs}) == ([False, True] if accumulation > 1 else [False])
    assert_same_training(runs)


def test_a_graphed_step_leaves_the_gradient_of_the_plain_step(assets: dict[str, pathlib.Path],
                                                              tmp_path: pathlib.Path) -> None:
    """The gradient itself, which the optimizers barely see the scale of (Muon orthogonalises, AdamW divides by
    its own running scale): over two micro-batches, the graphs' equals accelerate's backward's, which divides
    the loss by the accumulation steps."""
    grads = []
    for name in ("plain", "graphed"):
        trainer = Trainer(load_config(None, overrides(assets, tmp_path / name, **PACKED,
                                                      **{"training.gradient_accumulation_steps": 2})))
        if name == "graphed":
            trainer.step_graph = stand_in_graphs(trainer)
        for micro, (indices, cpu_batch) in enumerate(trainer._load_step(0)):
            with trainer.accelerator.accumulate(trainer.model):
                trainer._micro_step(indices, [], cpu_batch, accumulate=micro > 0)
        grads.append({n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and grads[0]
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, rtol=1e-5, atol=1e-8, msg=name)


def test_a_graph_failing_after_the_first_micro_batch_keeps_its_gradient(assets: dict[str, pathlib.Path],
                                                                        tmp_path: pathlib.Path) -> None:
    """The graph that adds to the gradients fails its check: the graphs are off from there, the gradients the
    first micro-batch wrote are restored, and the step ends uncaptured with the plain step's result."""
    class FailsWhenAdding(GraphedDrafterStep):
        accumulating = False

        def __call__(self, inputs: StepInputs, accumulate: bool = False) -> ObjectiveOutput:
            self.accumulating = accumulate
            return super().__call__(inputs, accumulate)

        def _check(self, *args: object) -> None:
            if self.accumulating:
                raise RuntimeError("a replayed graph's loss or gradients differ from the uncaptured step")
            super()._check(*args)  # type: ignore[arg-type]

    def failing_on_accumulation(trainer: Trainer) -> GraphedDrafterStep:
        params = [p for p in trainer.model.parameters() if p.requires_grad]
        return FailsWhenAdding(
            lambda inputs: trainer._drafter_loss(inputs.batch, inputs.features, inputs.blocks, inputs.teacher),
            params, trainer.accelerator.device, eager=True)

    runs = plain_and_graphed(assets, tmp_path, 2, {**PACKED, "training.gradient_accumulation_steps": 2},
                             failing_on_accumulation)
    assert runs[1][2].step_graph is None  # turned off at the first step's second micro-batch
    assert_same_training(runs)


def test_under_ddp_graphed_steps_averaged_by_hand_train_as_ddp_does(assets: dict[str, pathlib.Path],
                                                                     tmp_path: pathlib.Path) -> None:
    """Two processes (gloo), a micro-batch of one packed row each and two micro-batches a step: DDP's own steps,
    steps on the stand-in graphs with the gradients averaged by hand (what a DDP run with step graphs does), and
    uncaptured steps in that regime (such a run after its graphs failed) give the same losses and gradient norms
    (the mean's scale, which the optimizers barely see), and the same weights on both processes."""
    out = tmp_path / "runs"
    out.mkdir()
    settings = {**PACKED, "training.batch_size": 1, "training.gradient_accumulation_steps": 2,
                "data.validation_fraction": 0}
    on_two_cpu_processes(["tests.helpers.ddp_steps", str(out), "3",
                          *overrides(assets, tmp_path / "unused", **settings)], port_base=29000)
    runs = {path.stem: torch.load(path) for path in out.glob("*.pt")}
    reference = runs["ddp-rank0"]
    assert len(reference["losses"]) == 3 and len(runs) == 6
    for name, run in runs.items():
        assert run["losses"] == pytest.approx(reference["losses"], rel=1e-5), name
        assert run["grad_norms"] == pytest.approx(reference["grad_norms"], rel=1e-5), name
        for key, value in reference["weights"].items():
            torch.testing.assert_close(run["weights"][key], value, rtol=1e-4, atol=1e-6, msg=f"{name}: {key}")


def test_step_cuda_graphs_off_cuda_is_a_note_and_plain_steps(assets: dict[str, pathlib.Path], tmp_path: pathlib.Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    trainer = Trainer(load_config(None, overrides(assets, tmp_path / "run", **PACKED,
                                                  **{"training.step_cuda_graphs": True})))
    assert trainer.step_graph is None
    assert "training.step_cuda_graphs applies to packed rows on CUDA, in one process or under DDP, not in fp16" \
        in capsys.readouterr().out


class SyncingOps(TorchDispatchMode):
    """Records the ops that would make a GPU wait for the host, which a CUDA graph cannot capture: a count or
    a value read back (nonzero, masked_select, .item()), a boolean-mask index or index_put, a repeat_interleave
    whose output size comes from a tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.found: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        name = func.overloadpacket.__name__
        kwargs = kwargs or {}
        indices = args[1] if name in ("index", "index_put", "index_put_") and len(args) > 1 else []
        if (name in ("nonzero", "masked_select", "_local_scalar_dense")
                or any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in indices)
                or (name == "repeat_interleave" and isinstance(args[0], torch.Tensor) and args[0].dim() == 1
                    and len(args) == 1 and kwargs.get("output_size") is None)):
            self.found.append(name)
        return func(*args, **kwargs)


@pytest.mark.parametrize("weighting,loss", [("decay", "ce"), ("dpace", "kl")])
def test_the_captured_step_waits_for_the_host_nowhere(assets: dict[str, pathlib.Path], tmp_path: pathlib.Path,
                                                      weighting: str, loss: str) -> None:
    """What a graph captures, the forward, the loss and the backward over the loader's padded blocks, runs no
    op that reads a value back to the host and makes no tensor on the host to copy over (CUDA's capture refuses
    both). Dense attention: the recorder cannot enter flex attention's compiled kernel. As before a capture,
    the step runs once first; then a tensor made without the step's device lands on "meta" and the step fails."""
    trainer = Trainer(load_config(None, overrides(assets, tmp_path / "run", **PACKED, **{
        "training.position_weighting": weighting, "training.loss": loss, "training.attention": "dense"})))
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    trainer.step_graph = GraphedDrafterStep(
        lambda inputs: trainer._drafter_loss(inputs.batch, inputs.features, inputs.blocks, inputs.teacher), params,
        trainer.accelerator.device, eager=True)
    indices, cpu_batch = trainer._load_step(0)[0]
    step = trainer._target_pass(indices, [], cpu_batch)
    assert step.blocks.real_rows is not None  # padded by the loader
    buffers = step.on(trainer.accelerator.device)
    trainer.step_graph._forward_backward(buffers)  # the warm-up runs before a capture
    ops = SyncingOps()
    with ops, torch.device("meta"):
        trainer.step_graph._forward_backward(buffers)
    assert not ops.found, ops.found
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in params[:3])


def test_the_packed_flex_mask_is_built_on_the_device_alone() -> None:
    """The GPU step's mask (flex attention's BlockMask over packed chats), which the recorder above cannot see
    built inside the step: no value read back, no tensor made on the host (meta as the default device)."""
    block, context = 16, 256
    anchors = torch.tensor([[3, 40, 130, 200], [10, 90, 140, 230]])
    chat_of_key = (torch.arange(context) >= 128).long().expand(2, -1)
    args = (anchors, torch.ones_like(anchors, dtype=torch.bool), (anchors >= 128).long(), chat_of_key, block)
    expected = packed_flex_mask(*args)
    ops = SyncingOps()
    with ops, torch.device("meta"):
        mask = packed_flex_mask(*args)
    assert not ops.found, ops.found
    torch.testing.assert_close(mask.kv_num_blocks, expected.kv_num_blocks)
