"""The Gated DeltaNet step kernel against the runtime's PyTorch rule (`recurrent_rule`, itself checked against
the models' own decode step in tests/runtime/test_linear_attention.py): outputs and the state after every token,
grouped and ungrouped heads, head sizes that are not powers of two, fp32 and bf16; then a tiny Qwen3.5 layer's
token mixer with kernels="triton" against kernels="torch", rings included.

On CPU the kernels run under TRITON_INTERPRET=1; when this process imported triton without it, the file
re-runs itself in a subprocess that sets it from the start.
"""

from __future__ import annotations

import pytest
import torch

from dflash_train.kernels._triton import HAS_TRITON, interpreting
from dflash_train.kernels.gated_delta import _gated_delta_kernel, fits, gated_delta_triton
from dflash_train.runtime import linear_attention
from dflash_train.runtime.linear_attention import LinearStates, gated_delta_forward, recurrent_rule
from tests.helpers.kernels import DEVICE, compile_for_h100, kernels_here, pointers_written, under_interpreter
from tests.helpers.tiny_targets import build_tiny_target

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")

test_under_interpreter = under_interpreter(__file__)


def make_step(n: int, t: int, k_heads: int, v_heads: int, k_dim: int, v_dim: int, dtype: torch.dtype,
              seed: int) -> tuple[torch.Tensor, ...]:
    """(q, k, v, g, beta, state) as the layer hands them over: q/k/v views of one convolution output (strided,
    not contiguous), g in fp32 (from the fp32 A_log), beta in the model's dtype, a nonzero fp32 state."""
    gen = torch.Generator().manual_seed(seed)
    key, value = k_heads * k_dim, v_heads * v_dim
    mixed = (torch.randn(n, t, 2 * key + value, generator=gen) * 2).to(dtype).to(DEVICE)
    q, k, v = torch.split(mixed, [key, key, value], dim=-1)
    q, k = q.reshape(n, t, k_heads, k_dim), k.reshape(n, t, k_heads, k_dim)
    v = v.reshape(n, t, v_heads, v_dim)
    g = (-torch.rand(n, t, v_heads, generator=gen) * 2).to(DEVICE)
    beta = torch.rand(n, t, v_heads, generator=gen).to(dtype).to(DEVICE)
    state = torch.randn(n, v_heads, k_dim, v_dim, generator=gen).to(DEVICE)
    return q, k, v, g, beta, state


@kernels_here
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("t", "k_heads", "v_heads", "k_dim", "v_dim"), [
    (1, 2, 4, 16, 8),  # a decode step, two value heads per key head
    (3, 4, 4, 16, 8),  # one value head per key head
    (6, 2, 4, 16, 12),  # dv not a power of two, over two column blocks
    (3, 1, 3, 12, 8),  # dk not a power of two, three value heads on one key head
])
def test_kernel_matches_the_recurrent_rule(dtype: torch.dtype, t: int, k_heads: int, v_heads: int, k_dim: int,
                                           v_dim: int) -> None:
    step = make_step(2, t, k_heads, v_heads, k_dim, v_dim, dtype, seed=t * 10 + k_dim)
    assert fits(step[0], step[2])
    expected_out, expected_each = recurrent_rule(*step)
    out, each = gated_delta_triton(*step)
    assert out.dtype == dtype and each.dtype == torch.float32 and each.shape == expected_each.shape
    # The same fp32 arithmetic up to the order of the sums; bf16 outputs may round one ulp apart.
    tolerance = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(out, expected_out, **tolerance)
    torch.testing.assert_close(each, expected_each, atol=1e-5, rtol=1e-5)


