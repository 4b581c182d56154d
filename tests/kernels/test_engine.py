"""The fast loop with the fused Triton kernels gives the same tokens and acceptance lengths as with their
PyTorch references (fp32, tiny target; kernels interpreted on CPU)."""

from __future__ import annotations

import torch

from dflash_train.models import DFlashConfig, DFlashDraftModel
from dflash_train.runtime.engine import DecodeEngine, EngineConfig
from dflash_train.target import resolve_mask_token_id
from tests.helpers.kernels import DEVICE, kernels_here, under_interpreter
from tests.helpers.tiny_models import make_tiny_target

test_under_interpreter = under_interpreter(__file__)


@kernels_here
def test_triton_kernels_match_the_reference_path() -> None:
    torch.set_num_threads(1)
    # Three target layers, one after the drafter's two: under the interpreter each target layer's kernels
    # take most of the time, and more layers would only repeat them.
    target = make_tiny_target("llama", num_layers=3, seed=5)
    target.model.to(DEVICE)
    torch.manual_seed(0)
    mask_id = resolve_mask_token_id(target.tokenizer, target.vocab_size)
    config = DFlashConfig.from_target_config(target.config, mask_token_id=mask_id, num_hidden_layers=2, block_size=4,
                                             target_layer_ids=[0, 1])
    draft = DFlashDraftModel(config).to(DEVICE).eval()
    prompts = [[12, 40, 7, 99, 23], [61, 5, 18]]
    results, caches = {}, {}
    for kernels in ("torch", "triton"):
        engine = DecodeEngine(target, draft, EngineConfig(batch_size=2, block_size=4, max_new_tokens=12,
                                                          max_length=32, kernels=kernels))
        outputs, _ = engine.generate(prompts)
        results[kernels] = [(o.tokens, o.acceptance_lengths) for o in outputs]
        caches[kernels] = engine.drafter.cache
    assert results["triton"] == results["torch"]
    # The drafter's context K/V written by the fused kernel equal those of the drafter's own code.
    torch.testing.assert_close(caches["triton"].keys, caches["torch"].keys, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(caches["triton"].values, caches["torch"].values, atol=1e-5, rtol=1e-5)
    assert caches["torch"].keys.abs().sum() > 0
