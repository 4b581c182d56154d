"""Decoding on every architecture users train drafters for: the engine on the static-cache runtime
(`runtime/static_target.py`) where it runs the architecture, over the target's own forward and caches
(`runtime/hf_target.py`) where it does not, against the target's own greedy decoding by Hugging Face `generate`
and its own hidden states.

Drafts come from the target's greedy continuation with deterministic errors (`OracleEngine`), so cycles accept
anything from 1 to B tokens and every rollback path (crop, or replay from a copy) is taken."""

from __future__ import annotations

import pytest
import torch

from dflash_train.models import DFlashConfig, DFlashDraftModel
from dflash_train.runtime import engine as engine_module
from dflash_train.runtime.engine import DecodeEngine, EngineConfig, make_runner
from dflash_train.runtime.hf_target import HFCacheTarget
from dflash_train.runtime.static_target import StaticTarget, supports
from dflash_train.target import TargetModel
from tests.helpers.kernels import DEVICE, kernels_here, under_interpreter
from tests.helpers.static_target import long_memory, spread_sinks
from tests.helpers.tiny_targets import TINY_TARGET_FAMILIES, TINY_TARGETS, build_tiny_target
from tests.runtime.test_engine import OracleEngine

VOCAB = 256
BLOCK = 6
NEW_TOKENS = 24
# Replay: a window or a recurrent state cannot be cut back; the rest keep every key and value.
REPLAYED = set(TINY_TARGET_FAMILIES["sliding"]) | set(TINY_TARGET_FAMILIES["hybrid"])
# Attention-only architectures whose layers the static runtime runs as the models' own modules, with what their
# forwards do around them (`runtime/target_adapters.py`): embedding and logit scales, soft-caps, per-type RoPE.
OWN_LAYERS_ON_THE_STATIC_RUNTIME = ("phi3", "olmo2", "granite", "smollm3", "gemma2", "gemma3_text", "cohere2",
                                    "exaone4")
# Hybrids whose linear-attention (Gated DeltaNet) or short-convolution layers the runtime runs on its state rings
# (`linear_attention.py`).
GATED_DELTANET = ("qwen3_next", "qwen3_5", "qwen3_5_moe")
RING_KEPT = (*GATED_DELTANET, "lfm2", "nemotron_h", "falcon_h1")
# Multi-head latent attention: the layer's compressed latent and RoPE key cached at positions, one head each.
MLA = ("deepseek_v3", "deepseek_v3_yarn")
ON_THE_STATIC_RUNTIME = ("llama", "qwen2", "qwen3", "qwen3_yarn", "mistral", "qwen3_moe", "mixtral", "gpt_oss",
                         "glm4_moe", *OWN_LAYERS_ON_THE_STATIC_RUNTIME, *RING_KEPT, *MLA)


DYNAMIC_ROPE = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}  # refused by the static runtime


def tiny(name: str) -> TargetModel:
    target = TargetModel(build_tiny_target(name, VOCAB), None)
    long_memory(target)  # Mamba-2 state that matters (tests/helpers/static_target.py)
    return target


def make_draft(target: TargetModel, block_size: int) -> DFlashDraftModel:
    """A random drafter sized after the target (its mask token the last id: the tiny targets have no tokenizer)."""
    torch.manual_seed(0)
    config = DFlashConfig.from_target_config(target.config, mask_token_id=VOCAB - 1, num_hidden_layers=2,
                                             block_size=block_size, target_layer_ids=[1, 2])
    return DFlashDraftModel(config).eval()


def greedy(target: TargetModel, prompt: list[int], count: int) -> list[int]:
    """Hugging Face `generate`'s greedy continuation: the model's own loop and cache, nothing of ours."""
    ids = torch.tensor([prompt], device=target.device)
    out = target.model.generate(ids, max_new_tokens=count, min_new_tokens=count, do_sample=False,
                                attention_mask=torch.ones_like(ids))
    return out[0, len(prompt):].tolist()


