"""Latent attention with the up-projections absorbed (`runtime/latent_attention.py`) against the model's own
forward: a prompt longer than a step (the model's expanded path), then steps of a verify block's size that attend
in latent space, never calling kv_b_proj, with the logits of the full forward; the expanded path stays a switch."""

from __future__ import annotations

import pytest
import torch

from dflash_train.runtime.static_target import StaticTarget
from tests.helpers.static_target import tiny_target

PROMPT = 20  # longer than the runner's steps of 16: the model's own expanded path


def kv_b_proj_calls(target: object) -> list[int]:
    """A counter of kv_b_proj's forward calls over all layers (the expansion of cached latents)."""
    calls = [0]

    def count(*_: object) -> None:
        calls[0] += 1

    for layer in target.decoder_layers:  # type: ignore[attr-defined]
        layer.self_attn.kv_b_proj.register_forward_hook(count)
    return calls


@pytest.mark.parametrize("arch", ["deepseek_v3", "deepseek_v3_yarn"])
@pytest.mark.parametrize("absorb", [True, False], ids=["absorbed", "expanded"])
def test_steps_match_the_full_forward(arch: str, absorb: bool) -> None:
    target = tiny_target(arch)
    ids = torch.randint(10, 300, (2, PROMPT + 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        reference = target.model(ids).logits
    calls = kv_b_proj_calls(target)
    runner = StaticTarget(target, batch_size=2, max_length=48, absorb_latent=absorb)
    positions = torch.arange(PROMPT).expand(2, PROMPT)
    out = runner.forward(ids[:, :PROMPT], positions, kv_len=PROMPT)
    torch.testing.assert_close(out.logits, reference[:, :PROMPT], atol=1e-5, rtol=1e-4)
    assert calls[0] > 0  # the prompt took the expanded path either way
    calls[0] = 0
    for start in (PROMPT, PROMPT + 6):  # two steps of 6, the second reading the first's latents from the cache
        step = torch.arange(start, start + 6).expand(2, 6)
        out = runner.forward(ids[:, start : start + 6], step)
        torch.testing.assert_close(out.logits, reference[:, start : start + 6], atol=1e-5, rtol=1e-4)
    assert (calls[0] == 0) == absorb  # absorbed steps never expand the cache


def test_only_latent_attention_targets_absorb() -> None:
    assert StaticTarget(tiny_target("deepseek_v3"), batch_size=1, max_length=8).absorb_latent
    assert not StaticTarget(tiny_target("deepseek_v3"), batch_size=1, max_length=8, absorb_latent=False).absorb_latent
    assert not StaticTarget(tiny_target("qwen3_moe"), batch_size=1, max_length=8).absorb_latent


def test_a_quantised_up_projection_keeps_the_expanded_path() -> None:
    """A kv_b_proj that is not a plain matrix (a quantised checkpoint's module) cannot be absorbed by reading its
    weight: the runner keeps the model's own path, which calls the module."""

    class QuantisedLinear(torch.nn.Linear):
        pass

    target = tiny_target("deepseek_v3")
    for layer in target.decoder_layers:
        plain = layer.self_attn.kv_b_proj
        layer.self_attn.kv_b_proj = QuantisedLinear(plain.in_features, plain.out_features, bias=False)
    assert not StaticTarget(target, batch_size=1, max_length=8).absorb_latent
