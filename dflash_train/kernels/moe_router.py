"""A MoE router's choice from its logits in one launch: softmax, top-k and the renormalisation of the chosen
weights (Qwen3-MoE, Qwen3-Next, Qwen3.5-MoE, Mixtral), or top-k then a softmax over the chosen (gpt-oss).

Why: transformers' routers follow the logits' product with a softmax, `torch.topk` (a radix select and a sort
of its results), a sum and a division: five launches a layer where the work is a few hundred numbers, and at
Qwen3-30B-A3B's batch-1 step about a sixth of the step (docs/benchmarks.md, `decode_experts`).

How: one program per token holds its E logits (E ≤ 1024), computes the softmax in fp32 where it comes first,
takes the k largest by k rounds of max (the lowest expert id first among equal values), and writes the k
weights, finished as the module finishes them, and their expert ids. The logits' product stays the model's
(a matrix-vector product with its own kernel). A token's result depends on its logits alone: batch invariant.
"""

# Deliberately no postponed annotations (PEP 563): Triton reads the `tl.constexpr` annotations of kernels.
import torch
from torch.library import triton_op, wrap_triton

from dflash_train.kernels._triton import interpreting, jit, next_power_of_2, tl
from dflash_train.kernels.device import rounded

SOFTMAX_THEN_TOP_K = 0
TOP_K_THEN_SOFTMAX = 1
MAX_EXPERTS = 1024


def router_reference(logits: torch.Tensor, top_k: int, order: int, normalize: bool,
                     out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """What transformers' routers compute from their logits [T, E]: (weights [T, k] in `out_dtype`, ids [T, k])."""
    if order == SOFTMAX_THEN_TOP_K:
        probs = torch.softmax(logits.float(), dim=-1)
        values, index = torch.topk(probs, top_k, dim=-1)
        if normalize:
            values = values / values.sum(dim=-1, keepdim=True)
        return values.to(out_dtype), index
    values, index = torch.topk(logits, top_k, dim=-1)
    return torch.softmax(values, dim=-1, dtype=values.dtype).to(out_dtype), index


def _router_kernel(logits_ptr, weights_ptr, index_ptr, E, stride_l, TOP_K: tl.constexpr, K_PAD: tl.constexpr,
                   E_PAD: tl.constexpr, ORDER: tl.constexpr, NORMALIZE: tl.constexpr, ROUND_BITS: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    experts = tl.arange(0, E_PAD)
    ok = experts < E
    logits = tl.load(logits_ptr + token * stride_l + experts, mask=ok, other=float("-inf")).to(tl.float32)
    scores = logits
    if ORDER == 0:  # softmax over every expert, in fp32
        shifted = tl.exp(logits - tl.max(logits, axis=0))
        scores = shifted / tl.sum(shifted, axis=0)
    scores = tl.where(ok, scores, float("-inf"))
    slots = tl.arange(0, K_PAD)
    chosen = tl.zeros([K_PAD], dtype=tl.float32)
    ids = tl.zeros([K_PAD], dtype=tl.int32)
    for slot in tl.static_range(TOP_K):  # the largest left, the lowest id among equals, then taken out
        best = tl.max(scores, axis=0)
        pick = tl.min(tl.where(scores == best, experts, E_PAD), axis=0)
        chosen = tl.where(slots == slot, best, chosen)
        ids = tl.where(slots == slot, pick, ids)
        scores = tl.where(experts == pick, float("-inf"), scores)
    used = slots < TOP_K
    if ORDER == 0:
        if NORMALIZE:
            chosen = chosen / tl.sum(tl.where(used, chosen, 0.0), axis=0)
    else:  # a softmax over the k chosen logits, rounded to the logits' dtype as the module's is
        shifted = tl.where(used, tl.exp(chosen - tl.max(tl.where(used, chosen, float("-inf")), axis=0)), 0.0)
        chosen = shifted / tl.sum(shifted, axis=0)
    out_ty = weights_ptr.dtype.element_ty
    tl.store(weights_ptr + token * TOP_K + slots, rounded(chosen, ROUND_BITS, False).to(out_ty), mask=used)
    tl.store(index_ptr + token * TOP_K + slots, ids.to(tl.int64), mask=used)


@triton_op("dflash_train::moe_router", mutates_args=())
def _router_op(logits: torch.Tensor, top_k: int, order: int, normalize: bool,
               out_fp32: bool) -> tuple[torch.Tensor, torch.Tensor]:
    tokens, experts = logits.shape
    out_dtype = torch.float32 if out_fp32 else logits.dtype
    weights = torch.empty((tokens, top_k), device=logits.device, dtype=out_dtype)
    index = torch.empty((tokens, top_k), device=logits.device, dtype=torch.int64)
    kernel = jit(_router_kernel)
    if not interpreting():  # traced by torch.compile as part of the graph (interpreted kernels cannot be)
        kernel = wrap_triton(kernel)
    kernel[(tokens,)](logits, weights, index, experts, logits.stride(0), TOP_K=top_k,
                      K_PAD=next_power_of_2(top_k), E_PAD=next_power_of_2(experts), ORDER=order,
                      NORMALIZE=normalize, ROUND_BITS=interpreting() and out_dtype == torch.bfloat16)
    return weights, index


def moe_router_triton(logits: torch.Tensor, top_k: int, order: int, normalize: bool = True,
                      out_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`router_reference`'s contract in one launch: logits [T, E] -> (weights [T, k] in `out_dtype` (the
    logits' by default; fp32 or the logits' dtype), expert ids [T, k] int64)."""
    out_dtype = out_dtype or logits.dtype
    assert logits.dim() == 2 and 1 <= top_k <= logits.shape[1] <= MAX_EXPERTS, "logits [T, E], 1 <= k <= E <= 1024"
    assert out_dtype in (torch.float32, logits.dtype), "weights in fp32 or the logits' dtype"
    return _router_op(logits.contiguous(), top_k, order, normalize, out_dtype == torch.float32)
