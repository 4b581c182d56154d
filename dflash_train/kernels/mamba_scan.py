"""Mamba-2's selective scan of a decode or verify step (`runtime/linear_attention.py`, `selective_scan_steps`)
in one launch.

At a step of T tokens (1 when decoding plainly, up to the verify block) the PyTorch scan is a handful of small
kernels a token over the whole state [n, heads, P, N], each reading and writing it. Here one program owns a
block of a head's state, [BLOCK_P, N] in fp32 registers, for the whole step: it reads the previous state once,
and per token loads the head's x [P] and time step, its group's B and C [N] (each group serving heads / groups
consecutive heads), and writes the output and the state after the token (the state ring keeps each one, so that
a rejected verify can be taken back):

    S = S * exp(dt * A) + x ⊗ (dt * B);  out = S C + D * x

All in fp32, as the models' own decode step (`mamba2_selective_state_update`); the output stays fp32, as the
reference's does (the caller rounds it for the gated norm). A head's P rows are independent of each other
(every row's update reads only its own x and row of S), so the rows are split across programs; P and N need
not be powers of two (masked lanes hold zeros, which the update and the sum over N leave at zero).
"""

# Deliberately no postponed annotations (PEP 563): Triton reads the `tl.constexpr` annotations of kernels.
import torch
from torch.library import triton_op, wrap_triton

from dflash_train.kernels._triton import interpreting, jit, next_power_of_2, tl

MAX_STATE = 256  # a program holds its [BLOCK_P, N] state in registers; beyond this, keep the PyTorch scan
BLOCK_P = 8  # state rows a program: many programs at batch 1 (heads x P / 8), few registers each


def fits(hidden: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the kernel takes this step: hidden [n, T, heads, P] and b/c [n, T, groups, N] with groups dividing
    heads, and a state size whose rows fit a program's registers."""
    return (hidden.dim() == 4 and b.dim() == 4 and hidden.shape[:2] == b.shape[:2]
            and hidden.shape[2] % b.shape[2] == 0 and b.shape[-1] <= MAX_STATE)


def _mamba_scan_kernel(
    x_ptr, dt_ptr, a_ptr, b_ptr, c_ptr, d_ptr, state_ptr, out_ptr, each_ptr,
    T, HEADS,
    sx_row, sx_tok, sx_head, sx_p, sdt_row, sdt_tok, sdt_head,
    sb_row, sb_tok, sb_group, sb_n, sc_row, sc_tok, sc_group, sc_n,
    P_DIM: tl.constexpr, N_DIM: tl.constexpr, HEADS_PER_GROUP: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0)  # row * HEADS + head
    row = (pid // HEADS).to(tl.int64)  # int64: the per-token states of a large batch pass 2^31 elements
    head = pid % HEADS
    group = head // HEADS_PER_GROUP
    dp = tl.program_id(1) * BLOCK_P + tl.arange(0, BLOCK_P)
    dn = tl.arange(0, BLOCK_N)
    p_ok, n_ok = dp < P_DIM, dn < N_DIM
    square = (dp[:, None] * N_DIM + dn[None, :]).to(tl.int64)
    ok = p_ok[:, None] & n_ok[None, :]
    head_state = (row * HEADS + head) * (P_DIM * N_DIM)  # state [n, heads, P, N], contiguous
    s = tl.load(state_ptr + head_state + square, mask=ok, other=0.0).to(tl.float32)
    a = tl.load(a_ptr + head).to(tl.float32)
    d = tl.load(d_ptr + head).to(tl.float32)
    x_base = x_ptr + row * sx_row + head * sx_head + dp * sx_p
    b_base = b_ptr + row * sb_row + group * sb_group + dn * sb_n
    c_base = c_ptr + row * sc_row + group * sc_group + dn * sc_n
    dt_base = dt_ptr + row * sdt_row + head * sdt_head
    for t in range(T):
        x = tl.load(x_base + t * sx_tok, mask=p_ok, other=0.0).to(tl.float32)
        b = tl.load(b_base + t * sb_tok, mask=n_ok, other=0.0).to(tl.float32)
        c = tl.load(c_base + t * sc_tok, mask=n_ok, other=0.0).to(tl.float32)
        dt = tl.load(dt_base + t * sdt_tok).to(tl.float32)
        # The reference's order: dt * B first, then its outer product with x.
        s = s * tl.exp(dt * a) + (dt * b)[None, :] * x[:, None]
        out = tl.sum(s * c[None, :], axis=1) + x * d
        token = row * T + t  # out [n, T, heads, P] and each [n, T, heads, P, N], contiguous
        tl.store(out_ptr + (token * HEADS + head) * P_DIM + dp, out, mask=p_ok)
        tl.store(each_ptr + (token * HEADS + head) * (P_DIM * N_DIM) + square, s, mask=ok)


@triton_op("dflash_train::mamba_scan", mutates_args=())
def _mamba_scan_op(hidden: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
                   d: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    n, t, heads, p_dim = hidden.shape
    groups, n_dim = b.shape[2], b.shape[3]
    out = torch.empty((n, t, heads, p_dim), device=hidden.device, dtype=torch.float32)
    each = torch.empty((n, t, heads, p_dim, n_dim), device=hidden.device, dtype=torch.float32)
    block_p = min(BLOCK_P, next_power_of_2(p_dim))
    kernel = jit(_mamba_scan_kernel)
    if not interpreting():  # traced by torch.compile as part of the graph (interpreted kernels cannot be)
        kernel = wrap_triton(kernel)
    kernel[(n * heads, -(-p_dim // block_p))](
        hidden, dt, a, b, c, d, state, out, each, t, heads,
        *hidden.stride(), *dt.stride(), *b.stride(), *c.stride(),
        P_DIM=p_dim, N_DIM=n_dim, HEADS_PER_GROUP=heads // groups,
        BLOCK_P=block_p, BLOCK_N=next_power_of_2(n_dim), num_warps=1,
    )
    return out, each


def mamba_scan_triton(hidden: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
                      d: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `selective_scan_steps`: hidden [n, T, heads, P], dt [n, T, heads] (after softplus),
    a [heads], b/c [n, T, groups, N], d [heads], state [n, heads, P, N] -> (out [n, T, heads, P] float32 with
    the D skip, the float32 state after each token [n, T, heads, P, N]). hidden, dt, b and c may have any
    strides (the convolution's output, transposed, split and viewed: the kernel reads a few hundred bytes of
    them a token, so gathering them costs nothing, where a copy would be a launch); a custom op, so
    torch.compile keeps it in its graph and CUDA graphs capture it."""
    n, _, heads, p_dim = hidden.shape
    assert fits(hidden, b) and c.shape == b.shape, "use selective_scan_steps for this step"
    assert dt.shape == hidden.shape[:3] and a.shape == d.shape == (heads,)
    assert state.shape == (n, heads, p_dim, b.shape[-1])
    # a and d are read one element per program, the state whole.
    return _mamba_scan_op(hidden, dt, a.contiguous(), b, c, d.contiguous(), state.contiguous())
