"""The Mamba-2 scan step kernel against the runtime's PyTorch scan (`selective_scan_steps`, itself checked end to
end against the models' own forward in tests/runtime/test_linear_attention.py): outputs and the state after
every token, one and two groups of B/C, head and state sizes that are not powers of two, fp32 and bf16 inputs;
then a tiny Nemotron-H Mamba-2 mixer with kernels="triton" against kernels="torch", rings included.

On CPU the kernels run under TRITON_INTERPRET=1; when this process imported triton without it, the file
re-runs itself in a subprocess that sets it from the start.
"""

from __future__ import annotations

import pytest
import torch

from dflash_train.kernels._triton import HAS_TRITON, interpreting
from dflash_train.kernels.mamba_scan import _mamba_scan_kernel, fits, mamba_scan_triton
from dflash_train.runtime import linear_attention
from dflash_train.runtime.linear_attention import LinearStates, is_mamba, mamba2_forward, selective_scan_steps
from dflash_train.target import TargetModel
from tests.helpers.kernels import DEVICE, compile_for_h100, kernels_here, pointers_written, under_interpreter
from tests.helpers.static_target import long_memory
from tests.helpers.tiny_targets import build_tiny_target

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")

test_under_interpreter = under_interpreter(__file__)


def make_step(n: int, t: int, heads: int, groups: int, p_dim: int, n_dim: int, dtype: torch.dtype,
              seed: int) -> tuple[torch.Tensor, ...]:
    """(hidden, dt, a, b, c, d, state) as the mixer hands them over: hidden/B/C views of one convolution output
    laid out as the convolution leaves it ([n, channels, T] transposed: the channels are not the last stride once
    T > 1), dt positive in the model's dtype, A negative in fp32, D in the model's dtype, a nonzero fp32 state."""
    gen = torch.Generator().manual_seed(seed)
    inner, width = heads * p_dim, groups * n_dim
    xbc = (torch.randn(n, inner + 2 * width, t, generator=gen) * 2).to(dtype).to(DEVICE).transpose(1, 2)
    hidden, b, c = torch.split(xbc, [inner, width, width], dim=-1)
    hidden = hidden.reshape(n, t, heads, p_dim)
    b, c = b.reshape(n, t, groups, n_dim), c.reshape(n, t, groups, n_dim)
    dt = (torch.rand(n, t, heads, generator=gen) + 0.1).to(dtype).to(DEVICE)
    a = (-torch.rand(heads, generator=gen) * 2 - 0.1).to(DEVICE)
    d = torch.randn(heads, generator=gen).to(dtype).to(DEVICE)
    state = torch.randn(n, heads, p_dim, n_dim, generator=gen).to(DEVICE)
    return hidden, dt, a, b, c, d, state


