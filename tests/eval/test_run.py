"""The evaluator's per-dataset summary when outputs diverge: counted, located, and diagnosed."""

from __future__ import annotations

import pytest
import torch

from dflash_train.eval.prompts import Conversation, PromptSet
from dflash_train.eval.run import EvalSettings, Evaluator, PassTotals, Request
from dflash_train.runtime.engine import EngineConfig
from dflash_train.runtime.state import RequestOutput
from tests.helpers.decoding import make_draft, own_greedy
from tests.helpers.tiny_models import make_tiny_target


def test_divergent_outputs_are_counted_located_and_diagnosed() -> None:
    target = make_tiny_target("qwen3", num_layers=6, seed=1)
    evaluator = Evaluator(target, make_draft(target), EvalSettings(EngineConfig(block_size=4, max_new_tokens=8)))
    prompt = [20, 31, 42, 53]
    reference = own_greedy(target, prompt, 8)
    wrong = reference[:5] + [(reference[5] + 1) % 300] + reference[6:]
    done = [
        (Request(0, 0, [], prompt), RequestOutput(reference, [1] * 8, 4), RequestOutput(reference, [2, 2, 2, 1], 4)),
        (Request(1, 0, [], prompt), RequestOutput(reference, [1] * 8, 4), RequestOutput(wrong, [1] * 8, 4)),
        (Request(2, 0, [], prompt), RequestOutput(reference, [1] * 8, 4), RequestOutput(reference[:6], [3, 3], 4)),
    ]
    totals = {"target": PassTotals(24, 2.0, 24), "dflash": PassTotals(22, 1.0, 14)}
    prompt_set = PromptSet("x", [Conversation(["a"])] * 3, "test")
    row = evaluator._summarise(prompt_set, done, totals, too_long=1)
    assert row["lossless"] is False and row["lossless_requests"] == 1 and row["requests"] == 3
    first, second = row["mismatches"]
    assert (first["conversation"], first["first_divergence"]) == (1, 5)
    with torch.no_grad():
        logits = target.model(torch.tensor([prompt + reference[:5]])).logits[0, -1]
    assert first["logit_gap"] == pytest.approx(float(logits[reference[5]] - logits[wrong[5]]), abs=1e-5)
    assert first["logit_gap"] > 0  # the reference token is the target's argmax
    assert second["first_divergence"] == 6 and second["logit_gap"] is None  # a truncated output, not a token
    assert not first["tie"] and not second["tie"] and row["divergences_at_ties"] == 0
    assert row["lossless_up_to_ties"] is False
    assert row["acceptance_length"] == pytest.approx((1.75 + 1 + 3) / 3)
    assert row["speedup"] == pytest.approx((22 / 1.0) / (24 / 2.0))
    assert row["skipped"] == "1 prompts longer than the context"


def test_a_divergence_at_an_exact_tie_is_classified_as_one() -> None:
    target = make_tiny_target("qwen3", num_layers=6, seed=1)
    evaluator = Evaluator(target, make_draft(target), EvalSettings(EngineConfig(block_size=4, max_new_tokens=8)))
    prompt = [20, 31, 42, 53]
    reference = own_greedy(target, prompt, 8)
    with torch.no_grad():  # make token 7 tie with the target's choice at position 3, in the weights themselves
        hidden = target.model.model(torch.tensor([prompt + reference[:3]])).last_hidden_state[0, -1]
        head = target.model.lm_head.weight
        other = 7 if reference[3] != 7 else 8
        head[other] = head[reference[3]]
        assert float(hidden @ head[other] - hidden @ head[reference[3]]) == 0.0
    tied = reference[:3] + [other] + reference[4:]
    done = [(Request(0, 0, [], prompt), RequestOutput(reference, [1] * 8, 4), RequestOutput(tied, [1] * 8, 4))]
    totals = {"target": PassTotals(8, 1.0, 8), "dflash": PassTotals(8, 1.0, 8)}
    row = evaluator._summarise(PromptSet("x", [Conversation(["a"])], "test"), done, totals, too_long=0)
    assert row["lossless"] is False and row["mismatches"][0]["logit_gap"] == 0.0 and row["mismatches"][0]["tie"]
    assert row["lossless_up_to_ties"] is True and row["divergences_at_ties"] == 1
