"""Regeneration on CUDA: the captured-graph decode step gives exactly what Hugging Face's own loop gives."""

from __future__ import annotations

import pytest
import torch

from dflash_train.data.generation import BatchGenerator, GenerationSettings, hf_generate
from tests.tiny_models import make_tiny_target

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_graph_step_generation_equals_hf_generate_per_row(arch: str) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    target = make_tiny_target(arch, num_layers=3)
    model = target.model.cuda()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(7, 256, (n,), generator=g).tolist() for n in (3, 11, 7, 1, 30)]
    settings = GenerationSettings(40, stop_ids=(2,), pad_id=0, sync_every=4)
    generator = BatchGenerator(model, settings)
    batched = generator.generate(prompts)
    assert generator._current is not None and generator._current[2] is not None, "no CUDA graph was captured"
    assert generator.generate(prompts) == batched  # the replayed graph again, same answer
    for prompt, out in zip(prompts, batched, strict=True):
        (alone,) = hf_generate(model, [prompt], settings)
        assert out == alone
