"""The marginal oracle (`dflash_train.eval.marginal_oracle`) against an independent reference: a tiny target
(vocabulary 6, sharpened head and embeddings) whose tempered conditionals are enumerated with its own forward
(no cache) over every drafted path at a fixed context. From them: the exact marginals q_k, and the exact expected
tokens of one cycle, 1 + sum_k P(a >= k), with P(a >= k) = sum over drafts d_1..d_k of
prod_j min(q_j(d_j), p_T(d_j | c, d_<j)). The oracle's estimates are checked against those, its first marginal
against the target's distribution itself, its draws against its seed and its low-temperature limit against the
target's greedy decoding."""

from __future__ import annotations

import itertools
import math
from statistics import fmean

import pytest
import torch

from dflash_train.eval.marginal_oracle import MarginalOracle, SlotTotals
from dflash_train.target import TargetModel
from tests.helpers.decoding import own_greedy
from tests.helpers.tiny_models import make_tiny_model

VOCAB, CONTEXT, TEMPERATURE = 6, [1, 2, 3, 4, 5], 1.0


@pytest.fixture(scope="module")
def target() -> TargetModel:
    model = make_tiny_model("llama", num_layers=1, seed=2, vocab_rows=VOCAB)
    with torch.no_grad():  # peaked next-token distributions that depend on the tokens before
        model.lm_head.weight.mul_(12)
        model.model.embed_tokens.weight.mul_(12)
    return TargetModel(model, tokenizer=None)


def conditionals(target: TargetModel, block_size: int, temperature: float = TEMPERATURE) -> list[torch.Tensor]:
    """p_T(. | c, x_<k) for every prefix of 0..B-2 tokens, as tensors [V]*(k-1) + [V] in float64."""
    tables = []
    for length in range(block_size - 1):
        prefixes = torch.tensor(list(itertools.product(range(VOCAB), repeat=length)), dtype=torch.long)
        ids = torch.cat([torch.tensor([CONTEXT]).expand(len(prefixes), -1), prefixes.view(len(prefixes), length)], 1)
        with torch.no_grad():
            probs = torch.softmax(target.model(ids).logits[:, -1].double() / temperature, dim=-1)
        tables.append(probs.view(*([VOCAB] * length), VOCAB))
    return tables


def exact_marginals(tables: list[torch.Tensor]) -> list[torch.Tensor]:
    """q_k = sum over paths x_<k of P(x_<k) p_T(. | c, x_<k)."""
    marginals, paths = [], torch.tensor(1.0, dtype=torch.float64)
    for table in tables:
        joint = paths[..., None] * table  # P(x_<k, x_k)
        marginals.append(joint.reshape(-1, VOCAB).sum(0))
        paths = joint
    return marginals


def exact_tokens_per_cycle(tables: list[torch.Tensor], marginals: list[torch.Tensor]) -> float:
    """1 + sum_k P(a >= k) for drafts d_k ~ q_k, tested against p_T(. | c, d_<k)."""
    tokens, accepted = 1.0, torch.tensor(1.0, dtype=torch.float64)  # accepted: P(d_1..d_k drawn and accepted)
    for table, q in zip(tables, marginals, strict=True):
        accepted = accepted[..., None] * torch.minimum(table, q)
        tokens += float(accepted.sum())
    return tokens


def oracle_at_context(target: TargetModel, samples: int, block_size: int, seed: int = 0,
                      temperature: float = TEMPERATURE) -> MarginalOracle:
    oracle = MarginalOracle(target, samples, block_size, temperature, torch.Generator().manual_seed(seed))
    oracle.prefill(CONTEXT[:-1], block_size)  # the context's last token is the cycle's slot 0
    return oracle


def run_cycles(oracle: MarginalOracle, count: int) -> list[int]:
    slots = SlotTotals.zeros(oracle.block_size - 1)
    return [oracle.cycle(len(CONTEXT) - 1, CONTEXT[-1], slots).accepted + 1 for _ in range(count)]


def test_the_first_marginal_is_the_targets_distribution_and_each_is_a_distribution(target: TargetModel) -> None:
    tables = conditionals(target, 4)
    oracle = oracle_at_context(target, samples=16, block_size=4)
    for _ in range(20):
        run_cycles(oracle, 1)
        first, *later = oracle.marginals
        # q_1 is p_T(. | c) itself, not an average (float32 against the float64 reference forward)
        torch.testing.assert_close(first.double(), tables[0], atol=1e-6, rtol=0)
        for q in later:
            assert bool((q >= 0).all())
            assert float(q.sum()) == pytest.approx(1.0, abs=1e-5)


