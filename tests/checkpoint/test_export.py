"""An export loads through Transformers remote code and decodes losslessly with `spec_generate`."""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from dflash_train.checkpoint.weights import write_tensors
from dflash_train.runtime.reference_loop import generate_greedy
from dflash_train.target import TargetModel
from tests.helpers.checkpoints import export_tiny, load_remote, reference_greedy
from tests.helpers.tiny_models import make_tiny_target


def prompt(seed: int, length: int = 9) -> torch.Tensor:
    return torch.randint(10, 250, (1, length), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def target() -> TargetModel:
    return make_tiny_target("qwen3", num_layers=6, seed=1)


def test_export_directory_is_complete(tmp_path: Path, target: TargetModel) -> None:
    out = export_tiny(tmp_path, target)
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json", "dflash.py", "model.safetensors"]
    card = (out / "README.md").read_text()
    assert card.startswith("---\n") and "- dflash\n- speculative-decoding\n" in card
    assert '"num_speculative_tokens": 3' in card and "--speculative-algorithm DFLASH" in card


def test_exported_files_are_readable_by_everyone(tmp_path: Path, target: TargetModel) -> None:
    """safetensors writes model.safetensors through a private temporary file (0600), whose mode the export
    kept: a serving process of another user could not read the weights."""
    umask = os.umask(0o022)
    try:
        out = export_tiny(tmp_path, target)
    finally:
        os.umask(umask)
    modes = {path.name: stat.S_IMODE(path.stat().st_mode) for path in out.iterdir()}
    assert modes == dict.fromkeys(modes, 0o644) and "model.safetensors" in modes


def test_sharded_weights_are_readable_by_everyone_too(tmp_path: Path) -> None:
    write_tensors({"a": torch.zeros(64), "b": torch.ones(64)}, tmp_path, max_shard_bytes=256)
    assert {stat.S_IMODE(p.stat().st_mode) for p in tmp_path.glob("*.safetensors")} == {0o644}
    assert len(list(tmp_path.glob("*.safetensors"))) == 2


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_remote_spec_generate_is_the_targets_greedy_decoding(
    tmp_path: Path, target: TargetModel, block_size: int
) -> None:
    draft = load_remote(export_tiny(tmp_path, target, block_size=block_size))
    ids = prompt(block_size)
    out = draft.spec_generate(target.model, ids, max_new_tokens=24, stop_token_ids=[], temperature=0.0)
    assert out[0, : ids.shape[1]].tolist() == ids[0].tolist()
    assert out[0, ids.shape[1] :].tolist() == reference_greedy(target, ids, 24)
    assert all(1 <= a <= block_size for a in draft.last_acceptance_lengths)


def test_remote_loop_matches_our_reference_loop(tmp_path: Path, target: TargetModel) -> None:
    from dflash_train.checkpoint import load_draft

    out = export_tiny(tmp_path, target, block_size=4)
    ids = prompt(3)
    ours, _ = generate_greedy(target, load_draft(out, dtype=torch.float32), ids, max_new_tokens=20)
    remote = load_remote(out)
    theirs = remote.spec_generate(target.model, ids, max_new_tokens=20, stop_token_ids=[], temperature=0.0)
    assert theirs.tolist() == ours.output_ids.tolist()
    assert remote.last_acceptance_lengths == ours.acceptance_lengths


@pytest.mark.parametrize("error_rate", [0.0, 0.3])
def test_remote_loop_with_oracle_drafts_accepts_blocks_and_stays_lossless(
    tmp_path: Path, target: TargetModel, monkeypatch: pytest.MonkeyPatch, error_rate: float
) -> None:
    """Drafts copied from the reference (some corrupted) exercise multi-token acceptance and rollback."""
    block_size, total, ids = 8, 40, prompt(5)
    draft = load_remote(export_tiny(tmp_path, target, block_size=block_size))
    reference = reference_greedy(target, ids, total + block_size)
    gen, expected = torch.Generator().manual_seed(0), []

    def oracle(verifier: Any, draft_logits: torch.Tensor) -> tuple[torch.Tensor, None]:
        first = verifier.cache.get_seq_length() + 1 - ids.shape[1]  # reference index of slot 1
        drafts = torch.tensor(reference[first : first + block_size - 1])
        wrong = torch.rand(drafts.shape, generator=gen) < error_rate
        expected.append(int((~wrong).int().cumprod(0).sum()) + 1)
        return torch.where(wrong, (drafts + 1) % 300, drafts), None

    monkeypatch.setattr(sys.modules[type(draft).__module__]._Verifier, "propose", oracle)
    out = draft.spec_generate(target.model, ids, max_new_tokens=total, stop_token_ids=[], temperature=0.0)
    assert out[0, ids.shape[1] :].tolist() == reference[:total]
    assert draft.last_acceptance_lengths == expected
    if error_rate == 0.0:
        assert all(a == block_size for a in draft.last_acceptance_lengths[:-1])


def test_remote_loop_stops_at_the_first_stop_token(tmp_path: Path, target: TargetModel) -> None:
    draft = load_remote(export_tiny(tmp_path, target, block_size=4))
    ids = prompt(11)
    reference = reference_greedy(target, ids, 30)
    stop = reference[6]
    out = draft.spec_generate(target.model, ids, max_new_tokens=30, stop_token_ids=[stop], temperature=0.0)
    new = out[0, ids.shape[1] :].tolist()
    assert new == reference[: reference.index(stop) + 1]


def test_remote_sampling_runs_and_respects_limits(tmp_path: Path, target: TargetModel) -> None:
    draft = load_remote(export_tiny(tmp_path, target, block_size=4))
    torch.manual_seed(0)
    out = draft.spec_generate(target.model, prompt(2), max_new_tokens=17, stop_token_ids=[], temperature=0.8)
    assert out.shape == (1, 9 + 17) and int(out.max()) < 320
    assert sum(draft.last_acceptance_lengths) >= 16


@pytest.mark.slow
def test_smollm2_export_checks_against_the_alias_and_decodes_losslessly(tmp_path: Path) -> None:
    """The real default target (Llama, tied embeddings, 30 layers): export, check, remote decode."""
    from dflash_train.checkpoint import check_checkpoint, export_checkpoint, save_draft
    from dflash_train.models import DFlashConfig, DFlashDraftModel
    from dflash_train.target import load_target, load_target_config, resolve_mask_token_id

    target = load_target("smollm2-135m-instruct", dtype=torch.float32)
    config = DFlashConfig.from_target_config(
        target.config, mask_token_id=resolve_mask_token_id(target.tokenizer, target.vocab_size))
    torch.manual_seed(0)
    save_draft(DFlashDraftModel(config), tmp_path / "train")
    out = export_checkpoint(tmp_path / "train", tmp_path / "export", target="smollm2-135m-instruct")
    assert check_checkpoint(out, load_target_config("smollm2-135m-instruct")) == []
    card = (out / "README.md").read_text()
    assert "base_model: HuggingFaceTB/SmolLM2-135M-Instruct" in card
    assert "| target layers read (`target_layer_ids`) | [1, 8, 14, 20, 27] of 30 |" in card
    draft = load_remote(out)
    ids = target.tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                               add_generation_prompt=True, return_tensors="pt",
                                               return_dict=True)["input_ids"]
    out_ids = draft.spec_generate(target.model, ids, max_new_tokens=32, stop_token_ids=[2], temperature=0.0)
    reference = reference_greedy(target, ids, 32)
    if 2 in reference:
        reference = reference[: reference.index(2) + 1]
    assert out_ids[0, ids.shape[1] :].tolist() == reference
