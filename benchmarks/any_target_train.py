"""The training step with online features at mixture-of-experts target shapes (Qwen3-MoE; gpt-oss, with sliding
windows and attention sinks): the trainer's own step, its target pass and its drafter part timed apart, and the
step's peak memory beside the weights it holds.

    python -m benchmarks.any_target_train --shape qwen3-30b-a3b --shape gpt-oss-20b --layers 24   # one H100
    python -m benchmarks.any_target_train --shape qwen3-30b-a3b                                   # all 48 layers
    python -m benchmarks.any_target_train --shape tiny-moe --device cpu --warmup 1 --iters 2      # CPU smoke test

Targets: `benchmarks/any_target.py`'s shapes and builder (random weights made on the device, bf16 on CUDA,
float32 on a CPU; `--layers N` keeps the first N decoder layers: Qwen3-30B-A3B's 48 layers are 61 GB of bf16).
Each shape trains as its recipe says (`recipes/qwen3-30b-a3b-dflash-b16.yaml`: unpacked rows of 3,072 tokens;
`recipes/gpt-oss-20b-dflash-b16-packed.yaml`: rows of 8,192 packed tokens, varlen target attention; the toy
`tiny-moe` as Qwen3-30B-A3B, shrunk): 5 drafter layers sized by `DFlashConfig.from_target_config`, the default
target layer ids, block 16, up to 512 anchors a chat, flex mask, compiled drafter layers, AdamW, bf16 autocast.
`--recipe` and `--set section.key=value` change that. One micro-batch a step (gradient accumulation 1), so a
step is one target pass and one optimizer step.

The step is the trainer's. A `Trainer` is built from the recipe on random chats written to a temporary prepared
dataset (unpacked: each row one chat of `data.max_length` tokens; packed: chats of max_length/8 to max_length
tokens), its target the random one built here: the one piece swapped, since loading it from disk would move
tens of GB through the host. `Trainer.train_step` then runs on batches its loader laid out beforehand (in a
run, the loader thread does that while the previous step computes), and each step is waited for.

Per shape (medians over `--iters` steps after `--warmup`; CUDA events on a GPU, the wall clock on a CPU):
- `step_ms`: `train_step`; `target_ms`: its call of the online features (the target's pass up to the deepest
  captured layer, `features/online.py`); `drafter_ms`: the rest (the batch's copy, drafter forward, loss,
  backward, clipping, optimizer step); `phase_ms`: every phase the trainer marks, means over 3 more steps
  (`train_packing`'s device time per phase);
- `tokens_per_s`: the chats' tokens over the steps' time; `step_mfu` (as the trainer's progress bar shows it)
  and `drafter_mfu`: the drafter's model FLOPs (`training/flops.py`) over the step's and the drafter part's
  time; `target_mfu`: the target pass's model FLOPs (2 per active weight per token, k of E experts, and the
  attention's causal or windowed pairs per chat) over its time; MFU against `device_peak_flops()`;
- memory (None on a CPU): `target_weight_bytes`, `draft_param_bytes` (fp32), `optimizer_state_bytes`,
  `resident_bytes` (allocated between steps), `peak_bytes` (`torch.cuda.max_memory_allocated` over the timed
  steps), `step_bytes` (peak - resident: the step's activations and temporaries), `warmup_peak_bytes` (from
  the build through the warm-up steps, compilation included); `full_depth_peak_estimate_bytes`: the peak with
  the published depth's weights in place of the kept layers' (the target's pass keeps no activations across
  layers, and the drafter is the same);
- `experts_implementation` (the target config's `_experts_implementation`), `attn_implementation` (the
  model's own) and `target_attention` (the packed rows' pass).

`--budget-s` (default 480): a shape that would start after that many seconds is skipped, and a shape past it
stops timing steps after the first and leaves out the phases; all are listed under `skipped`. The JSON
(`benchmarks/results/any_target_train-<shape>.json`; tiny shapes under results/smoke/) is written as each
shape ends; a shape that runs out of GPU memory records `"status": "OOM"` and the next one runs. One table is
printed at the end.
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from unittest import mock

import datasets
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from benchmarks.any_target import SHAPES, Run, build_target, experts_of, peak_bytes, reset_peak, shape_config
from benchmarks.common import device_peak_flops, median, time_calls, write_result
from benchmarks.train_packing import phase_device_ms, save_word_tokenizer
from dflash_train.data.prepared import METADATA_FILE, tokenizer_hash
from dflash_train.features.packed_rows import chat_layout
from dflash_train.target import TargetModel
from dflash_train.training import trainer as trainer_module
from dflash_train.training.config import TrainConfig, load_config
from dflash_train.training.trainer import Trainer

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
SHAPE_RECIPES = {"qwen3-30b-a3b": RECIPES / "qwen3-30b-a3b-dflash-b16.yaml",
                 "gpt-oss-20b": RECIPES / "gpt-oss-20b-dflash-b16-packed.yaml",
                 "tiny-moe": RECIPES / "qwen3-30b-a3b-dflash-b16.yaml"}
DEFAULT_SHAPES = ("qwen3-30b-a3b", "gpt-oss-20b")
# The toy has 4 layers (one drafter layer reads layer 2) and 64-wide states: rows and anchors to match.
TINY_SETTINGS = ("model.num_draft_layers=1", "data.max_length=96", "training.num_anchors=8")
TINY_PACK_TOKENS = 192
# A CPU has no flex attention kernel worth timing, nor a compiler set up for the drafter, nor bf16 matmuls.
CPU_SETTINGS = ("training.compile=false", "training.mixed_precision=no", "training.attention=dense",
                "training.target_cuda_graphs=false")
PROMPT_SHARE = 10  # a chat's first tenth is its unsupervised prompt
SHORTEST_CHAT = 8  # packed chats are max_length/8 to max_length tokens long
PHASE_STEPS = 3  # steps after the timed ones, each phase of them timed apart


def say(message: str) -> None:
    print(f"any_target_train: {message}", flush=True)


# ---------------------------------------------------------------------------------------- data


def word_tokenizer(folder: Path, vocab_size: int) -> PreTrainedTokenizerBase:
    """`train_packing`'s one-word-per-id tokenizer, loaded as the trainer loads one: the trainer checks that the
    data was tokenised with the target's vocabulary (its hash) and that no id lies outside it, and random ids
    over the whole vocabulary pass both."""
    save_word_tokenizer(folder, vocab_size)
    return AutoTokenizer.from_pretrained(folder)


def chat_lengths(config: TrainConfig, count: int, seed: int) -> list[int]:
    """Unpacked rows: every chat a whole row (the recipe's longest). Packed: lengths spread evenly between
    max_length / SHORTEST_CHAT and max_length, so rows close on chats of several sizes."""
    longest = config.data.max_length
    if config.data.pack_tokens is None:
        return [longest] * count
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(longest // SHORTEST_CHAT, longest + 1, (count,), generator=generator).tolist()


def write_random_chats(folder: Path, lengths: list[int], vocab: int, tokenizer: PreTrainedTokenizerBase,
                       seed: int) -> Path:
    """A prepared dataset of random chats (ids drawn below the last, kept for the mask token)."""
    generator = torch.Generator().manual_seed(seed)
    ids = [torch.randint(0, vocab - 1, (n,), generator=generator).tolist() for n in lengths]
    masks = [[0] * (n // PROMPT_SHARE) + [1] * (n - n // PROMPT_SHARE) for n in lengths]
    datasets.Dataset.from_dict({"input_ids": ids, "loss_mask": masks}).save_to_disk(str(folder))
    meta = {"target": "random", "tokenizer_hash": tokenizer_hash(tokenizer), "rows": len(lengths)}
    (folder / METADATA_FILE).write_text(json.dumps(meta))
    return folder


def chats_needed(config: TrainConfig, steps: int) -> int:
    """Enough chats that the run's steps never wrap around into a second epoch of the same rows."""
    rows = steps * config.training.batch_size
    if config.data.pack_tokens is None:
        return rows
    per_row = SHORTEST_CHAT * config.data.pack_tokens // config.data.max_length
    return rows * max(per_row, 1) + 8


# ---------------------------------------------------------------------------------------- the trainer


def run_settings(name: str, recipe: Path, device: torch.device, vocab: int, steps: int, folder: Path,
                 extra: list[str]) -> list[str]:
    """Overrides on the recipe: the benchmark's own (data, output, one micro-batch a step, no validation or
    tracking), the toy's and the CPU's sizes, then the command line's `--set`."""
    settings = [f"model.target={name}", f"model.mask_token_id={vocab - 1}", f"data.prepared={folder / 'data'}",
                "data.validation_fraction=0", f"training.output_dir={folder / 'run'}", "training.resume=none",
                f"training.max_steps={steps}", "training.gradient_accumulation_steps=1", "tracking.report_to=none"]
    if SHAPES[name][2]:
        packs = load_config(recipe, ["data.prepared=unused"]).data.pack_tokens is not None
        settings += [*TINY_SETTINGS, *([f"data.pack_tokens={TINY_PACK_TOKENS}"] if packs else [])]
    if device.type == "cpu":
        settings += CPU_SETTINGS
    return settings + extra


@contextmanager
def trainer_target(target: TargetModel) -> Iterator[None]:
    """The trainer builds its target from `model.target`; here it takes the random one built on the device."""
    with mock.patch.object(trainer_module, "build_target", lambda config, device: target):
        yield


class TimedFeatures:
    """The trainer's online features, each call timed: CUDA events on a GPU (read once the step was waited
    for), the wall clock on a CPU."""

    def __init__(self, features: Callable[..., Any], device: torch.device) -> None:
        self.features = features
        self.device = device
        self.calls: list[tuple[Any, Any]] = []

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        start = self._now()
        out = self.features(*args, **kwargs)
        self.calls.append((start, self._now()))
        return out

    def __getattr__(self, name: str) -> Any:  # everything else is the wrapped features' own
        return getattr(self.features, name)

    def _now(self) -> Any:
        if self.device.type != "cuda":
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def take_ms(self) -> float:
        """Milliseconds of the calls since the last take (the device is waited for first)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            total = sum(start.elapsed_time(end) for start, end in self.calls)
        else:
            total = sum(end - start for start, end in self.calls) * 1e3
        self.calls.clear()
        return total


# ---------------------------------------------------------------------------------------- FLOPs


def causal_pairs(length: int, window: int | None) -> int:
    """(query, key) pairs a causal attention computes over one chat, each query seeing at most `window` keys."""
    if window is None or length <= window:
        return length * (length + 1) // 2
    return window * (window + 1) // 2 + (length - window) * window


def active_layer_params(layer: torch.nn.Module, experts: int, active: int) -> float:
    """Weights one token multiplies in a decoder layer: all but the experts', and k of E of those."""
    total = 0.0
    for name, parameter in layer.named_parameters():
        routed = ".experts." in f".{name}" and parameter.shape[0] == experts
        total += parameter.numel() * (active / experts if routed else 1.0)
    return total


def target_pass_flops(target: TargetModel, layers_run: int, chats: list[int]) -> float:
    """Model FLOPs of the target's pass over chats of these lengths through its first `layers_run` layers:
    2 per active weight per token, and QK^T and PV (2 each) over each chat's causal pairs, windowed on
    sliding layers."""
    config = target.config
    experts, active = experts_of(config)
    tokens = sum(chats)
    width = config.num_attention_heads * getattr(config, "head_dim", config.hidden_size // config.num_attention_heads)
    kinds = list(getattr(config, "layer_types", None) or ["full_attention"] * target.num_layers)
    flops = 0.0
    for index in range(layers_run):
        window = config.sliding_window if kinds[index] == "sliding_attention" else None
        flops += 2 * tokens * active_layer_params(target.decoder_layers[index], experts, active)
        flops += 4 * width * sum(causal_pairs(n, window) for n in chats)
    return flops


def layers_in_pass(trainer: Trainer) -> int:
    """The pass stops after the deepest captured layer, unless the loss reads the target's final states."""
    if trainer.features.soft_targets:
        return trainer.target.num_layers
    return max(trainer.draft_config.target_layer_ids) + 1


# ---------------------------------------------------------------------------------------- measurement


def bytes_of(tensors: Iterator[torch.Tensor]) -> int:
    return sum(tensor.numel() * tensor.element_size() for tensor in tensors)


def optimizer_state_bytes(optimizer: Any) -> int:
    return bytes_of(value for state in optimizer.state.values() for value in state.values()
                    if isinstance(value, torch.Tensor))


def published_weight_bytes(name: str, dtype: torch.dtype) -> int:
    """The whole-depth model's weights, counted on the meta device (nothing allocated)."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(shape_config(name, None), dtype=dtype)
    return bytes_of(model.parameters())


def timed_step(trainer: Trainer, step: list[Any]) -> tuple[float, dict[str, Any]]:
    """One `train_step` (which waits for the device at its end, for its metrics): its milliseconds, metrics."""
    metrics: dict[str, Any] = {}
    (ms,) = time_calls(lambda: metrics.update(trainer.train_step(step)), trainer.accelerator.device, 0, 1)
    return ms, metrics


def time_steps(trainer: Trainer, timed: TimedFeatures, loaded: list[Any], flops_of_pass: list[float],
               run: Run, name: str) -> list[dict[str, float]]:
    """Each preloaded step in order, timed whole and in its target pass; past the budget, none after the first."""
    records = []
    for index, step in enumerate(loaded):
        if index > 0 and run.elapsed() >= run.budget_s:
            run.skipped.append(f"{name} timed steps {index + 1}-{len(loaded)}")
            break
        timed.take_ms()
        step_ms, metrics = timed_step(trainer, step)
        records.append({"step_ms": step_ms, "target_ms": timed.take_ms(), "tokens": metrics["tokens"],
                        "drafter_flops": metrics["flops"], "target_flops": flops_of_pass[index],
                        "loss": metrics["loss"]})
    return records


def phase_breakdown(trainer: Trainer, run: Run, name: str) -> dict[str, float] | None:
    """Where the step's time goes, phase by phase as the trainer marks them (target features, drafter and loss,
    backward, optimizer, the metrics copy): `train_packing`'s device milliseconds per phase, means over
    PHASE_STEPS more steps."""
    if not run.allows(f"{name} phases"):
        return None
    phases, _ = phase_device_ms(trainer, PHASE_STEPS)
    return {phase.removeprefix("train/"): ms for phase, ms in phases.items()}


def summary(records: list[dict[str, float]], peak: float | None) -> dict[str, Any]:
    """Medians of the step's parts; rates over the steps' sums."""
    step_s = sum(r["step_ms"] for r in records) / 1e3
    target_s = sum(r["target_ms"] for r in records) / 1e3
    drafter = [r["step_ms"] - r["target_ms"] for r in records]
    out = {"timed_steps": len(records), "step_ms": median([r["step_ms"] for r in records]),
           "target_ms": median([r["target_ms"] for r in records]), "drafter_ms": median(drafter),
           "step_ms_all": [r["step_ms"] for r in records], "target_ms_all": [r["target_ms"] for r in records],
           "tokens_per_step": median([r["tokens"] for r in records]),
           "tokens_per_s": sum(r["tokens"] for r in records) / step_s,
           "drafter_tflop_per_step": median([r["drafter_flops"] for r in records]) / 1e12,
           "target_tflop_per_step": median([r["target_flops"] for r in records]) / 1e12,
           "losses": [r["loss"] for r in records]}
    rates = {"step_mfu": ("drafter_flops", step_s), "drafter_mfu": ("drafter_flops", sum(drafter) / 1e3),
             "target_mfu": ("target_flops", target_s)}
    for key, (flops, seconds) in rates.items():
        out[key] = sum(r[flops] for r in records) / seconds / peak if peak and seconds > 0 else None
    return out


def memory_figures(trainer: Trainer, device: torch.device, name: str, dtype: torch.dtype,
                   resident: int | None, peak: int | None, warmup_peak: int | None) -> dict[str, Any]:
    target_bytes = bytes_of(trainer.target.model.parameters())
    figures: dict[str, Any] = {
        "target_weight_bytes": target_bytes, "draft_param_bytes": bytes_of(trainer.model.parameters()),
        "optimizer_state_bytes": optimizer_state_bytes(trainer.optimizer), "resident_bytes": resident,
        "peak_bytes": peak, "warmup_peak_bytes": warmup_peak, "published_weight_bytes": None,
        "step_bytes": None, "full_depth_peak_estimate_bytes": None}
    if peak is not None and resident is not None:
        published = published_weight_bytes(name, dtype)
        figures |= {"published_weight_bytes": published, "step_bytes": peak - resident,
                    "full_depth_peak_estimate_bytes": peak - target_bytes + published}
    return figures


def allocated(device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    return torch.cuda.memory_allocated(device)


def build_trainer(name: str, target: TargetModel, folder: Path, args: argparse.Namespace,
                  steps: int) -> tuple[Trainer, list[str]]:
    recipe = Path(args.recipe) if args.recipe else SHAPE_RECIPES[name]
    settings = run_settings(name, recipe, target.device, target.vocab_size, steps, folder, args.set)
    config = load_config(recipe, settings)
    lengths = chat_lengths(config, chats_needed(config, steps), seed=0)
    write_random_chats(folder / "data", lengths, target.vocab_size, target.tokenizer, seed=1)
    with trainer_target(target):
        return Trainer(config), settings


def train_shape(name: str, run: Run, device: torch.device, dtype: torch.dtype,
                args: argparse.Namespace) -> dict[str, Any]:
    began = time.perf_counter()
    reset_peak(device)
    target = build_target(shape_config(name, args.layers), device, dtype)
    built_s = time.perf_counter() - began
    steps = args.warmup + args.iters
    with tempfile.TemporaryDirectory(prefix="any_target_train_") as scratch:
        target.tokenizer = word_tokenizer(Path(scratch) / "tokenizer", target.vocab_size)
        trainer, settings = build_trainer(name, target, Path(scratch), args, steps + PHASE_STEPS)
        trainer.features = timed = TimedFeatures(trainer.features, device)
        loaded = [trainer._load_step(step) for step in range(steps)]  # the loader thread's work, done first
        layers_run = layers_in_pass(trainer)
        flops_of_pass = [sum(target_pass_flops(target, layers_run, [n for _, _, n in chat_layout(batch)])
                             for _, batch in step) for step in loaded[args.warmup :]]
        say(f"{name}: {target.num_layers} layers ({layers_run} in the pass, ids {trainer.draft_config.target_layer_ids}), "
            f"{bytes_of(target.model.parameters()) / 1e9:.2f} GB of weights, experts "
            f"{target.config._experts_implementation}; {steps} steps ({run.elapsed():.0f} s into the run)")
        for step in loaded[: args.warmup]:  # the first compiles the drafter's layers and its flex attention
            trainer.train_step(step)
        warmup_peak, resident = peak_bytes(device), allocated(device)
        reset_peak(device)
        records = time_steps(trainer, timed, loaded[args.warmup :], flops_of_pass, run, name)
        peak = peak_bytes(device)
        result = {"shape": name, "status": "ok", **shape_header(name, trainer, layers_run, settings, built_s, args),
                  **summary(records, device_peak_flops()),
                  **memory_figures(trainer, device, name, dtype, resident, peak, warmup_peak),
                  "phase_ms": phase_breakdown(trainer, run, name)}
        trainer.accelerator.free_memory()
    return result


def shape_header(name: str, trainer: Trainer, layers_run: int, settings: list[str], built_s: float,
                 args: argparse.Namespace) -> dict[str, Any]:
    config, target = trainer.config, trainer.target
    experts, active = experts_of(target.config)
    return {"layers": target.num_layers, "published_layers": SHAPES[name][1]["num_hidden_layers"],
            "layers_in_pass": layers_run, "target_layer_ids": trainer.draft_config.target_layer_ids,
            "model_type": target.config.model_type, "dtype": str(target.dtype).removeprefix("torch."),
            "experts": experts, "active_experts": active,
            "experts_implementation": getattr(target.config, "_experts_implementation", None),
            "attn_implementation": target.config._attn_implementation,
            "recipe": str(Path(args.recipe) if args.recipe else SHAPE_RECIPES[name]),
            "settings": settings, "rows_per_step": config.training.batch_size,
            "row_tokens": config.data.pack_tokens or config.data.max_length, "packed": config.data.pack_tokens is not None,
            "num_anchors": config.training.num_anchors, "anchors_per_row": trainer.objective.anchors_per_row,
            "block_size": trainer.draft_config.block_size, "draft_layers": trainer.draft_config.num_hidden_layers,
            "target_attention": trainer.features.attention, "warmup": args.warmup, "iters": args.iters,
            "build_s": built_s}


def measure_shape(name: str, run: Run, device: torch.device, dtype: torch.dtype,
                  args: argparse.Namespace) -> dict[str, Any] | None:
    """One shape, its JSON written; out of GPU memory, a record that says so (the next shape still runs)."""
    if not run.allows(f"{name} (all of it)"):
        return None
    try:
        result = train_shape(name, run, device, dtype, args)
    except torch.OutOfMemoryError as error:
        result = {"shape": name, "status": "OOM", "layers": args.layers, "error": str(error).splitlines()[0],
                  "peak_bytes": peak_bytes(device)}
    result |= {"budget_s": args.budget_s, "skipped": [note for note in run.skipped if note.startswith(f"{name} ")]}
    free_device(device)
    path = write_result(f"any_target_train-{name}", result, smoke=SHAPES[name][2])
    phases = result.get("phase_ms") or {}
    say(f"{name}: {result['status']}" + "".join(f", {phase} {ms:.1f} ms" for phase, ms in phases.items())
        + f"; wrote {path}")
    return result


def free_device(device: torch.device) -> None:
    """The next shape starts with the memory empty: compiled graphs hold the last drafter's shapes."""
    torch._dynamo.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------- table

TABLE_HEADER = ("| shape | layers (pass / kept / published) | rows × tokens | step ms | target ms | drafter ms | "
                "tokens/s | drafter MFU | target MFU | peak GB | weights GB | experts |")


def _percent(value: float | None) -> str:
    return "" if value is None else f"{100 * value:.1f}%"


def _gigabytes(value: int | None) -> str:
    return "" if value is None else f"{value / 1e9:.1f}"


def table(results: list[dict[str, Any]]) -> str:
    lines = [TABLE_HEADER, "|" + "---|" * (TABLE_HEADER.count("|") - 1)]
    for r in results:
        if r["status"] != "ok":
            lines.append(f"| {r['shape']} | {r.get('layers') or ''} | {r['status']} |" + " |" * 9)
            continue
        weights = r["target_weight_bytes"] + r["draft_param_bytes"] + r["optimizer_state_bytes"]
        lines.append(
            f"| {r['shape']} | {r['layers_in_pass']} / {r['layers']} / {r['published_layers']} | "
            f"{r['rows_per_step']} × {r['row_tokens']}{' packed' if r['packed'] else ''} | {r['step_ms']:.1f} | "
            f"{r['target_ms']:.1f} | {r['drafter_ms']:.1f} | {r['tokens_per_s']:,.0f} | {_percent(r['drafter_mfu'])} | "
            f"{_percent(r['target_mfu'])} | {_gigabytes(r['peak_bytes'])} | {weights / 1e9:.1f} | "
            f"{r['experts_implementation']} |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", action="append", choices=tuple(SHAPES),
                        help=f"repeat for several (default: {', '.join(DEFAULT_SHAPES)})")
    parser.add_argument("--layers", type=int, default=None,
                        help="keep the first N decoder layers (a shape with fewer keeps all of its own)")
    parser.add_argument("--recipe", default=None, help="train every shape as this recipe says (default: each its own)")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="a recipe override, as `dflash-train train` takes them; repeat")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (the first compiles)")
    parser.add_argument("--iters", type=int, default=10, help="timed steps (medians)")
    parser.add_argument("--budget-s", type=float, default=480.0,
                        help="skip the shapes, and stop the timed steps, past this many seconds (default 480)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    args.shape = list(dict.fromkeys(args.shape or DEFAULT_SHAPES))
    if args.layers is not None and args.layers < 3:
        parser.error("--layers: at least 3 (the drafter reads a layer two before the last)")
    if args.warmup < 0 or args.iters < 1:
        parser.error("--warmup must be at least 0 and --iters at least 1")
    if torch.device(args.device).type != ("cuda" if torch.cuda.is_available() else "cpu"):
        parser.error(f"--device {args.device}: the trainer runs on CUDA exactly where CUDA is available "
                     "(hide the GPUs with CUDA_VISIBLE_DEVICES= for a CPU run)")
    return args


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    args = parse_args(argv)
    run = Run(args.budget_s)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    results = [result for name in args.shape if (result := measure_shape(name, run, device, dtype, args)) is not None]
    print(table(results), flush=True)
    if run.skipped:
        say(f"skipped (--budget-s {args.budget_s:.0f}): " + "; ".join(run.skipped))
    return results


if __name__ == "__main__":
    main()
