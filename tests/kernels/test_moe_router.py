"""The router kernel against `router_reference` (softmax and torch.topk as transformers' routers call them), which
is itself checked against every router class the runtime hands to the kernel (`runtime.experts.ROUTERS`), in
the transformers installed here.

On CPU the kernels run under TRITON_INTERPRET=1; when this process imported triton without it, the file
re-runs itself in a subprocess that sets it from the start.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dflash_train.kernels.moe_router import (
    SOFTMAX_THEN_TOP_K,
    TOP_K_THEN_SOFTMAX,
    moe_router_triton,
    router_reference,
)
from dflash_train.runtime.experts import ROUTERS
from tests.helpers.kernels import DEVICE, kernels_here, under_interpreter
from tests.helpers.tiny_targets import TINY_TARGET_FAMILIES, build_tiny_target

test_under_interpreter = under_interpreter(__file__)


def distinct_logits(tokens: int, experts: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Logits with no two equal in a row (steps of 1/16, exact in bf16), shuffled per token."""
    gen = torch.Generator().manual_seed(seed)
    values = (torch.arange(experts, dtype=torch.float32) - experts / 2) / 16
    return torch.stack([values[torch.randperm(experts, generator=gen)] for _ in range(tokens)]).to(dtype)


@kernels_here
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("order", "normalize", "fp32_weights"), [
    (SOFTMAX_THEN_TOP_K, True, False), (SOFTMAX_THEN_TOP_K, False, False), (SOFTMAX_THEN_TOP_K, True, True),
    (TOP_K_THEN_SOFTMAX, False, False)])
@pytest.mark.parametrize(("tokens", "experts", "top_k"), [(1, 128, 8), (5, 60, 4), (3, 8, 1)])
def test_kernel_matches_the_reference(dtype: torch.dtype, order: int, normalize: bool, fp32_weights: bool,
                                      tokens: int, experts: int, top_k: int) -> None:
    logits = distinct_logits(tokens, experts, dtype, seed=tokens + experts)
    out_dtype = torch.float32 if fp32_weights else dtype
    weights, index = moe_router_triton(logits.to(DEVICE), top_k, order, normalize, out_dtype)
    expected_weights, expected_index = router_reference(logits, top_k, order, normalize, out_dtype)
    assert torch.equal(index.cpu(), expected_index)  # the same experts, in the same order
    assert weights.dtype == out_dtype
    torch.testing.assert_close(weights.cpu(), expected_weights, atol=1e-6, rtol=1e-5 if out_dtype == torch.float32
                               else 8e-3)


@kernels_here
def test_equal_logits_choose_the_lowest_ids() -> None:
    logits = torch.tensor([[0.5, 2.0, 2.0, 1.0, 2.0, 2.0]])
    _, index = moe_router_triton(logits.to(DEVICE), 3, SOFTMAX_THEN_TOP_K, True)
    assert index.cpu().tolist() == [[1, 2, 4]]


def routers_of(model_type: str) -> list[torch.nn.Module]:
    model = build_tiny_target(model_type, 64, seed=2)
    return [module for module in model.modules() if type(module).__name__ in ROUTERS]


@pytest.mark.parametrize("model_type", [t for t in TINY_TARGET_FAMILIES["moe"] if routers_of(t)])
def test_the_rules_are_the_router_classes(model_type: str) -> None:
    """Each known router's forward is its logits' product then `router_reference` under its rule."""
    router = routers_of(model_type)[0]
    rule = ROUTERS[type(router).__name__]
    x = torch.randn(6, router.hidden_dim, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        router.weight.normal_(0.0, 1.0)
        logits, weights, index = router(x)
    normalize = getattr(router, rule.normalize) if isinstance(rule.normalize, str) else rule.normalize
    expected_logits = F.linear(x, router.weight, getattr(router, "bias", None))
    expected_weights, expected_index = router_reference(expected_logits, router.top_k, rule.order, bool(normalize),
                                                        torch.float32 if rule.fp32_weights else logits.dtype)
    torch.testing.assert_close(logits, expected_logits)
    assert torch.equal(index, expected_index) and weights.dtype == expected_weights.dtype
    torch.testing.assert_close(weights, expected_weights)