@kernels_here
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("t", "groups", "p_dim", "n_dim"), [
    (1, 1, 8, 16),  # a decode step, one group for the four heads
    (3, 2, 8, 16),  # two groups, two heads each
    (6, 2, 12, 8),  # P not a power of two, over two row blocks
    (3, 1, 4, 12),  # N not a power of two
])
def test_kernel_matches_the_selective_scan(dtype: torch.dtype, t: int, groups: int, p_dim: int, n_dim: int) -> None:
    step = make_step(2, t, 4, groups, p_dim, n_dim, dtype, seed=t * 10 + n_dim)
    assert fits(step[0], step[3])
    expected_out, expected_each = selective_scan_steps(*step)
    out, each = mamba_scan_triton(*step)
    assert out.dtype == each.dtype == torch.float32
    assert out.shape == expected_out.shape and each.shape == expected_each.shape
    # The same fp32 arithmetic on the same (rounded) inputs, up to the order of the sum over N.
    torch.testing.assert_close(out, expected_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(each, expected_each, atol=1e-5, rtol=1e-5)


@kernels_here
@pytest.mark.parametrize("t", [1, 3])
def test_the_mixer_with_the_kernel_matches_its_pytorch_scan(t: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A tiny Nemotron-H Mamba-2 mixer that remembers (`long_memory`), its step on rings of S = 4 tokens: two of
    three cache rows, one at position 0 (no state before it), one further on; the same output and the same rings
    written."""
    launches = []

    def counted(*args: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        launches.append(args[0].shape)
        return mamba_scan_triton(*args)

    monkeypatch.setattr(linear_attention, "mamba_scan_triton", counted)
    target = TargetModel(build_tiny_target("nemotron_h", 256).to(DEVICE), None)
    long_memory(target)
    module = next(layer.mixer for layer in target.decoder_layers if is_mamba(layer.mixer))
    gen = torch.Generator().manual_seed(t)
    rings = LinearStates(module, batch=3, step_tokens=4, device=torch.device(DEVICE), dtype=torch.float32)
    rings.states.copy_(torch.randn(rings.states.shape, generator=gen))
    rings.inputs.copy_(torch.randn(rings.inputs.shape, generator=gen))
    x = torch.randn(2, t, target.model.config.hidden_size, generator=gen).to(DEVICE)
    rows = torch.tensor([2, 0], device=DEVICE)
    positions = torch.tensor([[5], [0]], device=DEVICE) + torch.arange(t, device=DEVICE)
    results = {}
    for kernels in ("torch", "triton"):
        states, inputs = rings.states.clone(), rings.inputs.clone()
        with torch.no_grad():
            out = mamba2_forward(module, x, states, inputs, rows, positions, None, kernels=kernels)
        results[kernels] = out, states, inputs
    for ours, theirs in zip(results["triton"], results["torch"], strict=True):
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    assert len(launches) == 1  # kernels="triton" took the kernel, "torch" did not
    assert not torch.equal(results["triton"][1], rings.states)  # the step did write its states


def test_shapes_the_kernel_leaves_to_the_pytorch_scan() -> None:
    hidden = torch.empty(1, 2, 4, 8)
    assert fits(hidden, torch.empty(1, 2, 2, 16))
    assert not fits(hidden, torch.empty(1, 2, 3, 16))  # groups do not divide the heads
    assert not fits(hidden, torch.empty(1, 2, 1, 512))  # a state row past the registers


STRIDES = ("sx_row", "sx_tok", "sx_head", "sx_p", "sdt_row", "sdt_tok", "sdt_head",
           "sb_row", "sb_tok", "sb_group", "sb_n", "sc_row", "sc_tok", "sc_group", "sc_n")


def kernel_arguments(element: str) -> tuple[dict[str, object], dict[str, str]]:
    """(constexprs, pointer types) of the kernel at Nemotron-H's Mamba-2 heads (head dim 64, state 128, 8 groups
    of 16 heads)."""
    constants = dict(P_DIM=64, N_DIM=128, HEADS_PER_GROUP=16, BLOCK_P=8, BLOCK_N=128)
    pointers = {name: f"*{element}" for name in ("x_ptr", "dt_ptr", "b_ptr", "c_ptr", "d_ptr")}
    return constants, {**pointers, "a_ptr": "*fp32", "state_ptr": "*fp32", "out_ptr": "*fp32", "each_ptr": "*fp32"}


@pytest.mark.skipif(not HAS_TRITON or interpreting(), reason="needs triton's compiler")
@pytest.mark.parametrize("element", ["bf16", "fp32"])
def test_kernel_compiles_for_the_gpu(element: str) -> None:
    """A kernel that only fails in the GPU compiler (types the interpreter lets through) fails here, on CPU."""
    constants, pointers = kernel_arguments(element)
    compile_for_h100(_mamba_scan_kernel, constants, pointers, "fp32")


@pytest.mark.skipif(not HAS_TRITON or interpreting() or torch.cuda.is_available(), reason="CPU check of the compiler")
def test_torch_compile_sees_exactly_the_outputs_written(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under torch.compile, an argument inductor's analysis wrongly finds written would be copied at every call
    (the convolution's output, the previous states)."""
    hidden, dt, a, b, c, d, state = make_step(1, 2, 4, 2, 8, 16, torch.bfloat16, seed=0)
    tensors = dict(x_ptr=hidden, dt_ptr=dt, a_ptr=a, b_ptr=b, c_ptr=c, d_ptr=d, state_ptr=state,
                   out_ptr=torch.empty(1, 2, 4, 8), each_ptr=torch.empty(1, 2, 4, 8, 16))
    strides = dict(zip(STRIDES, (*hidden.stride(), *dt.stride(), *b.stride(), *c.stride()), strict=True))
    constants = dict(P_DIM=8, N_DIM=16, HEADS_PER_GROUP=2, BLOCK_P=8, BLOCK_N=16)
    kwargs = {**tensors, "T": 2, "HEADS": 4, **strides, **constants}
    assert pointers_written(_mamba_scan_kernel, kwargs, monkeypatch) == ["each_ptr", "out_ptr"]
