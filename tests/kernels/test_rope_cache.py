"""The fused attention-prologue kernel (q/k norms + RoPE + K/V cache write) against its PyTorch reference,
and the static target with the kernel against the same target on its PyTorch path (Llama without q/k
norms, Qwen2 with q/k/v biases, Qwen3 with q_norm/k_norm, a YaRN-scaled RoPE; decode and verify steps,
rows at different positions).

On CPU the kernels run under TRITON_INTERPRET=1; when this process imported triton without it, the file
re-runs itself in a subprocess that sets it from the start.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM

from dflash_train.kernels._triton import HAS_TRITON, interpreting
from dflash_train.kernels.rope_cache import (
    _rope_cache_kernel,
    rope_cache_reference,
    rope_cache_triton,
    supports_rope,
)
from dflash_train.runtime.fused_layer import FusedLayer
from dflash_train.runtime.static_target import StaticTarget, static_attention
from dflash_train.target import TargetModel
from tests.helpers.kernels import DEVICE, compile_for_h100, kernels_here, pointers_written, under_interpreter
from tests.helpers.tiny_models import make_tiny_config, make_tiny_target, make_tiny_tokenizer

test_under_interpreter = under_interpreter(__file__)

SENTINEL = 9.0


def rope_tables(positions: torch.Tensor, head_dim: int, theta: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [n, T, D] as transformers' default rotary embedding builds them (cat([freqs, freqs]))."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    freqs = positions.float()[..., None] * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def make_case(heads: int, kv_heads: int, head_dim: int, tokens: int, norms: bool, dtype: torch.dtype,
              seed: int) -> dict[str, torch.Tensor | None]:
    """Three input rows going to cache rows 2, 0 and 3 of four, each at its own position."""
    gen = torch.Generator().manual_seed(seed)
    starts = torch.tensor([5, 0, 17])
    positions = starts[:, None] + torch.arange(tokens)
    cos, sin = rope_tables(positions, head_dim)
    width = (heads + 2 * kv_heads) * head_dim
    cache_shape = (4, kv_heads, 40, head_dim)

    def weight() -> torch.Tensor | None:
        return (1 + 0.3 * torch.randn(head_dim, generator=gen)).to(dtype) if norms else None

    return dict(
        qkv=(torch.randn(3, tokens, width, generator=gen) * 3).to(dtype),
        q_norm_weight=weight(), k_norm_weight=weight(),
        cos=cos.to(dtype), sin=sin.to(dtype), positions=positions, rows=torch.tensor([2, 0, 3]),
        cache_k=torch.full(cache_shape, SENTINEL, dtype=dtype), cache_v=torch.full(cache_shape, SENTINEL, dtype=dtype),
    )


@kernels_here
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "tokens", "norms"), [
    (4, 2, 16, 1, True),  # Qwen3-style decode step, 2 query heads per KV head
    (4, 2, 16, 16, True),  # Qwen3-style verify block
    (6, 2, 12, 16, False),  # Llama-style, 3 query heads per KV head, half a head not a power of two
    (2, 2, 8, 1, False),  # no grouping
])
def test_kernel_matches_reference(dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int, tokens: int,
                                  norms: bool) -> None:
    case = make_case(heads, kv_heads, head_dim, tokens, norms, dtype, seed=heads * head_dim + tokens)
    ref = {k: v.clone() if v is not None else None for k, v in case.items()}
    q_ref = rope_cache_reference(heads=heads, eps=1e-6, **ref)
    dev = {k: v.to(DEVICE) if v is not None else None for k, v in case.items()}
    q = rope_cache_triton(heads=heads, eps=1e-6, **dev)
    assert q.shape == (3, tokens, heads, head_dim) and q.dtype == dtype
    # fp32: equal up to rounding (the GPU may fuse a RoPE product and the sum); bf16: the kernel rounds where
    # the PyTorch path rounds, so only the order of the fp32 sum of squares differs (one unit in the last
    # place, rarely).
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=8e-3)
    torch.testing.assert_close(q.cpu(), q_ref, **tol)
    torch.testing.assert_close(dev["cache_k"].cpu(), ref["cache_k"], **tol)
    torch.testing.assert_close(dev["cache_v"].cpu(), ref["cache_v"], atol=0, rtol=0)  # V is a plain copy
    if dtype == torch.bfloat16:
        assert (q.cpu() == q_ref).float().mean() > 0.99
    written = torch.zeros(4, 40, dtype=torch.bool)
    written[case["rows"][:, None], case["positions"]] = True
    untouched = ~written[:, None, :, None].expand_as(ref["cache_k"])
    assert (dev["cache_k"].cpu()[untouched] == SENTINEL).all() and (dev["cache_v"].cpu()[untouched] == SENTINEL).all()
    assert (dev["cache_k"].cpu()[~untouched] != SENTINEL).all()  # every written slot holds a key


def yarn_target() -> TargetModel:
    """A tiny Llama whose RoPE is YaRN-scaled (attention scaling folded into cos/sin)."""
    tokenizer = make_tiny_tokenizer()
    config = make_tiny_config("llama", num_layers=1, tokenizer=tokenizer)
    config.rope_parameters = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                              "rope_theta": 10000.0}
    torch.manual_seed(4)
    return TargetModel(AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval(), tokenizer)


def run_steps(target: TargetModel, fuse_prologue: bool) -> tuple[list[torch.Tensor], StaticTarget]:
    """Prefill rows 2 and 0, then a verify block of 16 and a decode step with every row at its own position."""
    runner = StaticTarget(target, batch_size=3, max_length=48, kernels="triton", fuse_prologue=fuse_prologue)
    ids = torch.randint(10, 200, (3, 30), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    logits = [runner.forward(ids[:2, :9], torch.arange(9, device=DEVICE).expand(2, 9),
                             row_index=torch.tensor([2, 0], device=DEVICE), kv_len=9,
                             logit_index=torch.tensor([8, 5], device=DEVICE)).logits]
    starts = torch.tensor([6, 1, 9], device=DEVICE)
    logits.append(runner.forward(ids[:, 9:25], starts[:, None] + torch.arange(16, device=DEVICE)).logits)
    logits.append(runner.forward(ids[:, 25:26], (starts + 16)[:, None]).logits)
    return logits, runner


@kernels_here
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "yarn"])
def test_runner_with_the_kernel_matches_its_pytorch_path(arch: str) -> None:
    torch.set_num_threads(1)
    # One layer: the runner calls the kernel the same way in every layer, and each call takes a second or two
    # under the interpreter.
    target = yarn_target() if arch == "yarn" else make_tiny_target(arch, num_layers=1, seed=1)
    target.model.to(DEVICE)
    fused_logits, fused = run_steps(target, fuse_prologue=True)
    torch_logits, reference = run_steps(target, fuse_prologue=False)
    assert fused.prologue == "triton" and reference.prologue == "torch"
    for ours, theirs in zip(fused_logits, torch_logits, strict=True):
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    for ours, theirs in zip(fused.keys + fused.values, reference.keys + reference.values, strict=True):
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    assert all(bool(k.abs().sum() > 0) for k in fused.keys)


def test_kernel_choice_follows_the_runner() -> None:
    target = make_tiny_target("qwen3", num_layers=1)
    assert StaticTarget(target, 1, 8).prologue == "torch"  # kernels="torch"
    assert StaticTarget(target, 1, 8, kernels="triton").prologue == "triton"
    assert StaticTarget(target, 1, 8, kernels="triton", fuse_prologue=False).prologue == "torch"
    assert StaticTarget(target, 1, 8, kernels="triton", fuse_projections=False).prologue == "torch"


class _LayerNormLike(nn.Module):
    """A q/k norm the kernel does not reproduce (no `variance_epsilon`)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))


