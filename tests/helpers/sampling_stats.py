"""The exact-distribution test of sampled decoding: a tiny target whose joint law over a few tokens is
enumerated from its own forward, and chi-square tests of sampled token tuples against it (or each other)."""

from __future__ import annotations

from collections import Counter

import torch

from dflash_train.models import DFlashConfig, DFlashDraftModel
from dflash_train.runtime.engine import DecodeEngine, EngineConfig
from dflash_train.target import TargetModel
from tests.helpers.tiny_models import make_tiny_model

VOCAB, PROMPT, TEMPERATURE, SAMPLES, NEW = 12, [3, 7, 1, 4], 0.8, 6000, 3


def sharpened_target() -> TargetModel:
    """The tiny target of the distribution tests: vocabulary VOCAB, a head sharpened to peaked but not
    degenerate next-token distributions."""
    model = make_tiny_model("llama", num_layers=3, seed=3, vocab_rows=VOCAB)
    with torch.no_grad():
        model.lm_head.weight.mul_(12)
    return TargetModel(model, tokenizer=None)


def exact_joint(target: TargetModel) -> torch.Tensor:
    """P(t1, t2, t3 | prompt) [V, V, V] by enumeration."""
    def next_probs(prefixes: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return torch.softmax(target.model(prefixes).logits[:, -1].double() / TEMPERATURE, dim=-1)

    prompt = torch.tensor([PROMPT])
    p1 = next_probs(prompt)[0]  # [V]
    firsts = torch.arange(VOCAB)[:, None]
    p2 = next_probs(torch.cat([prompt.expand(VOCAB, -1), firsts], 1))  # [V, V]
    pairs = torch.cartesian_prod(torch.arange(VOCAB), torch.arange(VOCAB))  # [V*V, 2]
    p3 = next_probs(torch.cat([prompt.expand(VOCAB * VOCAB, -1), pairs], 1)).view(VOCAB, VOCAB, VOCAB)
    return p1[:, None, None] * p2[:, :, None] * p3


def sampling_engine(target: TargetModel, with_draft: bool, seed: int, draft_scale: float = 1.0,
                    verification: str = "token") -> DecodeEngine:
    """The loop that draws SAMPLES generations of NEW tokens at TEMPERATURE in one batch, with a random
    drafter (block 3, seeded; drafts sampled at TEMPERATURE * draft_scale) or none. On a CPU it runs the
    PyTorch kernels; on CUDA the loop's defaults (its graph, torch.compile, the Triton kernels)."""
    torch.manual_seed(seed)
    config = DFlashConfig.from_target_config(target.config, mask_token_id=VOCAB - 1, num_hidden_layers=1,
                                             block_size=3)
    device = target.model.device
    draft = DFlashDraftModel(config).eval().to(device) if with_draft else None
    settings = {"kernels": "torch"} if device.type == "cpu" else {}
    return DecodeEngine(target, draft, EngineConfig(batch_size=SAMPLES, block_size=3, max_new_tokens=NEW,
                                                    max_length=16, temperature=TEMPERATURE,
                                                    draft_temperature_scale=draft_scale,
                                                    verification=verification, **settings))


def generations(engine: DecodeEngine) -> tuple[Counter[tuple[int, ...]], Counter[int]]:
    """Token tuples and acceptance lengths of the engine's SAMPLES generations from PROMPT."""
    outputs, _ = engine.generate([PROMPT] * SAMPLES)
    return Counter(tuple(o.tokens) for o in outputs), Counter(a for o in outputs for a in o.acceptance_lengths)


def draw(target: TargetModel, with_draft: bool, seed: int, draft_scale: float = 1.0,
         verification: str = "token") -> tuple[Counter[tuple[int, ...]], Counter[int]]:
    """`generations` of a fresh `sampling_engine`."""
    return generations(sampling_engine(target, with_draft, seed, draft_scale, verification))


def pooled_cells(expected: torch.Tensor) -> list[list[tuple[int, ...]]]:
    """Cells with at least 5 expected samples, and one cell pooling all the others."""
    cells = [tuple(int(i) for i in index) for index in torch.cartesian_prod(*[torch.arange(VOCAB)] * NEW)]
    big = [[c] for c in cells if float(expected[c]) * SAMPLES >= 5]
    return big + [[c for c in cells if float(expected[c]) * SAMPLES < 5]]


def chi2_pvalue(statistic: float, dof: int) -> float:
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(statistic / 2, dtype=torch.float64)))


def goodness_of_fit(counts: Counter[tuple[int, ...]], expected: torch.Tensor) -> float:
    cells = pooled_cells(expected)
    observed = torch.tensor([sum(counts[c] for c in group) for group in cells], dtype=torch.float64)
    wanted = torch.tensor([sum(float(expected[c]) for c in group) for group in cells], dtype=torch.float64) * SAMPLES
    return chi2_pvalue(float(((observed - wanted) ** 2 / wanted).sum()), len(cells) - 1)


def homogeneity(a: Counter[tuple[int, ...]], b: Counter[tuple[int, ...]], expected: torch.Tensor) -> float:
    cells = pooled_cells(expected)
    table = torch.tensor([[sum(s[c] for c in group) for group in cells] for s in (a, b)], dtype=torch.float64)
    fitted = table.sum(1, keepdim=True) * table.sum(0, keepdim=True) / table.sum()
    return chi2_pvalue(float(((table - fitted) ** 2 / fitted).sum()), len(cells) - 1)
