"""`DFlashDraftModel.compile_layers`: the layers share one compiled graph in training, and the compiled drafter
computes what the eager one does."""

from __future__ import annotations

import copy

import torch
import torch._dynamo
from torch._dynamo.utils import counters

from tests.helpers.tiny_drafts import tiny_draft


def test_compiled_layers_share_one_graph_and_match_the_eager_drafter() -> None:
    """The first layer's input (embeddings of the frozen table) needs no grad, the later layers' inputs do, and
    dynamo guards on requires_grad: without care the layer compiles twice. compile_layers makes the first input
    require grad too, so three layers run one graph; outputs and gradients equal the eager drafter's, and the
    caller's embeddings are left as they were."""
    torch._dynamo.reset()
    counters.clear()
    eager = tiny_draft(seed=3, num_hidden_layers=3)
    compiled = copy.deepcopy(eager)
    compiled.compile_layers()
    gen = torch.Generator().manual_seed(0)
    c, k, q = 10, eager.config.num_context_features, 8
    embeds = torch.randn(2, q, 32, generator=gen)
    inputs = (embeds, torch.arange(c, c + q).repeat(2, 1), torch.randn(2, c, k * 32, generator=gen),
              torch.arange(c).repeat(2, 1), None)
    got, expected = compiled(*inputs), eager(*inputs)
    got.square().sum().backward()
    expected.square().sum().backward()
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert not embeds.requires_grad and embeds.grad is None
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    for (name, p), (_, e) in zip(compiled.named_parameters(), eager.named_parameters(), strict=True):
        torch.testing.assert_close(p.grad, e.grad, rtol=1e-4, atol=1e-6, msg=name)
