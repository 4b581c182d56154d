"""The decode-experts kernel against a plain per-pair PyTorch loop (its reference, itself checked against
transformers' own experts modules in fp32), in the layouts MoE models store: [gate; up] halves with SiLU
(Qwen3-MoE, Mixtral), transposed, biased and interleaved with gpt-oss's clamped gate (both gates folded into
the kernel), and a gate the kernel leaves to the model; experts hit by
more pairs than one tile holds; a token's output the same bitwise whatever else the step holds.

On CPU the kernels run under TRITON_INTERPRET=1; when this process imported triton without it, the file
re-runs itself in a subprocess that sets it from the start.
"""

from __future__ import annotations

import pytest
import torch
from transformers import GptOssConfig, Qwen3MoeConfig
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

from dflash_train.kernels._triton import HAS_TRITON, interpreting
from dflash_train.kernels.decode_experts import ClampedGate, decode_experts_triton, experts_reference
from tests.helpers.kernels import DEVICE, compile_for_h100, kernels_here, randn, under_interpreter

test_under_interpreter = under_interpreter(__file__)


def own_gate(h: torch.Tensor) -> torch.Tensor:
    """A gate the kernel does not fold in (GELU of interleaved gate columns times up): run between launches."""
    return torch.nn.functional.gelu(h[..., ::2]) * h[..., 1::2]