def test_the_marginals_match_the_enumerated_ones(target: TargetModel) -> None:
    # Each entry of q_k is a mean over M independent paths of p_T(x | c, path_<k), a number in [0, 1] whose
    # expectation is q_k(x): by Hoeffding it is off by 0.06 or more with probability <= 2 exp(-2 M 0.06^2), 1e-6 at
    # M = 2048, so the 20 cycles' few hundred entries all fall within 0.06 but for a wrong estimator.
    marginals = exact_marginals(conditionals(target, 4))
    oracle = oracle_at_context(target, samples=2048, block_size=4)
    checked = [0, 0, 0]
    for _ in range(20):
        run_cycles(oracle, 1)
        for k, q in enumerate(oracle.marginals):
            assert (q.double() - marginals[k]).abs().max() < 0.06, f"slot {k + 1}"
            checked[k] += 1
    assert checked[2] > 0  # some cycles reached the last slot
    # a marginal that is not the slot before's conditional at its likeliest token: the test can tell them apart
    assert (marginals[1] - conditionals(target, 4)[1][int(marginals[0].argmax())]).abs().max() > 0.2


def finite_sample_expectation(tables: list[torch.Tensor], samples: int) -> float:
    """Block 3: the exact expected tokens per cycle of the oracle with M = `samples` paths. Slot 1's q is p_T(. | c),
    so its draft is always accepted; slot 2's q is the mean of p_T(. | c, x) over M draws x ~ p_T(. | c), whose law
    is that of the counts of each x (a multinomial), enumerated here."""
    first, second = tables  # [V], [V, V]
    counts = torch.tensor([[b - a - 1 for a, b in zip((-1, *bars), (*bars, samples + VOCAB - 1), strict=True)]
                           for bars in itertools.combinations(range(samples + VOCAB - 1), VOCAB - 1)],
                          dtype=torch.float64)  # every way to split M paths over the V first tokens
    log_multinomial = math.lgamma(samples + 1) - torch.lgamma(counts + 1).sum(1) + (counts * first.log()).sum(1)
    q = counts / samples @ second  # [K, V]: q_2 for each split
    accepted = (first[None, :, None] * torch.minimum(second[None], q[:, None])).sum((1, 2))  # P(slot 2 accepted)
    return 2.0 + float((log_multinomial.exp() * accepted).sum())


def test_one_cycle_of_the_oracle_takes_the_enumerated_tokens_on_average(target: TargetModel) -> None:
    # Block 3, M = 8: the expectation is exact for that M (no bias to allow for). a + 1 is 2 or 3 (slot 1 is always
    # accepted), a Bernoulli of variance m (1 - m) <= 1/4: the mean of 1500 cycles has a standard error <= 0.013,
    # and 4 of them (0.052) is missed by chance with probability 6e-5.
    tables = conditionals(target, 3)
    expected = finite_sample_expectation(tables, samples=8)
    lengths = run_cycles(oracle_at_context(target, samples=8, block_size=3), 1500)
    share = expected - 2.0
    tolerance = 4 * math.sqrt(share * (1 - share) / len(lengths))
    assert abs(fmean(lengths) - expected) < tolerance
    # The oracle with the exact marginal lies close (8 paths cost this target little), and a drafter that drafts
    # slot 2 from slot 1's distribution (the marginal one slot late) lies far outside the tolerance: the check can fail.
    exact = exact_tokens_per_cycle(tables, exact_marginals(tables))
    assert abs(exact - expected) < 0.05
    one_slot_late = exact_tokens_per_cycle(tables, [tables[0], tables[0]])
    assert abs(one_slot_late - expected) > 4 * tolerance
    # The marginal is the optimum of fitting the target's distribution, not of acceptance: on this toy a drafter that
    # bets slot 2 on the conditional after slot 1's likeliest token is accepted more (docs/results.md says so).
    greedy_bet = exact_tokens_per_cycle(tables, [tables[0], tables[1][int(tables[0].argmax())]])
    assert greedy_bet > exact + 0.05


@pytest.mark.slow
def test_with_many_paths_a_block_of_4_takes_the_enumerated_tokens_of_the_exact_marginal(target: TargetModel) -> None:
    # Block 4, M = 2048, against the exact marginals. Coupling the run with an oracle holding the exact q_k (drafts
    # equal except with probability TV(q̂_k, q_k), the same uniforms) moves a cycle's a + 1 only when slot k's
    # drafts differ, and then by at most B - k; E TV(q̂_k, q_k) <= sqrt(V/M) / 2 (the variances of q̂_k's entries
    # sum to <= 1/M), slot 1 is exact: a bias of at most 3 sqrt(V/M) / 2 = 0.081. a + 1 lies in 1..4, a standard
    # deviation <= 1.5: the mean of 1500 cycles has a standard error <= 0.039; 4 of them make the rest.
    tables = conditionals(target, 4)
    expected = exact_tokens_per_cycle(tables, exact_marginals(tables))
    lengths = run_cycles(oracle_at_context(target, samples=2048, block_size=4), 1500)
    assert abs(fmean(lengths) - expected) < 1.5 * math.sqrt(VOCAB / 2048) + 4 * 1.5 / math.sqrt(len(lengths))


def test_a_temperature_near_zero_drafts_the_greedy_path(target: TargetModel) -> None:
    """Every path, hence every marginal, is the greedy one: every draft is accepted, τ is the block size, and the
    output is the target's greedy decoding."""
    oracle = MarginalOracle(target, 8, 4, 1e-5, torch.Generator().manual_seed(0))
    out = oracle.decode(CONTEXT, 13)
    assert out.acceptance_lengths == [4, 4, 4]
    assert out.tokens == own_greedy(target, CONTEXT, 13)


