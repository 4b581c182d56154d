"""Packed vs padded training at SmolLM2 shapes: chat-passes per minute, valid block tokens/s, MFU, cold start.

    python -m benchmarks.train_packing                       # random SmolLM2-shaped target, synthetic chats
    python -m benchmarks.train_packing --prepared DIR --target DIR   # real regenerated chats and target
    python -m benchmarks.train_packing --recipe recipes/smollm2-135m-dflash-b16-packed.yaml --num-anchors 64 \
        --variants packed --profile        # the speedrun's recipe, and where its step's time goes

Each variant runs the real `Trainer` in its own process with an empty compilation cache, so its first
step is a cold start (compilation included), as on a fresh machine. Chats, without `--prepared`, have
lengths drawn from a log-normal distribution with a mean of about 480 tokens (regenerated SmolLM2 chats
average ~475), cut to 64..2048, the first 30 % of each unsupervised (system prompt and question). Every
variant draws up to `--num-anchors` anchors per chat, so anchors per supervised token are equal and
only the layout differs: `padded` is the unpacked path (16 chats a step, each padded to 2,048).
`--recipe` starts every variant from a recipe file instead of the trainer's defaults (its optimizer, for
one); `--set KEY=VALUE` overrides more settings after the variant's own. `load s` is the loader thread's
median time to read and lay out a step's data (the step waits for it if it is longer than the step).

`--profile` adds, per variant, a profile of 3 steps after the timed ones (`benchmarks.decode`'s profiler
ranges, one per step): the step's wall time, the GPU's kernel time and the idle gaps between its kernels
(a step whose gaps are large waits on the host: launches, syncs, data), launches, kernel time by category
(matmul, attention, cross-entropy, norm, optimizer, copy/cast, other fused, other), the heaviest
kernels by name, and the host's milliseconds in each phase the trainer marks (target features, drafter
and loss, backward, optimizer, and the metrics copy, which waits for the GPU to finish the step); then, over
3 more steps without the profiler, each phase's milliseconds on the device's own timeline (CUDA events at the
trainer's marks: the phase's kernels and the device's waits for the host inside it), which says which phase
a cheaper step has to come from. On a CPU, top-level operators stand in for kernels (`--tiny` is that smoke test: a tiny Llama and short chats).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import write_result
from benchmarks.profiling import as_intervals, gpu_time, kernel_categories, profiled_calls
from benchmarks.shapes import SMOLLM2_135M, TINY_LLAMA
from dflash_train.training.config import TrainingConfig
from dflash_train.training.flops import peak_flops

# Rows of 8,192 tokens, the target's packed forward on the varlen kernel, its decoder layers compiled and its
# pass replayed from CUDA graphs (the packed recipe's choices); the other packed variants change one thing
# each, whatever --recipe says.
PACKED = ["data.max_length=2048", "data.pack_tokens=8192", "training.batch_size=2", "training.compile=true",
          "training.target_attention=varlen", "training.compile_target=true", "training.target_cuda_graphs=true"]
VARIANTS: dict[str, list[str]] = {
    "padded": ["data.max_length=2048", "training.batch_size=16", "training.compile=true", "training.compile_target=false",
               "training.target_cuda_graphs=false"],
    "packed": PACKED,
    "packed-4x-rows": [*PACKED, "data.pack_tokens=16384", "training.batch_size=4"],
    "packed-eager-layers": [*PACKED, "training.compile=false"],
    # the target's forward over packed rows on SDPA with Hugging Face's dense per-chat mask
    "packed-sdpa-target": [*PACKED, "training.target_attention=sdpa"],
    # the same on flex attention: skips the tiles no chat fills, but compiles its kernel on the first step
    "packed-flex-target": [*PACKED, "training.target_attention=flex"],
    # the drafter's flex mask in tiles of 64 tokens instead of 128: fewer masked-out scores computed
    "packed-flex-tile64": [*PACKED, "training.flex_tile=64"],
    # the drafter's forward, loss and backward replayed from CUDA graphs too (training/step_graph.py)
    "packed-step-graphs": [*PACKED, "training.step_cuda_graphs=true"],
    # the target's pass launched kernel by kernel from the host instead of replayed from CUDA graphs
    "packed-uncaptured-target": [*PACKED, "training.target_cuda_graphs=false"],
    # the target's decoder layers eager (their forward launches ~50 kernels a layer)
    "packed-eager-target": [*PACKED, "training.compile_target=false", "training.target_cuda_graphs=false"],
    # distillation: the target's final states too, and soft targets in the fused cross-entropy kernel
    "packed-soft-targets": [*PACKED, "training.soft_targets=true"],
}
RESULT_PREFIX = "RESULT "
# A training step's kernels by name, the first pattern found in a lower-cased name naming its category; the
# project's Triton kernels go by their function names, inductor's `triton_*` kernels by what they fuse.
TRAINING_CATEGORIES = (
    ("cross-entropy", r"cross_entropy|_ce_|logsumexp"),
    ("attention", r"flex_attention|flash|fmha|attention|sdpa|softmax"),
    ("optimizer", r"foreach|multi_tensor|adam|muon|zeropower|lerp"),
    ("norm", r"rms_?norm|layer_?norm|rsqrt"),
    ("matmul", r"gemm|gemv|cutlass|cublas|nvjet|xmma|(?<![a-z])(add|b)?mm(?![a-z])|linear|matmul"),
    ("copy/cast", r"memcpy|memset|copy|to_copy|index|gather|scatter|cat(?![a-z])|fill"),
    ("other fused", r"^triton_"),
)
TINY_SETTINGS = ["model.num_draft_layers=2", "data.max_length=256", "data.pack_tokens=512", "training.batch_size=2",
                 "training.compile=false", "training.compile_target=false"]


def save_smollm2_shaped_target(path: Path, tiny: bool = False) -> None:
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(**(TINY_LLAMA if tiny else SMOLLM2_135M))
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(path)
    save_word_tokenizer(path, config.vocab_size)


def save_word_tokenizer(path: Path, vocab_size: int) -> None:
    """A word-level tokenizer with one word per id of the target's vocabulary: the trainer refuses data whose
    ids the tokenizer cannot produce, and the synthetic chats draw ids from the whole vocabulary."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size)} | {"<|im_end|>": 2, "<empty_output>": 16}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>").save_pretrained(path)


