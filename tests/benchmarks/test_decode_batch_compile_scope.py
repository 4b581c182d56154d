"""`benchmarks/decode_batch.py --compile-scope layer`: the engines compile one graph per part, the layer's
shared by every layer, and the JSON records the scope. The compilation runs dynamo with the "aot_eager"
backend (inductor's C++ compilation would take minutes on a small CPU): the plumbing, not the speed."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from benchmarks.decode_batch import main


def test_layer_scope_points_compile_three_graphs_per_forward(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    real = torch.compile

    def counting(fn: Callable[..., Any], **kwargs: Any) -> Callable[..., Any]:
        kwargs.pop("options")
        return real(fn, backend=counter, **kwargs)

    monkeypatch.setattr(torch, "compile", counting)
    out = tmp_path / "decode_batch.json"
    main(["--quick", "--compile", "--compile-scope", "layer", "--shapes", "smollm2", "--batches", "1",
          "--out", str(out)])
    result = json.loads(out.read_text())
    assert result["compile_scope"] == "layer"
    points = result["shapes"]["smollm2"]["points"]
    assert [(p["drafter"], p["compiled"], p["compile_error"]) for p in points] == [(False, True, None),
                                                                                  (True, True, None)]
    # Target alone (3 graphs), then the drafted cycle: the target's at the block's shapes (3), the drafter's (3)
    # and the block's embedding (1).
    assert counter.frame_count == 10
    torch._dynamo.reset()


def test_the_default_scope_is_recorded(tmp_path: Path) -> None:
    out = tmp_path / "decode_batch.json"
    main(["--quick", "--shapes", "smollm2", "--batches", "1", "--out", str(out)])
    assert json.loads(out.read_text())["compile_scope"] == "layer"


def test_the_products_asked_for_are_recorded_with_what_ran(tmp_path: Path) -> None:
    """--matmul reaches the runner; on a CPU (no Triton kernels) what ran is torch's, and each point says so."""
    out = tmp_path / "decode_batch.json"
    main(["--quick", "--shapes", "smollm2", "--batches", "1", "--matmul", "fused", "--out", str(out)])
    result = json.loads(out.read_text())
    assert result["matmul"] == "fused"
    assert [point["matmul"] for point in result["shapes"]["smollm2"]["points"]] == ["torch", "torch"]
