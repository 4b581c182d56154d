"""Loop stopping in regeneration: the device-side detector against the rule written out by hand and against
a plain per-token loop over every prefix; the runtime with `stop_loops` ends a row exactly where the full
greedy answer first ends in a loop, keeping everything before it."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

from dflash_train.regeneration.generation import Generated, Generator, hf_generate
from dflash_train.runtime.config import EngineConfig
from dflash_train.runtime.loop_stop import MAX_PERIOD, MIN_COMPARED, LoopDetector, ends_in_loop
from dflash_train.runtime.state import DecodeState
from tests.helpers.tiny_models import make_tiny_target


def looping(prefix: list[int], period: list[int], total: int) -> list[int]:
    """prefix, then `period` repeated (cut mid-copy) up to `total` tokens."""
    return prefix + [period[i % len(period)] for i in range(total - len(prefix))]


def test_the_rule_by_hand() -> None:
    assert not ends_in_loop([5] * MIN_COMPARED)  # 64 equal tokens: 63 comparisons hold, 64 are needed
    assert ends_in_loop([5] * (MIN_COMPARED + 1))
    line = list(range(100, 140))  # a 40-token line: three copies (120 tokens) are needed
    assert not ends_in_loop(looping([1, 2, 3], line, 3 + 119))
    assert ends_in_loop(looping([1, 2, 3], line, 3 + 120))
    assert ends_in_loop(looping([1, 2, 3], line, 3 + 135))  # cut mid-copy: still a loop
    long_line = list(range(100, 100 + MAX_PERIOD + 1))  # a period longer than MAX_PERIOD is not looked for
    assert not ends_in_loop(long_line * 4)
    assert not ends_in_loop(looping(list(range(200, 300)), line, 100 + 119) + [7])  # broken by its last token


def test_detector_equals_the_rule_on_every_row() -> None:
    rng = random.Random(0)
    rows = []
    for _ in range(200):
        prefix = [rng.randrange(1000) for _ in range(rng.randrange(0, 60))]
        period = [rng.randrange(3) for _ in range(rng.randrange(1, 70))]  # a small alphabet: near misses
        rows.append(looping(prefix, period, len(prefix) + rng.randrange(0, 200)))
    width = max(map(len, rows)) + 1
    out = torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.tensor(row, dtype=torch.long)
        out[i, len(row):] = torch.randint(0, 3, (width - len(row),))  # tokens past n_out are not read
    n_out = torch.tensor([len(row) for row in rows])
    found = LoopDetector(torch.device("cpu"))(out, n_out)
    expected = [ends_in_loop(row) for row in rows]
    assert found.tolist() == expected
    assert 20 < sum(expected) < 180  # both outcomes well represented


def test_a_looping_row_is_ended_with_finish_reason_loop() -> None:
    state = DecodeState(2, 1, 300, [999], torch.device("cpu"), LoopDetector(torch.device("cpu")))
    state.reset_rows(torch.tensor([0, 1]), torch.tensor([4, 4]), torch.tensor([3, 3]), torch.zeros(2, 2, dtype=torch.long))
    tokens = {0: looping([4], [7, 8, 9], 300), 1: [4] + [(i * 7919) % 500 + 10 for i in range(299)]}
    steps = 0
    while not bool(state.done.all()):
        for row in (0, 1):
            state.out[row, state.n_out[row]] = tokens[row][int(state.n_out[row])]
        state.advance(torch.ones(2, dtype=torch.long), state.out[torch.arange(2), state.n_out])
        steps += 1
    first_loop = next(n for n in range(1, 301) if ends_in_loop(tokens[0][:n]))
    outputs = state.harvest([0, 1], [3, 3])
    assert outputs[0].finish_reason == "loop" and outputs[0].tokens == tokens[0][:first_loop]
    assert outputs[1].finish_reason == "length" and outputs[1].tokens == tokens[1]


@pytest.fixture(scope="module")
def loopy_target():  # type: ignore[no-untyped-def]
    return make_tiny_target("llama", num_layers=2)


def test_regeneration_ends_a_row_where_its_full_answer_first_loops(loopy_target) -> None:  # type: ignore[no-untyped-def]
    """Against the target's own greedy decode in Hugging Face's loop, to the cap: a row the runtime ended as
    "loop" holds exactly the shortest prefix that ends in a loop; the others are unchanged."""
    g = torch.Generator().manual_seed(1)
    batch = [torch.randint(7, 256, (n,), generator=g).tolist() for n in (3, 9, 5, 12, 2, 7)]
    config = EngineConfig(batch_size=3, block_size=1, max_new_tokens=240, max_length=260, kernels="torch")
    stopping = Generator(loopy_target, replace(config, stop_loops=True)).generate(batch, list(range(len(batch))))
    reasons = []
    for prompt, got in zip(batch, stopping, strict=True):
        (full,) = hf_generate(loopy_target.model, [prompt], config)
        first = next((n for n in range(1, len(full.token_ids) + 1) if ends_in_loop(full.token_ids[:n])), None)
        expected = full if first is None else Generated(full.token_ids[:first], "loop")
        assert got == expected
        reasons.append(got.finish_reason)
    assert "loop" in reasons  # a random tiny model falls into loops: the test is not vacuous


@pytest.mark.gpu
def test_loop_stopping_inside_the_captured_compiled_step() -> None:
    """On CUDA the check runs inside the CUDA graph of a compiled regeneration step: each row ends where the
    same loop without the check first ends in a loop (same batch and shapes, so the same kernels)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    target = make_tiny_target("llama", num_layers=2)
    target.model.cuda()
    g = torch.Generator().manual_seed(1)
    batch = [torch.randint(7, 256, (n,), generator=g).tolist() for n in (3, 9, 5, 12, 2, 7)]
    config = EngineConfig(batch_size=3, block_size=1, max_new_tokens=240, max_length=260)
    full = Generator(target, config).generate(batch, list(range(len(batch))))
    generator = Generator(target, replace(config, stop_loops=True))
    stopping = generator.generate(batch, list(range(len(batch))))
    assert generator.engine.uses_cuda_graph and generator.engine.uses_compile
    for got, whole in zip(stopping, full, strict=True):
        first = next((n for n in range(1, len(whole.token_ids) + 1) if ends_in_loop(whole.token_ids[:n])), None)
        assert got == (whole if first is None else Generated(whole.token_ids[:first], "loop"))
    assert "loop" in {o.finish_reason for o in stopping}
