"""Varlen attention for packed rows (`dflash_train.features.varlen`): chat boundaries from position ids, and the
per-chat result against plain causal SDPA on each chat alone, on CPU and through PyTorch's kernel on the GPU
(the kernel's signatures: `test_varlen_kernel.py`)."""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F

from dflash_train.features.varlen import packed_sequences, sequence_bounds, varlen_attention
from dflash_train.features.varlen_kernel import varlen_kernel

LENGTHS = ((5, 3, 8), (9, 7))  # chats of two rows of 16 tokens


def positions() -> torch.Tensor:
    return torch.stack([torch.cat([torch.arange(n) for n in row]) for row in LENGTHS])


def qkv(heads: int = 4, kv_heads: int = 2, dim: int = 8, dtype: torch.dtype = torch.float32,
        device: str = "cpu") -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(0)
    shapes = [(2, heads, 16, dim), (2, kv_heads, 16, dim), (2, kv_heads, 16, dim)]
    return tuple(torch.randn(s, generator=gen).to(device=device, dtype=dtype) for s in shapes)


def reference(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """Each chat alone through causal SDPA, kv heads repeated: [b, S, H, D]."""
    out = torch.empty_like(query)
    groups = query.shape[1] // key.shape[1]
    for row, chats in enumerate(LENGTHS):
        start = 0
        for n in chats:
            part = slice(start, start + n)
            k = key[row, :, part].repeat_interleave(groups, 0)
            v = value[row, :, part].repeat_interleave(groups, 0)
            out[row, :, part] = F.scaled_dot_product_attention(query[row, :, part], k, v, is_causal=True)
            start += n
    return out.transpose(1, 2)


def test_boundaries_start_at_every_position_zero_and_every_row() -> None:
    assert sequence_bounds(positions()) == (0, 5, 8, 16, 25, 32)
    continuing = torch.tensor([[3, 4, 5, 0, 1]])  # a row that starts mid-count still starts a chat
    assert sequence_bounds(continuing) == (0, 3, 5)


def test_each_chat_attends_to_itself_only() -> None:
    query, key, value = qkv()
    with packed_sequences(positions(), torch.device("cpu")) as sequences:
        out, weights = varlen_attention(types.SimpleNamespace(), query, key, value, None, scaling=8 ** -0.5)
    assert weights is None and sequences.longest == 9
    torch.testing.assert_close(out, reference(query, key, value))


def test_the_layout_change_is_traced_into_the_callers_compiled_graph() -> None:
    """Under a compiled decoder layer, the copy of queries and keys into the kernel's [tokens, heads, dim] layout
    belongs to the layer's graph (where the compiler writes them so in the first place); only the kernel's call,
    which reads the chats' boundaries, stays outside it."""
    graphs: list[torch.fx.GraphModule] = []

    def record(graph: torch.fx.GraphModule, example_inputs: list[torch.Tensor]):  # noqa: ANN202 - dynamo's contract
        graphs.append(graph)
        return graph.forward

    def layer(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        return varlen_attention(types.SimpleNamespace(), query * 2, key * 2, value, None, scaling=8 ** -0.5)[0]

    torch._dynamo.reset()
    with packed_sequences(positions(), torch.device("cpu")):
        out = torch.compile(layer, backend=record)(*qkv())
        torch.testing.assert_close(out, layer(*qkv()))
    traced = [node.target for graph in graphs for node in graph.graph.nodes]
    assert traced.count("contiguous") == 3 and "mul" in str(traced)


def test_outside_its_context_it_refuses() -> None:
    query, key, value = qkv()
    with pytest.raises(RuntimeError, match="inside dflash_train.features.varlen.packed_sequences"):
        varlen_attention(types.SimpleNamespace(), query, key, value, None)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_cuda_kernel_matches_each_chat_alone() -> None:
    query, key, value = qkv(dtype=torch.bfloat16, device="cuda", dim=64)
    with packed_sequences(positions(), torch.device("cuda")):
        out, _ = varlen_attention(types.SimpleNamespace(), query, key, value, None, scaling=64 ** -0.5)
    assert varlen_kernel(query.device, 64 ** -0.5, 64) is not None  # the kernel ran, not the fallback
    expected = reference(*(t.float() for t in (query, key, value)))
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)
