"""The decode cycle's compiled layer code keeps compiling past dynamo's default of 8 graphs a code: DeepSeek-V3's
two layer kinds at ten step shapes each are twenty graphs of one code, and every one of them is compiled, not
left to run eager (as dynamo does past its limit, with one warning)."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
import torch._dynamo.config
from torch._dynamo.testing import CompileCounter

from dflash_train import compiling
from dflash_train.runtime.static_target import StaticTarget
from tests.helpers.static_target import tiny_target


def test_every_step_shape_of_every_layer_kind_is_compiled(monkeypatch: pytest.MonkeyPatch) -> None:
    counter = CompileCounter()  # a backend that counts the graphs it is given and runs them as traced
    real_compile = torch.compile
    monkeypatch.setattr(compiling.torch, "compile", lambda fn, **kwargs: real_compile(fn, backend=counter,
                                                                                         dynamic=False))
    torch._dynamo.reset()
    with torch._dynamo.config.patch(recompile_limit=8):  # dynamo's default, whatever ran before
        target = tiny_target("deepseek_v3")
        kinds = {type(layer.mlp).__name__ for layer in target.decoder_layers}
        assert len(kinds) == 2, kinds  # dense first layers beside expert ones: two graphs a shape
        runner = StaticTarget(target, batch_size=2, max_length=32)
        ids = torch.randint(10, 300, (2, 8), generator=torch.Generator().manual_seed(0))
        frames = []
        for rows in (1, 2):
            for tokens in range(1, 6):
                positions = torch.arange(tokens).expand(rows, tokens)
                runner.forward(ids[:rows, :tokens], positions, row_index=torch.arange(rows), compiled=True,
                               compile_scope="layer")
                frames.append(counter.frame_count)
        torch._dynamo.reset()
    new_graphs = [after - before for before, after in zip(frames, frames[1:], strict=False)]
    # each new shape: the embedding, the output and one layer graph per kind, the last shape as the first
    assert new_graphs[-1] == new_graphs[0] >= 2 + len(kinds), new_graphs
