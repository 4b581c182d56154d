"""Regeneration through the runtime at large batch with row refill, against Hugging Face `generate` at the
same batch and against the runtime at the old default settings, on the same prompts (one GPU).

    python -m benchmarks.regenerate --target DIR         # writes benchmarks/results/regenerate.json
    python -m benchmarks.regenerate --target DIR --rows 256,512 --prompts 2048 --max-new-tokens 512
    python -m benchmarks.regenerate --quick --target DIR  # tiny sizes, seconds on a CPU: a check of the script
    python -m benchmarks.regenerate --random-shape qwen3-8b  # writes benchmarks/results/regenerate-qwen3-8b.json

Workload: `--prompts` chat prompts (`--data`, a .jsonl of {"prompt": ...} rows or a `pack` prompt file, whose
rows' first user turns are taken; by default the bundled demo prompts, repeated with a number appended so
that repeats differ), encoded with the target's chat template, answered greedily with the target's own
stop ids, up to `--max-new-tokens` tokens each: answers end at different points, as in a real regeneration. Variants, all on the same prompts:
- the runtime at each of `--rows` rows (default 256 and 512), refilled in prefill waves (its default);
- the runtime at the old default settings: `--baseline-rows` (64) rows and no refill (the next 64 prompts
  start when all 64 have finished), the same-run baseline;
- Hugging Face `generate` at the batch of each `--rows` variant, on the first `--hf-batches` batches of the
  prompts (it is slow: its tokens/s come from those; 0 leaves it out).
`--stop-loops` ends the runtime variants' answers inside a verbatim loop, as the speedrun regenerates
(`regenerate --stop-loops`; the baseline still decodes them to the cap): answers end earlier, so answers/s is
the figure that counts, and tokens/s falls as a larger share of the time goes to prefilling the next prompts.
A loop-stopped answer counts as the same answer when it is the start of the baseline's.
The runtime is warmed up (compilation, CUDA graph capture) before it is timed, `generate` on a short call.
Reported per variant: generated tokens (stop tokens not counted), seconds, tokens/s, tokens/s over the
baseline's and over `generate`'s at the same rows (where it ran at those rows), and how many answers equal
those of the baseline (bf16 kernels of other batch shapes may break near-ties differently). The last line
is a verdict on the goal: the runtime's best tokens/s >= 120k for the chat target.

`--random-shape qwen3-8b` (`tiny-qwen3`: the CPU check) measures a target of that shape with random weights
instead (bf16 on CUDA, built on the device; nothing is downloaded), for the goal ">= 3x HF generate at equal
batch" (the verdict: the best ratio of the runtime variants). A random model has no meaningful chat template,
so its prompts are `--prompts` random token ids, their lengths drawn (seeded) between `--min-prompt` and
`--max-prompt`, and it gets no stop ids: every answer runs to `--max-new-tokens`, all of the same length, so
this variant measures decode throughput, not early finishes (refill only changes when the prefills run).
The weights are Hugging Face's initialisation (normal, std 0.02), whose 36-layer bf16 logits stay finite (the
script checks one prompt's before timing); greedy picks the first of tied maxima in both paths (torch.argmax).
Defaults of this mode where the command line sets none: 256 prompts, `--rows 64,256`, 128 new tokens,
`--hf-batches 1`: 256 x 128 = 32,768 tokens per variant, which decode in seconds; most of a run is each
engine's torch.compile and CUDA-graph warm-up, so it takes minutes in all (docs/benchmarks.md, `regenerate`,
'At Qwen3-8B's shape').
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import write_result
from benchmarks.shapes import QWEN3_8B, TINY_QWEN3, random_target
from dflash_train.data.prompt_ids import prompt_ids
from dflash_train.regeneration.generation import Generated, Generator, hf_generate
from dflash_train.runtime.config import EngineConfig, stop_token_ids
from dflash_train.target import TargetModel

DEMO_PROMPTS = Path(__file__).resolve().parents[1] / "data" / "prompts" / "demo_prompts.jsonl"
QUICK = {"rows": "4,8", "baseline_rows": 2, "prompts": 12, "max_new_tokens": 8, "hf_batches": 1}
RANDOM_SHAPES = {"qwen3-8b": QWEN3_8B, "tiny-qwen3": TINY_QWEN3}
# Defaults where the command line sets none. The random 8B's are smaller: `generate` there is far slower per
# step than on SmolLM2, and its answers all run to the end, so 2048 x 512 tokens would take hours.
DEFAULTS = {"prompts": 2048, "max_new_tokens": 512, "rows": "256,512", "hf_batches": 1}
RANDOM_DEFAULTS = {"prompts": 256, "max_new_tokens": 128, "rows": "64,256", "hf_batches": 1}
TOKENS_PER_S_GOAL = 120_000  # the chat target's regeneration (SmolLM2-135M, one H200)
HF_RATIO_GOAL = 3.0  # the random Qwen3-8B's runtime over `generate` at equal batch


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="smollm2-135m-instruct", help="alias, local directory or .gguf")
    parser.add_argument("--data", type=Path, default=DEMO_PROMPTS,
                        help='a .jsonl of {"prompt": ...} rows, or a prompt file of `dflash_train.prompts.pack`')
    parser.add_argument("--prompts", type=int, help=f"prompts answered by each variant (default {DEFAULTS['prompts']}; "
                        f"random shape: {RANDOM_DEFAULTS['prompts']})")
    parser.add_argument("--max-new-tokens", type=int, help=f"default {DEFAULTS['max_new_tokens']}; random shape: "
                        f"{RANDOM_DEFAULTS['max_new_tokens']}")
    parser.add_argument("--rows", help=f"rows of the runtime variants, comma-separated (default {DEFAULTS['rows']}; "
                        f"random shape: {RANDOM_DEFAULTS['rows']})")
    parser.add_argument("--baseline-rows", type=int, default=64, help="rows of the old default (no refill)")
    parser.add_argument("--hf-batches", type=int, help="batches timed through `generate` (default 1; 0: none)")
    parser.add_argument("--stop-loops", action="store_true",
                        help="the runtime variants end answers inside a verbatim loop, as the speedrun does")
    parser.add_argument("--random-shape", choices=sorted(RANDOM_SHAPES),
                        help="a target of this shape with random weights, on random-token prompts (see above; "
                        "--target and --data unused)")
    parser.add_argument("--min-prompt", type=int, default=32, help="random shape: shortest prompt, in tokens")
    parser.add_argument("--max-prompt", type=int, default=512, help="random shape: longest prompt, in tokens")
    parser.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile of the decode step")
    parser.add_argument("--quick", action="store_true", help=f"tiny sizes for a CPU check: {QUICK}")
    args = parser.parse_args(argv)
    defaults = QUICK if args.quick else RANDOM_DEFAULTS if args.random_shape else DEFAULTS
    for name, value in defaults.items():
        if args.quick or getattr(args, name) is None:
            setattr(args, name, value)
    return args


def load_prompts(target: TargetModel, path: Path, count: int) -> list[list[int]]:
    texts = [_first_user_turn(json.loads(line), path) for line in path.read_text().splitlines() if line.strip()]
    numbered = [texts[i % len(texts)] + (f" ({i // len(texts) + 1})" if i >= len(texts) else "") for i in range(count)]
    return [prompt_ids(target.tokenizer, [{"role": "user", "content": text}], thinking=False) for text in numbered]


def _first_user_turn(row: dict[str, Any], path: Path) -> str:
    """A row's prompt: its "prompt", or the first user turn of its "messages" (a `dflash_train.prompts.pack`
    file, so that the benchmark answers the very prompts a regeneration would)."""
    if isinstance(row.get("prompt"), str):
        return row["prompt"]
    turns = [m.get("content") for m in row.get("messages") or () if isinstance(m, dict) and m.get("role") == "user"]
    if turns and isinstance(turns[0], str):
        return turns[0]
    raise ValueError(f"{path}: a row has neither a \"prompt\" string nor a user turn in \"messages\"")


def random_prompts(count: int, vocab_size: int, shortest: int, longest: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(shortest, longest + 1, (count,), generator=generator).tolist()
    return [torch.randint(0, vocab_size, (n,), generator=generator).tolist() for n in lengths]


def load_workload(args: argparse.Namespace, device: torch.device,
                  dtype: torch.dtype) -> tuple[TargetModel, list[list[int]]]:
    if args.random_shape:
        shape = RANDOM_SHAPES[args.random_shape]
        target = random_target("qwen3", shape, device, dtype)
        prompts = random_prompts(args.prompts, shape["vocab_size"], args.min_prompt, args.max_prompt)
        check_finite(target, prompts[0])
        return target, prompts
    from dflash_train.target import load_target

    target = load_target(args.target, dtype=dtype, device=device)
    return target, load_prompts(target, args.data, args.prompts)


@torch.no_grad()
def check_finite(target: TargetModel, prompt: list[int]) -> None:
    """NaN or inf logits would make every greedy pick an artifact; random deep bf16 models can overflow."""
    logits = target.model(torch.tensor([prompt], device=target.device)).logits
    if not torch.isfinite(logits).all():
        raise RuntimeError("the random target's logits are not finite; its weights need a smaller std")


def stop_ids(target: TargetModel, args: argparse.Namespace) -> tuple[int, ...]:
    """None for a random target: its answers all run to the end (see the module docstring)."""
    if args.random_shape:
        return ()
    return tuple(stop_token_ids(target.tokenizer, target.model.generation_config))


def timed(fn: Callable[[], Any], device: torch.device) -> tuple[float, Any]:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    started = time.perf_counter()
    result = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - started, result


def runtime_config(target: TargetModel, prompts: list[list[int]], rows: int, refill: bool,
                   args: argparse.Namespace, stop_loops: bool = False) -> EngineConfig:
    """No refill: waves of all the rows, so a batch starts only once every row of the last one finished."""
    longest = max(len(p) for p in prompts)
    stops = stop_ids(target, args)
    no_refill = {} if refill else {"prefill_rows": rows, "prefill_tokens": rows * longest}
    return EngineConfig(batch_size=rows, block_size=1, max_new_tokens=args.max_new_tokens,
                        max_length=longest + args.max_new_tokens + 1, stop_token_ids=stops,
                        compile=False if args.no_compile else None, stop_loops=stop_loops,
                        **no_refill)  # type: ignore[arg-type]


def run_runtime(target: TargetModel, prompts: list[list[int]], rows: int, refill: bool,
                args: argparse.Namespace) -> tuple[dict[str, Any], list[Generated]]:
    loops = args.stop_loops and refill  # the baseline is the old default: every answer to its end
    generator = Generator(target, runtime_config(target, prompts, rows, refill, args, stop_loops=loops))
    assert generator.engine is not None, "the runtime does not support this target"
    setup_s, _ = timed(lambda: generator.generate(prompts[:2], [0, 0]), target.device)  # compile, capture
    seconds, outputs = timed(lambda: generator.generate(prompts, [0] * len(prompts)), target.device)
    name = ("runtime, loops stopped" if loops else "runtime") if refill else "runtime (old default)"
    engine = generator.engine
    return row(name, rows, "waves" if refill else "none", outputs, seconds) | {
        "setup_s": setup_s, "cuda_graph": engine.uses_cuda_graph, "compiled": engine.uses_compile,
        "kernels": engine.kernels}, outputs


def run_hf(target: TargetModel, prompts: list[list[int]], rows: int,
           args: argparse.Namespace) -> tuple[dict[str, Any], list[Generated]]:
    config = runtime_config(target, prompts, rows, True, args)
    pad = getattr(target.tokenizer, "pad_token_id", None)  # a random target has no tokenizer
    pad = 0 if pad is None else pad
    subset = prompts[: rows * args.hf_batches]
    hf_generate(target.model, subset[:2], EngineConfig(max_new_tokens=4), pad_id=pad)  # warm-up
    seconds, outputs = timed(lambda: [out for start in range(0, len(subset), rows)
                                      for out in hf_generate(target.model, subset[start: start + rows], config,
                                                             pad_id=pad)], target.device)
    return row("HF generate", rows, "-", outputs, seconds), outputs


def row(variant: str, rows: int, refill: str, outputs: list[Generated], seconds: float) -> dict[str, Any]:
    tokens = sum(len(out.token_ids) for out in outputs)
    # Printed as measured: compiling each variant takes a while, and a run cut short keeps what it measured.
    print(f"regenerate: {variant}, {rows} rows: {tokens:,} tokens in {seconds:.2f} s", flush=True)
    return {"variant": variant, "rows": rows, "refill": refill, "prompts": len(outputs), "tokens": tokens,
            "seconds": seconds, "tokens_per_s": tokens / seconds, "answers_per_s": len(outputs) / seconds,
            "finish_reasons": dict(Counter(getattr(out, "finish_reason", "?") for out in outputs))}


def same_answers(outputs: list[Generated], reference: list[Generated]) -> int:
    """Answers equal to the reference's; one ended inside a loop, when it is the start of the reference's."""
    def same(out: Generated, ref: Generated) -> bool:
        if out.finish_reason == "loop":
            return list(ref.token_ids[: len(out.token_ids)]) == list(out.token_ids)
        return out == ref
    return sum(same(a, b) for a, b in zip(outputs, reference, strict=False))


def add_ratios(results: list[dict[str, Any]], baseline: dict[str, Any]) -> None:
    """tokens/s over the baseline's, and over `generate`'s at the same rows (None where it did not run)."""
    hf = {r["rows"]: r["tokens_per_s"] for r in results if r["variant"] == "HF generate"}
    for r in results:
        r["vs_baseline"] = r["tokens_per_s"] / baseline["tokens_per_s"]
        r["vs_hf"] = r["tokens_per_s"] / hf[r["rows"]] if r["rows"] in hf else None


def print_table(results: list[dict[str, Any]], title: str) -> None:
    print(f"\n{title}")
    print(f"{'variant':<22} {'rows':>5} {'refill':>6} {'prompts':>7} {'tokens':>9} {'seconds':>8} {'tokens/s':>10} "
          f"{'answers/s':>9} {'x baseline':>10} {'x HF':>7} {'same answers':>13}")
    for r in results:
        vs_hf = "-" if r["vs_hf"] is None else f"{r['vs_hf']:.2f}x"
        print(f"{r['variant']:<22} {r['rows']:>5} {r['refill']:>6} {r['prompts']:>7} {r['tokens']:>9,} "
              f"{r['seconds']:>8.2f} {r['tokens_per_s']:>10,.0f} {r['answers_per_s']:>9,.1f} "
              f"{r['vs_baseline']:>9.2f}x {vs_hf:>7} "
              f"{r['same_answers']:>6}/{r['prompts']}")


def verdict(results: list[dict[str, Any]], random_shape: bool) -> tuple[str, str]:
    """The goal, and one line on it from the runtime's best variant (refilled, at one of `--rows`)."""
    runtime = [r for r in results if r["variant"].startswith("runtime") and r["refill"] != "none"]
    if random_shape:
        goal, best = f">= {HF_RATIO_GOAL:g}x HF generate at equal batch", max(runtime, key=lambda r: r["vs_hf"] or 0)
        if best["vs_hf"] is None:
            return goal, f"goal {goal}: not measured (--hf-batches 0)"
        measured, met = f"{best['vs_hf']:.2f}x HF generate", best["vs_hf"] >= HF_RATIO_GOAL
    else:
        goal, best = f">= {TOKENS_PER_S_GOAL // 1000}k tokens/s", max(runtime, key=lambda r: r["tokens_per_s"])
        measured, met = f"{best['tokens_per_s']:,.0f} tokens/s", best["tokens_per_s"] >= TOKENS_PER_S_GOAL
    return goal, f"goal {goal}: {'met' if met else 'NOT met'}, runtime {measured} at {best['rows']} rows"


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    target, prompts = load_workload(args, device, dtype)
    rows = [int(r) for r in args.rows.split(",")]
    baseline, reference = run_runtime(target, prompts, args.baseline_rows, False, args)
    results = [baseline]
    for batch in rows:
        result, outputs = run_runtime(target, prompts, batch, True, args)
        results.append(result | {"same_answers": same_answers(outputs, reference)})
        if args.hf_batches > 0:
            hf, hf_outputs = run_hf(target, prompts, batch, args)
            results.append(hf | {"same_answers": same_answers(hf_outputs, reference)})
    baseline["same_answers"] = len(prompts)
    add_ratios(results, baseline)
    title = workload_title(args, dtype, device, len(prompts))
    print_table(results, title)
    goal, line = verdict(results, bool(args.random_shape))
    payload = {"config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
               "workload": title, "goal": goal, "verdict": line, "results": results}
    path = write_result(f"regenerate-{args.random_shape}" if args.random_shape else "regenerate", payload,
                        smoke=args.quick)
    print(f"wrote {path}\n{line}")
    return payload


def workload_title(args: argparse.Namespace, dtype: torch.dtype, device: torch.device, prompts: int) -> str:
    kind = f"{str(dtype).removeprefix('torch.')} on {device.type}, greedy"
    if args.random_shape:
        return (f"regeneration, random {args.random_shape} {kind}, {prompts} random-token prompts of "
                f"{args.min_prompt}..{args.max_prompt} tokens, {args.max_new_tokens} new tokens each (no stop ids)")
    return f"regeneration, {args.target} {kind}, {prompts} prompts, up to {args.max_new_tokens} new tokens"


if __name__ == "__main__":
    main()
