"""Regeneration on CUDA: the runtime (captured graph, Triton kernels, compiled step, rows refilled) gives
exactly what Hugging Face's own loop gives."""

from __future__ import annotations

import pytest
import torch

from dflash_train.regeneration.generation import Generator, hf_generate
from dflash_train.runtime.config import EngineConfig
from tests.helpers.tiny_models import make_tiny_target

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_graph_step_generation_equals_hf_generate_per_row(arch: str) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    target = make_tiny_target(arch, num_layers=3)
    model = target.model.cuda()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(7, 256, (n,), generator=g).tolist() for n in (3, 11, 7, 1, 30)]
    config = EngineConfig(batch_size=3, block_size=1, max_new_tokens=40, max_length=128, stop_token_ids=(2,))
    generator = Generator(target, config)
    batched = generator.generate(prompts, [0] * len(prompts))
    engine = generator.engine
    assert engine is not None and engine.uses_cuda_graph and engine.kernels == "triton", engine.graph_error
    assert generator.generate(prompts, [0] * len(prompts)) == batched  # the replayed graph again, same answer
    for prompt, out in zip(prompts, batched, strict=True):
        (alone,) = hf_generate(model, [prompt], config)
        assert out == alone
