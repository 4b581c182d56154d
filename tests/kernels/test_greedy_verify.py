"""The fused greedy-verification kernel against its PyTorch reference and a hand-written per-row loop.

On CPU the kernels run under TRITON_INTERPRET=1; when this process imported triton without it, the file
re-runs itself in a subprocess that sets it from the start.
"""

from __future__ import annotations

import pytest
import torch

from dflash_train.kernels._triton import HAS_TRITON
from dflash_train.kernels.greedy_verify import (
    block_argmax_triton,
    greedy_verify_reference,
    greedy_verify_triton,
)
from tests.helpers.kernels import DEVICE, kernels_here, under_interpreter

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")


test_under_interpreter = under_interpreter(__file__)


def loop_oracle(logits: torch.Tensor, block: torch.Tensor, out: torch.Tensor, n_out: torch.Tensor,
                done: torch.Tensor) -> tuple[list[int], list[int]]:
    """One row at a time, in Python: the semantics written out."""
    lengths, bonuses = [], []
    for r in range(block.shape[0]):
        target = [int(logits[r, k].float().argmax()) for k in range(block.shape[1])]
        a = 0
        while a + 1 < block.shape[1] and int(block[r, a + 1]) == target[a]:
            a += 1
        committed = block[r, 1 : a + 1].tolist() + [target[a]]
        if not done[r]:
            n = int(n_out[r])
            out[r, n : n + a + 1] = torch.tensor(committed)
        lengths.append(a + 1)
        bonuses.append(target[a])
    return lengths, bonuses


def make_case(
    batch: int, width: int, vocab: int, dtype: torch.dtype, seed: int, ties: bool
) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, width, vocab, generator=gen).to(dtype)
    if ties:  # equal maxima inside one vocabulary chunk and across chunks: the first index must win
        for index in (vocab // 3, vocab // 3 + 1, vocab - 2):
            logits[..., index] = 50.0
    target = logits.float().argmax(-1)
    block = torch.randint(0, vocab, (batch, width), generator=gen)
    for r in range(batch):  # accept a random prefix of the drafts
        keep = int(torch.randint(0, width, (1,), generator=gen))
        block[r, 1 : keep + 1] = target[r, :keep]
    width_out = 3 * width + 2
    out = torch.full((batch, width_out), -7, dtype=torch.int64)
    n_out = torch.randint(0, width + 1, (batch,), generator=gen)
    done = torch.zeros(batch, dtype=torch.bool)
    if batch > 1:
        done[1] = True
    return logits, block, out, n_out, done


@kernels_here
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("batch", "width", "vocab", "block_v"), [(1, 1, 37, 16), (3, 5, 301, 64), (2, 16, 1000, 128)])
@pytest.mark.parametrize("ties", [False, True])
def test_kernel_matches_reference_and_loop(dtype: torch.dtype, batch: int, width: int, vocab: int, block_v: int,
                                           ties: bool) -> None:
    logits, block, out, n_out, done = make_case(batch, width, vocab, dtype, seed=batch * 100 + width, ties=ties)
    out_loop, out_ref, out_kernel = out.clone(), out.clone(), out.clone()
    lengths, bonuses = loop_oracle(logits, block, out_loop, n_out, done)
    ref_len, ref_bonus = greedy_verify_reference(logits, block, out_ref, n_out, done)
    out_kernel = out_kernel.to(DEVICE)
    k_len, k_bonus = greedy_verify_triton(logits.to(DEVICE), block.to(DEVICE), out_kernel, n_out.to(DEVICE),
                                          done.to(DEVICE), block_v=block_v)
    out_kernel = out_kernel.cpu()
    assert ref_len.tolist() == lengths and ref_bonus.tolist() == bonuses
    assert k_len.tolist() == lengths and k_bonus.tolist() == bonuses
    # Everything except the sink column (last) matches the loop exactly.
    assert torch.equal(out_ref[:, :-1], out_loop[:, :-1])
    assert torch.equal(out_kernel[:, :-1], out_loop[:, :-1])
    if ties:
        assert all(int(t) == vocab // 3 for t in logits.float().argmax(-1).flatten())


@kernels_here
def test_full_acceptance_and_immediate_rejection() -> None:
    vocab, width = 50, 4
    logits = torch.full((2, width, vocab), -1.0)
    chosen = torch.tensor([[3, 4, 5, 6], [7, 8, 9, 10]])
    logits.scatter_(2, chosen[..., None], 5.0)
    block = torch.tensor([[1, 3, 4, 5], [1, 2, 8, 9]])  # row 0: all drafts right; row 1: first draft wrong
    out = torch.zeros(2, 10, dtype=torch.int64, device=DEVICE)
    n_out = torch.tensor([2, 0], device=DEVICE)
    done = torch.zeros(2, dtype=torch.bool, device=DEVICE)
    length, bonus = greedy_verify_triton(logits.to(DEVICE), block.to(DEVICE), out, n_out, done, block_v=16)
    assert length.tolist() == [4, 1] and bonus.tolist() == [6, 7]
    assert out[0, 2:6].tolist() == [3, 4, 5, 6] and out[1, :1].tolist() == [7]


@kernels_here
@pytest.mark.parametrize(("vocab", "block_v"), [(300, 64), (1000, None)])
def test_block_argmax_is_torch_argmax(vocab: int, block_v: int | None) -> None:
    logits = make_case(3, 5, vocab, torch.bfloat16, seed=vocab, ties=True)[0]
    tokens = block_argmax_triton(logits.to(DEVICE), block_v=block_v)
    assert torch.equal(tokens.cpu(), logits.float().argmax(-1))
    # into a strided view, as the decode block's draft slots: the slot before each row's stays untouched
    block = torch.full((3, 6), -1, dtype=torch.int64, device=DEVICE)
    assert block_argmax_triton(logits.to(DEVICE), block_v=block_v, out=block[:, 1:]).data_ptr() == block[:, 1:].data_ptr()
    assert torch.equal(block[:, 1:].cpu(), logits.float().argmax(-1)) and (block[:, 0] == -1).all()
    with pytest.raises(ValueError, match=r"out must be int64 \[3, 5\]"):
        block_argmax_triton(logits.to(DEVICE), out=block[:, 2:])
