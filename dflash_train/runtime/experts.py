"""The decode-experts kernel as one of transformers' experts implementations, for every MoE target whose experts
module uses transformers' experts interface (Qwen3-MoE, Mixtral, gpt-oss, GLM-4-MoE, DeepSeek-V3, Qwen3.5-MoE,
Qwen3-Next and others): their shared experts and block stay the model's own. Routers whose rule the router
kernel reproduces (`ROUTERS`) choose through it after their own logits' product.

Steps of a few tokens (decode, verify, the regeneration batch) run on `kernels/decode_experts.py`; anything
else runs on the implementation the model had (the grouped products on CUDA): prefill, training passes that
need gradients, experts the kernel does not reproduce (no gate, a norm after each expert, experts split
across devices). Installed by the static runtime when it runs its Triton kernels.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, _default_apply_gate

from dflash_train.kernels._triton import HAS_TRITON, interpreter_ready
from dflash_train.kernels.decode_experts import ClampedGate, decode_experts_triton, fits
from dflash_train.kernels.moe_router import (
    MAX_EXPERTS,
    SOFTMAX_THEN_TOP_K,
    TOP_K_THEN_SOFTMAX,
    moe_router_triton,
)

NAME = "dflash_decode"
_FALLBACK = "_dflash_fallback_experts"  # the implementation a module had before, for the steps the kernel leaves


def experts_modules(model: nn.Module) -> list[nn.Module]:
    """The modules of `model` dispatched through transformers' experts interface (their own `has_gate` flag)."""
    return [module for module in model.modules() if hasattr(module, "has_gate") and hasattr(module, "down_proj")]


class RouterRule(NamedTuple):
    """What a router class does after its logits: the order of softmax and top-k, whether the chosen weights are
    renormalised (True, False, or the name of the module's attribute that says), and if they stay in fp32."""

    order: int
    normalize: bool | str
    fp32_weights: bool


# transformers' router classes, by name, whose forward is F.linear then exactly this rule (in every version
# the project supports: tests/runtime/test_decode_experts_models.py compares each with the class's forward).
ROUTERS: dict[str, RouterRule] = {
    "Qwen3MoeTopKRouter": RouterRule(SOFTMAX_THEN_TOP_K, "norm_topk_prob", False),
    "Qwen3NextTopKRouter": RouterRule(SOFTMAX_THEN_TOP_K, "norm_topk_prob", False),
    "Qwen3_5MoeTopKRouter": RouterRule(SOFTMAX_THEN_TOP_K, True, False),
    "MixtralTopKRouter": RouterRule(SOFTMAX_THEN_TOP_K, True, True),
    "GptOssTopKRouter": RouterRule(TOP_K_THEN_SOFTMAX, False, False),
}


def use_decode_experts(model: nn.Module, enabled: bool = True) -> bool:
    """Switch `model`'s experts to the decode kernel and its known routers to the router kernel (or both back
    to what they had); whether any module switched."""
    modules = experts_modules(model)
    if not modules or not HAS_TRITON or not hasattr(model, "set_experts_implementation"):
        return False
    for router in (module for module in model.modules() if type(module).__name__ in ROUTERS):
        if enabled:
            router.forward = types.MethodType(decode_router_forward, router)
        else:
            router.__dict__.pop("forward", None)  # the class's own again
    _register()
    current = model.config._experts_implementation
    if enabled and current != NAME:
        for module in modules:
            setattr(module, _FALLBACK, module.config._experts_implementation)
        model.set_experts_implementation(NAME)
    elif not enabled and current == NAME:
        model.set_experts_implementation(getattr(modules[0], _FALLBACK, "grouped_mm"))
    return True


