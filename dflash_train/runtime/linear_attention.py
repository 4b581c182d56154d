"""Gated DeltaNet layers (Qwen3-Next, Qwen3.5, Qwen3.5-MoE), Mamba-2 layers (Nemotron-H) and LFM2's short
convolutions on the static runtime: fixed-shape state rings that a verify block can be taken back from at no cost,
as the KV cache's slots are.

A linear-attention layer keeps no keys and values: it carries a recurrent state S [v_heads, k_dim, v_dim] and
the last `conv_kernel - 1` inputs of its causal convolution. The engine verifies B tokens and commits a + 1 of
them, so the next forward must start from the state after the last committed token, which a single running
state cannot give back. Instead each row keeps, per layer:

- `states` [b, S, v_heads, k_dim, v_dim] (float32, as the model's own recurrence): the state after each of the
  last S positions, at slot position % S. A forward at p reads slot (p - 1) % S. Stale slots (positions a
  rejected verify wrote past p - 1) lie within S - 1 positions after it and so never alias it, as long as no
  forward is longer than S tokens; a longer one (a prompt) is committed whole and keeps only its last state.
- `inputs` [b, R + 1, conv_dim]: the convolution's inputs at slot position % R, R = S + conv_kernel, the last
  slot a sink for tokens nothing will read (a prompt's padding, its tokens before the last R). The conv reads
  positions p - kernel + 1 .. p - 1 from here, zeros before position 0.

Steps of at most S tokens run the recurrence token by token, as the model's own decode step does, keeping every
intermediate state (with kernels="triton", in one launch: `kernels/gated_delta.py`, and Mamba-2's scan
`kernels/mamba_scan.py`); prompts run the model's own chunked rule (`torch_chunk_gated_delta_rule` of its
modeling module) with padding made inert (no decay, no write), so the final state is the state after each row's
last real token.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN

from dflash_train.kernels.gated_delta import fits as kernel_fits
from dflash_train.kernels.gated_delta import gated_delta_triton
from dflash_train.kernels.mamba_scan import fits as scan_fits
from dflash_train.kernels.mamba_scan import mamba_scan_triton

# `config.layer_types` of the layers run on state rings: Gated DeltaNet and Nemotron-H's Mamba-2 (both
# "linear_attention"), LFM2's short convolution (which keeps only its convolution's inputs), and Falcon-H1's
# layers, Mamba-2 beside attention ("hybrid")
LINEAR_LAYER_TYPES = ("linear_attention", "conv", "hybrid")


def is_linear_layer(config: Any, index: int) -> bool:
    layer_types = getattr(config, "layer_types", None)
    return layer_types is not None and layer_types[index] in LINEAR_LAYER_TYPES


def token_mixer(layer: nn.Module) -> nn.Module:
    """The ring-kept module of a decoder layer: Qwen3-Next's and Qwen3.5's `linear_attn`, Falcon-H1's `mamba`,
    Nemotron-H's `mixer`, LFM2's `conv`."""
    for name in ("linear_attn", "mamba", "mixer", "conv"):
        if hasattr(layer, name):
            return getattr(layer, name)
    raise ValueError(f"{type(layer).__name__} has no linear-attention, Mamba or convolution module")


def is_mamba(module: nn.Module) -> bool:
    return hasattr(module, "ssm_state_size")


class LinearStates:
    """One ring-kept layer's state rings for `batch` cache rows (module docstring); a short convolution has no
    recurrent state (`states` then holds nothing)."""

    def __init__(self, module: nn.Module, batch: int, step_tokens: int, device: torch.device,
                 dtype: torch.dtype) -> None:
        self.step_tokens = step_tokens  # S
        self.kernel = module.conv_kernel_size
        self.input_slots = step_tokens + self.kernel  # R; slot R is the sink
        self.states = torch.zeros(batch, step_tokens, *_state_shape(module), dtype=torch.float32, device=device)
        self.inputs = torch.zeros(batch, self.input_slots + 1, _conv_channels(module), dtype=dtype, device=device)

    @staticmethod
    def bytes_for(module: nn.Module, batch: int, step_tokens: int, dtype: torch.dtype) -> int:
        states = batch * step_tokens * torch.Size(_state_shape(module)).numel() * 4
        inputs = batch * (step_tokens + module.conv_kernel_size + 1) * _conv_channels(module) * dtype.itemsize
        return states + inputs


def _state_shape(module: nn.Module) -> tuple[int, ...]:
    if is_mamba(module):
        return module.num_heads, module.head_dim, module.ssm_state_size
    if not hasattr(module, "num_v_heads"):  # a short convolution
        return (0,)
    return module.num_v_heads, module.head_k_dim, module.head_v_dim


def _conv_channels(module: nn.Module) -> int:
    return module.conv_dim if hasattr(module, "conv_dim") else module.conv.in_channels


def mamba2_forward(module: nn.Module, x: torch.Tensor, states: torch.Tensor, inputs: torch.Tensor,
                   rows: torch.Tensor, positions: torch.Tensor, last: torch.Tensor | None,
                   kernels: str = "torch") -> torch.Tensor:
    """A Mamba-2 mixer (Nemotron-H, Falcon-H1) on x [n, T, H] (after its block's norm), its rings used as a Gated
    DeltaNet layer's (`gated_delta_forward`): the gate, the convolved x/B/C and the time step from one product (with
    Falcon-H1's input multiplier and per-channel multipliers); a step's
    selective scan token by token as the model's decode step (`mamba2_selective_state_update`) computes it, a
    prompt's by the model's own chunked scan with padding given a zero time step (no decay, no input); the gated
    group norm (or Falcon-H1's plain SiLU gate where it has no norm) and the output projection. `kernels`
    "triton": a step's scan in one launch (`kernels/mamba_scan.py`) where it fits."""
    n, t, _ = x.shape
    projected = module.in_proj(x * getattr(module, "ssm_in_multiplier", 1.0))
    if hasattr(module, "mup_vector"):
        projected = projected * module.mup_vector
    gate, xbc, dt = projected.split([module.intermediate_size, module.conv_dim, module.num_heads], dim=-1)
    xbc = _convolve(module.conv1d, xbc, inputs, rows, positions, last, activation=module.activation)
    groups_width = module.n_groups * module.ssm_state_size
    hidden, b, c = torch.split(xbc, [module.intermediate_size, groups_width, groups_width], dim=-1)
    hidden = hidden.reshape(n, t, module.num_heads, module.head_dim)
    b = b.reshape(n, t, module.n_groups, module.ssm_state_size)
    c = c.reshape(n, t, module.n_groups, module.ssm_state_size)
    a = -torch.exp(module.A_log.float())
    step_tokens, start = states.shape[1], positions[:, 0]
    previous = carried_state(states, rows, start)
    dt = F.softplus(dt + module.dt_bias.to(dt.dtype))
    if last is None:
        step = mamba_scan_triton if kernels == "triton" and scan_fits(hidden, b) else selective_scan_steps
        out, each = step(hidden, dt, a, b, c, module.D, previous)
        out = out.to(x.dtype)  # the model's decode step hands its norm the model's dtype
        states[rows[:, None], positions % step_tokens] = each
    else:
        low, high = module.time_step_limit  # the model's prompt scan clamps; clamped here so padding stays at 0
        real = torch.arange(t, device=x.device)[None] <= last[:, None]
        dt = torch.clamp(dt, low, high) * real[..., None]
        chunk_scan = sys.modules[type(module).__module__].mamba2_chunk_scan  # the model's own
        out, final = chunk_scan(hidden, dt, a, b, c, chunk_size=module.chunk_size, D=module.D, initial_states=previous,
                                return_final_states=True)
        keep_final_state(states, rows, positions, last, final)
    out = out.reshape(n, t, -1)
    out = module.norm(out, gate) if getattr(module, "mamba_rms_norm", True) else out * F.silu(gate)
    return module.out_proj(out.to(x.dtype))


def selective_scan_steps(hidden: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
                         d: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mamba-2's selective scan token by token, as the model's decode step computes it: hidden [n, T, heads, P],
    dt [n, T, heads] (after softplus), a [heads], b/c [n, T, groups, N] (each group serving heads // groups
    consecutive heads), d [heads], state [n, heads, P, N] float32 -> (out [n, T, heads, P] float32 with the D
    skip, the state after each token [n, T, heads, P, N])."""
    heads = hidden.shape[2]
    b = b.float().repeat_interleave(heads // b.shape[2], dim=2)
    c = c.float().repeat_interleave(heads // c.shape[2], dim=2)
    outs, each = [], []
    for i in range(hidden.shape[1]):
        x, step = hidden[:, i].float(), dt[:, i].float()  # [n, heads, P], [n, heads]
        decay = torch.exp(step * a)[..., None, None]
        state = state * decay + (step[..., None] * b[:, i])[:, :, None, :] * x[..., None]
        outs.append((state * c[:, i, :, None, :]).sum(-1) + x * d.float()[:, None])
        each.append(state)
    return torch.stack(outs, dim=1), torch.stack(each, dim=1)


def short_conv_forward(module: nn.Module, x: torch.Tensor, inputs: torch.Tensor, rows: torch.Tensor,
                       positions: torch.Tensor, last: torch.Tensor | None) -> torch.Tensor:
    """LFM2's short convolution on x [n, T, H] (after its operator norm), its inputs kept in `inputs` as a Gated
    DeltaNet layer's are: B * x convolved causally (no activation), gated by C, projected out."""
    b, c, gated_in = module.in_proj(x).chunk(3, dim=-1)
    out = _convolve(module.conv, b * gated_in, inputs, rows, positions, last, activation=None)
    return module.out_proj(c * out)


def gated_delta_forward(module: nn.Module, x: torch.Tensor, states: torch.Tensor, inputs: torch.Tensor,
                        rows: torch.Tensor, positions: torch.Tensor, last: torch.Tensor | None,
                        kernels: str = "torch") -> torch.Tensor:
    """The layer's token mixer on x [n, T, H] (after its input norm) for cache rows `rows` [n] at `positions`
    [n, T] -> [n, T, H], reading and writing `LinearStates.states` and `.inputs` (passed as tensors, so that a
    compiled layer's code serves every layer). `last` [n]: the index of each row's last real token, for a
    prompt (committed whole, right-padded); None for a step of at most S tokens, every one kept. `kernels`
    "triton": a step's recurrence in one launch (`kernels/gated_delta.py`) where it fits."""
    n, t, _ = x.shape
    step_tokens = states.shape[1]
    mixed, z, b, a = _projections(module, x)
    mixed = _convolve(module.conv1d, mixed, inputs, rows, positions, last, activation=module.activation)
    q, k, v = torch.split(mixed, [module.key_dim, module.key_dim, module.value_dim], dim=-1)
    q = q.reshape(n, t, -1, module.head_k_dim)
    k = k.reshape(n, t, -1, module.head_k_dim)
    v = v.reshape(n, t, -1, module.head_v_dim)
    beta = b.sigmoid()
    g = -module.A_log.float().exp() * F.softplus(a.float() + module.dt_bias)
    start = positions[:, 0]
    previous = carried_state(states, rows, start)
    if last is None:
        step = gated_delta_triton if kernels == "triton" and kernel_fits(q, v) else recurrent_rule
        out, each = step(q, k, v, g, beta, previous)
        states[rows[:, None], positions % step_tokens] = each
    else:
        real = torch.arange(t, device=x.device)[None] <= last[:, None]  # [n, T]
        beta, g = beta * real[..., None], g * real[..., None]  # padding: state passes through unchanged
        chunk_rule = sys.modules[type(module).__module__].torch_chunk_gated_delta_rule  # the model's own
        groups = v.shape[2] // k.shape[2]
        if groups > 1:  # the layer's own forward repeats q/k for the value heads before the rule in some versions
            q, k = q.repeat_interleave(groups, dim=2), k.repeat_interleave(groups, dim=2)
        out, final = chunk_rule(q, k, v, g=g, beta=beta, initial_state=previous, output_final_state=True,
                                use_qk_l2norm_in_kernel=True)
        keep_final_state(states, rows, positions, last, final)
    out = module.norm(out.reshape(-1, module.head_v_dim), z.reshape(-1, module.head_v_dim))
    return module.out_proj(out.reshape(n, t, -1))


def _projections(module: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(conv inputs [n, T, conv_dim] as q | k | v, z [n, T, Hv, dv], b and a [n, T, Hv]): Qwen3.5's four
    products, or Qwen3-Next's two with their per-key-head interleaving undone by the module's own method."""
    n, t, _ = x.shape
    if hasattr(module, "in_proj_qkvz"):
        q, k, v, z, b, a = module.fix_query_key_value_ordering(module.in_proj_qkvz(x), module.in_proj_ba(x))
        mixed = torch.cat([y.reshape(n, t, -1) for y in (q, k, v)], dim=-1)
        return mixed, z, b, a
    z = module.in_proj_z(x).reshape(n, t, -1, module.head_v_dim)
    return module.in_proj_qkv(x), z, module.in_proj_b(x), module.in_proj_a(x)


def carried_state(states: torch.Tensor, rows: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
    """The state each row carries into a forward starting at `start` [n]: its ring's slot for start - 1, or zeros
    for a row starting at position 0."""
    previous = states[rows, (start - 1) % states.shape[1]]
    return torch.where((start > 0).reshape(-1, *[1] * (previous.dim() - 1)), previous, torch.zeros_like(previous))


def keep_final_state(states: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor, last: torch.Tensor,
                     final: torch.Tensor) -> None:
    """A prompt's state after each row's last real token (`last` [n]), at that token's slot: the one state of a
    prompt a later forward may start from."""
    end = positions.gather(1, last[:, None])[:, 0]
    states[rows, end % states.shape[1]] = final.to(torch.float32)


def _convolve(conv: nn.Conv1d, mixed: torch.Tensor, inputs: torch.Tensor, rows: torch.Tensor,
              positions: torch.Tensor, last: torch.Tensor | None, activation: str | None) -> torch.Tensor:
    """The causal depthwise convolution and its activation over [the row's previous kernel - 1 inputs, mixed],
    as the model's conv over a zero-padded prompt or its cached decode step computes it; writes mixed's kept
    tokens into the input ring `inputs` [b, R + 1, conv_dim]."""
    kernel, slots = conv.kernel_size[0], inputs.shape[1] - 1
    offsets = torch.arange(1 - kernel, 0, device=mixed.device)
    before = positions[:, :1] + offsets[None]  # [n, kernel - 1]
    history = inputs[rows[:, None], before % slots]
    history = torch.where((before >= 0)[..., None], history, torch.zeros_like(history))
    keep = torch.ones_like(positions, dtype=torch.bool)
    if last is not None:  # a prompt: only its real tokens, and of those the last R, reach the ring
        index = torch.arange(positions.shape[1], device=mixed.device)[None]
        keep = (index <= last[:, None]) & (index > last[:, None] - slots)
    inputs[rows[:, None], torch.where(keep, positions % slots, slots)] = mixed
    weight = conv.weight  # [C, 1, kernel]
    full = torch.cat([history, mixed], dim=1).transpose(1, 2).to(weight.dtype)  # [n, C, kernel - 1 + T]
    out = F.conv1d(full, weight, conv.bias, groups=full.shape[1])
    return (out if activation is None else ACT2FN[activation](out)).to(mixed.dtype).transpose(1, 2)


def recurrent_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule token by token, as the models' own decode step computes it (L2-normed q and k, q
    scaled by k_dim^-0.5, float32): q/k [n, T, Hk, dk], v [n, T, Hv, dv], g/beta [n, T, Hv], state
    [n, Hv, dk, dv] -> (out [n, T, Hv, dv] in v's dtype, the state after each token [n, T, Hv, dk, dv])."""
    dtype, groups = v.dtype, v.shape[2] // k.shape[2]
    if groups > 1:  # each q/k head serves `groups` consecutive value heads
        q, k = q.repeat_interleave(groups, dim=2), k.repeat_interleave(groups, dim=2)
    q, k, v, g, beta = (y.transpose(1, 2).float() for y in (q, k, v, g, beta))  # heads first
    q = _l2norm(q) / q.shape[-1] ** 0.5
    k = _l2norm(k)
    outs, each = [], []
    for i in range(q.shape[2]):
        state = state * g[:, :, i].exp()[..., None, None]
        memory = (state * k[:, :, i, :, None]).sum(dim=-2)
        delta = (v[:, :, i] - memory) * beta[:, :, i, None]
        state = state + k[:, :, i, :, None] * delta[..., None, :]
        outs.append((state * q[:, :, i, :, None]).sum(dim=-2))
        each.append(state)
    out = torch.stack(outs, dim=2).transpose(1, 2).to(dtype)
    return out, torch.stack(each, dim=1)


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)
