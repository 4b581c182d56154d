"""Chunked, fused head + cross-entropy against a naive full-logits computation."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from dflash_train.objective import DFlashObjective, chunked_weighted_cross_entropy, slot_weights
from dflash_train.objective.objective import expected_acceptance_length
from tests.helpers.tiny_drafts import frozen_embed_and_head, tiny_draft


def naive_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    ce = F.cross_entropy((hidden @ weight.T).float(), labels, reduction="none")
    return (ce * w).sum() / w.sum()


def test_slot_weights_are_the_paper_decay() -> None:
    w = slot_weights(16, None)
    assert w[0] == 0
    assert w[1] == 1.0
    assert math.isclose(float(w[2]), math.exp(-1 / 7), rel_tol=1e-6)
    assert math.isclose(float(w[15]), math.exp(-14 / 7), rel_tol=1e-6)
    assert math.isclose(float(slot_weights(8, None)[3]), math.exp(-2 / 4), rel_tol=1e-6)
    assert math.isclose(float(slot_weights(10, None)[4]), math.exp(-3 / 5), rel_tol=1e-6)
    assert (slot_weights(16, math.inf)[1:] == 1).all()
    with pytest.raises(ValueError, match="loss_decay_gamma"):
        slot_weights(6, None)


@pytest.mark.parametrize("rows,hidden_size,vocab,chunk", [(37, 16, 123, 5), (5, 123, 123, 1), (64, 8, 50, 64)])
def test_chunked_equals_naive_fp32(rows: int, hidden_size: int, vocab: int, chunk: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    hidden = torch.randn(rows, hidden_size, generator=gen, requires_grad=True)
    weight = torch.randn(vocab, hidden_size, generator=gen, requires_grad=True)
    labels = torch.randint(0, vocab, (rows,), generator=gen)
    w = torch.rand(rows, generator=gen)
    loss, correct = chunked_weighted_cross_entropy(hidden, weight, labels, w, chunk_rows=chunk)
    (grad,) = torch.autograd.grad(loss * 3.0, hidden)
    ref_hidden = hidden.detach().clone().requires_grad_(True)
    ref = naive_loss(ref_hidden, weight.detach(), labels, w)
    (ref_grad,) = torch.autograd.grad(ref * 3.0, ref_hidden)
    torch.testing.assert_close(loss, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grad, ref_grad, atol=1e-6, rtol=1e-4)
    assert torch.equal(correct, (hidden @ weight.T).argmax(-1) == labels)
    assert weight.grad is None, "the frozen head must get no gradient"


def test_chunked_equals_naive_bf16() -> None:
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(29, 32, generator=gen).bfloat16().requires_grad_(True)
    weight = torch.randn(77, 32, generator=gen).bfloat16()
    labels = torch.randint(0, 77, (29,), generator=gen)
    w = torch.rand(29, generator=gen)
    loss, _ = chunked_weighted_cross_entropy(hidden, weight, labels, w, chunk_rows=8)
    loss.backward()
    ref_hidden = hidden.detach().float().requires_grad_(True)
    naive_loss(ref_hidden, weight.float(), labels, w).backward()
    torch.testing.assert_close(loss, naive_loss(hidden.detach().float(), weight.float(), labels, w), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(hidden.grad.float(), ref_hidden.grad, atol=2e-3, rtol=5e-2)


def objective_case(seed: int) -> tuple:
    """A tiny drafter, its frozen embedding/head, one random batch of 2 × 30 tokens, an objective and blocks."""
    draft = tiny_draft(block_size=4)
    config = draft.config
    embed, head = frozen_embed_and_head(config)
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, 50, (2, 30), generator=gen)
    loss_mask = torch.rand(2, 30, generator=gen) < 0.8
    features = torch.randn(2, 30, config.num_context_features * config.hidden_size, generator=gen)
    objective = DFlashObjective(block_size=4, mask_token_id=config.mask_token_id, num_anchors=6,
                                loss_decay_gamma=3.0, mask_kind="dense", chunk_rows=7)
    blocks = objective.make_blocks(input_ids, loss_mask, gen)
    return draft, embed, head, input_ids, loss_mask, features, objective, blocks, gen


def test_objective_equals_naive_full_logits_loss() -> None:
    """Whole objective vs. full logits over every block row, masked and weighted by hand."""
    draft, embed, head, input_ids, loss_mask, features, objective, blocks, _ = objective_case(3)
    out = objective(draft, embed, head, input_ids, loss_mask, features, blocks=blocks)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in draft.named_parameters()}
    draft.zero_grad()

    hidden = draft(embed(blocks.input_ids), blocks.positions, features,
                   torch.arange(30).expand(2, -1), objective.attention_mask(blocks, 30))
    logits = hidden @ head.T  # [b, N*B, V]: everything, the naive way
    ce = F.cross_entropy(logits.flatten(0, 1), blocks.labels.flatten(), reduction="none", ignore_index=-100)
    slot = torch.arange(blocks.labels.shape[1]) % 4
    w = torch.exp(-(slot - 1) / 3.0).expand_as(blocks.labels).flatten()
    w = (w * (blocks.labels.flatten() != -100)).view(2, -1)
    ce = ce.view(2, -1)
    ref = ((ce * w).sum(1) / w.sum(1)).mean()  # each sequence's weighted mean, averaged
    ref.backward()
    torch.testing.assert_close(out.loss, ref, atol=1e-5, rtol=1e-5)
    for name, p in draft.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, atol=1e-6, rtol=1e-4, msg=name)
    hits = (logits.argmax(-1) == blocks.labels).float()
    for k in range(1, 4):
        sel = (blocks.labels != -100) & (slot == k)
        assert math.isclose(float(out.slot_accuracy[k - 1]), float(hits[sel].mean()), rel_tol=1e-6)


def test_expected_acceptance_length_is_cumulative_product() -> None:
    acc = torch.tensor([0.9, 0.5, 0.2])
    assert math.isclose(float(expected_acceptance_length(acc)), 1 + 0.9 + 0.45 + 0.09, rel_tol=1e-6)
    assert float(expected_acceptance_length(torch.ones(15))) == 16.0


def test_head_matmuls_run_in_the_heads_dtype() -> None:
    """fp32 hidden rows (an fp32 final norm under autocast) against a bf16 head: bf16 matmuls, fp32 grads."""
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(19, 32, generator=gen, requires_grad=True)
    weight = torch.randn(53, 32, generator=gen).bfloat16()
    labels = torch.randint(0, 53, (19,), generator=gen)
    w = torch.rand(19, generator=gen)
    loss, _ = chunked_weighted_cross_entropy(hidden, weight, labels, w, chunk_rows=4)
    loss.backward()
    assert hidden.grad.dtype == torch.float32
    ce = F.cross_entropy((hidden.detach().bfloat16() @ weight.T).float(), labels, reduction="none")
    torch.testing.assert_close(loss, (ce * w).sum() / w.sum(), atol=1e-5, rtol=1e-5)


def test_soft_targets_chunked_equals_naive_distillation_loss() -> None:
    gen = torch.Generator().manual_seed(11)
    hidden = torch.randn(37, 16, generator=gen, requires_grad=True)
    teacher = torch.randn(37, 16, generator=gen)
    weight, labels = torch.randn(50, 16, generator=gen), torch.randint(0, 50, (37,), generator=gen)
    w = torch.rand(37, generator=gen)
    loss, correct = chunked_weighted_cross_entropy(hidden, weight, labels, w, chunk_rows=8, teacher_hidden=teacher)
    loss.backward()
    grad = hidden.grad.clone()
    hidden.grad = None
    soft = (teacher @ weight.T).softmax(-1)
    ref = ((-(soft * (hidden @ weight.T).log_softmax(-1)).sum(-1)) * w).sum() / w.sum()
    ref.backward()
    torch.testing.assert_close(loss, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grad, hidden.grad, atol=1e-6, rtol=1e-4)
    assert torch.equal(correct, (hidden @ weight.T).argmax(-1) == labels)  # accuracy stays against the tokens


def test_objective_soft_targets_read_the_target_state_one_position_earlier() -> None:
    """Slot k of anchor a is taught by the target's state at a+k-1 (the one that predicts token a+k)."""
    draft, embed, head, input_ids, loss_mask, features, objective, blocks, gen = objective_case(5)
    teacher_states = torch.randn(2, 30, draft.config.hidden_size, generator=gen)
    out = objective(draft, embed, head, input_ids, loss_mask, features, blocks=blocks, teacher_states=teacher_states)
    hidden = draft(embed(blocks.input_ids), blocks.positions, features,
                   torch.arange(30).expand(2, -1), objective.attention_mask(blocks, 30))
    total = torch.zeros(())
    for b in range(2):
        num, den = torch.zeros(()), torch.zeros(())
        for row in range(blocks.labels.shape[1]):
            if blocks.labels[b, row] == -100:
                continue
            k, position = row % 4, int(blocks.positions[b, row])
            soft = (teacher_states[b, position - 1] @ head.T).softmax(-1)
            ce = -(soft * (hidden[b, row] @ head.T).log_softmax(-1)).sum()
            weight = math.exp(-(k - 1) / 3.0)
            num, den = num + weight * ce, den + weight
        total = total + num / den
    torch.testing.assert_close(out.loss, total / 2, atol=1e-5, rtol=1e-5)
