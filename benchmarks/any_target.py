"""Decode speed of mixture-of-experts targets (Qwen3-MoE; gpt-oss, with sliding windows and attention sinks) on
`HFCacheTarget` (`dflash_train/runtime/hf_target.py`): the target through its own Hugging Face forward and
caches, the engine's path for every architecture the static runner does not cover.

    python -m benchmarks.any_target --shape qwen3-30b-a3b --shape gpt-oss-20b --layers 24   # one H100, < 8 min
    python -m benchmarks.any_target --shape gpt-oss-20b --batch 1                            # all 24 layers
    python -m benchmarks.any_target --shape tiny-moe --layers 2 --new-tokens 4 --device cpu  # CPU smoke test
    python -m benchmarks.any_target --shape moonlight-16b-a3b --runner auto --latent-baseline --batch 1 --batch 16

Shapes (random weights; bf16 on CUDA, float32 on CPU), as published but for `--layers`, which keeps the first
N decoder layers (for a quick run, and for memory: Qwen3-30B-A3B's 48 layers are 61 GB of bf16 weights):
- `qwen3-30b-a3b`: Qwen3-MoE, 48 layers, hidden 2048, 32/4 heads of 128, 128 experts of width 768, 8 active,
  vocabulary 151,936, RoPE theta 1e6;
- `gpt-oss-20b`: 24 layers, hidden 2880, 64/8 heads of 64 with attention sinks, 32 experts of width 2880 with
  biases, 4 active, vocabulary 201,088, sliding window 128 on every other layer, YaRN (factor 32 over 4,096);
- `tiny-moe`: a toy Qwen3-MoE (4 layers, hidden 64, 8 experts, 2 active, vocabulary 512) for the CPU test;
  `tiny-hybrid` and `tiny-mla`, toys of Qwen3-Next and of Moonlight (DeepSeek-V3's latent attention) likewise.
Each model is built on the device by `AutoModelForCausalLM.from_config` under `torch.device` (transformers'
own random initialisation, run on the GPU: seconds); building takes `build_s`, which no figure includes.

Per shape, in one run (CUDA events, medians), at each `--batch` (default 1 and 16), every row its own random
`--prompt-tokens`-token prompt, `--new-tokens` greedy tokens per row:
- `hf`: Hugging Face `generate` (its dynamic cache, eager): tokens/s of the whole call (prefill included),
  and its decode step, `(generate(N) - generate(1)) / (N - 1)`;
- `engine`: our `DecodeEngine` without a drafter (block 1) on `HFCacheTarget`: tokens/s of `generate` (prefill
  included, as HF's; `engine_decode_tokens_per_s` without it) and the time of one step (`engine.step`).
  `--runner auto` runs both engine measurements on the runner the engine picks itself instead (`make_runner`:
  the static runner where it covers the architecture; `engine_runner` and `dflash_runner` say which ran);
- `dflash`: `DecodeEngine` with a random 1-layer drafter (block `--block-size`): the time of one cycle (draft,
  verify, accept, drafter context). A random drafter's drafts are refused, so tokens/s would say nothing:
  the cycle's time is the figure (`dflash_cycle_over_engine_step`: its cost in target steps);
- `*_peak_bytes`: `torch.cuda.max_memory_allocated` over each measurement (weights included; None on a CPU).
`HFCacheTarget` runs rows one after another, each as a batch of one, so its step at batch b is b forwards.

Bytes: `weight_bytes` (all), and `active_bytes_per_step`, what a batch-1 decode step must read: every weight
but the experts' and the input embedding, each MoE layer's active experts only (k of E), one embedding row
(all of it where tied: the head reads it). For batch b, `bytes_per_step` counts the experts a batch reads
if routing were uniform: E (1 - (1 - k/E)^b) per layer. The floor is bytes / the copy bandwidth measured at
the start of the run (`copy_bandwidth`: a 1 GiB device-to-device copy, bytes read and written over time);
`*_over_floor` are step times over it.

`--budget-s` (default 480): once the run has taken that long, the measurements left are skipped and listed
under `skipped`, so a command under a 10-minute limit ends with results; the JSON
(`benchmarks/results/any_target-<shape>.json`; tiny shapes under results/smoke/) is written after every
measurement, `"complete": false` until the shape's last one. One table of every shape is printed at the end.
"""

from __future__ import annotations

