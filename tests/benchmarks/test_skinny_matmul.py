"""`benchmarks/skinny_matmul.py` (GPU only): its candidate tilings fit in shared memory and are ones a dot
takes, its summary table reads a results file, and on a CPU it stops with one line."""

from __future__ import annotations

import pytest
import torch

from benchmarks.skinny_matmul import QWEN3_8B_PRODUCTS, SHARED_BYTES, candidates, main, table
from dflash_train.kernels.skinny_matmul import BLOCK_M


def test_candidates_fit_in_shared_memory() -> None:
    configs = candidates()
    assert len(configs) == len(set(configs)) > 20
    for config in configs:
        assert config.num_stages * (config.block_n + BLOCK_M) * config.block_k * 2 <= SHARED_BYTES
    assert {config.block_n for config in configs} == {16, 32, 64, 128}


def test_table() -> None:
    entry = {"n": 4096, "k": 4096, "best_config": [16, 256, 2, 4], "checks": {"row_invariant_16": True}}
    for m in (1, 16):
        for key in ("cublas", "table", "best"):
            entry[f"{key}_m{m}_us"], entry[f"{key}_m{m}_tb_s"] = 10.0, 3.4
    text = table({"products": {"o_proj": entry}})
    assert "o_proj" in text and "(16, 256, 2, 4)" in text and "CONFIGS: {(4096, 4096): (16, 256, 2, 4)}" in text
    assert QWEN3_8B_PRODUCTS["o_proj"] == (4096, 4096)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's answer")
def test_needs_a_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main([])
    assert "needs a CUDA device" in capsys.readouterr().err