def prompt_of(length: int, seed: int) -> list[int]:
    return torch.randint(3, VOCAB, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def assert_commits_the_targets_greedy_tokens_and_features(target: TargetModel,
                                                          runner: StaticTarget | HFCacheTarget) -> None:
    """Blocks whose first a drafts are right: the runner's argmax at slots 0..a is the greedy continuation and
    its features there are the model's hidden states, however far the previous block reached past them."""
    prompt = prompt_of(20, 0)
    tokens = prompt + greedy(target, prompt, 30)
    full = target.model(torch.tensor([tokens]), output_hidden_states=True).hidden_states
    layer_ids = [1, 2]
    first = runner.forward(torch.tensor([prompt]), torch.arange(20)[None], feature_layer_ids=layer_ids)
    assert int(first.logits[0, -1].argmax()) == tokens[20]
    gen, p = torch.Generator().manual_seed(1), 20
    while p + BLOCK < len(tokens):
        accepted = int(torch.randint(0, BLOCK, (1,), generator=gen))
        wrong = torch.randint(3, VOCAB, (BLOCK - 1 - accepted,), generator=gen).tolist()
        block = tokens[p: p + accepted + 1] + wrong
        out = runner.forward(torch.tensor([block]), torch.arange(p, p + BLOCK)[None], feature_layer_ids=layer_ids)
        assert out.logits[0, : accepted + 1].argmax(-1).tolist() == tokens[p + 1: p + accepted + 2]
        expected = torch.cat([full[i + 1][0, p: p + accepted + 1] for i in layer_ids], dim=-1)
        torch.testing.assert_close(out.features[0, : accepted + 1], expected, atol=1e-4, rtol=1e-4)
        p += accepted + 1


@pytest.mark.parametrize("name", TINY_TARGETS)
def test_runner_commits_the_targets_greedy_tokens_and_features(name: str) -> None:
    """The model's own forward and caches, on every architecture: each rollback (crop, replay) is exact."""
    target = tiny(name)
    runner = HFCacheTarget(target, 1, 128)
    assert_commits_the_targets_greedy_tokens_and_features(target, runner)
    assert runner.rollback == ("replay" if name in REPLAYED else "crop")


@pytest.mark.parametrize("name", ON_THE_STATIC_RUNTIME)
def test_static_runner_commits_the_targets_greedy_tokens_and_features(name: str) -> None:
    """The same on the static-cache runtime (PyTorch kernels), on every architecture it runs: sliding windows
    shorter than the sequence, stale slots past the accepted drafts overwritten by the next block."""
    target = tiny(name)
    assert supports(target)
    assert_commits_the_targets_greedy_tokens_and_features(target, StaticTarget(target, 1, 128))


def assert_oracle_decoding_is_lossless(target: TargetModel, batch_size: int, kernels: str = "torch",
                                       new_tokens: int = NEW_TOKENS, own_forward: bool = False) -> OracleEngine:
    """Drafts from the target's own continuation with deterministic errors: every output is HF `generate`'s,
    through cycles that accept from 1 to B tokens. Returns the engine, for its runner. `own_forward`: on the
    target's own forward and caches (`HFCacheTarget`) whatever `make_runner` would pick."""
    batch = [prompt_of(9, 1), prompt_of(14, 2)][:batch_size]
    continuations = [greedy(target, p, new_tokens + BLOCK) for p in batch]
    config = EngineConfig(batch_size=batch_size, block_size=BLOCK, max_new_tokens=new_tokens, max_length=64,
                          kernels=kernels)
    runner = HFCacheTarget(target, batch_size, config.max_length) if own_forward else None
    engine = OracleEngine(target, make_draft(target, block_size=BLOCK).to(target.device), config, runner=runner)
    engine.continuation = torch.tensor(continuations, device=target.device)
    engine.prompt_lengths = torch.tensor([len(p) for p in batch], device=target.device)
    outputs, _ = engine.generate(batch)
    for reference, output in zip(continuations, outputs, strict=True):
        assert output.tokens == reference[:new_tokens]
        assert max(output.acceptance_lengths) == BLOCK and min(output.acceptance_lengths) == 1
    return engine


@pytest.mark.parametrize("name", ["deepseek_v3", "qwen3_next", "falcon_h1", "lfm2"])
@pytest.mark.parametrize("batch_size", [1, 2])
def test_engine_is_lossless_on_the_targets_own_forward(name: str, batch_size: int) -> None:
    """The path of configs the static runtime refuses (and of transformers 4), on a family of each rollback:
    cut back (latent attention), replayed (linear attention, Mamba, convolutions)."""
    engine = assert_oracle_decoding_is_lossless(tiny(name), batch_size, own_forward=True)
    assert isinstance(engine.runner, HFCacheTarget) and not engine.uses_compile


@pytest.mark.parametrize("name", MLA)
@pytest.mark.parametrize("batch_size", [1, 2])
def test_the_static_runtime_runs_latent_attention_losslessly(name: str, batch_size: int) -> None:
    """DeepSeek-V3 (and with YaRN): the layer's own MLA on our cache, holding its latent and RoPE key (one head
    each) at positions, experts as its own block; decoding equals HF `generate`."""
    target = tiny(name)
    assert supports(target)
    engine = assert_oracle_decoding_is_lossless(target, batch_size)
    assert isinstance(engine.runner, StaticTarget)
    attention = target.decoder_layers[0].self_attn
    assert engine.runner.keys[0].shape[1:] == (1, 64, attention.kv_lora_rank)
    assert engine.runner.values[0].shape[1:] == (1, 64, attention.qk_rope_head_dim)
    assert engine.runner.compare_with_hf(prompt_of(9, 1))["max_abs_logit_diff"] < 1e-4


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral", "gpt_oss"])
@pytest.mark.parametrize("batch_size", [1, 2])
def test_the_static_runtime_runs_mixture_of_experts_targets_losslessly(name: str, batch_size: int) -> None:
    """Experts through the model's own block inside the static runner's layers (fused attention projections,
    static caches; gpt-oss's sink logits and alternating windows in its attention): its logits match the
    model's forward, and decoding equals HF `generate`."""
    target = tiny(name)
    assert supports(target)
    engine = assert_oracle_decoding_is_lossless(target, batch_size)
    assert not isinstance(engine.runner, HFCacheTarget)
    assert engine.runner.compare_with_hf(prompt_of(9, 1))["max_abs_logit_diff"] < 1e-4


@pytest.mark.parametrize("name", ["glm4_moe", *OWN_LAYERS_ON_THE_STATIC_RUNTIME])
@pytest.mark.parametrize("batch_size", [1, 2])
def test_the_static_runtime_runs_attention_only_targets_losslessly(name: str, batch_size: int) -> None:
    """The engine picks the static runner (`make_runner`) for them; decoding equals HF `generate` through cycles
    that accept 1 to B tokens, rows at different positions, and the runner's logits match the model's forward."""
    target = tiny(name)
    engine = assert_oracle_decoding_is_lossless(target, batch_size)
    assert isinstance(engine.runner, StaticTarget)
    assert (engine.runner.fused is not None) == (name == "glm4_moe")  # the Llama family's layer, experts beside
    assert engine.runner.compare_with_hf(prompt_of(9, 1))["max_abs_logit_diff"] < 1e-4


@pytest.mark.parametrize("name", RING_KEPT)
@pytest.mark.parametrize("batch_size", [1, 2])
def test_the_static_runtime_runs_ring_kept_hybrids_losslessly(name: str, batch_size: int) -> None:
    """Qwen3-Next and Qwen3.5 (dense and MoE), LFM2, Nemotron-H, Falcon-H1: linear-attention, short-convolution
    or Mamba-2 layers on the runtime's state rings (Falcon-H1's beside attention in each layer), attention as the
    models' own layers. Decoding equals HF `generate` through cycles that accept 1 to B tokens
    (each rejection takes the recurrent and convolution states back), and the logits match the model's forward."""
    target = tiny(name)
    engine = assert_oracle_decoding_is_lossless(target, batch_size)
    runner = engine.runner
    assert isinstance(runner, StaticTarget) and runner.step_tokens == BLOCK
    ring_kept = {"lfm2": 3, "nemotron_h": 1, "falcon_h1": 4}.get(name, 3)  # of the tiny target's 4 layers
    assert sum(states is not None for states in runner.linear_states) == ring_kept
    assert runner.compare_with_hf(prompt_of(9, 1))["max_abs_logit_diff"] < 1e-4


test_under_interpreter = under_interpreter(f"{__file__}::test_gpt_oss_decodes_losslessly_with_its_sinks_on_the_attention_kernel")


@kernels_here
def test_gpt_oss_decodes_losslessly_with_its_sinks_on_the_attention_kernel() -> None:
    """gpt-oss's decode and verify attention on the split-key kernel (interpreted on CPU), its sink logits
    spread so that dropping them shows and its sliding layers' window (8 here) shorter than the prompt:
    decoding equals HF `generate` through cycles that accept 1 to B tokens, and the runner's logits the
    model's forward."""
    target = TargetModel(build_tiny_target("gpt_oss", VOCAB, sliding_window=8), None)
    spread_sinks(target)
    target.model.to(DEVICE)
    engine = assert_oracle_decoding_is_lossless(target, batch_size=1, kernels="triton", new_tokens=12)
    runner = engine.runner
    assert isinstance(runner, StaticTarget) and runner.attention == "triton"
    # the bounds that route a layer's attention to the kernel, for a verify block of every row
    assert runner._masks(torch.zeros(1, BLOCK, dtype=torch.long, device=DEVICE), 64)[None].dtype == torch.int32
    assert engine.compile_error is None
    assert runner.compare_with_hf(prompt_of(9, 1))["max_abs_logit_diff"] < 1e-4


@pytest.mark.parametrize("name", ["gemma2", "lfm2"])
def test_target_alone_with_rows_that_finish_and_refill(name: str) -> None:
    """One token a step, no copies taken: rows that finish early step in place until refilled, which takes a
    token back from a cache that cannot be cut (a sliding window, gemma2's on its own forward here: the engine
    would take the static runtime for it, or a recurrent state)."""
    target = tiny(name)
    batch = [prompt_of(9, 1), prompt_of(14, 2), prompt_of(6, 3)]
    config = EngineConfig(batch_size=2, block_size=1, max_new_tokens=12, max_length=64, kernels="torch")
    runner = HFCacheTarget(target, config.batch_size, config.max_length)
    outputs, _ = DecodeEngine(target, None, config, runner=runner).generate(batch)
    assert [output.tokens for output in outputs] == [greedy(target, p, 12) for p in batch]


def test_a_random_drafter_decodes_a_hybrid_target_losslessly() -> None:
    """The drafter itself proposing (rarely right): the committed tokens are still the target's own."""
    target = tiny("qwen3_5")
    prompt = prompt_of(12, 3)
    config = EngineConfig(batch_size=1, block_size=4, max_new_tokens=16, max_length=64, kernels="torch")
    (output,), _ = DecodeEngine(target, make_draft(target, block_size=4), config).generate([prompt])
    assert output.tokens == greedy(target, prompt, 16)


def test_the_fallback_is_said_once_per_architecture(caplog: pytest.LogCaptureFixture,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine_module, "_announced", set())
    target = TargetModel(build_tiny_target("llama", VOCAB, rope_parameters=DYNAMIC_ROPE), None)
    config = EngineConfig(batch_size=1, block_size=4, max_new_tokens=4, max_length=32, kernels="torch")
    with caplog.at_level("WARNING"):
        make_runner(target, config, "torch")
        make_runner(target, config, "torch")
    said = [r.getMessage() for r in caplog.records if "does not run" in r.getMessage()]
    assert len(said) == 1 and "'llama'" in said[0]


@pytest.mark.parametrize(("name", "overrides", "why"), [
    ("llama", {"rope_parameters": DYNAMIC_ROPE},
     "the step's longest position"),
    ("gemma3_text", {"use_bidirectional_attention": True}, "bidirectional"),
])
def test_targets_the_static_runtime_cannot_run_exactly_stay_on_their_own_forward(
        name: str, overrides: dict[str, object], why: str) -> None:
    """A rope whose frequencies follow the forward's longest position would give a row of a batched step other
    positions' RoPE than it has decoded alone; bidirectional attention has no causal decode at all."""
    target = TargetModel(build_tiny_target(name, VOCAB, **overrides), None)
    config = EngineConfig(batch_size=1, block_size=4, max_new_tokens=4, max_length=32, kernels="torch")
    assert not supports(target) and isinstance(make_runner(target, config, "torch"), HFCacheTarget)
    with pytest.raises(ValueError, match=why):
        StaticTarget(target, 1, 32)


def test_adapters_written_for_transformers_5_refuse_older_modeling_code(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before transformers 5, Gemma-2 scaled its embeddings in the model's forward and Gemma-3's layers took two
    cos/sin pairs: the adapters of the models' own layers say which code they follow, and older code falls back."""
    from dflash_train.runtime import target_adapters

    monkeypatch.setattr(target_adapters, "TRANSFORMERS_MAJOR", 4)
    assert not supports(tiny("gemma2")) and not supports(tiny("glm4_moe")) and supports(tiny("llama"))


def test_qwen3_5_as_published_decodes_on_the_static_runtime() -> None:
    """Qwen3.5 checkpoints are published as image-text models (`Qwen3_5ForConditionalGeneration`): the runtime
    runs their language model (its multimodal RoPE given text positions, its linear-attention layers on the
    rings), losslessly, and its logits match the whole model's forward."""
    from transformers import AutoModelForImageTextToText, Qwen3_5Config

    text = build_tiny_target("qwen3_5", VOCAB).config.to_dict()
    vision = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=64)
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(Qwen3_5Config(text_config=text, vision_config=vision)).eval()
    target = TargetModel(model, None)
    engine = assert_oracle_decoding_is_lossless(target, 2)
    assert isinstance(engine.runner, StaticTarget)
    assert engine.runner.compare_with_hf(prompt_of(12, 4))["max_abs_logit_diff"] < 1e-4