import argparse
import gc
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    DeepseekV3Config,
    GptOssConfig,
    PretrainedConfig,
    Qwen3MoeConfig,
    Qwen3NextConfig,
)

from benchmarks.common import median, results_directory, time_calls, write_result
from benchmarks.decode_timing import default_dtype
from benchmarks.experts_reached import experts_reached, summary
from benchmarks.profiling import kernel_profile
from dflash_train.features.layer_ids import default_target_layer_ids
from dflash_train.models import DFlashConfig, DFlashDraftModel
from dflash_train.runtime.engine import DecodeEngine, EngineConfig
from dflash_train.runtime.experts import use_decode_experts
from dflash_train.runtime.hf_target import HFCacheTarget
from dflash_train.target import TargetModel

QWEN3_30B_A3B: dict[str, Any] = dict(
    num_hidden_layers=48, hidden_size=2048, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
    num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, intermediate_size=6144,
    vocab_size=151936, max_position_embeddings=40960, norm_topk_prob=True, rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0}, tie_word_embeddings=False)
# layer_types left to the config: sliding, full, sliding, ... for any layer count, as published
GPT_OSS_20B: dict[str, Any] = dict(
    num_hidden_layers=24, hidden_size=2880, num_attention_heads=64, num_key_value_heads=8, head_dim=64,
    num_local_experts=32, num_experts_per_tok=4, intermediate_size=2880, vocab_size=201088, sliding_window=128,
    max_position_embeddings=131072, rms_norm_eps=1e-5, attention_bias=True, tie_word_embeddings=False,
    rope_parameters={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                     "original_max_position_embeddings": 4096, "rope_theta": 150000.0})
# Gated DeltaNet layers and gated full attention, three to one; 160 GB of weights in bf16, so on one GPU run it
# with --layers (20 layers, the pattern five times, fit an 80 GB card)
QWEN3_NEXT_80B_A3B: dict[str, Any] = dict(
    num_hidden_layers=48, hidden_size=2048, intermediate_size=5120, num_attention_heads=16, num_key_value_heads=2,
    head_dim=256, linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
    linear_num_key_heads=16, linear_num_value_heads=32, num_experts=512, num_experts_per_tok=10,
    moe_intermediate_size=512, shared_expert_intermediate_size=512, decoder_sparse_step=1, norm_topk_prob=True,
    vocab_size=151936, max_position_embeddings=262144, rms_norm_eps=1e-6, tie_word_embeddings=False,
    rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25})
TINY_MOE: dict[str, Any] = dict(
    num_hidden_layers=4, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128, intermediate_size=128, vocab_size=512,
    max_position_embeddings=4096, norm_topk_prob=True,
    rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0}, tie_word_embeddings=False)
# DeepSeek-V3's architecture (latent attention, shared and routed experts, the first layer dense) at a size one card
# holds whole: 27 layers, 64 routed experts of which 6 active, 2 shared
MOONLIGHT_16B_A3B: dict[str, Any] = dict(
    num_hidden_layers=27, hidden_size=2048, intermediate_size=11264, num_attention_heads=16, num_key_value_heads=16,
    q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
    n_routed_experts=64, num_experts_per_tok=6, n_shared_experts=2, moe_intermediate_size=1408, first_k_dense_replace=1,
    n_group=1, topk_group=1, routed_scaling_factor=2.446, norm_topk_prob=True, vocab_size=163840,
    max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=False,
    rope_parameters={"rope_type": "default", "rope_theta": 50_000.0})
TINY_MLA: dict[str, Any] = MOONLIGHT_16B_A3B | dict(
    num_hidden_layers=3, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=4,
    kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8,
    num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=32, vocab_size=512, max_position_embeddings=4096)
TINY_HYBRID: dict[str, Any] = QWEN3_NEXT_80B_A3B | dict(
    num_hidden_layers=4, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
    num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=64,
    vocab_size=512, max_position_embeddings=4096)
# name -> (config class, published sizes, a toy for CPU checks)
SHAPES: dict[str, tuple[type[PretrainedConfig], dict[str, Any], bool]] = {
    "qwen3-30b-a3b": (Qwen3MoeConfig, QWEN3_30B_A3B, False),
    "gpt-oss-20b": (GptOssConfig, GPT_OSS_20B, False),
    "qwen3-next-80b-a3b": (Qwen3NextConfig, QWEN3_NEXT_80B_A3B, False),
    "moonlight-16b-a3b": (DeepseekV3Config, MOONLIGHT_16B_A3B, False),
    "tiny-moe": (Qwen3MoeConfig, TINY_MOE, True),
    "tiny-hybrid": (Qwen3NextConfig, TINY_HYBRID, True),
    "tiny-mla": (DeepseekV3Config, TINY_MLA, True)}
