"""The Gated DeltaNet recurrence of the static runtime (`runtime/linear_attention.py`) against the models' own
decode step, and its state rings' footprint. The rings' rollback is checked end to end against the models' full
forward in tests/runtime/test_any_target_decode.py and test_static_target.py."""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen3_5 import modeling_qwen3_5

from dflash_train.runtime.linear_attention import LinearStates, recurrent_rule
from dflash_train.runtime.static_target import StaticTarget
from dflash_train.target import TargetModel
from tests.helpers.tiny_targets import build_tiny_target


@pytest.mark.parametrize("k_heads", [2, 4])
def test_the_recurrence_keeps_each_state_of_the_models_own_decode_steps(k_heads: int) -> None:
    """Token by token through the model's `torch_recurrent_gated_delta_rule` (one call a token, its final
    state carried): the same outputs, and our state after each token is the state it carries on. Two key heads
    for four value heads: each q/k head serves two consecutive value heads."""
    gen = torch.Generator().manual_seed(0)
    n, t, v_heads, dk, dv = 2, 5, 4, 8, 6
    q, k = (torch.randn(n, t, k_heads, dk, generator=gen) for _ in range(2))
    v = torch.randn(n, t, v_heads, dv, generator=gen)
    g = -torch.rand(n, t, v_heads, generator=gen)
    beta = torch.rand(n, t, v_heads, generator=gen)
    state = torch.randn(n, v_heads, dk, dv, generator=gen)
    out, each = recurrent_rule(q, k, v, g, beta, state)
    # the rule of some transformers versions takes q/k repeated for the value heads, as the layer repeats them
    q_model, k_model = (x.repeat_interleave(v_heads // k_heads, dim=2) for x in (q, k))
    reference = state
    for i in range(t):
        step = slice(i, i + 1)
        expected, reference = modeling_qwen3_5.torch_recurrent_gated_delta_rule(
            q_model[:, step], k_model[:, step], v[:, step], g=g[:, step], beta=beta[:, step], initial_state=reference,
            output_final_state=True, use_qk_l2norm_in_kernel=True)
        torch.testing.assert_close(out[:, step], expected, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(each[:, i], reference, atol=1e-5, rtol=1e-5)


def test_the_rings_are_counted_in_the_cache_and_sized_by_the_step() -> None:
    """Each linear-attention layer keeps S float32 states and S + kernel convolution inputs (plus a sink) per
    row instead of a KV cache; `cache_bytes` (what eval reports) counts them."""
    target = TargetModel(build_tiny_target("qwen3_5", 256), None)
    runner = StaticTarget(target, batch_size=2, max_length=32, step_tokens=6)
    module = next(layer.linear_attn for layer in target.decoder_layers if hasattr(layer, "linear_attn"))
    rings = runner.linear_states[0]
    assert rings is not None and rings.states.shape == (2, 6, module.num_v_heads, module.head_k_dim,
                                                        module.head_v_dim)
    assert rings.inputs.shape == (2, 6 + module.conv_kernel_size + 1, module.conv_dim)
    kv = sum(t.numel() * t.element_size() for t in runner.keys + runner.values)
    assert runner.cache_bytes() == kv + 3 * LinearStates.bytes_for(module, 2, 6, target.dtype)


def test_a_step_longer_than_the_rings_is_refused_never_run_wrong() -> None:
    """A verify of more tokens than the rings keep could not be taken back: the runner refuses it after position 0
    (from position 0 it is a prompt, committed whole), and an engine refuses a shared runner whose rings are
    shorter than its block (eval's target-only engine builds the runner its drafted engine shares)."""
    from dflash_train.runtime.engine import DecodeEngine, EngineConfig
    from tests.runtime.test_any_target_decode import make_draft

    target = TargetModel(build_tiny_target("qwen3_5", 256), None)
    runner = StaticTarget(target, batch_size=1, max_length=32, step_tokens=2)
    ids = torch.arange(3, 8)[None]
    runner.forward(ids, torch.arange(5)[None])  # a prompt from position 0
    with pytest.raises(ValueError, match="longer than the 2 the linear-attention states take back"):
        runner.forward(ids[:, :3], torch.arange(5, 8)[None])
    shared = DecodeEngine(target, None, EngineConfig(block_size=1, max_length=32, kernels="torch")).runner
    with pytest.raises(ValueError, match="runner_step_tokens=4"):
        DecodeEngine(target, make_draft(target, 4), EngineConfig(block_size=4, max_length=32, kernels="torch"),
                     runner=shared)
    wide = EngineConfig(block_size=1, max_length=32, kernels="torch", runner_step_tokens=4)
    shared = DecodeEngine(target, None, wide).runner
    drafted = DecodeEngine(target, make_draft(target, 4), EngineConfig(block_size=4, max_length=32, kernels="torch"),
                           runner=shared)
    assert drafted.runner is shared and shared.step_tokens == 4
    # without a drafter an engine verifies one token a step: its rings keep one state a row, whatever the block
    alone = DecodeEngine(target, None, EngineConfig(block_size=16, max_length=32, kernels="torch"))
    assert alone.runner.step_tokens == 1


@pytest.mark.parametrize(("arch", "overrides"), [("qwen3_next", {}), ("qwen3_5", {}), ("lfm2", {}),
                                                ("nemotron_h", {}), ("falcon_h1", {}),
                                                ("falcon_h1", {"mamba_rms_norm": True})])
def test_a_verify_reads_the_state_its_row_carried(arch: str, overrides: dict[str, object]) -> None:
    """After a prompt, a verify block's logits equal the model's full forward (`check_prefill_and_verify` checks
    that per architecture); here, that they depend on what the rings carried: the same block after the rings are
    wiped gives other logits. Without this the check above could pass on tiny targets whose state fades at once
    (`tests/helpers/static_target.long_memory`). Falcon-H1 with its multipliers away from 1, with and without
    the gated norm of its Mamba output."""
    from tests.helpers.static_target import OVERRIDES, long_memory

    target = TargetModel(build_tiny_target(arch, 320, seed=1, **OVERRIDES.get(arch, {}), **overrides), None)
    long_memory(target)
    runner = StaticTarget(target, batch_size=1, max_length=32, step_tokens=6)
    ids = torch.randint(10, 200, (1, 14), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        reference = target.model(ids).logits[0, 9:14]
    runner.forward(ids[:, :9], torch.arange(9)[None], logit_index=torch.tensor([8]))
    carried = runner.forward(ids[:, 9:14], torch.arange(9, 14)[None]).logits[0]
    torch.testing.assert_close(carried, reference, atol=1e-5, rtol=1e-4)
    runner.forward(ids[:, :9], torch.arange(9)[None], logit_index=torch.tensor([8]))
    for rings in runner.linear_states:
        if rings is not None:
            rings.states.zero_()
            rings.inputs.zero_()
    wiped = runner.forward(ids[:, 9:14], torch.arange(9, 14)[None]).logits[0]
    assert (wiped - reference).abs().max() > 10 * 1e-5  # well past the tolerance the carried block meets


@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_5"])
def test_the_runner_asks_no_more_of_the_models_code_than_every_transformers_version_gives(
        arch: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Some transformers versions' chunked delta rule takes q/k with as many heads as v (the layer repeats them
    first), and Qwen3.5's rotary embedding indexes a grid axis a [b, T] position tensor lacks: with the model's
    code held to those stricter contracts, a prompt and a verify still equal the model's own forward."""
    import sys

    target = TargetModel(build_tiny_target(arch, 256, seed=1), None)
    ids = torch.randint(10, 200, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        reference = target.model(ids).logits[0, 8:12]
    module = sys.modules[type(target.model).__module__]
    own_rule = module.torch_chunk_gated_delta_rule

    def equal_heads_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: object) -> object:
        assert q.shape[2] == k.shape[2] == v.shape[2], "q/k not repeated for the value heads"
        return own_rule(q, k, v, **kwargs)

    monkeypatch.setattr(module, "torch_chunk_gated_delta_rule", equal_heads_rule)
    rotary = target.model.model.rotary_emb
    if hasattr(rotary, "mrope_section"):
        own_forward = rotary.forward

        def grid_positions_only(x: torch.Tensor, position_ids: torch.Tensor) -> object:
            assert position_ids.dim() == 3, "positions without their grid axis"
            return own_forward(x, position_ids)

        monkeypatch.setattr(rotary, "forward", grid_positions_only)
    runner = StaticTarget(target, batch_size=1, max_length=32, step_tokens=4)
    runner.forward(ids[:, :8], torch.arange(8)[None], logit_index=torch.tensor([7]))
    verify = runner.forward(ids[:, 8:12], torch.arange(8, 12)[None]).logits[0]
    torch.testing.assert_close(verify, reference, atol=1e-5, rtol=1e-4)


def test_ungated_experts_stay_on_the_models_own_code() -> None:
    """Nemotron-H's experts have no gate (squared ReLU on up alone) and no gate_up_proj: the decode-experts
    kernel, which folds a gate into its up product, must decline them rather than fail on the missing weight."""
    from dflash_train.runtime.experts import kernel_takes

    target = TargetModel(build_tiny_target("nemotron_h", 256), None)
    experts = next(module for module in target.model.modules() if type(module).__name__ == "NemotronHExperts")
    tokens = torch.zeros(2, 64)
    assert not kernel_takes(experts, tokens, torch.zeros(2, 2, dtype=torch.long))


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5", "nemotron_h", "falcon_h1", "deepseek_v3", "gpt_oss"])
def test_the_cache_layout_counts_what_the_runner_allocates(arch: str) -> None:
    """`inspect` sizes a row's caches from the layout alone (`cache_layout`); the runner's allocated tensors
    (`cache_bytes`) are the reference: KV caches of attention layers only, MLA's latent, the rings."""
    from dflash_train.runtime.cache_layout import cache_layout

    target = TargetModel(build_tiny_target(arch, 256), None)
    runner = StaticTarget(target, batch_size=2, max_length=32, step_tokens=6)
    assert runner.cache_bytes() == 2 * cache_layout(target).bytes_per_row(target, 32, 6)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen3_5", "nemotron_h", "falcon_h1", "deepseek_v3"])
def test_the_compiled_step_equals_the_eager_one(arch: str) -> None:
    """torch.compile of the runner's layers (compile scope "layer", as the engine compiles its cycle) over the
    rings, the Mamba-2 blocks and the latent cache: two verify blocks after a prompt give the eager forward's
    logits, so nothing in these layers breaks the graph into another computation (inductor on CPU here)."""
    target = TargetModel(build_tiny_target(arch, 256), None)
    ids = torch.randint(10, 200, (2, 15), generator=torch.Generator().manual_seed(0))
    logits = []
    for compiled in (False, True):
        runner = StaticTarget(target, batch_size=2, max_length=32, step_tokens=6)
        runner.forward(ids[:, :8], torch.arange(8).expand(2, 8), logit_index=torch.tensor([7, 7]))
        logits.append([runner.forward(ids[:, start:start + 6], torch.arange(start, start + 6).expand(2, 6),
                                      compiled=compiled, compile_scope="layer").logits for start in (8, 9)])
    for eager, compiled in zip(*logits, strict=True):
        torch.testing.assert_close(compiled, eager, atol=1e-5, rtol=1e-4)
