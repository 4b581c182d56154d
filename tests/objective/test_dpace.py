"""D-PACE position weighting (arXiv 2605.18810): the weights against a hand-written loop and the closed form,
no gradient through them, the loss against a naive full-logits computation, and its independence of how a
batch is split (or packed)."""

from __future__ import annotations

import math
import pathlib

import pytest
import torch
import torch.nn.functional as F

from dflash_train.features.packed_rows import collate_packed
from dflash_train.objective import DFlashObjective
from dflash_train.objective.blocks import Blocks
from dflash_train.objective.objective import dpace_block_weights
from dflash_train.target import TargetModel
from dflash_train.training.config import load_config
from dflash_train.training.data import collate
from dflash_train.training.trainer import run_training
from tests.helpers.packing import PACK, chats, drafter, run
from tests.helpers.paths import CPU_RECIPE
from tests.helpers.tiny_drafts import frozen_embed_and_head, tiny_draft
from tests.helpers.tiny_models import make_tiny_target
from tests.helpers.training import overrides, save_tiny_prepared, save_tiny_target, train_losses

ALPHA = 0.3


def loop_weights(ce: list[float], labelled: list[bool], alpha: float) -> list[float]:
    """One block, slot by slot: w_j = sum over m >= j, up to the first unlabelled slot, of prod_{i<=m} q~_i."""
    smoothed = [(1 - alpha) * math.exp(-c) + alpha for c in ce]
    end = next((k for k in range(1, len(ce)) if not labelled[k]), len(ce))  # the chain stops before `end`
    weights = [0.0] * len(ce)
    for j in range(1, end):
        for m in range(j, end):
            weights[j] += math.prod(smoothed[1 : m + 1])
    return weights


def test_weights_of_one_block_are_the_closed_form() -> None:
    ce = [0.0, 0.2, 1.5, 0.7]
    q = [(1 - ALPHA) * math.exp(-c) + ALPHA for c in ce]
    got = dpace_block_weights(torch.tensor([ce]), torch.tensor([[False, True, True, True]]), ALPHA)[0]
    want = [0.0, q[1] + q[1] * q[2] + q[1] * q[2] * q[3], q[1] * q[2] + q[1] * q[2] * q[3], q[1] * q[2] * q[3]]
    torch.testing.assert_close(got, torch.tensor(want), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("labelled", [
    [False, True, True, True, True, True],  # a whole block
    [False, True, True, True, False, False],  # the chat ends inside the block
    [False, True, False, True, True, True],  # an unsupervised slot: later slots are past the chain's end
    [False, True, False, False, False, False],
])
@pytest.mark.parametrize("alpha", [0.0, ALPHA, 1.0])
def test_weights_equal_a_loop_over_the_block(labelled: list[bool], alpha: float) -> None:
    ce = torch.rand(6, generator=torch.Generator().manual_seed(len(labelled) + sum(labelled))) * 3
    got = dpace_block_weights(ce[None, None], torch.tensor(labelled)[None, None], alpha)[0, 0]
    want = loop_weights(ce.tolist(), labelled, alpha)
    torch.testing.assert_close(got, torch.tensor(want), rtol=1e-6, atol=1e-7)


def test_weights_carry_no_gradient() -> None:
    ce = torch.rand(2, 3, 5, requires_grad=True)
    labelled = torch.ones(2, 3, 5, dtype=torch.bool)
    labelled[..., 0] = False
    assert not dpace_block_weights(ce, labelled, ALPHA).requires_grad


def objective_case(seed: int) -> tuple:
    draft = tiny_draft(block_size=4)
    embed, head = frozen_embed_and_head(draft.config)
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, 50, (2, 30), generator=gen)
    loss_mask = torch.rand(2, 30, generator=gen) < 0.8
    features = torch.randn(2, 30, draft.config.num_context_features * draft.config.hidden_size, generator=gen)
    objective = DFlashObjective(block_size=4, mask_token_id=draft.config.mask_token_id, num_anchors=6,
                                mask_kind="dense", chunk_rows=7, position_weighting="dpace", dpace_alpha=ALPHA)
    blocks = objective.make_blocks(input_ids, loss_mask, gen)
    return draft, embed, head, input_ids, loss_mask, features, objective, blocks