def save_synthetic_chats(path: Path, chats: int, target: Path, tiny: bool = False) -> None:
    import datasets
    from transformers import AutoTokenizer

    from dflash_train.data.prepared import tokenizer_hash

    gen = torch.Generator().manual_seed(0)
    mean_log, longest, vocab = (4.0, 256, TINY_LLAMA["vocab_size"]) if tiny else (6.0, 2048, SMOLLM2_135M["vocab_size"])
    lengths = torch.exp(torch.randn(chats, generator=gen) * 0.6 + mean_log).clamp(64, longest).long().tolist()
    ids = [torch.randint(17, vocab, (n,), generator=gen).tolist() for n in lengths]
    masks = [[0] * (3 * n // 10) + [1] * (n - 3 * n // 10) for n in lengths]
    datasets.Dataset.from_dict({"input_ids": ids, "loss_mask": masks}).save_to_disk(str(path))
    meta = {"target": str(target), "tokenizer_hash": tokenizer_hash(AutoTokenizer.from_pretrained(target))}
    (path / "dflash_data.json").write_text(json.dumps(meta))


def unpacked(name: str) -> list[str]:
    """`padded` stays one chat per row whatever the recipe (the packed recipe) or the tiny settings pack."""
    return ["data.pack_tokens=null"] if name == "padded" else []


def run_variant(name: str, target: Path, prepared: Path, work: Path, args: argparse.Namespace) -> dict[str, Any]:
    """One variant in this process: setup, the cold first step, then `args.steps` steps with prefetching
    (and with `args.profile`, 3 profiled steps after them)."""
    from dflash_train.training.config import load_config
    from dflash_train.training.trainer import Trainer

    steps = args.steps
    overrides = [f"model.target={target}", "model.mask_token_id=16", f"data.prepared={prepared}",
                 "data.validation_fraction=0", f"training.num_anchors={args.num_anchors}", "tracking.report_to=none",
                 f"training.output_dir={work / 'run'}", "training.resume=none", "training.max_steps=100000",
                 "training.eval_every=0", "training.save_every=100000000", "training.time_budget_minutes=null",
                 *VARIANTS[name], *(TINY_SETTINGS if args.tiny else []), *unpacked(name), *args.set]
    started = time.perf_counter()
    trainer = Trainer(load_config(args.recipe, overrides))
    setup_s = time.perf_counter() - started
    pool = ThreadPoolExecutor(1)  # as the trainer's loader thread
    load_seconds: list[float] = []

    def load(step: int) -> list[tuple[list[int], dict[str, Any]]]:
        began = time.perf_counter()
        loaded = trainer._load_step(step)
        load_seconds.append(time.perf_counter() - began)
        return loaded

    upcoming = pool.submit(load, trainer.step)
    rows: list[dict[str, float]] = []
    for _ in range(steps + 1):
        began = time.perf_counter()
        loaded = upcoming.result()
        upcoming = pool.submit(load, trainer.step + 1)
        metrics = trainer.train_step(loaded)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        rows.append({"seconds": time.perf_counter() - began, "chats": sum(len(ids) for ids, _ in loaded),
                     "tokens": metrics["tokens"], "slots": metrics["supervised_slots"], "flops": metrics["flops"],
                     "step_flops": metrics["step_flops"]})
    flops_per_step = statistics.fmean(r["flops"] for r in rows[1:])  # the model FLOPs MFU counts (training/flops.py)
    step_flops_per_step = statistics.fmean(r["step_flops"] for r in rows[1:])  # the target's pass added
    queued = queued_steps(trainer, pool, upcoming, load, steps, flops_per_step)
    pool.shutdown()
    if args.profile:
        device_ms, device_step_ms = phase_device_ms(trainer)
        profile = {**step_profile(trainer), "device_ms": device_ms, "device_step_ms": device_step_ms}
    else:
        profile = None
    first, steady = rows[0], rows[1:]
    step_s = statistics.median(r["seconds"] for r in steady)
    total_s = sum(r["seconds"] for r in steady)
    peak = peak_flops(trainer.accelerator.device)  # the trainer's own denominator (DFLASH_PEAK_TFLOPS overrides)
    graphs = getattr(trainer, "step_graph", None)
    queued_flops = queued.pop("queued_flops_per_s")
    return {
        "variant": name, "setup_s": setup_s, "first_step_s": first["seconds"], "step_s_median": step_s,
        "load_s_median": statistics.median(load_seconds[1:]),  # a step's data, read and laid out by the loader
        "chats_per_step": statistics.mean(r["chats"] for r in steady),
        "chat_passes_per_min": 60 * sum(r["chats"] for r in steady) / total_s,
        "tokens_per_s": sum(r["tokens"] for r in steady) / total_s,
        "valid_block_tokens_per_s": sum(r["slots"] for r in steady) / total_s,
        "flops_per_step": flops_per_step,
        "mfu": (sum(r["flops"] for r in steady) / total_s / peak) if peak else None,
        "mfu_median_step": (statistics.median(r["flops"] for r in steady) / step_s / peak) if peak else None,
        **queued,
        "queued_mfu": queued_flops / peak if peak else None,
        # the whole step's work: the target's forward pass (online features) counted beside the drafter's
        "step_flops_per_step": step_flops_per_step,
        "queued_step_mfu": queued_flops * step_flops_per_step / flops_per_step / peak if peak else None,
        # Distinct shapes captured (step graphs only): each costs a capture, once, in the steps above.
        "step_graphs_captured": len(graphs.graphs) if graphs is not None else None,
        "pack_token_fill": metrics.get("pack_token_fill"), "pack_anchor_fill": metrics.get("pack_anchor_fill"),
        **({"profile": profile} if profile is not None else {}),
    }


def queued_steps(trainer: Any, pool: ThreadPoolExecutor, upcoming: Any, load: Any, steps: int,
                 flops_per_step: float) -> dict[str, float]:
    """`steps` more steps as `fit` runs them between logged steps: queued back to back, the device waited for
    once at the end (the steps above wait at each one's end, so the host never runs ahead of the device). Their
    FLOPs are not resolved one by one (that would wait for each): the steps above give the mean per step."""
    began, chats = time.perf_counter(), 0
    for i in range(steps):
        loaded = upcoming.result()
        upcoming = pool.submit(load, trainer.step + 1)
        chats += sum(len(ids) for ids, _ in loaded)
        trainer.train_step(loaded, resolve=i == steps - 1)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    seconds = time.perf_counter() - began
    upcoming.result()  # the loader's step after the last, not timed
    return {"queued_step_s": seconds / steps, "queued_chat_passes_per_min": 60 * chats / seconds,
            "queued_flops_per_s": flops_per_step / (seconds / steps)}


def step_profile(trainer: Any, steps: int = 3, top: int = 60) -> dict[str, Any]:
    """Where `steps` training steps' time goes (their data loaded beforehand): the median and the mean wall time
    of a step, means per step of the kernel time, gaps and launches, kernel time by category, the `top`
    heaviest kernels by name, and the host's time in the phases the trainer marks (means per step, which
    add up to at most the mean wall time: the phases run inside the step)."""
    device = trainer.accelerator.device
    loaded = [trainer._load_step(trainer.step + i) for i in range(steps)]
    profiled = profiled_calls(lambda: trainer.train_step(loaded.pop(0)), device, iters=steps)
    by_name: dict[str, list[float]] = {}
    for launch in (launch for call in profiled.calls for launch in call):
        entry = by_name.setdefault(launch.name, [0.0, 0.0])
        entry[0] += launch.duration_us / steps / 1e3
        entry[1] += 1 / steps
    heaviest = sorted(by_name.items(), key=lambda item: -item[1][0])[:top]
    return {"steps": steps, "wall_ms": statistics.median(profiled.wall_us) / 1e3,
            "wall_mean_ms": statistics.fmean(profiled.wall_us) / 1e3,
            **gpu_time(as_intervals(profiled.calls)),
            "categories": kernel_categories(profiled.calls, TRAINING_CATEGORIES),
            "kernels": {name: {"ms": ms, "launches": count} for name, (ms, count) in heaviest},
            # the host's time in each phase the trainer marks (`train/...`): where a step's gaps come from
            "host_ms": {name: us / steps / 1e3 for name, us in profiled.ranges_us.items() if name.startswith("train/")}}


class WallEvent:
    """A CUDA event's `record` / `elapsed_time` on a CPU, where work is synchronous: the host's clock is the device's."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def record(self) -> None:
        self.seconds = time.perf_counter()

    def elapsed_time(self, end: WallEvent) -> float:
        return (end.seconds - self.seconds) * 1e3


def phase_device_ms(trainer: Any, steps: int = 3) -> tuple[dict[str, float], float]:
    """Per phase the trainer marks (`train/...`), the milliseconds per step of the device's timeline between the
    phase's start and end: its kernels and the gaps in which the device waited for the host, unprofiled. Events
    are recorded on the stream at each mark (the step's `record_function`, wrapped for these steps), so the
    backward's kernels, launched from autograd's own thread, still fall inside their phase. -> (those means,
    the mean milliseconds of the same steps whole, which the phases fall within)."""
    import dflash_train.training.step as step_module  # where the step's phases are marked

    cuda = trainer.accelerator.device.type == "cuda"
    new_event = (lambda: torch.cuda.Event(enable_timing=True)) if cuda else WallEvent
    spans: list[tuple[str, Any, Any]] = []
    marked_phase = step_module.record_function

    @contextlib.contextmanager
    def timed_phase(name: str) -> Iterator[None]:
        start, end = new_event(), new_event()
        start.record()
        with marked_phase(name):
            yield
        end.record()
        spans.append((name, start, end))

    loaded = [trainer._load_step(trainer.step + i) for i in range(steps)]
    whole: list[tuple[Any, Any]] = []
    step_module.record_function = timed_phase
    try:
        for batch in loaded:
            whole.append((new_event(), new_event()))
            whole[-1][0].record()
            trainer.train_step(batch)
            whole[-1][1].record()
    finally:
        step_module.record_function = marked_phase
    if cuda:
        torch.cuda.synchronize()
    totals: dict[str, float] = {}
    for name, start, end in spans:
        totals[name] = totals.get(name, 0.0) + start.elapsed_time(end)
    step_ms = sum(start.elapsed_time(end) for start, end in whole) / steps
    return {name: ms / steps for name, ms in totals.items()}, step_ms


def print_profile(result: dict[str, Any]) -> None:
    profile = result["profile"]
    print(f"  {result['variant']}: step {profile['wall_ms']:.1f} ms, kernels {profile['kernel_ms']:.1f} ms, gaps "
          f"{profile['gap_ms']:.1f} ms, {profile['launches']:.0f} launches", flush=True)
    for category, entry in profile["categories"].items():
        print(f"    {category:<14} {entry['ms']:>9.2f} ms {entry['launches']:>7.0f} launches", flush=True)
    phases = ", ".join(f"{name.removeprefix('train/')} {ms:.1f}" for name, ms in profile.get("host_ms", {}).items())
    print(f"    host ms by phase: {phases}", flush=True)
    device = ", ".join(f"{name.removeprefix('train/')} {ms:.1f}" for name, ms in profile.get("device_ms", {}).items())
    print(f"    device ms by phase (kernels and waits, unprofiled): {device}", flush=True)


def launch(name: str, args: argparse.Namespace, target: Path, prepared: Path, work: Path) -> dict[str, Any]:
    """A variant in a fresh process with an empty compilation cache: its result, or {"variant", "exit",
    "errors"} if it failed (kept in the results file: a log cut short still leaves the reason)."""
    run_dir = work / f"{name}-{time.time_ns()}"  # a fresh folder: a cold compilation cache every time
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(run_dir / "inductor"), PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "benchmarks.train_packing", "--one", name, "--target", str(target),
           "--prepared", str(prepared), "--workdir", str(run_dir), "--steps", str(args.steps),
           "--num-anchors", str(args.num_anchors), *(["--recipe", str(args.recipe)] if args.recipe else []),
           *(["--profile"] if args.profile else []), *(["--tiny"] if args.tiny else []),
           *(item for setting in args.set for item in ("--set", setting))]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_PREFIX):
            return json.loads(line[len(RESULT_PREFIX):])
    errors = error_lines(proc.stderr)
    print(f"{name}: failed (exit {proc.returncode}): {'; '.join(errors) or 'no exception line'}\n"
          f"{proc.stderr[-1500:]}", flush=True)
    return {"variant": name, "exit": proc.returncode, "errors": errors or [proc.stderr.strip()[-300:]]}


def error_lines(stderr: str, limit: int = 3) -> list[str]:
    """The exception lines of a failed variant's stderr (`...Error: message`), first first: inductor's lowering
    errors end in pages of graph dumps, so the stderr's tail alone does not say what failed."""
    pattern = re.compile(r"^(?:[\w.]+\.)?\w*(?:Error|Exception)\b.*")
    return [line.strip()[:300] for line in stderr.splitlines() if pattern.match(line.strip())][:limit]


HEADER = (f"{'variant':<22} {'chats/st':>7} {'step s':>8} {'chats/min':>10} {'vs pad':>7} {'block tok/s':>12} "
          f"{'MFU':>6} {'first s':>8} {'setup s':>7} {'load s':>7} {'queued/min':>10} {'vs pad':>7} "
          f"{'q MFU':>6} {'step':>6} {'graphs':>6}")


def print_row(result: dict[str, Any]) -> None:
    ratio, queued_ratio = result.get("chat_passes_vs_padded"), result.get("queued_chat_passes_vs_padded")
    mfu = f"{result['mfu']:.1%}" if result["mfu"] is not None else "-"
    queued_mfu = f"{result['queued_mfu']:.1%}" if result.get("queued_mfu") is not None else "-"
    step_mfu = f"{result['queued_step_mfu']:.1%}" if result.get("queued_step_mfu") is not None else "-"
    graphs = result.get("step_graphs_captured")
    print(f"{result['variant']:<22} {result['chats_per_step']:>7.1f} {result['step_s_median']:>8.3f} "
          f"{result['chat_passes_per_min']:>10,.0f} {f'{ratio:.2f}x' if ratio else '-':>7} "
          f"{result['valid_block_tokens_per_s']:>12,.0f} {mfu:>6} {result['first_step_s']:>8.1f} "
          f"{result['setup_s']:>7.1f} {result.get('load_s_median', float('nan')):>7.3f} "
          f"{result.get('queued_chat_passes_per_min', float('nan')):>10,.0f} "
          f"{f'{queued_ratio:.2f}x' if queued_ratio else '-':>7} {queued_mfu:>6} {step_mfu:>6} "
          f"{'-' if graphs is None else graphs:>6}", flush=True)


def add_ratios(results: list[dict[str, Any]]) -> None:
    """Each variant's chat-passes per minute over the padded variant's of the same run (when it ran), with
    steps waited for one by one and with steps queued back to back as `fit` runs them."""
    padded = next((r for r in results if r["variant"] == "padded"), None)
    for result in results:
        for key in ("chat_passes_per_min", "queued_chat_passes_per_min"):
            ratio = result[key] / padded[key] if padded and result.get(key) and padded.get(key) else None
            result[key.replace("_per_min", "_vs_padded")] = ratio


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", type=Path, default=None)
    parser.add_argument("--prepared", type=Path, default=None)
    parser.add_argument("--chats", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--num-anchors", type=int, default=TrainingConfig.num_anchors)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--recipe", type=Path, default=None, help="a recipe YAML every variant starts from")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a setting over the variant's own (repeatable), e.g. training.optimizer=muon")
    parser.add_argument("--profile", action="store_true", help="also profile 3 steps of each variant")
    parser.add_argument("--tiny", action="store_true", help="a tiny Llama and short chats: a CPU smoke test")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # run one variant here (child process)
    args = parser.parse_args(argv)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="dflash_pack_"))
    if args.one:
        result = run_variant(args.one, args.target, args.prepared, work, args)
        print(RESULT_PREFIX + json.dumps(result), flush=True)
        return
    target = args.target or work / "target"
    if args.target is None and not (target / "tokenizer.json").exists():
        save_smollm2_shaped_target(target, args.tiny)
    prepared = args.prepared or work / "prepared"
    if args.prepared is None and not (prepared / "dflash_data.json").exists():
        save_synthetic_chats(prepared, args.chats, target, args.tiny)
    print(f"\nTraining layouts, SmolLM2 shapes, N={args.num_anchors} anchors per chat, {args.steps} steps each")
    print(HEADER, flush=True)
    results, failed, path = [], [], None
    names = [name.strip() for name in args.variants.split(",")]
    unknown = [name for name in names if name not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}: choose from {', '.join(VARIANTS)}")
    for name in names:
        result = launch(name, args, target, prepared, work)
        if "errors" in result:
            failed.append(result)
        else:
            results.append(result)
            add_ratios(results)
            print_row(result)
            if "profile" in result:
                print_profile(result)
        # Written after every variant: a run cut short by a time limit keeps what it measured.
        path = write_result("train_packing", {"config": {k: str(v) for k, v in vars(args).items()},
                                              "results": results, "failed": failed,
                                              "goal": ">= 4x the padded path's chat-passes per minute"},
                            smoke=args.tiny)
    if not results:
        raise SystemExit("train_packing: no variant finished (their errors are above and in the results file)")
    print(f"\nAll variants, chat-passes per minute against the padded rows of this run:\n{HEADER}")
    for result in results:
        print_row(result)
    for failure in failed:
        print(f"{failure['variant']}: failed (exit {failure['exit']}): {'; '.join(failure['errors'])}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
