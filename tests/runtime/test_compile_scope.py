"""Compile scope "layer": one decoder layer is compiled and its code serves every layer, for the target runner
and the drafter; the embedding/inputs and the output/norm are compiled as two small graphs of their own.

The fast tests run torch.compile with the "aot_eager" backend (dynamo's tracing, guards and cache, and
AOTAutograd's functionalisation of the in-place cache writes, without inductor's C++ compilation, which takes
about 20 s per graph on a small CPU): they check the plumbing, that the outputs and the caches equal the
eager path's, and that the layers reuse one compiled code instead of recompiling per layer. The slow ones
run the default inductor backend."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from transformers import AutoModelForCausalLM

from dflash_train.runtime.engine import DecodeEngine, EngineConfig
from dflash_train.runtime.static_draft import StaticDrafter
from dflash_train.runtime.static_target import StaticTarget
from dflash_train.target import TargetModel
from tests.helpers.decoding import make_draft, own_greedy, prompts
from tests.helpers.tiny_models import make_tiny_config

REGIONS = 3  # graphs per compiled forward under scope "layer": before the layers, one layer, after them


@pytest.fixture
def compiles() -> Iterator[CompileCounterWithBackend]:
    """Counts the graphs dynamo compiles from here on (none cached from other tests); a recompile is an error."""
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    real = torch.compile

    def counting(fn: Callable[..., Any], **kwargs: Any) -> Callable[..., Any]:
        assert kwargs.pop("options") is None  # inductor options have no meaning for this backend
        return real(fn, backend=counter, **kwargs)

    with pytest.MonkeyPatch.context() as patch, torch._dynamo.config.patch(error_on_recompile=True):
        patch.setattr(torch, "compile", counting)
        yield counter
    torch._dynamo.reset()


@pytest.fixture
def inductor() -> Iterator[None]:
    """The default backend, each graph compiled once: a recompile is an error."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    with torch._dynamo.config.patch(error_on_recompile=True):
        yield
    torch._dynamo.reset()


def verify_forwards(target: TargetModel, fuse_projections: bool, scope: str | None) -> tuple[
        list[tuple[torch.Tensor, torch.Tensor]], StaticTarget]:
    """Two prompts prefilled (eager), then two verify blocks of 4 over both rows at per-row positions,
    compiled in `scope` (None: eager): the blocks' (logits, features) and the runner (for its caches)."""
    runner = StaticTarget(target, batch_size=2, max_length=32, fuse_projections=fuse_projections)
    gen = torch.Generator().manual_seed(3)
    prompt = torch.randint(10, 200, (2, 7), generator=gen)
    runner.forward(prompt, torch.arange(7).expand(2, 7), kv_len=7, logit_index=torch.tensor([6, 4]))
    outputs = []
    for start in (torch.tensor([7, 5]), torch.tensor([9, 8])):
        block = torch.randint(10, 200, (2, 4), generator=gen)
        out = runner.forward(block, start[:, None] + torch.arange(4), feature_layer_ids=[1, 2],
                             compiled=scope is not None, compile_scope=scope or "step")
        outputs.append((out.logits, out.features))
    return outputs, runner


def assert_same_forwards(target: TargetModel, fuse_projections: bool, atol: float) -> None:
    eager, eager_runner = verify_forwards(target, fuse_projections, None)
    compiled, runner = verify_forwards(target, fuse_projections, "layer")
    for (logits, features), (expected_logits, expected_features) in zip(compiled, eager, strict=True):
        torch.testing.assert_close(logits, expected_logits, atol=atol, rtol=0)
        torch.testing.assert_close(features, expected_features, atol=atol, rtol=0)
    for cache, expected in zip(runner.keys + runner.values, eager_runner.keys + eager_runner.values, strict=True):
        torch.testing.assert_close(cache, expected, atol=atol, rtol=0)


@pytest.mark.parametrize("fuse_projections", [True, False])
def test_target_layer_scope_equals_eager_with_one_code_for_all_layers(
        target: TargetModel, compiles: CompileCounterWithBackend, fuse_projections: bool) -> None:
    """Logits, features and every layer's K/V cache as the eager path's; six layers and two verify blocks,
    three graphs compiled in all (so no layer recompiled: that would also raise)."""
    assert_same_forwards(target, fuse_projections, atol=1e-6)
    assert compiles.frame_count == REGIONS


def mixed_window_target() -> TargetModel:
    """A tiny Qwen3 whose layers alternate a sliding window of 5 and full attention: two masks per forward."""
    config = make_tiny_config("qwen3", num_layers=4)
    config.layer_types = ["sliding_attention", "full_attention"] * 2
    config.sliding_window, config.use_sliding_window = 5, True
    torch.manual_seed(2)
    return TargetModel(AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval(), tokenizer=None)