def test_loss_and_gradients_equal_naive_with_detached_weights() -> None:
    """Per chat, sum_j w_j·CE_j over its blocks / its valid anchors, averaged over chats; w held constant."""
    draft, embed, head, input_ids, loss_mask, features, objective, blocks = objective_case(4)
    out = objective(draft, embed, head, input_ids, loss_mask, features, blocks=blocks)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in draft.named_parameters()}
    draft.zero_grad()

    hidden = draft(embed(blocks.input_ids), blocks.positions, features, torch.arange(30).expand(2, -1),
                   objective.attention_mask(blocks, 30))
    ce = F.cross_entropy((hidden @ head.T).flatten(0, 1), blocks.labels.flatten(), reduction="none",
                         ignore_index=-100).view(2, -1, 4)
    labelled = (blocks.labels != -100).view(2, -1, 4)
    weights = torch.zeros_like(ce)
    for b in range(2):
        for n in range(ce.shape[1]):
            weights[b, n] = torch.tensor(loop_weights(ce[b, n].tolist(), labelled[b, n].tolist(), ALPHA))
    per_chat = (weights * ce).sum(dim=(1, 2)) / blocks.valid.sum(1)
    ref = per_chat.mean()
    ref.backward()
    torch.testing.assert_close(out.loss, ref, atol=1e-5, rtol=1e-5)
    for name, p in draft.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, atol=1e-6, rtol=1e-4, msg=name)


def rows_of(blocks: Blocks, rows: slice) -> Blocks:
    return Blocks(blocks.anchors[rows], blocks.valid[rows], blocks.input_ids[rows], blocks.positions[rows],
                  blocks.labels[rows], blocks.block_size)


def test_a_batch_split_in_two_gives_the_same_loss() -> None:
    draft, embed, head, _, _, features, objective, blocks = objective_case(9)
    hidden = draft(embed(blocks.input_ids), blocks.positions, features, torch.arange(30).expand(2, -1),
                   objective.attention_mask(blocks, 30)).detach()
    whole = objective.loss_from_hidden(hidden, head, blocks).loss
    halves = [objective.loss_from_hidden(hidden[rows], head, rows_of(blocks, rows)).loss
              for rows in (slice(0, 1), slice(1, 2))]
    torch.testing.assert_close(whole, (halves[0] + halves[1]) / 2, rtol=1e-6, atol=1e-7)


@pytest.fixture(scope="module")
def target() -> TargetModel:
    return make_tiny_target("qwen3", num_layers=5)


def test_a_packed_batch_equals_its_chats_unpacked(target: TargetModel) -> None:
    draft = drafter(target)
    rows = chats(0, 3 * target.hidden_size)  # every chat keeps all its anchors in its row (16 per row)
    flat = [chat for row in rows for chat in row]
    seeds = [7919 * i + 3 for i in range(len(flat))]
    objective = DFlashObjective(block_size=4, mask_token_id=4, num_anchors=6, mask_kind="dense", chunk_rows=13,
                                anchors_per_row=16, position_weighting="dpace", dpace_alpha=ALPHA)
    unpacked, unpacked_grads = run(objective, draft, target, collate(flat), seeds, "offline")
    packed, packed_grads = run(objective, draft, target, collate_packed(rows, PACK, len(rows)), seeds, "offline")
    torch.testing.assert_close(packed.loss, unpacked.loss, rtol=1e-5, atol=1e-6)
    for name, grad in unpacked_grads.items():
        torch.testing.assert_close(packed_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_config_selects_dpace_and_checks_alpha() -> None:
    recipe = CPU_RECIPE
    assert load_config(recipe).training.position_weighting == "decay"  # off by default
    config = load_config(recipe, ["training.position_weighting=dpace", "training.dpace_alpha=0.25"])
    assert (config.training.position_weighting, config.training.dpace_alpha) == ("dpace", 0.25)
    with pytest.raises(ValueError, match=r"training.dpace_alpha must be in \[0, 1\], got 1.5"):
        load_config(recipe, ["training.dpace_alpha=1.5"])
    with pytest.raises(ValueError, match="is not one of"):
        load_config(recipe, ["training.position_weighting=linear"])


def test_training_runs_with_dpace(tmp_path: pathlib.Path) -> None:
    """The trainer hands the option to the objective: the same run, with D-PACE, learns other losses."""
    assets = {"target": save_tiny_target(tmp_path / "target"), "data": save_tiny_prepared(tmp_path / "data")}
    losses = {}
    for weighting in ("decay", "dpace"):
        out = tmp_path / weighting
        run_training(load_config(None, overrides(assets, out, **{"training.max_steps": 4, "training.eval_every": 0,
                                                                "training.position_weighting": weighting})))
        losses[weighting] = train_losses(out)
    assert sorted(losses["dpace"]) == [1, 2, 3, 4] and all(math.isfinite(v) for v in losses["dpace"].values())
    assert losses["dpace"][1] != pytest.approx(losses["decay"][1], rel=1e-3)
