"""The per-row state update after a decode cycle, fused: one launch instead of ~30 small ones.

`DecodeState.advance` in PyTorch is a chain of tiny element-wise ops over [b] and [b, B] tensors (gather the
committed tokens, test them against the stop ids, find the first stop, update counters and flags). Inside a
CUDA graph each is still a kernel with its own latency; for a small target, whose whole step is a few hundred
such kernels, that chain is several percent of a cycle. Here one program per row does all of it, with the same semantics:

    committed = out[r, n_out .. n_out + B)     (slots past accept_len ignored)
    first stop slot s among them, if any: kept = s + 1, else kept = accept_len
    for a row not done: accept_log[r, n_cycles] = accept_len; n_cycles += 1; n_out += kept;
        start += accept_len; last_token = bonus; stopped |= hit and n_out <= max_new_tokens;
        done |= hit or n_out >= max_new_tokens
"""

# Deliberately no postponed annotations (PEP 563): Triton reads the `tl.constexpr` annotations of kernels.
import torch

from dflash_train.kernels._triton import jit, next_power_of_2, tl


def _advance_kernel(
    out_ptr, n_out_ptr, accept_ptr, bonus_ptr, done_ptr, stopped_ptr, start_ptr, last_ptr, n_cycles_ptr, log_ptr,
    stop_ids_ptr, B, num_stop_ids, max_new_tokens, out_stride, out_sink, log_stride,
    BLOCK_B: tl.constexpr, BLOCK_S: tl.constexpr,
):
    r = tl.program_id(0)
    active = tl.load(done_ptr + r) == 0  # finished or idle rows are carried through unchanged (no store)
    n = tl.load(n_out_ptr + r)
    accept_len = tl.load(accept_ptr + r)
    slots = tl.arange(0, BLOCK_B)
    columns = tl.minimum(n + slots, out_sink)
    committed = tl.load(out_ptr + r.to(tl.int64) * out_stride + columns, mask=slots < B, other=-1)
    stop_slots = tl.arange(0, BLOCK_S)
    stop_ids = tl.load(stop_ids_ptr + stop_slots, mask=stop_slots < num_stop_ids, other=-1)
    is_stop = tl.sum((committed[:, None] == stop_ids[None, :]).to(tl.int32), axis=1) > 0
    is_stop = is_stop & (slots < accept_len) & (committed >= 0)
    first_stop = tl.min(tl.where(is_stop, slots, BLOCK_B), axis=0)
    hit = first_stop < BLOCK_B
    kept = tl.where(hit, first_stop + 1, accept_len)
    cycles = tl.load(n_cycles_ptr + r)
    tl.store(log_ptr + r.to(tl.int64) * log_stride + cycles, accept_len, mask=active)
    tl.store(n_cycles_ptr + r, cycles + 1, mask=active)
    n_new = n + kept
    tl.store(n_out_ptr + r, n_new, mask=active)
    tl.store(start_ptr + r, tl.load(start_ptr + r) + accept_len, mask=active)
    tl.store(last_ptr + r, tl.load(bonus_ptr + r), mask=active)
    stopped = (tl.load(stopped_ptr + r) != 0) | (hit & (n_new <= max_new_tokens))
    tl.store(stopped_ptr + r, stopped.to(tl.uint8), mask=active)
    tl.store(done_ptr + r, (hit | (n_new >= max_new_tokens)).to(tl.uint8), mask=active)


def advance_triton(
    out: torch.Tensor, n_out: torch.Tensor, accept_len: torch.Tensor, bonus: torch.Tensor, done: torch.Tensor,
    stopped: torch.Tensor, start: torch.Tensor, last_token: torch.Tensor, n_cycles: torch.Tensor,
    accept_log: torch.Tensor, stop_ids: torch.Tensor, block_size: int, max_new_tokens: int,
) -> None:
    """`DecodeState.advance` on these tensors, in place: out [b, W] and accept_log [b, L] int64 (their last
    columns sinks), the [b] int64 counters, done/stopped [b] bool, stop_ids [S] int64."""
    rows = out.shape[0]
    assert out.stride(1) == 1 and accept_log.stride(1) == 1 and done.dtype == stopped.dtype == torch.bool
    jit(_advance_kernel)[(rows,)](
        out, n_out, accept_len.contiguous(), bonus.contiguous(), done.view(torch.uint8), stopped.view(torch.uint8),
        start, last_token, n_cycles, accept_log, stop_ids, block_size, stop_ids.numel(), max_new_tokens,
        out.stride(0), out.shape[1] - 1, accept_log.stride(0),
        BLOCK_B=next_power_of_2(block_size), BLOCK_S=next_power_of_2(max(1, stop_ids.numel())),
    )