@pytest.mark.parametrize("fuse_projections", [True, False])
def test_layers_with_other_windows_share_the_code_too(compiles: CompileCounterWithBackend,
                                                      fuse_projections: bool) -> None:
    """A layer's window is the mask the loop hands it, not something the layer graph specialises on."""
    target = mixed_window_target()
    assert StaticTarget(target, batch_size=1, max_length=8).windows == [5, None, 5, None]
    assert_same_forwards(target, fuse_projections, atol=1e-6)
    assert compiles.frame_count == REGIONS


@pytest.mark.parametrize(("arch", "graphs"), [("gemma3_text", REGIONS), ("cohere2", REGIONS + 1)])
def test_models_own_layers_compile_one_code_per_layer_type_at_most(
        compiles: CompileCounterWithBackend, arch: str, graphs: int) -> None:
    """A model's own layers share one code when their types differ only in what the loop hands them (gemma3_text:
    the mask, and the cos/sin of its local or global rotary embedding), and get one code per type where their
    forward branches on it (cohere2: RoPE on sliding layers only), never one per layer."""
    from tests.helpers.static_target import tiny_target

    target = tiny_target(arch)
    assert StaticTarget(target, batch_size=1, max_length=8).windows == [5, 5, 5, None]
    with torch._dynamo.config.patch(error_on_recompile=graphs == REGIONS):
        assert_same_forwards(target, fuse_projections=True, atol=1e-5)
    assert compiles.frame_count == graphs


def drafter_hidden(target: TargetModel, scope: str | None) -> list[torch.Tensor]:
    """A drafter's context written from random features, then its hidden states for two blocks of 4 at
    per-row positions, compiled in `scope` (None: eager)."""
    draft = make_draft(target, block_size=4, seed=5)
    drafter = StaticDrafter(draft, batch_size=2, block_size=4, max_length=32)
    gen = torch.Generator().manual_seed(4)
    features = torch.randn(2, 9, draft.fc.in_features, generator=gen)
    drafter.write_context(features, torch.arange(9).expand(2, 9))
    hidden = []
    for start in (torch.tensor([6, 9]), torch.tensor([7, 9])):
        embeds = torch.randn(2, 4, draft.config.hidden_size, generator=gen)
        hidden.append(drafter.hidden(embeds, start[:, None] + torch.arange(4), start, compiled=scope is not None,
                                     compile_scope=scope or "step"))
    return hidden


def test_drafter_layer_scope_equals_eager_with_one_code_for_all_layers(
        target: TargetModel, compiles: CompileCounterWithBackend) -> None:
    for hidden, expected in zip(drafter_hidden(target, "layer"), drafter_hidden(target, None), strict=True):
        torch.testing.assert_close(hidden, expected, atol=1e-6, rtol=0)
    assert compiles.frame_count == REGIONS


def layer_scope_engine(target: TargetModel) -> DecodeEngine:
    config = EngineConfig(batch_size=2, block_size=8, max_new_tokens=24, max_length=64, kernels="torch",
                          compile=True, compile_scope="layer")
    return DecodeEngine(target, make_draft(target, seed=3), config)


def test_engine_with_a_drafter_under_layer_scope_is_lossless(target: TargetModel,
                                                            compiles: CompileCounterWithBackend) -> None:
    """Greedy decoding with a drafter, rows refilled mid-run, equals the target's own greedy decoding; the
    cycle compiled three graphs for the target, three for the drafter and one for the block's embedding,
    whatever the number of cycles."""
    eng = layer_scope_engine(target)
    outputs, stats = eng.generate(prompts(3))
    assert eng.uses_compile and eng.compile_error is None and stats.cycles > 3
    assert [o.tokens for o in outputs] == [own_greedy(target, p, 24) for p in prompts(3)]
    assert compiles.frame_count == 2 * REGIONS + 1


def test_unknown_compile_scope_is_refused(target: TargetModel) -> None:
    with pytest.raises(ValueError, match="compile_scope must be one of step, layer, not 'model'"):
        EngineConfig(compile_scope="model")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="compile_scope must be one of step, layer"):
        StaticTarget(target, batch_size=1, max_length=8).forward(torch.tensor([[5]]), torch.tensor([[0]]),
                                                                 compiled=True, compile_scope="model")


@pytest.mark.slow
def test_inductor_layer_scope_target_and_drafter_equal_eager(target: TargetModel, inductor: None) -> None:
    """With inductor (C++ on the CPU): float32 outputs and caches as the eager path's, and three graphs per
    forward, the layer's shared by every layer."""
    assert_same_forwards(target, fuse_projections=True, atol=1e-5)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == REGIONS
    for hidden, expected in zip(drafter_hidden(target, "layer"), drafter_hidden(target, None), strict=True):
        torch.testing.assert_close(hidden, expected, atol=1e-5, rtol=1e-5)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 2 * REGIONS


@pytest.mark.slow
def test_inductor_engine_under_layer_scope_is_lossless(target: TargetModel, inductor: None) -> None:
    eng = layer_scope_engine(target)
    outputs, _ = eng.generate(prompts(3))
    assert eng.uses_compile and eng.compile_error is None
    assert [o.tokens for o in outputs] == [own_greedy(target, p, 24) for p in prompts(3)]