@kernels_here
@pytest.mark.parametrize("t", [1, 3])
def test_the_layer_with_the_kernel_matches_its_pytorch_rule(t: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A tiny Qwen3.5 Gated DeltaNet layer's step on rings of S = 4 tokens: two of three cache rows, one at
    position 0 (no state before it), one further on; the same output and the same rings written."""
    launches = []

    def counted(*args: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        launches.append(args[0].shape)
        return gated_delta_triton(*args)

    monkeypatch.setattr(linear_attention, "gated_delta_triton", counted)
    model = build_tiny_target("qwen3_5", 256).to(DEVICE)
    module = next(layer.linear_attn for layer in model.model.layers if hasattr(layer, "linear_attn"))
    gen = torch.Generator().manual_seed(t)
    rings = LinearStates(module, batch=3, step_tokens=4, device=torch.device(DEVICE), dtype=torch.float32)
    rings.states.copy_(torch.randn(rings.states.shape, generator=gen))
    rings.inputs.copy_(torch.randn(rings.inputs.shape, generator=gen))
    x = torch.randn(2, t, model.config.hidden_size, generator=gen).to(DEVICE)
    rows = torch.tensor([2, 0], device=DEVICE)
    positions = torch.tensor([[5], [0]], device=DEVICE) + torch.arange(t, device=DEVICE)
    results = {}
    for kernels in ("torch", "triton"):
        states, inputs = rings.states.clone(), rings.inputs.clone()
        with torch.no_grad():
            out = gated_delta_forward(module, x, states, inputs, rows, positions, None, kernels=kernels)
        results[kernels] = out, states, inputs
    for ours, theirs in zip(results["triton"], results["torch"], strict=True):
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    assert len(launches) == 1  # kernels="triton" took the kernel, "torch" did not
    assert not torch.equal(results["triton"][1], rings.states)  # the step did write its states


def test_shapes_the_kernel_leaves_to_the_pytorch_rule() -> None:
    q = torch.empty(1, 2, 2, 16)
    assert fits(q, torch.empty(1, 2, 4, 8))
    assert not fits(q, torch.empty(1, 2, 3, 8))  # key heads do not divide the value heads
    assert not fits(torch.empty(1, 2, 2, 512), torch.empty(1, 2, 4, 8))  # a state column past the registers


def kernel_arguments(element: str) -> tuple[dict[str, object], dict[str, str]]:
    """(constexprs, pointer types) of the kernel at Qwen3.5's linear-attention heads (128-dim, 32 value heads
    over 16 key heads)."""
    constants = dict(K_DIM=128, V_DIM=128, GROUPS=2, SCALE=128 ** -0.5, EPS=1e-6, BLOCK_K=128, BLOCK_V=8)
    pointers = {name: f"*{element}" for name in ("q_ptr", "k_ptr", "v_ptr", "beta_ptr", "out_ptr")}
    return constants, {**pointers, "g_ptr": "*fp32", "state_ptr": "*fp32", "each_ptr": "*fp32"}


@pytest.mark.skipif(not HAS_TRITON or interpreting(), reason="needs triton's compiler")
@pytest.mark.parametrize("element", ["bf16", "fp32"])
def test_kernel_compiles_for_the_gpu(element: str) -> None:
    """A kernel that only fails in the GPU compiler (types the interpreter lets through) fails here, on CPU."""
    constants, pointers = kernel_arguments(element)
    compile_for_h100(_gated_delta_kernel, constants, pointers, "fp32")


@pytest.mark.skipif(not HAS_TRITON or interpreting() or torch.cuda.is_available(), reason="CPU check of the compiler")
def test_torch_compile_sees_exactly_the_outputs_written(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under torch.compile, an argument inductor's analysis wrongly finds written would be copied at every call
    (the projections, the previous states)."""
    q, k, v, g, beta, state = make_step(1, 2, 2, 4, 128, 128, torch.bfloat16, seed=0)
    each = torch.empty(1, 2, 4, 128, 128)
    tensors = dict(q_ptr=q, k_ptr=k, v_ptr=v, g_ptr=g, beta_ptr=beta, state_ptr=state, out_ptr=torch.empty_like(v),
                   each_ptr=each)
    strides = dict(zip(("sq_row", "sq_tok", "sq_head", "sk_row", "sk_tok", "sk_head", "sv_row", "sv_tok", "sv_head",
                        "sg_row", "sg_tok", "sb_row", "sb_tok"),
                       (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *g.stride()[:2], *beta.stride()[:2]),
                       strict=True))
    constants, _ = kernel_arguments("bf16")
    kwargs = {**tensors, "T": 2, "V_HEADS": 4, **strides, **constants}
    assert pointers_written(_gated_delta_kernel, kwargs, monkeypatch) == ["each_ptr", "out_ptr"]
