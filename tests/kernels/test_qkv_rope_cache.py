"""The q/k/v product with the attention prologue in its epilogue, against the two steps it fuses in PyTorch
(`skinny_fused_reference` then `rope_cache_reference`): q and both caches, with and without Qwen3's q/k
norms and q/k/v biases, tokens of several cache rows at scattered positions, in fp32 and bf16 (bf16 rounded
on the bits under the interpreter, so equal but for a sum whose order tips a rounding); and the kernel's
GPU compilation and the tensors torch.compile finds it writes (kernels interpreted on CPU:
`tests.helpers.kernels`).
"""

from __future__ import annotations

import pytest
import torch

from dflash_train.kernels._triton import HAS_TRITON, interpreting
from dflash_train.kernels.qkv_rope_cache import (
    _qkv_rope_cache_kernel,
    qkv_rope_cache_reference,
    qkv_rope_cache_triton,
)
from dflash_train.kernels.skinny_matmul import BLOCK_M
from tests.helpers import kernels as helpers
from tests.helpers.kernels import DEVICE, kernels_here

test_under_interpreter = helpers.under_interpreter(__file__)

HEADS, KV_HEADS, DIM, HIDDEN, SLOTS = 4, 2, 32, 80, 24


def inputs(n: int, t: int, dtype: torch.dtype, norms: bool, bias: bool, seed: int) -> dict[str, object]:
    gen = torch.Generator().manual_seed(seed)

    def draw(*shape: int) -> torch.Tensor:
        return helpers.randn(*shape, dtype=dtype, gen=gen)

    def norm_weight(width: int) -> torch.Tensor:
        return (1 + draw(width) / 4).to(dtype)

    width = (HEADS + 2 * KV_HEADS) * DIM
    angles = torch.rand(n, t, DIM // 2, generator=gen) * 6
    cos, sin = torch.cat([angles.cos()] * 2, dim=-1), torch.cat([angles.sin()] * 2, dim=-1)
    positions = torch.stack([torch.randperm(SLOTS, generator=gen)[:t] for _ in range(n)])
    return dict(
        x=draw(n, t, HIDDEN) * 2, weight=draw(width, HIDDEN) / 9, bias=draw(width) if bias else None,
        norm_weight=norm_weight(HIDDEN), norm_eps=1e-5, heads=HEADS,
        q_norm_weight=norm_weight(DIM) if norms else None, k_norm_weight=norm_weight(DIM) if norms else None,
        eps=1e-6, cos=cos.to(dtype), sin=sin.to(dtype), positions=positions,
        rows=torch.randperm(3, generator=gen)[:n], cache_k=torch.zeros(3, KV_HEADS, SLOTS, DIM, dtype=dtype),
        cache_v=torch.zeros(3, KV_HEADS, SLOTS, DIM, dtype=dtype))


def on(device: str, args: dict[str, object]) -> dict[str, object]:
    return {k: v.clone().to(device) if isinstance(v, torch.Tensor) else v for k, v in args.items()}


@kernels_here
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("n", "t", "norms", "bias"), [
    (1, 1, True, False),  # a decode step, Qwen3's q/k norms
    (2, 8, False, True),  # two rows' verify blocks, q/k/v biases (Qwen2), no norms (Llama)
    (3, 14, True, True),  # 42 token rows: three row tiles, the last partial
])
def test_kernel_matches_the_two_steps_it_fuses(dtype: torch.dtype, n: int, t: int, norms: bool, bias: bool) -> None:
    args = inputs(n, t, dtype, norms, bias, seed=n * 10 + t)
    expected, got = on("cpu", args), on(DEVICE, args)
    q_ref = qkv_rope_cache_reference(**expected)
    q = qkv_rope_cache_triton(**got).cpu()
    assert q.shape == (n, t, HEADS, DIM) and q.dtype == dtype
    for name, ours, reference in (("q", q, q_ref), ("k", got["cache_k"].cpu(), expected["cache_k"]),
                                  ("v", got["cache_v"].cpu(), expected["cache_v"])):
        if dtype == torch.float32:
            torch.testing.assert_close(ours, reference, atol=3e-5, rtol=3e-5, msg=name)
        else:  # the same rounding steps: equal, but for a sum whose order tips a rounding (rare, one unit)
            assert float((ours != reference).float().mean()) < 0.02, name
            torch.testing.assert_close(ours, reference, atol=3e-2, rtol=1.6e-2, msg=name)
    untouched = torch.ones(3, KV_HEADS, SLOTS, dtype=torch.bool)  # slots no token was written to stay zero
    for i, row in enumerate(args["rows"].tolist()):
        untouched[row, :, args["positions"][i]] = False
    assert not got["cache_k"].cpu()[untouched].any() and not got["cache_v"].cpu()[untouched].any()