DEFAULT_SHAPES = ("qwen3-30b-a3b", "gpt-oss-20b")
MEASUREMENTS = ("hf", "engine", "dflash")
EXPERT_BASELINES = ("engine_model_experts", "dflash_model_experts")  # `--experts-baseline`
LATENT_BASELINES = ("engine_expanded_latent", "dflash_expanded_latent")  # `--latent-baseline`
BASELINES = EXPERT_BASELINES + LATENT_BASELINES


def say(message: str) -> None:
    print(f"any_target: {message}", flush=True)


def shape_config(name: str, layers: int | None) -> PretrainedConfig:
    """The shape's config, its first `layers` decoder layers only (all where it has fewer)."""
    config_class, sizes, _ = SHAPES[name]
    return config_class(**(sizes | {"num_hidden_layers": min(layers or sizes["num_hidden_layers"],
                                                              sizes["num_hidden_layers"])}))


def build_target(config: PretrainedConfig, device: torch.device, dtype: torch.dtype) -> TargetModel:
    """Seeded random weights, made on `device` in `dtype` (no copy of 60 GB through the host)."""
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return TargetModel(model.eval(), tokenizer=None)


# ---------------------------------------------------------------------------------------- bytes


def experts_of(config: PretrainedConfig) -> tuple[int, int]:
    """(experts per MoE layer E, active per token k)."""
    total = getattr(config, "num_experts", None) or config.num_local_experts
    return int(total), int(config.num_experts_per_tok)


def weight_bytes(model: torch.nn.Module) -> dict[str, int]:
    """All weights' bytes; the experts' among them (tensors with one leading row per expert); the input
    embedding's (counted in the head too where tied) and one row of it."""
    total_experts, _ = experts_of(model.config)
    total = experts = 0
    for name, parameter in model.named_parameters():  # tied weights come once
        size = parameter.numel() * parameter.element_size()
        total += size
        if ".experts." in name and parameter.shape[0] == total_experts:
            experts += size
    embed = model.get_input_embeddings().weight
    tied = model.get_output_embeddings().weight is embed
    return {"weight_bytes": total, "expert_bytes": experts,
            "embedding_bytes": 0 if tied else embed.numel() * embed.element_size(),
            "embedding_row_bytes": embed.shape[1] * embed.element_size()}


def bytes_per_step(counts: dict[str, int], config: PretrainedConfig, rows: int) -> float:
    """Bytes a decode step of `rows` tokens reads: everything but the experts and the input embedding, the
    experts `rows` tokens reach under uniform routing (k of E for one token), an embedding row per token."""
    total_experts, active = experts_of(config)
    reached = total_experts * (1 - (1 - active / total_experts) ** rows)
    dense = counts["weight_bytes"] - counts["expert_bytes"] - counts["embedding_bytes"]
    return dense + counts["expert_bytes"] * reached / total_experts + rows * counts["embedding_row_bytes"]


def copy_bandwidth(device: torch.device) -> float:
    """Bytes/s of a device-to-device copy, bytes read and written both counted (1 GiB on a GPU)."""
    size = (1 << 30) if device.type == "cuda" else (1 << 26)
    source = torch.empty(size, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    ms = median(time_calls(lambda: target.copy_(source), device, warmup=3, iters=10))
    return 2 * size / (ms * 1e-3)


# ---------------------------------------------------------------------------------------- measurements


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)


