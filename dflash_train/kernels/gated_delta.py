"""The Gated DeltaNet recurrence of a decode or verify step (`runtime/linear_attention.py`, `recurrent_rule`) in
one launch.

At a step of T tokens (1 when decoding plainly, up to the verify block) the PyTorch rule is a dozen small
kernels a token over the whole state [n, Hv, dk, dv], which a Qwen3.5 layer reads and writes several times per
token. Here one program owns a block of a value head's state, [dk, BLOCK_V] in fp32 registers, for the whole
step: it reads the previous state once, and per token loads q, k (its key head's, each serving Hv / Hk
consecutive value heads), v, g and beta, and writes the output and the state after the token (the state ring
keeps each one, so that a rejected verify can be taken back):

    q = l2norm(q) * dk^-0.5,  k = l2norm(k),  l2norm(x) = x * rsqrt(sum(x²) + 1e-6)
    S = S * exp(g);  S = S + k ⊗ (beta * (v - kᵀS));  out = qᵀS

All in fp32, as the models' own decode step, the output rounded once to v's dtype. A value head's dv columns
are independent of each other (every column's update reads only its own column of S), so the columns are
split across programs; dk and dv need not be powers of two (masked lanes hold zeros, which the norms and the
update leave at zero).
"""

# Deliberately no postponed annotations (PEP 563): Triton reads the `tl.constexpr` annotations of kernels.
import torch
from torch.library import triton_op, wrap_triton

from dflash_train.kernels._triton import interpreting, jit, next_power_of_2, tl

EPS = 1e-6  # the models' l2norm epsilon
MAX_K_DIM = 256  # a program holds its [dk, BLOCK_V] state in registers; beyond this, keep the PyTorch rule
BLOCK_V = 8  # state columns a program: many programs at batch 1 (Hv x dv / 8), few registers each


def fits(q: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the kernel takes this step: q/k [n, T, Hk, dk] and v [n, T, Hv, dv] with Hk dividing Hv, and
    a key dimension whose state columns fit a program's registers."""
    return (q.dim() == 4 and v.dim() == 4 and q.shape[:2] == v.shape[:2] and v.shape[2] % q.shape[2] == 0
            and q.shape[-1] <= MAX_K_DIM)


def _gated_delta_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, out_ptr, each_ptr,
    T, V_HEADS,
    sq_row, sq_tok, sq_head, sk_row, sk_tok, sk_head, sv_row, sv_tok, sv_head,
    sg_row, sg_tok, sb_row, sb_tok,
    K_DIM: tl.constexpr, V_DIM: tl.constexpr, GROUPS: tl.constexpr, SCALE: tl.constexpr, EPS: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
):
    pid = tl.program_id(0)  # row * V_HEADS + value head
    row = (pid // V_HEADS).to(tl.int64)  # int64: the per-token states of a large batch pass 2^31 elements
    head = pid % V_HEADS
    k_head = head // GROUPS
    dk = tl.arange(0, BLOCK_K)
    dv = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    k_ok, v_ok = dk < K_DIM, dv < V_DIM
    square = (dk[:, None] * V_DIM + dv[None, :]).to(tl.int64)
    ok = k_ok[:, None] & v_ok[None, :]
    head_state = (row * V_HEADS + head) * (K_DIM * V_DIM)  # state [n, Hv, dk, dv], contiguous
    s = tl.load(state_ptr + head_state + square, mask=ok, other=0.0).to(tl.float32)
    q_base = q_ptr + row * sq_row + k_head * sq_head
    k_base = k_ptr + row * sk_row + k_head * sk_head
    v_base = v_ptr + row * sv_row + head * sv_head
    for t in range(T):
        q = tl.load(q_base + t * sq_tok + dk, mask=k_ok, other=0.0).to(tl.float32)
        k = tl.load(k_base + t * sk_tok + dk, mask=k_ok, other=0.0).to(tl.float32)
        v = tl.load(v_base + t * sv_tok + dv, mask=v_ok, other=0.0).to(tl.float32)
        gate = tl.load(g_ptr + row * sg_row + t * sg_tok + head).to(tl.float32)
        beta = tl.load(beta_ptr + row * sb_row + t * sb_tok + head).to(tl.float32)
        # Constants as constexprs: torch.compile would pass float arguments as fp64.
        q = q * tl.rsqrt(tl.sum(q * q, axis=0) + EPS) * SCALE
        k = k * tl.rsqrt(tl.sum(k * k, axis=0) + EPS)
        s = s * tl.exp(gate)
        memory = tl.sum(s * k[:, None], axis=0)  # [BLOCK_V]: what the state recalls for k
        delta = (v - memory) * beta
        s = s + k[:, None] * delta[None, :]
        out = tl.sum(s * q[:, None], axis=0)
        token = row * T + t  # out [n, T, Hv, dv] and each [n, T, Hv, dk, dv], contiguous
        tl.store(out_ptr + (token * V_HEADS + head) * V_DIM + dv, out.to(out_ptr.dtype.element_ty), mask=v_ok)
        tl.store(each_ptr + (token * V_HEADS + head) * (K_DIM * V_DIM) + square, s, mask=ok)


@triton_op("dflash_train::gated_delta", mutates_args=())
def _gated_delta_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                    state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    n, t, v_heads, v_dim = v.shape
    k_dim = q.shape[-1]
    out = torch.empty((n, t, v_heads, v_dim), device=v.device, dtype=v.dtype)
    each = torch.empty((n, t, v_heads, k_dim, v_dim), device=v.device, dtype=torch.float32)
    block_v = min(BLOCK_V, next_power_of_2(v_dim))
    kernel = jit(_gated_delta_kernel)
    if not interpreting():  # traced by torch.compile as part of the graph (interpreted kernels cannot be)
        kernel = wrap_triton(kernel)
    kernel[(n * v_heads, -(-v_dim // block_v))](
        q, k, v, g, beta, state, out, each, t, v_heads,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), g.stride(0), g.stride(1), beta.stride(0), beta.stride(1),
        K_DIM=k_dim, V_DIM=v_dim, GROUPS=v_heads // q.shape[2], SCALE=k_dim ** -0.5, EPS=EPS,
        BLOCK_K=next_power_of_2(k_dim), BLOCK_V=block_v, num_warps=1,
    )
    return out, each


def gated_delta_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `recurrent_rule`: q/k [n, T, Hk, dk], v [n, T, Hv, dv], g/beta [n, T, Hv], state
    [n, Hv, dk, dv] -> (out [n, T, Hv, dv] in v's dtype, the float32 state after each token [n, T, Hv, dk, dv]).
    q, k and v may be views of the convolution's output (any strides but the last); a custom op, so
    torch.compile keeps it in its graph and CUDA graphs capture it."""
    n, _, v_heads, v_dim = v.shape
    assert fits(q, v) and k.shape == q.shape, "use recurrent_rule for this step"
    assert g.shape == beta.shape == v.shape[:3] and state.shape == (n, v_heads, q.shape[-1], v_dim)
    # The kernel steps along a head with stride one, g and beta along their heads too; the state is read whole.
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    return _gated_delta_op(q, k, v, g.contiguous(), beta.contiguous(), state.contiguous())
