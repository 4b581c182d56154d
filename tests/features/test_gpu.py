"""Extraction on CUDA: the asynchronous pipeline (pinned inputs, side-stream copies, writer threads) stores
what the capture gives row by row."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.tiny_models import make_tiny_target

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_cuda_extraction_stores_what_the_capture_gives(dtype: str, tmp_path) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    import datasets

    from dflash_train.features.capture import compute_features
    from dflash_train.features.extract import ExtractConfig, extract
    from dflash_train.features.store import FeatureStore, dequantize_fp8, quantize_fp8

    target = make_tiny_target("qwen3", num_layers=6)
    target.model.cuda()
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(7, 256, (int(n),), generator=g).tolist() for n in torch.randint(3, 90, (41,), generator=g)]
    data = datasets.Dataset.from_dict({"input_ids": ids, "loss_mask": [[1] * len(row) for row in ids]})
    # many small micro-batches over several windows: pinned buffers are reused while copies are in flight
    config = ExtractConfig([0, 2, 4], dtype, rows_per_shard=3, token_budget=160, write_threads=2)
    extract(target, data, tmp_path, config, {"target": "tiny"})
    store = FeatureStore(tmp_path)
    for i, row in enumerate(ids):
        alone = compute_features(target, torch.tensor([row], device="cuda"), [0, 2, 4])[0]
        if dtype == "fp8":
            alone = dequantize_fp8(*quantize_fp8(alone, 3))
        stored = store[i]
        assert stored["input_ids"].tolist() == row
        torch.testing.assert_close(stored["features"].float(), alone.float().cpu(), rtol=1.6e-2, atol=2e-2)
