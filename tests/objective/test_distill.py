"""Distillation at a temperature (objective/distill.py) against hand-written PyTorch: per-row KL and TV mixed
with the label's CE, values and gradients; TV against the acceptance rate speculative sampling measures; the
whole objective with its slot decay and masked rows; weight 0 as the CE path; a tiny drafter that learns."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from dflash_train.objective import DFlashObjective, Distillation, chunked_distillation_rows
from dflash_train.objective.distill import CHUNK_BUFFERS, distill_chunk_rows
from dflash_train.objective.loss import chunked_cross_entropy_rows, default_chunk_rows
from dflash_train.runtime.sampling import probabilities, sample, speculative_sample
from tests.helpers.tiny_drafts import frozen_embed_and_head, tiny_draft


def rows_case(rows: int, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    hidden, teacher = torch.randn(rows, 12, generator=gen), torch.randn(rows, 12, generator=gen)
    head = torch.randn(37, 12, generator=gen) / 2
    labels = torch.randint(0, 37, (rows,), generator=gen)
    return hidden, teacher, head, labels


def hand_written(x: torch.Tensor, t: torch.Tensor, labels: torch.Tensor, kind: str, temperature: float,
                 weight: float) -> torch.Tensor:
    """(1 - w)·CE(x, y) + w·D(softmax(t/T), softmax(x/T)) per row, straight from the definitions."""
    p, q = (x / temperature).softmax(-1), (t / temperature).softmax(-1)
    kl, tv = (q * (q.log() - p.log())).sum(-1), 1 - torch.minimum(p, q).sum(-1)
    divergence = kl if kind == "kl" else tv
    return (1 - weight) * F.cross_entropy(x, labels, reduction="none") + weight * divergence


def loss_dependent_weights(loss: torch.Tensor) -> torch.Tensor:
    """Row weights that depend on the (detached) losses, as D-PACE's do."""
    return torch.exp(-loss.detach()) + torch.arange(loss.numel()) / loss.numel()


@pytest.mark.parametrize("kind", ["kl", "tv"])
@pytest.mark.parametrize(("temperature", "weight", "chunk"), [(1.0, 1.0, 5), (0.6, 0.5, 8), (1.7, 0.25, 1),
                                                              (0.8, 1.0, 64)])
def test_rows_and_gradient_equal_the_definitions(kind: str, temperature: float, weight: float, chunk: int) -> None:
    hidden, teacher, head, labels = rows_case(23, 3)
    got_hidden = hidden.clone().requires_grad_(True)
    loss, label_ce, correct = chunked_distillation_rows(got_hidden, head, labels, teacher,
                                                        Distillation(kind, temperature, weight), chunk)
    (loss * loss_dependent_weights(loss)).sum().backward()

    want_hidden = hidden.clone().requires_grad_(True)
    want = hand_written(want_hidden @ head.T, teacher @ head.T, labels, kind, temperature, weight)
    (want * loss_dependent_weights(want)).sum().backward()
    torch.testing.assert_close(loss, want.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_hidden.grad, want_hidden.grad, atol=1e-6, rtol=1e-4)
    torch.testing.assert_close(label_ce, F.cross_entropy(hidden @ head.T, labels, reduction="none"))
    assert torch.equal(correct, (hidden @ head.T).argmax(-1) == labels)  # accuracy stays against the labels
    assert not label_ce.requires_grad and loss.dtype == torch.float32