def constants(element: str, norms: bool) -> dict[str, object]:
    return dict(EPS=1e-5, EPS_Q=1e-6, EPS_K=1e-6, HEADS=32, KV_HEADS=8, HALF=64, BLOCK_HALF=64, BLOCK_M=BLOCK_M,
                BLOCK_K=128, HAS_BIAS=True, HAS_QK_NORM=norms, BF16=element == "bf16", FP16=element == "fp16",
                IEEE=element == "fp32", UPCAST=False, OPAQUE=True)


POINTERS = ("x_ptr", "g_ptr", "w_ptr", "b_ptr", "q_norm_ptr", "k_norm_ptr", "cos_ptr", "sin_ptr", "q_ptr",
            "cache_k_ptr", "cache_v_ptr")


@pytest.mark.skipif(not HAS_TRITON or interpreting(), reason="needs triton's compiler")
@pytest.mark.parametrize(("element", "norms"), [("bf16", True), ("bf16", False), ("fp16", True), ("fp32", True)])
def test_kernel_compiles_for_the_gpu(element: str, norms: bool) -> None:
    pointers = {name: f"*{element}" for name in POINTERS} | {"pos_ptr": "*i64", "row_ptr": "*i64"}
    helpers.compile_for_h100(_qkv_rope_cache_kernel, constants(element, norms), pointers, "fp32")


@pytest.mark.skipif(not HAS_TRITON or interpreting() or torch.cuda.is_available(), reason="CPU check of the compiler")
def test_torch_compile_sees_exactly_q_and_the_caches_written(monkeypatch: pytest.MonkeyPatch) -> None:
    bf16 = dict(dtype=torch.bfloat16)
    tensors = dict(x_ptr=torch.empty(1, 4096, **bf16), g_ptr=torch.empty(4096, **bf16),
                   w_ptr=torch.empty(48 * 128, 4096, **bf16), b_ptr=torch.empty(48 * 128, **bf16),
                   q_norm_ptr=torch.empty(128, **bf16), k_norm_ptr=torch.empty(128, **bf16),
                   cos_ptr=torch.empty(1, 128, **bf16), sin_ptr=torch.empty(1, 128, **bf16),
                   pos_ptr=torch.zeros(1, dtype=torch.long), row_ptr=torch.zeros(1, dtype=torch.long),
                   q_ptr=torch.empty(1, 32, 128, **bf16), cache_k_ptr=torch.empty(1, 8, 64, 128, **bf16),
                   cache_v_ptr=torch.empty(1, 8, 64, 128, **bf16))
    kwargs = {**tensors, "M": 1, "K": 4096, "T": 1, "stride_xm": 4096, "stride_wn": 4096, "sc_row": 8 * 64 * 128,
              "sc_head": 64 * 128, "sc_slot": 128, **constants("bf16", norms=True)}
    assert helpers.pointers_written(_qkv_rope_cache_kernel, kwargs, monkeypatch) == ["cache_k_ptr", "cache_v_ptr", "q_ptr"]
