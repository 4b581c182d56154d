"""Every MoE target of the matrix with its experts switched to the decode kernel and its known routers to the router
kernel (`runtime/experts.py`): the model's own forward gives the logits it gives with transformers' eager
experts and its routers' own forwards (fp32), the kernels ran for the steps of few tokens and left the others
to the implementation the model had, and switching back restores both.
The static runtime switches a MoE target's experts with its kernels.

On CPU the kernels run under TRITON_INTERPRET=1; when this process imported triton without it, the file
re-runs itself in a subprocess that sets it from the start.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from dflash_train.kernels.decode_experts import MAX_PAIRS, ClampedGate
from dflash_train.runtime import experts
from dflash_train.runtime.experts import NAME, ROUTERS, experts_modules, kernel_gate, use_decode_experts
from tests.helpers.kernels import DEVICE, kernels_here, under_interpreter
from tests.helpers.tiny_targets import TINY_TARGET_FAMILIES, build_tiny_target

test_under_interpreter = under_interpreter(__file__)
VOCAB = 96


def counting(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Pairs per kernel call, recorded as the experts implementation calls the kernel."""
    calls: list[int] = []
    kernel: Callable[..., Any] = experts.decode_experts_triton

    def spy(x: torch.Tensor, index: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append(index.numel())
        return kernel(x, index, *args, **kwargs)

    monkeypatch.setattr(experts, "decode_experts_triton", spy)
    return calls


def counting_routers(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Tokens per router-kernel call."""
    calls: list[int] = []
    kernel: Callable[..., Any] = experts.moe_router_triton

    def spy(logits: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        calls.append(logits.shape[0])
        return kernel(logits, *args, **kwargs)

    monkeypatch.setattr(experts, "moe_router_triton", spy)
    return calls


@kernels_here
@pytest.mark.parametrize("model_type", TINY_TARGET_FAMILIES["moe"])
def test_the_kernel_gives_the_models_logits(model_type: str, monkeypatch: pytest.MonkeyPatch) -> None:
    model = build_tiny_target(model_type, VOCAB, seed=3).to(DEVICE)
    model.set_experts_implementation("eager")
    ids = torch.randint(0, VOCAB, (1, 4), generator=torch.Generator().manual_seed(1)).to(DEVICE)  # in reach for every layout
    with torch.no_grad():
        expected = model(ids).logits
        calls, routed = counting(monkeypatch), counting_routers(monkeypatch)
        assert use_decode_experts(model)
        assert model.config._experts_implementation == NAME
        got = model(ids).logits
    assert calls and all(pairs <= MAX_PAIRS for pairs in calls)
    known_routers = [m for m in model.modules() if type(m).__name__ in ROUTERS]
    assert len(routed) == len(known_routers)  # each known router chose through the kernel, once
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    use_decode_experts(model, enabled=False)
    assert model.config._experts_implementation == "eager"
    assert not any("forward" in vars(router) for router in known_routers)  # the classes' own forwards again


@kernels_here
def test_steps_of_many_tokens_and_gradients_keep_the_models_experts(monkeypatch: pytest.MonkeyPatch) -> None:
    model = build_tiny_target("qwen3_moe", VOCAB, seed=4).to(DEVICE)
    model.set_experts_implementation("eager")
    use_decode_experts(model)
    calls = counting(monkeypatch)
    top_k = model.config.num_experts_per_tok
    long = torch.zeros(1, MAX_PAIRS // top_k + 1, dtype=torch.long, device=DEVICE)
    with torch.no_grad():
        model(long)
    assert calls == []  # a prefill past the kernel's reach
    embeds = model.get_input_embeddings()(long[:, :3]).detach().requires_grad_()
    model(inputs_embeds=embeds).logits.sum().backward()  # a pass that needs gradients
    assert calls == [] and embeds.grad is not None


@pytest.mark.parametrize(("model_type", "folded"), [("qwen3_moe", None), ("mixtral", None), ("deepseek_v3", None),
                                                    ("gpt_oss", ClampedGate)])
def test_known_gates_are_folded_into_the_kernel(model_type: str, folded: type | None) -> None:
    model = build_tiny_target(model_type, VOCAB)
    gates = {type(gate) if gate is not None else None for gate in map(kernel_gate, experts_modules(model))}
    assert gates == {folded}
