"""Greedy verification of a drafted block, fused: vocabulary argmax, accepted prefix, bonus, commit.

For row r of a batch, with block = [x_start, d_1 .. d_{B-1}] and target logits [B, V] on it:

    t_k   = argmax_v logits[k, v]              (first index among equal maxima, as torch.argmax)
    a     = #leading k in 1..B-1 with d_k == t_{k-1}
    bonus = t_a
    out[r, n_out[r] + k] = d_{k+1} for k < a, bonus for k == a      (skipped for rows already done)

Returns accept_len = a + 1 (the acceptance-length sample of the cycle) and the bonus token.

Two launches, no host synchronisation: (1) one program per (row, slot, vocab chunk) reduces its chunk to
(max, first argmax); (2) one program per row reduces the chunks, compares with the drafts and writes the
committed tokens.
"""

# Deliberately no postponed annotations (PEP 563): Triton reads the `tl.constexpr` annotations of kernels.
import torch

from dflash_train.kernels._triton import jit, next_power_of_2, tl


def greedy_verify_reference(
    logits: torch.Tensor, block: torch.Tensor, out: torch.Tensor, n_out: torch.Tensor, done: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch version. logits [b, B, V]; block [b, B] int64; out [b, W] int64 written in place;
    n_out [b] int64; done [b] bool. Returns (accept_len [b], bonus [b]), both int64."""
    target = logits.argmax(dim=-1)  # [b, B]
    return accept_and_commit_reference(target, block, out, n_out, done)


def accept_and_commit_reference(
    target: torch.Tensor, block: torch.Tensor, out: torch.Tensor, n_out: torch.Tensor, done: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The part after the argmax: target [b, B] are the target's tokens at each slot."""
    matches = (block[:, 1:] == target[:, :-1]).long()  # [b, B-1]
    accepted = matches.cumprod(dim=-1).sum(dim=-1)  # a, [b]
    bonus = target.gather(1, accepted[:, None])[:, 0]
    commit_tokens(out, n_out, block, accepted, bonus, done)
    return accepted + 1, bonus


def commit_tokens(
    out: torch.Tensor,
    n_out: torch.Tensor,
    block: torch.Tensor,
    accepted: torch.Tensor,
    bonus: torch.Tensor,
    done: torch.Tensor,
) -> None:
    """out[r, n_out[r] + k] = block[r, k+1] for k < a_r, bonus_r at k == a_r; rows with done[r] untouched.

    Static shapes: every slot is scattered, and slots that must not be written go to out's last column,
    which the caller keeps as a sink (so `out` needs B columns of headroom plus one).
    """
    b, width = block.shape[0], block.shape[1]
    slots = torch.arange(width, device=block.device)[None, :]  # [1, B]
    shifted = torch.cat([block[:, 1:], block[:, :1]], dim=1)  # [b, B]: d_{k+1} at slot k
    tokens = torch.where(slots < accepted[:, None], shifted, bonus[:, None])
    write = (slots <= accepted[:, None]) & ~done[:, None]
    sink = out.shape[1] - 1
    index = torch.where(write, n_out[:, None] + slots, torch.full_like(slots, sink).expand(b, width))
    out.scatter_(1, index, tokens)


def _argmax_chunks_kernel(logits_ptr, part_max_ptr, part_idx_ptr, V, n_chunks, BLOCK_V: tl.constexpr):
    row = tl.program_id(0)  # (batch row, slot) flattened
    chunk = tl.program_id(1)
    offs = chunk * BLOCK_V + tl.arange(0, BLOCK_V)
    x = tl.load(logits_ptr + row.to(tl.int64) * V + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
    best = tl.max(x, axis=0)
    # First index among equal maxima inside the chunk (torch.argmax semantics).
    first = tl.min(tl.where(x == best, offs, 2147483647), axis=0)
    tl.store(part_max_ptr + row * n_chunks + chunk, best)
    tl.store(part_idx_ptr + row * n_chunks + chunk, first.to(tl.int64))


def _argmax_finish_kernel(part_max_ptr, part_idx_ptr, out_ptr, n_chunks, width, out_stride_b, out_stride_w,
                          BLOCK_C: tl.constexpr):
    """Per (row, slot): the chunks' maxima reduced to torch.argmax's answer (the first index of the maximum),
    stored at out[row // width, row % width] of a strided [b, width] output."""
    row = tl.program_id(0)
    chunks = tl.arange(0, BLOCK_C)
    valid = chunks < n_chunks
    part_max = tl.load(part_max_ptr + row * n_chunks + chunks, mask=valid, other=float("-inf"))
    part_idx = tl.load(part_idx_ptr + row * n_chunks + chunks, mask=valid, other=9223372036854775807)
    best = tl.max(part_max, axis=0)
    # Chunks are in vocabulary order, so the smallest index holding the maximum is the first.
    token = tl.min(tl.where(part_max == best, part_idx, 9223372036854775807), axis=0)
    tl.store(out_ptr + (row // width) * out_stride_b + (row % width) * out_stride_w, token)


def _accept_commit_kernel(
    part_max_ptr, part_idx_ptr, block_ptr, out_ptr, n_out_ptr, done_ptr, accept_ptr, bonus_ptr,
    B, n_chunks, out_stride, BLOCK_B: tl.constexpr, BLOCK_C: tl.constexpr,
):
    r = tl.program_id(0)
    slots = tl.arange(0, BLOCK_B)
    chunks = tl.arange(0, BLOCK_C)
    valid = (slots[:, None] < B) & (chunks[None, :] < n_chunks)
    offs = (r * B + slots[:, None]) * n_chunks + chunks[None, :]
    part_max = tl.load(part_max_ptr + offs, mask=valid, other=float("-inf"))
    part_idx = tl.load(part_idx_ptr + offs, mask=valid, other=9223372036854775807)
    best = tl.max(part_max, axis=1)
    # Chunks are in vocabulary order, so the smallest index holding the maximum is torch.argmax's answer.
    target = tl.min(tl.where(part_max == best[:, None], part_idx, 9223372036854775807), axis=1)  # [BLOCK_B]
    has_draft = slots + 1 < B
    drafts = tl.load(block_ptr + r * B + slots + 1, mask=has_draft, other=-1)  # d_{k+1} at slot k
    miss = (drafts != target) | ~has_draft
    accepted = tl.min(tl.where(miss, slots, BLOCK_B), axis=0)  # a: first slot whose next draft is wrong
    bonus = tl.sum(tl.where(slots == accepted, target, 0), axis=0)
    tokens = tl.where(slots < accepted, drafts, bonus)
    n = tl.load(n_out_ptr + r)
    last = tl.where(tl.load(done_ptr + r) == 0, accepted, -1)  # rows already done commit nothing
    tl.store(out_ptr + r.to(tl.int64) * out_stride + n + slots, tokens, mask=slots <= last)
    tl.store(accept_ptr + r, (accepted + 1).to(tl.int64))
    tl.store(bonus_ptr + r, bonus)


def greedy_verify_triton(
    logits: torch.Tensor,
    block: torch.Tensor,
    out: torch.Tensor,
    n_out: torch.Tensor,
    done: torch.Tensor,
    block_v: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `greedy_verify_reference` (logits fp32/bf16/fp16, any V)."""
    b, width, vocab = logits.shape
    assert block.shape == (b, width) and block.dtype == torch.int64 and out.dtype == torch.int64
    assert out.stride(1) == 1 and n_out.dtype == torch.int64 and done.dtype == torch.bool
    logits = logits.contiguous()
    block_v = block_v or min(4096, next_power_of_2(vocab))
    n_chunks = -(-vocab // block_v)
    device = logits.device
    part_max = torch.empty(b * width, n_chunks, device=device, dtype=torch.float32)
    part_idx = torch.empty(b * width, n_chunks, device=device, dtype=torch.int64)
    jit(_argmax_chunks_kernel)[(b * width, n_chunks)](logits, part_max, part_idx, vocab, n_chunks, BLOCK_V=block_v)
    accept_len = torch.empty(b, device=device, dtype=torch.int64)
    bonus = torch.empty(b, device=device, dtype=torch.int64)
    jit(_accept_commit_kernel)[(b,)](
        part_max, part_idx, block.contiguous(), out, n_out, done.view(torch.uint8), accept_len, bonus,
        width, n_chunks, out.stride(0), BLOCK_B=next_power_of_2(width), BLOCK_C=next_power_of_2(n_chunks),
    )
    return accept_len, bonus


def block_argmax_triton(logits: torch.Tensor, block_v: int | None = None, out: torch.Tensor | None = None,
                        ) -> torch.Tensor:
    """The token at every slot, logits [b, B, V] -> [b, B] int64 (torch.argmax's first index among equal
    maxima), in two launches: the verify's vocabulary pass, then one that reduces each slot's chunks. For the
    drafter's greedy drafts (PyTorch's argmax over a [15, 49,152] bf16 block is slow for the little it reads:
    docs/benchmarks.md, 'Figures behind code choices') and a caller that decides acceptance itself (the acceptance replay of benchmarks/decode_batch.py). `out`: an
    int64 [b, B] tensor, any strides (the decode block's draft slots), written in place of a new one, which
    saves the copy into it."""
    b, width, vocab = logits.shape
    logits = logits.contiguous()
    block_v = block_v or min(4096, next_power_of_2(vocab))
    n_chunks = -(-vocab // block_v)
    part_max = torch.empty(b * width, n_chunks, device=logits.device, dtype=torch.float32)
    part_idx = torch.empty(b * width, n_chunks, device=logits.device, dtype=torch.int64)
    jit(_argmax_chunks_kernel)[(b * width, n_chunks)](logits, part_max, part_idx, vocab, n_chunks, BLOCK_V=block_v)
    if out is not None and (out.shape != (b, width) or out.dtype != torch.int64 or out.device != logits.device):
        raise ValueError(f"out must be int64 [{b}, {width}] on {logits.device}, not {out.dtype} "
                         f"{list(out.shape)} on {out.device}")
    tokens = torch.empty(b, width, device=logits.device, dtype=torch.int64) if out is None else out
    jit(_argmax_finish_kernel)[(b * width,)](part_max, part_idx, tokens, n_chunks, width, *tokens.stride(),
                                             BLOCK_C=next_power_of_2(n_chunks))
    return tokens
