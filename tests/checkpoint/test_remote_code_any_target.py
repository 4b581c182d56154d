"""The exported remote code's `spec_generate` on targets whose caches cannot all be cut back (sliding windows,
sinks, linear attention, convolutions, Mamba) and on experts and latent attention: the target's own greedy
output, and the same cycles as our engine with the same drafter (so the same drafts), for every architecture
of the matrix (tests/helpers/tiny_targets.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dflash_train.checkpoint import load_draft
from dflash_train.runtime.engine import DecodeEngine, EngineConfig
from dflash_train.target import TargetModel
from tests.helpers.checkpoints import export_tiny, load_remote, reference_greedy
from tests.helpers.tiny_targets import TINY_TARGETS, build_tiny_target

NEW_TOKENS = 20


@pytest.mark.parametrize("name", TINY_TARGETS)
def test_remote_spec_generate_is_lossless_with_our_cycles(name: str, tmp_path: Path) -> None:
    target = TargetModel(build_tiny_target(name, 320), None)
    out = export_tiny(tmp_path, target, block_size=4, target_layer_ids=[1, 2])
    prompt = torch.randint(10, 250, (1, 9), generator=torch.Generator().manual_seed(0))
    remote = load_remote(out)
    generated = remote.spec_generate(target.model, prompt, max_new_tokens=NEW_TOKENS, stop_token_ids=[])
    assert generated[0, 9:].tolist() == reference_greedy(target, prompt, NEW_TOKENS)
    config = EngineConfig(batch_size=1, block_size=4, max_new_tokens=NEW_TOKENS, max_length=64, kernels="torch")
    (ours,), _ = DecodeEngine(target, load_draft(out, dtype=torch.float32), config).generate([prompt[0].tolist()])
    assert ours.acceptance_lengths == remote.last_acceptance_lengths
