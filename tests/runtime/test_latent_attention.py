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


def test_the_kernel_paths_bounds_select_the_slots_the_mask_does() -> None:
    """On the Triton path the runner hands layers the visible slots as bounds [n, 2, T] instead of a bool mask
    (`bounds_from_positions`): the absorbed attention reads both alike."""
    from dflash_train.kernels.static_attention import bounds_from_positions
    from dflash_train.runtime.latent_attention import absorbed_attention

    target = tiny_target("deepseek_v3")
    attn = target.decoder_layers[1].self_attn
    generator = torch.Generator().manual_seed(2)
    latent = torch.randn(2, 1, 12, attn.kv_lora_rank, generator=generator)
    rope = torch.randn(2, 1, 12, attn.qk_rope_head_dim, generator=generator)

    class Cache:  # the runner's cache, already holding 12 slots: returns them whatever it is given
        def update(self, *_: object) -> tuple[torch.Tensor, torch.Tensor]:
            return latent, rope

    positions = torch.tensor([[7, 8, 9], [3, 4, 5]])
    x = torch.randn(2, 3, target.config.hidden_size, generator=generator)
    embeddings = target.model.model.rotary_emb(x, positions)
    bounds = bounds_from_positions(positions, None)
    mask = (torch.arange(12) <= positions[:, :, None])[:, None]  # [n, 1, T, S], causal
    with torch.no_grad():
        by_mask = absorbed_attention(attn, x, embeddings, mask, Cache())
        by_bounds = absorbed_attention(attn, x, embeddings, bounds, Cache())
        unmasked = absorbed_attention(attn, x, embeddings, torch.ones_like(mask), Cache())
    torch.testing.assert_close(by_bounds, by_mask)
    assert not torch.allclose(unmasked, by_mask)  # the mask matters here