def decode_experts_forward(module: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                           top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers' experts call: hidden_states [T, H], the router's top-k ids and weights [T, k] -> [T, H]."""
    if not kernel_takes(module, hidden_states, top_k_index):
        return _fallback(module, hidden_states, top_k_index, top_k_weights)
    return decode_experts_triton(
        hidden_states, top_k_index, top_k_weights, module.gate_up_proj, module.down_proj,
        getattr(module, "gate_up_proj_bias", None) if module.has_bias else None,
        getattr(module, "down_proj_bias", None) if module.has_bias else None,
        transposed=module.is_transposed, gate=kernel_gate(module))


def decode_router_forward(router: nn.Module, hidden_states: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """A known router's forward (`ROUTERS`): its own logits' product, then the router kernel's choice, where the
    kernel runs (no gradient, a device it runs on); else the class's own forward."""
    rule = ROUTERS[type(router).__name__]
    hidden_states = hidden_states.reshape(-1, router.hidden_dim)
    on_device = hidden_states.is_cuda or (hidden_states.device.type == "cpu" and interpreter_ready())
    needs_grad = torch.is_grad_enabled() and (hidden_states.requires_grad or router.weight.requires_grad)
    if not on_device or needs_grad or router.num_experts > MAX_EXPERTS:
        return type(router).forward(router, hidden_states)
    logits = F.linear(hidden_states, router.weight, getattr(router, "bias", None))
    normalize = getattr(router, rule.normalize) if isinstance(rule.normalize, str) else rule.normalize
    weights, index = moe_router_triton(logits, router.top_k, rule.order, bool(normalize),
                                       torch.float32 if rule.fp32_weights else logits.dtype)
    return logits, weights, index


def kernel_takes(module: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor) -> bool:
    """Whether this call is one the kernel reproduces: a few tokens, no gradient, on a device it runs on."""
    if not getattr(module, "has_gate", False) or not hasattr(module, "gate_up_proj"):  # ungated experts (Nemotron-H's
        return False  # squared ReLU on up alone): the kernel folds a gate into the up product, so they stay the model's
    on_device = hidden_states.is_cuda or (hidden_states.device.type == "cpu" and interpreter_ready())
    pairs, experts = top_k_index.numel(), module.gate_up_proj.shape[0]
    return (on_device and fits(pairs, experts, bool(module.is_transposed)) and module.has_gate
            and not getattr(module, "has_post_expert_norm", False)
            and not getattr(module, "_is_expert_parallel", False)
            and not (torch.is_grad_enabled() and (hidden_states.requires_grad or module.gate_up_proj.requires_grad))
            and module.gate_up_proj.dtype == hidden_states.dtype == module.down_proj.dtype)


def kernel_gate(module: nn.Module) -> ClampedGate | Callable[[torch.Tensor], torch.Tensor] | None:
    """The gate as the kernel takes it: None for transformers' default SiLU(gate) * up over concatenated
    halves and a `ClampedGate` for gpt-oss's (both folded into the up product); any other gate is the module's
    own, run between the two products."""
    gate = type(module)._apply_gate
    if gate is _default_apply_gate and getattr(module, "is_concatenated", True) and _is_silu(
            getattr(module, "act_fn", None)):
        return None
    if gate.__qualname__ == "GptOssExperts._apply_gate" and not getattr(module, "is_concatenated", True):
        return ClampedGate(float(module.alpha), float(module.limit))
    return module._apply_gate


def _is_silu(act: Any) -> bool:
    return isinstance(act, nn.SiLU) or type(act).__name__ in ("SiLUActivation", "SiLU")


def _fallback(module: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
              top_k_weights: torch.Tensor) -> torch.Tensor:
    name = getattr(module, _FALLBACK, "grouped_mm")
    if name == "eager" or name not in ALL_EXPERTS_FUNCTIONS:
        return type(module).forward.__wrapped__(module, hidden_states, top_k_index, top_k_weights)
    return ALL_EXPERTS_FUNCTIONS[name](module, hidden_states, top_k_index, top_k_weights)


def _register() -> None:
    if NAME not in ALL_EXPERTS_FUNCTIONS:
        ALL_EXPERTS_FUNCTIONS.register(NAME, decode_experts_forward)
