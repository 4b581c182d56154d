"""The evaluator's per-dataset summary: divergences from the lossless check's output counted and located,
and no lossless claim where no check ran; what its warm-up decodes."""

from __future__ import annotations

import pytest
import torch

from dflash_train.eval.console import lossless_mark
from dflash_train.eval.run import EvalSettings, Evaluator, PassTotals, Request
from dflash_train.prompts.eval_sets import Conversation, PromptSet
from dflash_train.runtime.engine import EngineConfig
from dflash_train.runtime.state import RequestOutput
from tests.helpers.decoding import make_draft
from tests.helpers.tiny_models import make_tiny_target


def evaluator(lossless_check: bool = True) -> Evaluator:
    target = make_tiny_target("qwen3", num_layers=6, seed=1)
    settings = EvalSettings(EngineConfig(block_size=4, max_new_tokens=8), lossless_check=lossless_check)
    return Evaluator(target, make_draft(target), settings)


def test_divergent_outputs_are_counted_and_located() -> None:
    reference = [5, 9, 11, 7, 3, 8, 2, 4]
    wrong = reference[:5] + [6] + reference[6:]
    done = [  # (request, the lossless check's output, the output with the drafter)
        (Request(0, 0, [], [1]), RequestOutput(reference, [1] * 8, 4), RequestOutput(reference, [2, 2, 2, 1], 4)),
        (Request(1, 0, [], [1]), RequestOutput(reference, [1] * 8, 4), RequestOutput(wrong, [1] * 8, 4)),
        (Request(2, 0, [], [1]), RequestOutput(reference, [1] * 8, 4), RequestOutput(reference[:6], [3, 3], 4)),
    ]
    totals = {"target": PassTotals(24, 2.0, 24), "dflash": PassTotals(22, 1.0, 14),
              "lossless_check": PassTotals(24, 3.0, 24)}
    prompt_set = PromptSet("x", [Conversation(["a"])] * 3, "test")
    row = evaluator()._summarise(prompt_set, done, totals, too_long=1)
    assert row["lossless"] is False and row["lossless_requests"] == 1 and row["requests"] == 3
    assert lossless_mark(row) == "NO (1/3)"
    first, second = row["mismatches"]
    assert first == {"conversation": 1, "turn": 0, "first_divergence": 5, "target_tokens": 8, "dflash_tokens": 8}
    assert second["first_divergence"] == 6 and second["dflash_tokens"] == 6  # cut short, not a wrong token
    assert row["decode_seconds_lossless_check"] == 3.0
    assert row["acceptance_length"] == pytest.approx((1.75 + 1 + 3) / 3)
    assert row["acceptance_length_per_request"] == [[0, 0, 1.75], [1, 0, 1.0], [2, 0, 3.0]]
    assert row["speedup"] == pytest.approx((22 / 1.0) / (24 / 2.0))  # against the one-token pass, not the check
    assert row["skipped"] == "1 prompts longer than the context"


def test_no_check_no_claim() -> None:
    done = [(Request(0, 0, [], [1]), None, RequestOutput([5, 9], [2], 4))]
    totals = {"target": PassTotals(2, 1.0, 2), "dflash": PassTotals(2, 1.0, 1), "lossless_check": PassTotals()}
    row = evaluator(lossless_check=False)._summarise(PromptSet("x", [Conversation(["a"])], "test"), done, totals, 0)
    assert row["lossless"] is None and row["lossless_requests"] is None and row["mismatches"] == []
    assert row["decode_seconds_lossless_check"] is None and lossless_mark(row) == "n/a"


class _CountingEngine:
    """What `_warm_up` reads of an engine, counting the requests it decodes."""

    def __init__(self, device: str, uses_compile: bool) -> None:
        self.device, self.uses_compile = torch.device(device), uses_compile
        self.prepared, self.decoded = 0, []

    def prepare(self) -> None:
        self.prepared += 1

    def generate(self, prompts: list[list[int]]) -> None:
        self.decoded.extend(prompts)


@pytest.mark.parametrize(("device", "uses_compile", "decodes"),
                         [("cpu", False, False), ("cpu", True, True), ("cuda", False, True)])
def test_warm_up_decodes_the_first_request_only_where_something_compiles(
        device: str, uses_compile: bool, decodes: bool) -> None:
    """An eager CPU engine is prepared and nothing more; a compiled one, or any CUDA engine (its graphs are
    captured per shape), decodes the first request too."""
    engine = _CountingEngine(device, uses_compile)
    first = Request(0, 0, [], [1, 2, 3])
    evaluator()._warm_up(engine, first, "dflash")  # type: ignore[arg-type]
    assert engine.prepared == 1
    assert engine.decoded == ([[1, 2, 3]] if decodes else [])
