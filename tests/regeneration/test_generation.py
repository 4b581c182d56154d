"""Regeneration through the runtime (no drafter, rows refilled as they finish) against the target's own
greedy decode in Hugging Face `generate`, prompt by prompt; seeded sampling that does not depend on the
row, batch or company a prompt runs in; stop ids, max_new_tokens, finish reasons, prefill waves, and the
`generate` fallback for other architectures."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import pytest
import torch

from dflash_train.regeneration.generation import Generated, Generator, hf_generate
from dflash_train.runtime.config import EngineConfig
from dflash_train.runtime.engine import DecodeEngine
from dflash_train.runtime.sampling import request_seed, seed_keys, seeded_sample, seeded_uniform
from dflash_train.target import TargetModel
from tests.helpers.tiny_models import TINY_ARCHS, make_tiny_target

PROMPT_LENGTHS = (3, 11, 7, 1, 16, 5, 9)
MAX_NEW = 20


def runtime(**overrides: object) -> EngineConfig:
    base = EngineConfig(batch_size=3, block_size=1, max_new_tokens=MAX_NEW, max_length=48, kernels="torch")
    return replace(base, **overrides)  # type: ignore[arg-type]


def prompts(count: int = len(PROMPT_LENGTHS), seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(7, 256, (n,), generator=g).tolist() for n in PROMPT_LENGTHS[:count]]


def alone(target: TargetModel, prompt: list[int], config: EngineConfig) -> Generated:
    """The target's own greedy decode of one prompt, unpadded, in Hugging Face's loop."""
    (out,) = hf_generate(target.model, [prompt], config)
    return out


def staggered_stops(target: TargetModel, batch: Sequence[list[int]]) -> tuple[int, ...]:
    """Stop ids that end answers at different points: for every other prompt, the first token of its free
    answer that is new there at position 2, 5, 8, ... (other answers may stop on them too, or run on)."""
    stops = []
    for i, prompt in enumerate(batch[::2]):
        tokens = alone(target, prompt, runtime()).token_ids
        stops += [next((t for k, t in enumerate(tokens) if k >= 2 + 3 * i and t not in tokens[:k]), tokens[-1])]
    return tuple(stops)


@pytest.fixture(scope="module")
def tiny() -> TargetModel:
    return make_tiny_target("llama", num_layers=3)


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_regeneration_equals_the_targets_own_greedy_decode_with_refill(arch: str) -> None:
    """Seven prompts through three rows: rows finish at different times (a stop id or the length limit)
    and take the next prompt, prefilled beside rows still decoding."""
    target = make_tiny_target(arch, num_layers=3)
    if arch == "mistral":
        target.model.config.sliding_window = 6  # shorter than most prompts plus answers
    batch = prompts()
    config = runtime(stop_token_ids=staggered_stops(target, batch))
    outputs = Generator(target, config).generate(batch, seeds=list(range(len(batch))))
    expected = [alone(target, p, config) for p in batch]
    assert outputs == expected
    assert {o.finish_reason for o in outputs} == {"stop", "length"}
    assert len({len(o.token_ids) for o in outputs}) > 2  # rows really finished at different times


def test_prefill_waves_and_groups_give_the_same_greedy_answers(tiny: TargetModel) -> None:
    batch = prompts()
    config = runtime(stop_token_ids=staggered_stops(tiny, batch))
    reference = Generator(tiny, replace(config, batch_size=1)).generate(batch, seeds=[0] * len(batch))
    generator = Generator(tiny, replace(config, batch_size=4, prefill_rows=2))
    first, second = generator.submit(batch[:3], [0] * 3), generator.submit(batch[3:], [0] * 4)
    assert second() == reference[3:] and first() == reference[:3]  # a later group may be waited for first


def test_waves_are_cut_by_rows_and_tokens(tiny: TargetModel) -> None:
    engine = DecodeEngine(tiny, None, runtime(batch_size=8, prefill_rows=3, prefill_tokens=20))
    engine.submit([[5] * n for n in (5, 5, 5, 5, 9, 2)])
    assert list(engine._waves) == [[0, 1, 2], [3, 4], [5]]
    assert runtime(batch_size=64).wave_rows == 8 and runtime(batch_size=2, prefill_rows=5).wave_rows == 2


@pytest.mark.parametrize("top_p", [1.0, 0.8])
def test_a_prompts_sampled_answer_does_not_depend_on_its_row_batch_or_company(tiny: TargetModel,
                                                                               top_p: float) -> None:
    batch = prompts()
    seeds = [request_seed(7, i) for i in range(len(batch))]
    config = runtime(temperature=1.0, top_p=top_p)
    one_by_one = [Generator(tiny, replace(config, batch_size=1)).generate([p], [s])[0]
                  for p, s in zip(batch, seeds, strict=True)]
    together = Generator(tiny, replace(config, batch_size=5, prefill_rows=2)).generate(batch, seeds)
    order = [4, 0, 6, 2, 5, 1, 3]  # other rows, other waves, other neighbours
    shuffled = Generator(tiny, replace(config, batch_size=3)).generate([batch[i] for i in order],
                                                                      [seeds[i] for i in order])
    assert together == one_by_one
    assert [shuffled[order.index(i)] for i in range(len(batch))] == one_by_one
    other_seeds = Generator(tiny, config).generate(batch, [s + 1 for s in seeds])
    assert other_seeds != one_by_one and len({tuple(o.token_ids) for o in one_by_one}) == len(batch)


def test_stop_ids_max_new_tokens_and_finish_reason(tiny: TargetModel) -> None:
    prompt = [10, 20, 30]
    (free,) = Generator(tiny, runtime(max_new_tokens=16)).generate([prompt], [0])  # no stop ids
    assert free.finish_reason == "length" and len(free.token_ids) == 16
    stop = free.token_ids[3]
    (stopped,) = Generator(tiny, runtime(max_new_tokens=16, stop_token_ids=(stop,))).generate([prompt], [0])
    cut = free.token_ids.index(stop)
    assert stopped == Generated(free.token_ids[:cut], "stop")
    (at_limit,) = Generator(tiny, runtime(max_new_tokens=cut + 1, stop_token_ids=(stop,))).generate([prompt], [0])
    assert at_limit == Generated(free.token_ids[:cut], "stop")  # the stop token is the last one allowed
    (short,) = Generator(tiny, runtime(max_new_tokens=cut, stop_token_ids=(stop,))).generate([prompt], [0])
    assert short == Generated(free.token_ids[:cut], "length")
    (first,) = Generator(tiny, runtime(stop_token_ids=(free.token_ids[0],))).generate([prompt], [0])
    assert first == Generated([], "stop")


def test_unsupported_architecture_falls_back_to_hf_generate(tiny: TargetModel,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    import dflash_train.regeneration.generation as generation

    batch = prompts(4)
    config = runtime(stop_token_ids=(2,))
    expected = Generator(tiny, config).generate(batch, [0] * 4)
    monkeypatch.setattr(generation, "supports", lambda target: False)
    fallback = Generator(tiny, config)
    assert fallback.engine is None and fallback.generate(batch, [0] * 4) == expected


def test_seeded_draws_follow_temperature_and_top_p() -> None:
    """20,000 seeded draws from one distribution: frequencies within 4 standard errors of softmax(l / T),
    renormalised over the nucleus with top-p; nothing outside the nucleus is ever drawn."""
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -30.0])
    n, temperature = 20_000, 0.7
    keys = seed_keys(list(range(n)))
    for top_p, kept in ((1.0, 6), (0.8, 2)):
        tokens = seeded_sample(logits.expand(n, -1), temperature, top_p, keys, torch.zeros(n, dtype=torch.long))
        p = torch.softmax(logits / temperature, dim=-1)[:kept]
        p = torch.cat([p / p.sum(), torch.zeros(6 - kept)])
        freq = torch.bincount(tokens, minlength=6).double() / n
        assert ((freq - p).abs() <= 4 * (p * (1 - p) / n).sqrt() + 1e-12).all(), (freq, p)
    uniform = seeded_uniform(keys[:4], torch.tensor([0, 1, 2, 3]))
    assert ((uniform >= 0) & (uniform < 1)).all() and len(set(uniform.tolist())) == 4
    assert torch.equal(seeded_uniform(keys[:4], torch.tensor([0, 1, 2, 3])), uniform)  # a pure function