def test_layers_and_ropes_the_kernel_does_not_cover_keep_the_pytorch_path() -> None:
    target = make_tiny_target("qwen3", num_layers=1)
    layer = target.decoder_layers[0]
    assert FusedLayer(layer, static_attention).prologue_supported
    layer.self_attn.k_norm = _LayerNormLike(16)
    assert not FusedLayer(layer, static_attention).prologue_supported
    positions = torch.arange(4)[None]
    assert supports_rope(rope_tables(positions, 16)[0], 16)
    assert not supports_rope(rope_tables(positions, 8)[0], 16)  # partial rotary: 8 of 16 dims
    assert not supports_rope(rope_tables(positions, 15)[0][..., :15], 15)  # odd head size


def kernel_arguments(element: str, norms: bool) -> tuple[dict[str, object], dict[str, str]]:
    """(constexprs, pointer types) of the kernel at Qwen3-8B heads."""
    constants = dict(EPS_Q=1e-6, EPS_K=1e-6, HEADS=32, KV_HEADS=8, HALF=64, BLOCK_HALF=64, HAS_NORM=norms,
                     BF16=element == "bf16", FP16=element == "fp16", OPAQUE=True)
    pointers = {name: f"*{element}" for name in ("qkv_ptr", "q_norm_ptr", "k_norm_ptr", "cos_ptr", "sin_ptr", "q_ptr",
                                                 "cache_k_ptr", "cache_v_ptr")}
    return constants, {**pointers, "pos_ptr": "*i64", "row_ptr": "*i64"}


@pytest.mark.skipif(not HAS_TRITON or interpreting(), reason="needs triton's compiler")
@pytest.mark.parametrize("element", ["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("norms", [True, False])
def test_kernel_compiles_for_the_gpu(element: str, norms: bool) -> None:
    """A kernel that only fails in the GPU compiler (types the interpreter lets through) fails here, on CPU."""
    constants, pointers = kernel_arguments(element, norms)
    compile_for_h100(_rope_cache_kernel, constants, pointers, "fp32")


@pytest.mark.skipif(not HAS_TRITON or interpreting() or torch.cuda.is_available(), reason="CPU check of the compiler")
def test_torch_compile_sees_exactly_q_and_the_caches_written(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under torch.compile, the kernel's outputs are what inductor's analysis of its code finds written; an
    argument wrongly found written would be copied at every call (the rotary tables, the projections)."""
    bf16 = dict(dtype=torch.bfloat16)
    tensors = dict(qkv_ptr=torch.empty(1, 1, 48 * 128, **bf16), q_norm_ptr=torch.empty(128, **bf16),
                   k_norm_ptr=torch.empty(128, **bf16), cos_ptr=torch.empty(1, 1, 128, **bf16),
                   sin_ptr=torch.empty(1, 1, 128, **bf16), pos_ptr=torch.zeros(1, 1, dtype=torch.long),
                   row_ptr=torch.zeros(1, dtype=torch.long), q_ptr=torch.empty(1, 1, 32, 128, **bf16),
                   cache_k_ptr=torch.empty(1, 8, 64, 128, **bf16), cache_v_ptr=torch.empty(1, 8, 64, 128, **bf16))
    constants, _ = kernel_arguments("bf16", norms=True)
    kwargs = {**tensors, "T": 1, "sc_row": 8 * 64 * 128, "sc_head": 64 * 128, "sc_slot": 128, **constants}
    assert pointers_written(_rope_cache_kernel, kwargs, monkeypatch) == ["cache_k_ptr", "cache_v_ptr", "q_ptr"]
