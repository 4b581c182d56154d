"""The shipped remote code (`export/dflash.py`) computes what our model computes, samples exactly the
target's distribution, and (slow tier) works under transformers 4.57, which published drafters pin."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
from transformers import AutoModel

from dflash_train.checkpoint import load_draft
from dflash_train.checkpoint.export import export_assets_dir
from tests.helpers.checkpoints import export_tiny
from tests.helpers.tiny_models import make_tiny_target

TF457_PYTHON = Path(os.environ.get("DFLASH_TRAIN_TF457_PYTHON", "/tmp/venv457/bin/python"))


def remote_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("dflash_remote_code", export_assets_dir() / "dflash.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_remote_code_imports_only_torch_and_transformers() -> None:
    source = (export_assets_dir() / "dflash.py").read_text()
    roots = {line.split()[1].split(".")[0] for line in source.splitlines()
             if line.startswith(("import ", "from ")) and not line.startswith("from __future__")}
    assert roots <= {"copy", "inspect", "torch", "transformers"}, roots


ROPE_SETTINGS = {
    "default": {},
    "linear": {"rope_theta": 500000.0, "rope_scaling": {"rope_type": "linear", "factor": 4.0}},
    "llama3": {"rope_theta": 500000.0, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}},
    "yarn": {"rope_theta": 1000000.0, "rope_scaling": {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}},
}


@pytest.mark.parametrize("rope", sorted(ROPE_SETTINGS))
def test_remote_hidden_states_and_logits_equal_ours(tmp_path: Path, rope: str) -> None:
    target = make_tiny_target("qwen3", num_layers=6, seed=1)
    out = export_tiny(tmp_path, target, block_size=4, **ROPE_SETTINGS[rope])
    ours = load_draft(out, dtype=torch.float32)
    assert (ours.config.rope_scaling or {}).get("rope_type") == (None if rope == "default" else rope)
    remote = AutoModel.from_pretrained(out, trust_remote_code=True, dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    features = torch.randn(1, 10, 2 * 64, generator=gen)  # [1, C, K*H]
    embeds = torch.randn(1, 4, 64, generator=gen)  # [1, B, H]
    at = 3000  # far positions, where the rope variants differ
    # ours: context cached in two steps, then the block at positions at+10 .. at+13
    cache = ours.new_cache(1, 32)
    ours.extend_context(cache, features[:, :6], at + torch.arange(6)[None])
    ours.extend_context(cache, features[:, 6:], at + torch.arange(6, 10)[None])
    expected = ours.draft_block(cache, embeds, at + torch.arange(10, 14)[None])
    # remote: in one call, and incrementally through its own cache
    at_once = remote(embeds, features, at + torch.arange(14)[None])
    remote_cache = remote_module_of(remote).DFlashContextCache(len(remote.layers))
    remote(embeds, features[:, :6], at + torch.cat([torch.arange(6), torch.arange(10, 14)])[None], remote_cache)
    stepwise = remote(embeds, features[:, 6:], at + torch.arange(6, 14)[None], remote_cache)
    head = target.lm_head
    for got in (at_once, stepwise):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(head(got), head(expected), rtol=1e-5, atol=1e-5)
        assert torch.equal(head(got).argmax(-1), head(expected).argmax(-1))


def remote_module_of(model: torch.nn.Module) -> ModuleType:
    return sys.modules[type(model).__module__]


def test_speculative_accept_keeps_the_target_distribution() -> None:
    """First committed token ~ p[0]; second, given the first draft was accepted, ~ p[1]."""
    accept = remote_module().speculative_accept
    gen = torch.Generator().manual_seed(0)
    p = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.1, 0.2, 0.3, 0.4], [0.25, 0.25, 0.25, 0.25]])
    q = torch.tensor([[0.1, 0.1, 0.2, 0.6], [0.4, 0.3, 0.2, 0.1]])
    first, second, trials = torch.zeros(4), torch.zeros(4), 20_000
    for _ in range(trials):
        drafts = torch.multinomial(q, 1, generator=gen)[:, 0]
        a, token = accept(drafts, q, p, gen)
        first[int(drafts[0]) if a >= 1 else token] += 1
        if a >= 1:
            second[int(drafts[1]) if a >= 2 else token] += 1
    assert (first / trials - p[0]).abs().max() < 0.02
    assert (second / second.sum() - p[1]).abs().max() < 0.02
    assert second.sum() > 2_000  # enough samples to mean something


def test_greedy_rule_is_argmax_agreement() -> None:
    verifier = object.__new__(remote_module()._Verifier)
    verifier.temperature = 0.0
    logits = torch.full((4, 9), -1.0)
    logits[0, 5], logits[1, 6], logits[2, 2], logits[3, 8] = 1, 1, 1, 1  # target: 5, 6, 2, 8
    assert verifier.accept(torch.tensor([5, 6, 7]), None, logits) == (2, 2)
    assert verifier.accept(torch.tensor([4, 6, 2]), None, logits) == (0, 5)
    assert verifier.accept(torch.tensor([5, 6, 2]), None, logits) == (3, 8)


TF457_SCRIPT = """
import sys, torch, transformers
from transformers import AutoModel, AutoModelForCausalLM
assert transformers.__version__.startswith("4.57"), transformers.__version__
target = AutoModelForCausalLM.from_pretrained(sys.argv[1], torch_dtype=torch.float32).eval()
for export_dir, data_file in zip(sys.argv[2::2], sys.argv[3::2]):
    draft, info = AutoModel.from_pretrained(export_dir, trust_remote_code=True, torch_dtype=torch.float32,
                                            output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    data = torch.load(data_file)
    hidden = draft(data["embeds"], data["features"], data["positions"])
    torch.testing.assert_close(hidden, data["hidden"], rtol=1e-5, atol=1e-5)
    ids = data["prompt"]
    out = draft.spec_generate(target, ids, max_new_tokens=24, stop_token_ids=[], temperature=0.0)
    ref = ids
    for _ in range(24):
        ref = torch.cat([ref, target(ref).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert out.tolist() == ref.tolist(), (out.tolist(), ref.tolist())
    print("ok", transformers.__version__, export_dir, draft.last_acceptance_lengths)
"""


def write_expected(export_dir: Path, data_file: Path) -> None:
    """Our model's hidden states on fixed inputs (far positions), for the other interpreter to match."""
    ours = load_draft(export_dir, dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    features, embeds = torch.randn(1, 10, 128, generator=gen), torch.randn(1, 4, 64, generator=gen)
    positions = 3000 + torch.arange(14)[None]
    cache = ours.new_cache(1, 16)
    ours.extend_context(cache, features, positions[:, :10])
    hidden = ours.draft_block(cache, embeds, positions[:, 10:])
    prompt = torch.randint(10, 250, (1, 9), generator=gen)
    torch.save({"features": features, "embeds": embeds, "positions": positions, "hidden": hidden,
                "prompt": prompt}, data_file)


@pytest.mark.slow
@pytest.mark.skipif(not TF457_PYTHON.exists(), reason=f"no transformers 4.57 venv at {TF457_PYTHON}")
def test_remote_code_under_transformers_457(tmp_path: Path) -> None:
    """Set DFLASH_TRAIN_TF457_PYTHON to a python with torch and transformers==4.57.* installed."""
    target = make_tiny_target("qwen3", num_layers=6, seed=1)
    target.model.save_pretrained(tmp_path / "target")
    args = [str(tmp_path / "target")]
    for rope in ("default", "llama3"):
        out = export_tiny(tmp_path, target, name=rope, block_size=4, **ROPE_SETTINGS[rope])
        write_expected(out, tmp_path / f"{rope}.pt")
        args += [str(out), str(tmp_path / f"{rope}.pt")]
    result = subprocess.run([str(TF457_PYTHON), "-c", TF457_SCRIPT, *args], capture_output=True, text=True,
                            timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("ok 4.57") == 2, result.stdout
