"""The target's packed pass replayed from CUDA graphs (`dflash_train.features.graphed`): padded boundaries and
longest-chat buckets, and, against the uncaptured pass on the same rows, the features of a tiny target over
steps whose chats change (CPU: the eager stand-in that replays on the same buffers; CUDA: real graphs)."""

from __future__ import annotations

import types

import pytest
import torch

from dflash_train.features.capture import compute_features
from dflash_train.features.graphed import GraphedFeatures, longest_bucket, padded_bounds
from dflash_train.features.varlen import (
    VARLEN,
    PackedSequences,
    packed_sequences,
    register,
    use_sequences,
    varlen_attention,
)
from dflash_train.target import TargetModel
from dflash_train.target.attention import attention_implementation
from tests.helpers.tiny_models import make_tiny_target

ROWS, LENGTH, LAYERS = 2, 512, (1, 3)


def test_buckets_are_powers_of_two_from_256_up_to_the_row() -> None:
    assert [longest_bucket(n, 8192) for n in (1, 256, 257, 3000, 8192)] == [256, 256, 512, 4096, 8192]
    assert longest_bucket(700, 600) == 600


def test_unused_boundary_slots_are_empty_chats_at_the_end() -> None:
    assert padded_bounds((0, 5, 16), 4) == [0, 5, 16, 16, 16]
    with pytest.raises(ValueError, match="3 chats do not fit 2"):
        padded_bounds((0, 1, 2, 3), 2)


def test_empty_chats_change_no_output() -> None:
    """The fallback (and so the CPU tests) skips empty chats as the CUDA kernel does."""
    gen = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(1, 2, 12, 8, generator=gen) for _ in range(3))
    outputs = []
    for bounds in ((0, 5, 12), (0, 5, 12, 12, 12)):
        cu = torch.tensor(bounds, dtype=torch.int32)
        with use_sequences(PackedSequences(cu, bounds, 7)):
            outputs.append(varlen_attention(types.SimpleNamespace(), query, key, value, None)[0])
    torch.testing.assert_close(outputs[1], outputs[0], rtol=0, atol=0)


def step_positions(lengths: list[list[int]]) -> torch.Tensor:
    """Position ids of packed rows holding chats of `lengths` (the rest of a row: padding, its own chat)."""
    rows = []
    for row in lengths:
        parts = [torch.arange(n) for n in row]
        parts.append(torch.arange(LENGTH - sum(row)))
        rows.append(torch.cat(parts))
    return torch.stack(rows)


# Steps whose chats (padding included) cross the capacity step (32 boundary slots) and the longest-chat
# buckets both ways; the last repeats the first's key: (32, 512), (64, 512), (32, 256), (64, 256), (32, 512).
STEPS = [[[100, 200, 150], [300]], [[10] * 40, [50, 50]], [[250, 200], [256, 256]], [[8] * 60, [256, 256]],
         [[300, 100], [120, 130, 140]]]


def uncaptured(target: TargetModel, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    register()
    with torch.no_grad(), attention_implementation(target.model, VARLEN), packed_sequences(positions, ids.device):
        return compute_features(target, ids, LAYERS, position_ids=positions.to(ids.device))


def replayed_against_uncaptured(target: TargetModel, device: torch.device, eager: bool) -> list[float]:
    """Largest difference per step between the graphed pass and the uncaptured one, same rows."""
    register()

    def features_pass(ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, None]:
        with torch.no_grad(), attention_implementation(target.model, VARLEN):
            return compute_features(target, ids, LAYERS, position_ids=positions), None

    graphed = GraphedFeatures(features_pass, ROWS, LENGTH, device, eager=eager)
    gaps = []
    for number, lengths in enumerate(STEPS):
        positions = step_positions(lengths)
        ids = torch.randint(7, 200, (ROWS, LENGTH), generator=torch.Generator().manual_seed(number)).to(device)
        features, final = graphed(ids, positions.to(device), positions)
        assert final is None
        expected = uncaptured(target, ids, positions)
        gaps.append((features.float() - expected.float()).abs().max().item())
    assert set(graphed.graphs) == {(32, 512), (64, 512), (32, 256), (64, 256)}  # one capture a key
    return gaps


def test_the_replayed_pass_equals_the_uncaptured_one_as_chats_change() -> None:
    target = make_tiny_target("llama", num_layers=4)
    assert replayed_against_uncaptured(target, torch.device("cpu"), eager=True) == [0.0] * len(STEPS)


def test_a_graph_that_replays_wrong_features_is_refused() -> None:
    """A new graph's first features are checked against the uncaptured pass: a replay that leaves its
    outputs stale (here: never written) stops the graphs instead of feeding the drafter wrong features."""
    target = make_tiny_target("llama", num_layers=4)

    def features_pass(ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, None]:
        with torch.no_grad(), attention_implementation(target.model, VARLEN):
            return compute_features(target, ids, LAYERS, position_ids=positions), None

    register()
    graphed = GraphedFeatures(features_pass, ROWS, LENGTH, torch.device("cpu"), eager=True)
    stale = types.SimpleNamespace(replay=lambda: None, outputs=(torch.zeros(ROWS, LENGTH, 2 * 64), None))
    graphed._capture = lambda capacity, bucket: stale  # type: ignore[method-assign]
    positions = step_positions(STEPS[0])
    with pytest.raises(RuntimeError, match="differ from the uncaptured pass"):
        graphed(torch.randint(7, 200, (ROWS, LENGTH)), positions, positions)
    assert not graphed.graphs  # not kept


def test_rows_of_another_shape_are_refused() -> None:
    graphed = GraphedFeatures(lambda ids, positions: (ids, None), ROWS, LENGTH, torch.device("cpu"), eager=True)
    positions = step_positions([[32], [32]])[:, :32]
    with pytest.raises(ValueError, match=r"rows of shape \(2, 32\), captured for \(2, 512\)"):
        graphed(torch.zeros(2, 32, dtype=torch.long), positions, positions)


def test_real_graphs_need_cuda() -> None:
    with pytest.raises(ValueError, match="need a CUDA device"):
        GraphedFeatures(lambda ids, positions: (ids, None), ROWS, LENGTH, torch.device("cpu"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graphs_replay_the_uncaptured_pass() -> None:
    target = make_tiny_target("llama", num_layers=4)
    target.model.to(device="cuda", dtype=torch.bfloat16)
    gaps = replayed_against_uncaptured(target, torch.device("cuda"), eager=False)
    assert max(gaps) <= 1e-2, gaps  # the varlen kernel with a wider grid: same arithmetic per chat