def test_a_seed_fixes_the_run_and_another_seed_changes_it(target: TargetModel) -> None:
    def decode(seed: int) -> tuple[list[int], list[int], SlotTotals]:
        slots = SlotTotals.zeros(3)
        out = MarginalOracle(target, 8, 4, TEMPERATURE, torch.Generator().manual_seed(seed)).decode(CONTEXT, 24,
                                                                                                      slots=slots)
        return out.tokens, out.acceptance_lengths, slots

    assert decode(0) == decode(0)
    assert decode(0)[0] != decode(1)[0]


def test_decoding_ends_at_a_stop_token_or_at_the_token_budget(target: TargetModel) -> None:
    oracle = MarginalOracle(target, 4, 4, TEMPERATURE, torch.Generator().manual_seed(0))
    out = oracle.decode(CONTEXT, 10)
    assert len(out.tokens) == 10 and out.finish_reason == "length"
    assert sum(out.acceptance_lengths) >= 9  # the first token comes from the prompt's pass, the rest from cycles
    stopped = oracle.decode(CONTEXT, 10, stop_ids=range(VOCAB))  # whatever comes first stops it
    assert len(stopped.tokens) == 1 and stopped.acceptance_lengths == [] and stopped.finish_reason == "stop"


def test_slot_totals_average_over_the_cycles_that_reached_each_slot() -> None:
    slots = SlotTotals([8, 4, 0], [4.0, 2.0, 0.0], [4.0, 2.0, 0.0])
    assert slots.rates() == {"expected_acceptance_given_reached": [0.5, 0.5, None],
                             "mode_acceptance_given_reached": [0.5, 0.5, None]}


def exact_block_verified_tokens(tables: list[torch.Tensor], marginals: list[torch.Tensor]) -> float:
    """1 + E[a] for drafts d_k ~ q_k judged together by block verification (`block_verify_law`), every draft
    block enumerated; the bonus slot's distribution does not enter a."""
    from dflash_train.runtime.sampling import block_verify_law

    slots, tokens = len(marginals), 1.0
    q = torch.stack(marginals)[None]  # [1, B-1, V]
    for drafts in itertools.product(range(VOCAB), repeat=slots):
        rows = [tables[k][drafts[:k]] for k in range(slots)]
        p = torch.stack([*rows, rows[-1]])[None]  # the last row stands in for the bonus slot's
        h, _ = block_verify_law(p, q, torch.tensor([drafts]))
        drawn = math.prod(float(marginals[k][d]) for k, d in enumerate(drafts))
        none_longer = 1.0
        for k in range(slots, 0, -1):
            tokens += drawn * none_longer * float(h[0, k]) * k
            none_longer *= 1 - float(h[0, k])
    return tokens


def test_with_block_verification_the_drafted_block_is_judged_on_its_own_conditionals(
        target: TargetModel, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every slot is drafted, and the rule sees the target's enumerated conditionals along the drafts (the bonus row
    after all of them), the oracle's marginals and its drafts; the cycle commits the kept drafts and the rule's
    token. Over many cycles the tokens per cycle match the enumerated expectation of block verification, which
    is at least token-wise testing's."""
    import dflash_train.eval.marginal_oracle as oracle_module

    tables = conditionals(target, 5)  # prefixes up to 3 tokens: the bonus row of block 4
    seen: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]] = []
    real = oracle_module.block_verify_sample

    def recorded(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202 - the rule's own signature
        found = real(*args, **kwargs)
        seen.append((args[0], args[1], args[2], found))
        return found

    monkeypatch.setattr(oracle_module, "block_verify_sample", recorded)
    oracle = MarginalOracle(target, 256, 4, TEMPERATURE, torch.Generator().manual_seed(0), verification="block")
    oracle.prefill(CONTEXT[:-1], 4)
    lengths = []
    for _ in range(400):
        cycle = oracle.cycle(len(CONTEXT) - 1, CONTEXT[-1], SlotTotals.zeros(3))
        logits, draft_logits, drafts, (kept, token) = seen[-1]
        d = tuple(drafts[0].tolist())
        for k in range(4):
            torch.testing.assert_close(torch.softmax(logits[0, k].double(), -1), tables[k][d[:k]], atol=1e-5, rtol=0)
        torch.testing.assert_close(draft_logits[0].exp(), torch.stack(oracle.marginals))
        assert cycle.committed == [*d[: int(kept)], int(token)]
        lengths.append(cycle.accepted + 1)
    marginals = exact_marginals(tables[:3])
    block = exact_block_verified_tokens(tables[:3], marginals)
    assert block >= exact_tokens_per_cycle(tables[:3], marginals)
    # a + 1 in [1, 4]: the standard error of 400 cycles is at most 0.075; M = 256 paths bias q by a few hundredths
    assert abs(fmean(lengths) - block) < 0.35