def peak_bytes(device: torch.device) -> int | None:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def random_prompts(rows: int, length: int, vocab: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(rows)
    return torch.randint(3, vocab - 1, (rows, length), generator=generator).tolist()


def measure_hf(target: TargetModel, prompts: list[list[int]], args: argparse.Namespace) -> dict[str, Any]:
    """Hugging Face `generate`, greedy: the whole call for N new tokens, and the step from N against 1; with the
    experts the model was loaded with (an engine before may have switched them to the decode kernel)."""
    use_decode_experts(target.model, enabled=False)
    ids = torch.tensor(prompts, device=target.device)
    mask = torch.ones_like(ids)

    def call(count: int) -> Callable[[], Any]:
        return lambda: target.model.generate(ids, attention_mask=mask, max_new_tokens=count, min_new_tokens=count,
                                             do_sample=False, pad_token_id=0)

    rows, new = len(prompts), args.new_tokens
    produced = call(new)()
    if produced.shape[1] != ids.shape[1] + new:
        raise RuntimeError(f"generate gave {produced.shape[1] - ids.shape[1]} tokens, not {new}")
    full_ms = median(time_calls(call(new), target.device, warmup=0, iters=args.repeats))
    one_ms = median(time_calls(call(1), target.device, warmup=1, iters=args.repeats))
    measured = {"hf_generate_ms": full_ms, "hf_generate_one_token_ms": one_ms,
                "hf_tokens_per_s": rows * new / full_ms * 1e3}
    step_ms = (full_ms - one_ms) / (new - 1)
    if step_ms <= 0:  # the calls' noise exceeds their difference (a loaded CPU, few tokens): no step to report
        say(f"HF generate's step not measured: {new} tokens took {full_ms:.2f} ms, one took {one_ms:.2f} ms; "
            "raise --new-tokens or --repeats")
        return measured
    return {**measured, "hf_step_ms": step_ms, "hf_decode_tokens_per_s": rows / step_ms * 1e3}


def engine_for(target: TargetModel, draft: DFlashDraftModel | None, rows: int,
               args: argparse.Namespace, **settings: str) -> DecodeEngine:
    """The engine on `HFCacheTarget` (`--runner hf`), or on the runner the engine picks itself (`auto`);
    `settings`: `EngineConfig` fields a baseline changes (`experts`, `latent`)."""
    block = args.block_size if draft is not None else 1
    config = EngineConfig(batch_size=rows, block_size=block, max_new_tokens=args.new_tokens,
                          max_length=args.prompt_tokens + args.new_tokens + 2 * args.block_size, **settings)
    runner = HFCacheTarget(target, rows, config.max_length) if args.runner == "hf" else None
    engine = DecodeEngine(target, draft, config, runner=runner)
    engine.prepare()  # warm-up cycles (Triton kernels compile there): outside every timing
    return engine


def step_ms(engine: DecodeEngine, prompts: list[list[int]], args: argparse.Namespace) -> float:
    """One `engine.step` (a cycle of every row) with each row decoding after its prompt."""
    engine.prefill(list(range(len(prompts))), prompts)
    return median(time_calls(engine.step, engine.device, args.warmup, args.iters))


def measure_engine(target: TargetModel, prompts: list[list[int]], args: argparse.Namespace,
                   **settings: str) -> dict[str, Any]:
    """Our loop without a drafter on `HFCacheTarget`: one step's time, then (prefill and steps warm) `generate`'s
    tokens/s."""
    engine = engine_for(target, None, len(prompts), args, **settings)
    result: dict[str, Any] = {"engine_runner": type(engine.runner).__name__,
                              "engine_step_ms": step_ms(engine, prompts, args)}
    if args.profile:
        result["engine_profile"] = write_profile(engine, f"{target.config.model_type}-b{len(prompts)}{tag(settings)}")
    outputs, stats = engine.generate(prompts)
    if any(len(output.tokens) != args.new_tokens for output in outputs):
        raise RuntimeError("the engine stopped a row before --new-tokens")
    result |= {"engine_tokens_per_s": stats.new_tokens / stats.wall_s,
               "engine_decode_tokens_per_s": stats.decode_tokens_per_s}
    del engine
    return result


def write_profile(engine: DecodeEngine, name: str) -> str:
    """The kernels of a few `engine.step`s (a target step, or a DFlash cycle with a drafter), heaviest first,
    written beside the JSON as any_target-NAME.profile.txt; returns the file's name."""
    path = results_directory(engine.device.type != "cuda") / f"any_target-{name}.profile.txt"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(kernel_profile(engine.step, engine.device, iters=5) + "\n")
    return path.name


def random_drafter(target: TargetModel, block_size: int) -> DFlashDraftModel:
    """A random 1-layer drafter sized after the target (its mask token the last id), reading the middle layer
    (layer 0 of a 2-layer cut: a drafter may not read the last). Built on the target's device in its dtype
    (`.to(bfloat16)` would also round the RoPE frequencies), then moved there, for buffers made on the CPU."""
    layers = target.num_layers
    config = DFlashConfig.from_target_config(
        target.config, mask_token_id=target.config.vocab_size - 1, num_hidden_layers=1, block_size=block_size,
        target_layer_ids=default_target_layer_ids(layers, 1) if layers >= 3 else [layers - 2])
    torch.manual_seed(1)
    with torch.device(target.device), default_dtype(target.dtype):
        draft = DFlashDraftModel(config)
    return draft.to(target.device).eval()


def measure_dflash(target: TargetModel, prompts: list[list[int]], args: argparse.Namespace,
                   **settings: str) -> dict[str, Any]:
    """One DFlash cycle of every row with a random drafter (draft, verify, accept, drafter context)."""
    draft = random_drafter(target, args.block_size)
    engine = engine_for(target, draft, len(prompts), args, **settings)
    result = {"dflash_runner": type(engine.runner).__name__, "dflash_cycle_ms": step_ms(engine, prompts, args),
              "draft_bytes": sum(p.numel() * p.element_size() for p in draft.parameters())}
    if args.profile:  # where a cycle's time goes: the drafter, the verify's experts, the rest
        result["dflash_profile"] = write_profile(
            engine, f"{target.config.model_type}-b{len(prompts)}{tag(settings)}-cycle")
        result |= verify_routing(target, prompts, args.block_size)
    del engine, draft
    return result


def verify_routing(target: TargetModel, prompts: list[list[int]], block: int) -> dict[str, Any]:
    """Distinct experts a verify-sized block of random tokens after each prompt reaches in each MoE layer,
    against even routing (`experts_reached`); nothing for a model without experts."""
    generator = torch.Generator().manual_seed(len(prompts) + block)
    drafted = torch.randint(3, target.config.vocab_size - 1, (len(prompts), block), generator=generator)
    counts = experts_reached(target.model, torch.cat([torch.tensor(prompts), drafted], 1).to(target.device), block)
    if not counts:
        return {}
    experts, top_k = experts_of(target.config)
    return summary(counts, experts, block, top_k, rows=len(prompts))


def tag(settings: dict[str, str]) -> str:
    """A profile file's suffix for a baseline's settings ("" for the defaults)."""
    return "".join(f"-{value}" for value in settings.values())


def baseline(measure: Callable[..., dict[str, Any]], name: str, **settings: str) -> Callable[..., dict[str, Any]]:
    """`measure` with `settings` in place of the engine's defaults (the experts the model was loaded with instead
    of the decode kernel, `--experts-baseline`; a latent-attention target's expanded path instead of the absorbed
    one, `--latent-baseline`), its keys renamed `<name>_...`: the default's baseline, measured in the same run."""
    prefix = measure.__name__.removeprefix("measure_")

    def measured(target: TargetModel, prompts: list[list[int]], args: argparse.Namespace) -> dict[str, Any]:
        result = measure(target, prompts, args, **settings)
        return {key.replace(prefix, name, 1): value for key, value in result.items()}

    return measured


MEASURE: dict[str, Callable[[TargetModel, list[list[int]], argparse.Namespace], dict[str, Any]]] = {
    "hf": measure_hf, "engine": measure_engine, "dflash": measure_dflash,
    "engine_model_experts": baseline(measure_engine, "engine_model_experts", experts="model"),
    "dflash_model_experts": baseline(measure_dflash, "dflash_model_experts", experts="model"),
    "engine_expanded_latent": baseline(measure_engine, "engine_expanded_latent", latent="expanded"),
    "dflash_expanded_latent": baseline(measure_dflash, "dflash_expanded_latent", latent="expanded")}


# ---------------------------------------------------------------------------------------- run


@dataclass
class Run:
    """The wall-time guard: measurements that would start after `budget_s` are skipped, with a note."""

    budget_s: float
    started: float = field(default_factory=time.perf_counter)
    skipped: list[str] = field(default_factory=list)

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def allows(self, what: str) -> bool:
        if self.elapsed() < self.budget_s:
            return True
        self.skipped.append(what)
        say(f"skipped {what}: the run has taken {self.elapsed():.0f} s of --budget-s {self.budget_s:.0f}")
        return False


def shape_header(name: str, target: TargetModel, device: torch.device, bandwidth: float) -> dict[str, Any]:
    config = target.config
    total_experts, active = experts_of(config)
    counts = weight_bytes(target.model)
    active_bytes = bytes_per_step(counts, config, 1)
    return {"shape": name, "layers": config.num_hidden_layers, "published_layers": SHAPES[name][1]["num_hidden_layers"],
            "model_type": config.model_type, "dtype": str(target.dtype).removeprefix("torch."),
            "experts": total_experts, "active_experts": active, "hidden_size": config.hidden_size,
            "vocab_size": config.vocab_size, "layer_types": list(getattr(config, "layer_types", None) or []),
            "attn_implementation": config._attn_implementation,
            "experts_implementation": getattr(config, "_experts_implementation", None),
            "copy_bandwidth": bandwidth, **counts, "active_bytes_per_step": active_bytes,
            "floor_ms": active_bytes / bandwidth * 1e3}


def ratios(point: dict[str, Any]) -> dict[str, float]:
    pairs = {"hf_step_over_floor": ("hf_step_ms", "floor_ms"), "engine_step_over_floor": ("engine_step_ms", "floor_ms"),
             "engine_step_over_hf_step": ("engine_step_ms", "hf_step_ms"),
             "dflash_cycle_over_floor": ("dflash_cycle_ms", "floor_ms"),
             "dflash_cycle_over_engine_step": ("dflash_cycle_ms", "engine_step_ms")}
    return {key: point[a] / point[b] for key, (a, b) in pairs.items() if a in point and b in point}


def measure_batch(target: TargetModel, rows: int, header: dict[str, Any], run: Run, args: argparse.Namespace,
                  save: Callable[[], None], point: dict[str, Any]) -> None:
    """Every measurement at `rows` rows into `point`, saved after each one."""
    counts = {key: header[key] for key in ("weight_bytes", "expert_bytes", "embedding_bytes", "embedding_row_bytes")}
    point["bytes_per_step"] = bytes_per_step(counts, target.config, rows)
    point["floor_ms"] = point["bytes_per_step"] / header["copy_bandwidth"] * 1e3
    prompts = random_prompts(rows, args.prompt_tokens, target.config.vocab_size)
    chosen = MEASUREMENTS + (EXPERT_BASELINES if args.experts_baseline else ()) + (
        LATENT_BASELINES if args.latent_baseline else ())
    for name in args.measure or chosen:
        if not run.allows(f"{header['shape']} batch {rows} {name}"):
            continue
        say(f"{header['shape']} batch {rows}: {name} ... ({run.elapsed():.0f} s into the run)")
        reset_peak(target.device)
        point.update(MEASURE[name](target, prompts, args))
        point[f"{name}_peak_bytes"] = peak_bytes(target.device)
        point.update(ratios(point))
        gc.collect()
        say(f"{header['shape']} batch {rows}: " + ", ".join(
            f"{key} {value:.3f}" for key, value in point.items() if key.startswith(name) and isinstance(value, float)))
        save()


def measure_shape(name: str, run: Run, bandwidth: float, device: torch.device, dtype: torch.dtype,
                  args: argparse.Namespace) -> dict[str, Any] | None:
    if not run.allows(f"{name} (all of it)"):
        return None
    began = time.perf_counter()
    target = build_target(shape_config(name, args.layers), device, dtype)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    result = shape_header(name, target, device, bandwidth) | {"build_s": time.perf_counter() - began}
    say(f"{name}: {result['layers']} layers, {result['weight_bytes'] / 1e9:.2f} GB of weights, "
        f"{result['active_bytes_per_step'] / 1e9:.3f} GB a batch-1 step, built in {result['build_s']:.1f} s")
    result |= {"prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens, "block_size": args.block_size,
               "budget_s": args.budget_s, "runner": args.runner, "batches": {}, "skipped": [], "complete": False}

    def save() -> None:
        result["skipped"] = [note for note in run.skipped if note.startswith(f"{name} ")]
        write_result(f"any_target-{name}", result, smoke=SHAPES[name][2])

    for rows in args.batch:
        result["batches"][str(rows)] = {}
        measure_batch(target, rows, result, run, args, save, result["batches"][str(rows)])
    result["complete"] = not any(note.startswith(f"{name} ") for note in run.skipped)
    save()
    del target
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


# ---------------------------------------------------------------------------------------- table

TABLE_HEADER = "| shape | layers | batch | loop | tokens/s | ms/step | floor ms | x floor | peak GB |"
# (label, tokens/s key, ms key, measurement); {runner}: the engine's target runner
LOOPS = (("HF generate", "hf_tokens_per_s", "hf_step_ms", "hf"),
         ("engine on {runner}, target only", "engine_tokens_per_s", "engine_step_ms", "engine"),
         ("DFlash cycle on {runner} (random drafter)", None, "dflash_cycle_ms", "dflash"),
         ("engine on {runner}, model's experts", "engine_model_experts_tokens_per_s", "engine_model_experts_step_ms",
          "engine_model_experts"),
         ("DFlash cycle on {runner}, model's experts", None, "dflash_model_experts_cycle_ms", "dflash_model_experts"),
         ("engine on {runner}, latent expanded", "engine_expanded_latent_tokens_per_s",
          "engine_expanded_latent_step_ms", "engine_expanded_latent"),
         ("DFlash cycle on {runner}, latent expanded", None, "dflash_expanded_latent_cycle_ms",
          "dflash_expanded_latent"))


def table(results: list[dict[str, Any]]) -> str:
    """One line per shape, batch and loop measured (the cycle: per cycle, and no tokens/s)."""
    lines = [TABLE_HEADER, "|" + "---|" * (TABLE_HEADER.count("|") - 1)]
    for result in results:
        for rows, point in result["batches"].items():
            for label, rate, ms, name in LOOPS:
                if ms not in point:
                    continue
                peak = point.get(f"{name}_peak_bytes")
                label = label.format(runner=point.get(f"{name}_runner"))
                lines.append(f"| {result['shape']} | {result['layers']} | {rows} | {label} | "
                             f"{f'{point[rate]:,.1f}' if rate else ''} | {point[ms]:.2f} | {point['floor_ms']:.3f} | "
                             f"{point[ms] / point['floor_ms']:.1f} | {'' if peak is None else f'{peak / 1e9:.1f}'} |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", action="append", choices=tuple(SHAPES),
                        help=f"repeat for several (default: {', '.join(DEFAULT_SHAPES)})")
    parser.add_argument("--layers", type=int, default=None, help="keep the first N decoder layers (at least 2; a shape with fewer keeps all of its own)")
    parser.add_argument("--batch", action="append", type=int, help="rows decoded at once; repeat (default: 1 and 16)")
    parser.add_argument("--new-tokens", type=int, default=64, help="greedy tokens per row (at least 2)")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16, help="the DFlash cycle's block")
    parser.add_argument("--runner", choices=("hf", "auto"), default="hf",
                        help="the engine's target runner: hf, HFCacheTarget (default); auto, the engine's own pick "
                             "(the static runner where it covers the architecture)")
    parser.add_argument("--experts-baseline", action="store_true",
                        help="also measure the engine and the cycle with the model's own experts implementation "
                             "instead of the decode-experts kernel (same run)")
    parser.add_argument("--latent-baseline", action="store_true",
                        help="also measure the engine and the cycle of a latent-attention target with every cached "
                             "slot expanded, the model's own path, instead of attention in latent space (same run)")
    parser.add_argument("--profile", action="store_true",
                        help="write the kernels of a few engine steps and DFlash cycles to results/any_target-*.profile.txt")
    parser.add_argument("--measure", action="append", choices=MEASUREMENTS + BASELINES,
                        help="measurements to run; repeat (default: all, the baselines with --experts-baseline "
                             "and --latent-baseline)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed engine steps before the timed ones")
    parser.add_argument("--iters", type=int, default=10, help="timed engine steps (median)")
    parser.add_argument("--repeats", type=int, default=2, help="timed `generate` calls of each length (median)")
    parser.add_argument("--budget-s", type=float, default=480.0,
                        help="skip the measurements that would start after this many seconds (default 480)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    args.shape = list(dict.fromkeys(args.shape or DEFAULT_SHAPES))
    args.batch = list(dict.fromkeys(args.batch or (1, 16)))
    if args.layers is not None and args.layers < 2:
        parser.error("--layers: at least 2 (the drafter reads a layer before the last)")
    if args.new_tokens < 2 or min(args.batch) < 1:
        parser.error("--new-tokens must be at least 2 and every --batch at least 1")
    return args


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    args = parse_args(argv)
    run = Run(args.budget_s)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    bandwidth = copy_bandwidth(device)
    say(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s on {args.device}")
    results = [result for name in args.shape
               if (result := measure_shape(name, run, bandwidth, device, dtype, args)) is not None]
    print(table(results), flush=True)
    if run.skipped:
        say(f"skipped (--budget-s {args.budget_s:.0f}): " + "; ".join(run.skipped))
    return results


if __name__ == "__main__":
    main()