def routing(tokens: int, top_k: int, experts: int, gen: torch.Generator,
            crowd: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct experts per token, drawn at random (`crowd`: every token's first choice is that expert)."""
    index = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
    if crowd is not None:
        for t in range(tokens):
            row = index[t].tolist()
            if crowd in row:
                row.remove(crowd)
            index[t] = torch.tensor([crowd, *row][:top_k])
    weights = torch.softmax(torch.randn(tokens, top_k, generator=gen), dim=-1)
    return index, weights


def weights_for(experts: int, hidden: int, inner: int, dtype: torch.dtype, gen: torch.Generator,
                transposed: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    up = randn(experts, 2 * inner, hidden, dtype=torch.float32, gen=gen) / hidden ** 0.5
    down = randn(experts, hidden, inner, dtype=torch.float32, gen=gen) / inner ** 0.5
    if transposed:
        up, down = up.transpose(1, 2).contiguous(), down.transpose(1, 2).contiguous()
    return (up.to(dtype), down.to(dtype), randn(experts, 2 * inner, dtype=dtype, gen=gen),
            randn(experts, hidden, dtype=dtype, gen=gen))


CASES = [  # tokens, top_k, experts, hidden, inner, crowd
    (1, 2, 6, 40, 24, None),  # a decode step
    (5, 3, 8, 72, 40, None),  # a few rows, sizes off the tiles
    (20, 2, 6, 48, 24, 4),  # one expert taken by every token: more pairs than a tile, in two chunks
]


@kernels_here
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["silu_halves", "gpt_oss", "own_gate"])
@pytest.mark.parametrize(("tokens", "top_k", "experts", "hidden", "inner", "crowd"), CASES)
def test_kernel_matches_the_reference(dtype: torch.dtype, layout: str, tokens: int, top_k: int, experts: int,
                                      hidden: int, inner: int, crowd: int | None) -> None:
    gen = torch.Generator().manual_seed(tokens * 31 + hidden)
    transposed = layout != "silu_halves"
    up, down, up_bias, down_bias = weights_for(experts, hidden, inner, dtype, gen, transposed)
    biases = (up_bias, down_bias) if transposed else (None, None)
    gate = {"silu_halves": None, "gpt_oss": ClampedGate(1.702, 1.5), "own_gate": own_gate}[layout]
    x = randn(tokens, hidden, dtype=dtype, gen=gen)
    index, weights = routing(tokens, top_k, experts, gen, crowd)
    got = decode_experts_triton(*(t.to(DEVICE) for t in (x, index, weights, up, down)),
                                *(b.to(DEVICE) if b is not None else None for b in biases),
                                transposed=transposed, gate=gate).cpu()
    expected = experts_reference(x, index, weights, up, down, *biases, transposed=transposed, gate=gate)
    assert got.shape == (tokens, hidden) and got.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(got, expected, atol=2e-5, rtol=2e-5)
    else:  # the same rounding steps: equal but for a sum whose order tips a rounding (rare, one unit)
        assert float((got != expected).float().mean()) < 0.03
        torch.testing.assert_close(got, expected, atol=2e-2, rtol=1e-2)


@kernels_here
def test_a_token_is_batch_invariant() -> None:
    """One token alone, then among others (sharing its experts or not): bitwise the same output."""
    gen = torch.Generator().manual_seed(5)
    experts, hidden, inner, top_k, dtype = 8, 64, 32, 2, torch.bfloat16
    up, down, _, _ = (t.to(DEVICE) for t in weights_for(experts, hidden, inner, dtype, gen, False))
    x, (index, weights) = randn(1, hidden, dtype=dtype, gen=gen), routing(1, top_k, experts, gen)
    alone = decode_experts_triton(x.to(DEVICE), index.to(DEVICE), weights.to(DEVICE), up, down)[0]
    for tokens, place in [(3, 1), (16, 9), (24, 0)]:
        others = randn(tokens, hidden, dtype=dtype, gen=gen) * 3
        more_index, more_weights = routing(tokens, top_k, experts, gen, crowd=int(index[0, 0]))
        others[place], more_index[place], more_weights[place] = x[0], index[0], weights[0]
        got = decode_experts_triton(others.to(DEVICE), more_index.to(DEVICE), more_weights.to(DEVICE), up, down)
        assert torch.equal(got[place], alone), (tokens, place)


def test_the_reference_is_the_modules() -> None:
    """The per-pair loop in fp32 equals transformers' own eager experts (Qwen3-MoE's and gpt-oss's)."""
    gen = torch.Generator().manual_seed(7)
    tokens, top_k, experts, hidden, inner = 6, 2, 4, 32, 16
    x = randn(tokens, hidden, dtype=torch.float32, gen=gen)
    index, weights = routing(tokens, top_k, experts, gen)
    qwen = Qwen3MoeExperts(Qwen3MoeConfig(hidden_size=hidden, moe_intermediate_size=inner, num_experts=experts))
    oss = GptOssExperts(GptOssConfig(hidden_size=hidden, intermediate_size=inner, num_local_experts=experts))
    for module in (qwen, oss):
        for param in module.parameters():
            param.data = randn(*param.shape, dtype=torch.float32, gen=gen) / 4
        module.config._experts_implementation = "eager"
    oss.limit = 0.3  # small enough that the clamps act on these values
    with torch.no_grad():
        torch.testing.assert_close(experts_reference(x, index, weights, qwen.gate_up_proj, qwen.down_proj),
                                   qwen(x, index, weights), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(
            experts_reference(x, index, weights, oss.gate_up_proj, oss.down_proj, oss.gate_up_proj_bias,
                              oss.down_proj_bias, transposed=True, gate=ClampedGate(oss.alpha, oss.limit)),
            oss(x, index, weights), atol=1e-5, rtol=1e-5)


@kernels_here
@pytest.mark.parametrize("crowd", [None, 1])
def test_a_grid_over_the_steps_experts_gives_the_bits_of_one_over_every_expert(
        crowd: int | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Up to COMPACT_PAIRS pairs, a program row per distinct expert of the step (fewer rows than experts when
    tokens share them); past it, one per expert: the same bits either way."""
    from dflash_train.kernels import decode_experts

    gen = torch.Generator().manual_seed(9)
    up, down, _, _ = (t.to(DEVICE) for t in weights_for(16, 48, 24, torch.bfloat16, gen, False))
    x = randn(6, 48, dtype=torch.bfloat16, gen=gen).to(DEVICE)
    index, weights = (t.to(DEVICE) for t in routing(6, 2, 16, gen, crowd))
    compact = decode_experts_triton(x, index, weights, up, down)
    monkeypatch.setattr(decode_experts, "COMPACT_PAIRS", 0)
    assert torch.equal(decode_experts_triton(x, index, weights, up, down), compact)


@pytest.mark.skipif(not HAS_TRITON or interpreting(), reason="needs triton's compiler")
@pytest.mark.parametrize(("compact", "gate"), [(True, 2), (False, 1)])
def test_the_kernel_compiles_for_an_h100(compact: bool, gate: int) -> None:
    """sm_90 code without a GPU: the distinct-expert search and both folded gates, with no 16-bit FMA."""
    from dflash_train.kernels.decode_experts import _experts_kernel

    pointers = {name: "*bf16" for name in ("x_ptr", "w_ptr", "b_ptr", "rw_ptr", "y_ptr")}
    pointers |= {"ids_ptr": "*i32", "ALPHA": "fp32", "LIMIT": "fp32"}
    constants = dict(S_PAD=64, COMPACT=compact, GATE=gate, HAS_BIAS=gate == 2, WEIGHTED=False, BLOCK_M=16,
                     BLOCK_N=64, BLOCK_K=64, IEEE=False, UPCAST=False, ROUND_BITS=False)
    assert compile_for_h100(_experts_kernel, constants, pointers, "fp32")
