"""The fused per-row state update against `DecodeState`'s PyTorch update and a per-row Python loop, on rows
that are idle, hit a stop token at some slot (or past the accepted ones), reach max_new_tokens, or run on.

On CPU the kernels run under TRITON_INTERPRET=1; when this process imported triton without it, the file
re-runs itself in a subprocess that sets it from the start.
"""

from __future__ import annotations

import pytest
import torch

from dflash_train.kernels._triton import HAS_TRITON
from dflash_train.runtime.state import DecodeState
from tests.helpers.kernels import DEVICE, kernels_here, under_interpreter

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")

test_under_interpreter = under_interpreter(__file__)

STOPS = [3, 11]
FIELDS = ("start", "last_token", "n_out", "n_cycles", "stopped", "done")


def random_state(rows: int, block: int, max_new: int, seed: int, fused: bool, stops: list[int]) -> DecodeState:
    g = torch.Generator().manual_seed(seed)
    state = DecodeState(rows, block, max_new, stops, torch.device(DEVICE), fused=fused)
    state.out.copy_(torch.randint(12, 40, state.out.shape, generator=g))
    for r in range(rows):  # a stop token at a random slot of the block about to be committed, in most rows
        n = int(torch.randint(1, max_new, (1,), generator=g))
        state.n_out[r] = n
        if r % 4 and stops:
            state.out[r, min(n + r % block, state.out.shape[1] - 1)] = stops[r % len(stops)]
    state.n_cycles.copy_(torch.randint(0, 5, (rows,), generator=g))
    state.start.copy_(torch.randint(10, 100, (rows,), generator=g))
    state.done.copy_(torch.rand(rows, generator=g) < 0.2)
    state.stopped.copy_(state.done & (torch.rand(rows, generator=g) < 0.5).to(state.done.device))
    return state


def loop_oracle(state: DecodeState, accept: list[int], bonus: list[int], stops: list[int]) -> dict[str, list]:
    """The update written out row by row."""
    fields = {name: getattr(state, name).tolist() for name in FIELDS}
    for r in range(len(accept)):
        if fields["done"][r]:
            continue
        n = fields["n_out"][r]
        committed = [state.out[r, min(n + k, state.out.shape[1] - 1)].item() for k in range(accept[r])]
        first = next((k for k, token in enumerate(committed) if token in stops), None)
        kept = accept[r] if first is None else first + 1
        fields["n_out"][r] = n + kept
        fields["n_cycles"][r] += 1
        fields["start"][r] += accept[r]
        fields["last_token"][r] = bonus[r]
        fields["stopped"][r] = fields["stopped"][r] or (first is not None and n + kept <= state.max_new_tokens)
        fields["done"][r] = first is not None or n + kept >= state.max_new_tokens
    return fields


@kernels_here
@pytest.mark.parametrize(("rows", "block", "stops"), [(37, 16, STOPS), (9, 8, [3]), (6, 1, STOPS), (8, 4, [])])
def test_fused_update_equals_the_pytorch_one_and_the_loop(rows: int, block: int, stops: list[int]) -> None:
    max_new = 40
    g = torch.Generator().manual_seed(rows)
    accept = torch.randint(1, block + 1, (rows,), generator=g)
    bonus = torch.randint(12, 40, (rows,), generator=g)
    plain, fused = (random_state(rows, block, max_new, 7, flag, stops) for flag in (False, True))
    expected = loop_oracle(plain, accept.tolist(), bonus.tolist(), stops)
    before_logs = plain.accept_log.clone()
    for state in (plain, fused):
        state.advance(accept.to(DEVICE), bonus.to(DEVICE))
    for name in FIELDS:
        assert getattr(fused, name).tolist() == getattr(plain, name).tolist() == expected[name], name
    # the acceptance log: each running row's entry at its cycle count; the sink column is scratch
    assert torch.equal(fused.accept_log[:, :-1].cpu(), plain.accept_log[:, :-1].cpu())
    ran = ~torch.tensor([bool(d) for d in random_state(rows, block, max_new, 7, False, stops).done.tolist()])
    assert not torch.equal(plain.accept_log[ran].cpu(), before_logs[ran].cpu()) or not ran.any()
    assert torch.equal(fused.out.cpu(), plain.out.cpu())  # the update reads tokens, never writes them