def test_tv_is_one_minus_the_acceptance_rate_of_speculative_sampling() -> None:
    """The runtime's own rejection sampling (one draft slot), run many times on the same logits: the share of
    accepted drafts is 1 - TV at the sampling temperature."""
    gen = torch.Generator().manual_seed(0)
    target = torch.randn(20, generator=gen) * 2
    draft = target + torch.randn(20, generator=gen) * 1.5  # a drafter that roughly agrees
    temperature, draws = 0.7, 40_000
    tv, _, _ = chunked_distillation_rows(draft[None], torch.eye(20), torch.zeros(1, dtype=torch.long), target[None],
                                         Distillation("tv", temperature))
    torch.manual_seed(1)
    draft_logits = draft.expand(draws, 1, 20)
    drafts = sample(probabilities(draft_logits, temperature))  # [draws, 1]
    accepted, _ = speculative_sample(target.expand(draws, 2, 20), draft_logits, drafts, temperature)
    assert abs(float(accepted.float().mean()) - (1 - float(tv))) < 0.015


def test_kl_at_temperature_one_has_the_soft_targets_gradient() -> None:
    """KL(q || p) and the soft-target cross-entropy differ by q's entropy, a constant of the drafter."""
    hidden, teacher, head, labels = rows_case(19, 5)
    kl_hidden, soft_hidden = hidden.clone().requires_grad_(True), hidden.clone().requires_grad_(True)
    kl, _, _ = chunked_distillation_rows(kl_hidden, head, labels, teacher, Distillation("kl"), 6)
    soft, _ = chunked_cross_entropy_rows(soft_hidden, head, labels, 6, teacher_hidden=teacher, fused=False)
    kl.sum().backward()
    soft.sum().backward()
    q = (teacher @ head.T).softmax(-1)
    torch.testing.assert_close(soft.detach() - kl.detach(), -(q * q.log()).sum(-1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(kl_hidden.grad, soft_hidden.grad, atol=1e-6, rtol=1e-4)


def test_towards_temperature_zero_kl_is_the_drafters_margin_below_the_targets_argmax() -> None:
    """The drafter is tempered too (as it is sampled), so T·KL tends to max_v x_v - x_y, y the target's argmax:
    a hinge at the greedy acceptance rule, zero once the drafter's argmax is the target's (not the CE)."""
    hidden, teacher, head, labels = rows_case(9, 7)
    kl, _, _ = chunked_distillation_rows(hidden, head, labels, teacher, Distillation("kl", 1e-3))
    x, y = hidden @ head.T, (teacher @ head.T).argmax(-1)
    torch.testing.assert_close(1e-3 * kl, x.max(-1).values - x.gather(1, y[:, None])[:, 0], atol=1e-2, rtol=0)


def test_default_chunks_hold_no_more_fp32_than_the_ce_path() -> None:
    for vocab in (32_000, 151_936):
        assert distill_chunk_rows(vocab, fused=False) * CHUNK_BUFFERS <= default_chunk_rows(vocab) * 2
        assert distill_chunk_rows(vocab, fused=True) == default_chunk_rows(vocab)  # two 16-bit logits, not fp32


@pytest.mark.parametrize(("arguments", "message"), [
    (("js",), "kind 'js' is not one of"),
    (("kl", 0.0), "temperature must be a finite number > 0, got 0.0"),
    (("kl", -1.0), "temperature must be a finite number > 0"),
    (("tv", math.nan), "temperature must be a finite number > 0, got nan"),
    (("tv", math.inf), "temperature must be a finite number > 0, got inf"),
    (("kl", 1.0, 1.5), r"weight must be in \[0, 1\], got 1.5"),
    (("kl", 1.0, math.nan), r"weight must be in \[0, 1\], got nan"),
])
def test_bad_settings_are_refused(arguments: tuple, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Distillation(*arguments)


def objective_case(seed: int, distillation: Distillation | None) -> tuple:
    """A tiny drafter, its frozen embedding/head, a random batch of 2 × 30 tokens (a fifth of them unsupervised),
    the target's random final states, an objective and its blocks."""
    draft = tiny_draft(block_size=4)
    embed, head = frozen_embed_and_head(draft.config)
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, 50, (2, 30), generator=gen)
    loss_mask = torch.rand(2, 30, generator=gen) < 0.8
    features = torch.randn(2, 30, draft.config.num_context_features * draft.config.hidden_size, generator=gen)
    teacher_states = torch.randn(2, 30, draft.config.hidden_size, generator=gen)
    objective = DFlashObjective(block_size=4, mask_token_id=draft.config.mask_token_id, num_anchors=6,
                                loss_decay_gamma=3.0, mask_kind="dense", chunk_rows=7, distillation=distillation)
    blocks = objective.make_blocks(input_ids, loss_mask, gen)
    return draft, embed, head, (input_ids, loss_mask, features), teacher_states, objective, blocks


@pytest.mark.parametrize("distillation", [Distillation("kl", 0.7, 0.6), Distillation("tv", 1.3, 1.0)])
def test_objective_equals_a_hand_written_loop_over_the_rows(distillation: Distillation) -> None:
    """Slot k of anchor a is taught by the target's state at a+k-1; rows without a label count nothing; each
    chat's loss is its decay-weighted mean, and the batch's the mean over chats."""
    draft, embed, head, batch, teacher_states, objective, blocks = objective_case(5, distillation)
    out = objective(draft, embed, head, *batch, blocks=blocks, teacher_states=teacher_states)
    out.loss.backward()
    grads = {name: p.grad.clone() for name, p in draft.named_parameters()}
    draft.zero_grad()
    hidden = draft(embed(blocks.input_ids), blocks.positions, batch[2], torch.arange(30).expand(2, -1),
                   objective.attention_mask(blocks, 30))
    total = torch.zeros(())
    for b in range(2):
        num, den = torch.zeros(()), torch.zeros(())
        for row in range(blocks.labels.shape[1]):
            label = blocks.labels[b, row]
            if label == -100:
                continue
            k, position = row % 4, int(blocks.positions[b, row])
            row_loss = hand_written((hidden[b, row] @ head.T)[None], (teacher_states[b, position - 1] @ head.T)[None],
                                    label[None], distillation.kind, distillation.temperature, distillation.weight)
            weight = math.exp(-(k - 1) / 3.0)
            num, den = num + weight * row_loss[0], den + weight
        total = total + num / den
    (total / 2).backward()
    torch.testing.assert_close(out.loss, total.detach() / 2, atol=1e-5, rtol=1e-5)
    for name, p in draft.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, atol=1e-6, rtol=1e-4, msg=name)


def test_weight_zero_is_the_ce_path_even_with_the_targets_states() -> None:
    draft, embed, head, batch, teacher_states, objective, blocks = objective_case(6, Distillation("tv", 0.7, 0.0))
    mixed = objective(draft, embed, head, *batch, blocks=blocks, teacher_states=teacher_states)
    objective.distillation = None
    plain = objective(draft, embed, head, *batch, blocks=blocks)
    assert torch.equal(mixed.loss, plain.loss) and torch.equal(mixed.slot_correct, plain.slot_correct)


def test_a_distillation_without_the_targets_states_is_a_clear_error() -> None:
    draft, embed, head, batch, _, objective, blocks = objective_case(7, Distillation("kl", 0.8))
    with pytest.raises(ValueError, match="the kl loss distils the target's distribution: pass teacher_states"):
        objective(draft, embed, head, *batch, blocks=blocks)


@pytest.mark.parametrize("distillation", [Distillation("kl", 0.7, 1.0), Distillation("tv", 1.0, 0.5),
                                          Distillation("tv", 0.7, 1.0)])
def test_a_tiny_drafter_learns_the_new_loss(distillation: Distillation) -> None:
    draft, embed, head, batch, teacher_states, objective, blocks = objective_case(8, distillation)
    optimizer = torch.optim.Adam(draft.parameters(), lr=3e-3)
    losses = []
    for _ in range(12):
        out = objective(draft, embed, head, *batch, blocks=blocks, teacher_states=teacher_states)
        optimizer.zero_grad()
        out.loss.backward()
        optimizer.step()
        losses.append(float(out.loss.detach()))
    assert losses[-1] < 0.9 * losses[0], losses
