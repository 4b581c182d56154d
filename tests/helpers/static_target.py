"""The static-cache target runner checked against the model's own Hugging Face forward (no cache)."""

from __future__ import annotations

import math
from typing import Any

import torch

from dflash_train.features.capture import capture_features
from dflash_train.runtime.static_target import StaticTarget
from dflash_train.target import TargetModel
from tests.helpers.tiny_models import TINY_ARCHS, make_tiny_target
from tests.helpers.tiny_targets import build_tiny_target

SHORT_WINDOWS = {"sliding_window": 5}
# Caps that change a tiny random gemma2's scores and logits (the published 50 and 30 barely touch them).
SMALL_SOFT_CAPS = {"attn_logit_softcapping": 0.05, "final_logit_softcapping": 0.5}
OVERRIDES: dict[str, dict[str, Any]] = {
    "gpt_oss": SHORT_WINDOWS, "gemma2": SHORT_WINDOWS | SMALL_SOFT_CAPS, "gemma3_text": SHORT_WINDOWS,
    "cohere2": SHORT_WINDOWS, "exaone4": SHORT_WINDOWS,
    # every µP multiplier away from 1, so that one the runtime dropped shows, and the Mamba output weighing enough
    # in the logits that a state carried wrongly shows too
    "deepseek_v3": {"v_head_dim": 12},  # values narrower than keys, as DeepSeek-V3's (128 against 192)
    "falcon_h1": dict(attention_in_multiplier=0.5, attention_out_multiplier=1.5, ssm_in_multiplier=1.25,
                      ssm_out_multiplier=4.0, mlp_multipliers=[0.8, 1.2], key_multiplier=0.9, lm_head_multiplier=0.5),
}


def tiny_target(arch: str) -> TargetModel:
    """A target of `tests/helpers/tiny_targets.py`; those with sliding layers with windows of 5, gpt_oss's with
    spread sinks (`spread_sinks`) and gemma2's with small soft-caps, so that each changes what 14 tokens attend
    to, or the logits."""
    target = TargetModel(build_tiny_target(arch, 320, seed=1, **OVERRIDES.get(arch, {})), None)
    spread_sinks(target)
    long_memory(target)
    return target


def long_memory(target: TargetModel) -> None:
    """Mamba-2 mixers that remember (decay 0.05 a unit time step, time steps near 0.7) and lean on their state
    (skip 0.1, inputs four times larger): initialised as the models are (decay 1..heads, skip 1, small inputs), a
    tiny mixer's state fades within a token or two and its output is mostly the skip, so a state carried wrongly
    would change nothing a test sees."""
    for layer in target.decoder_layers:
        mixer = getattr(layer, "mixer", None) or getattr(layer, "mamba", None)  # Nemotron-H's, Falcon-H1's
        if mixer is not None and hasattr(mixer, "ssm_state_size"):
            with torch.no_grad():
                mixer.A_log.fill_(math.log(0.05))
                mixer.dt_bias.zero_()
                mixer.D.fill_(0.1)
                mixer.in_proj.weight.mul_(4.0)  # B, C and x of a size that makes the state's share of the output show


def spread_sinks(target: TargetModel) -> None:
    """Sink logits from -1 to 3 across each layer's heads (initialised near 0, they weigh about as much as one
    key): a kernel that dropped them, or gave them to the wrong head, changes the logits."""
    for layer in target.decoder_layers:
        sinks = getattr(getattr(layer, "self_attn", None), "sinks", None)  # linear-attention layers have none
        if sinks is not None:
            with torch.no_grad():
                sinks.copy_(torch.linspace(-1.0, 3.0, sinks.numel()))


def check_prefill_and_verify(arch: str, kernels: str, device: str = "cpu", fuse_projections: bool = True) -> None:
    """The runner against the model's own forward: prefill of some rows, then a verify block per row at
    different positions (sliding windows short enough to matter for mistral and `tiny_target`'s). Run with
    kernels="torch" by the runtime's tests and with kernels="triton" by the kernel's tests (interpreted on CPU).
    `arch` beyond the tokenizer-backed four: a target of `tests/helpers/tiny_targets.py` (experts, sinks, the
    architectures whose own layers the runtime runs)."""
    target = make_tiny_target(arch, num_layers=4, seed=1) if arch in TINY_ARCHS else tiny_target(arch)
    if arch == "mistral":
        target.model.config.sliding_window = 5  # short enough to matter on 14 tokens
    ids = torch.randint(10, 200, (2, 14), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        reference = target.model(ids).logits
    features = capture_features(target, ids, [1, 2])
    target.model.to(device)
    ids = ids.to(device)
    runner = StaticTarget(target, batch_size=3, max_length=32, kernels=kernels, fuse_projections=fuse_projections)
    # Prompts of 9 and 6 tokens into rows 2 and 0, right-padded to 9.
    prompt = torch.stack([ids[0, :9], torch.cat([ids[1, :6], torch.zeros(3, dtype=torch.long, device=device)])])
    out = runner.forward(prompt, torch.arange(9, device=device).expand(2, 9), row_index=torch.tensor([2, 0], device=device),
                         kv_len=9, logit_index=torch.tensor([8, 5], device=device), feature_layer_ids=[1, 2])
    torch.testing.assert_close(out.logits[:, 0].cpu(), torch.stack([reference[0, 8], reference[1, 5]]), atol=1e-5,
                               rtol=1e-4)
    torch.testing.assert_close(out.features[0].cpu(), features[0, :9], atol=1e-5, rtol=1e-4)
    # One verify over all rows: row 0 continues at position 6, row 2 at 9 (row 1 is idle garbage).
    block = torch.stack([ids[1, 6:11], ids[0, 3:8], ids[0, 9:14]])
    positions = torch.stack([torch.arange(6, 11), torch.arange(3, 8), torch.arange(9, 14)]).to(device)
    out = runner.forward(block, positions, feature_layer_ids=[1, 2])
    torch.testing.assert_close(out.logits[0].cpu(), reference[1, 6:11], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(out.logits[2].cpu(), reference[0, 9:14], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(out.features[2].cpu(), features[0, 9:14], atol=1e-5, rtol=1e-4)
