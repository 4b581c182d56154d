"""Regeneration through the runtime at large batch with row refill, against Hugging Face `generate` at the
same batch and against the runtime at the old default settings, on the same prompts (one GPU).

    python -m benchmarks.regenerate --target DIR         # writes benchmarks/results/regenerate.json
    python -m benchmarks.regenerate --target DIR --rows 256,512 --prompts 2048 --max-new-tokens 512
    python -m benchmarks.regenerate --quick --target DIR  # tiny sizes, seconds on a CPU: a check of the script

Workload: `--prompts` chat prompts (`--data`, a .jsonl of {"prompt": ...} rows, by default the bundled demo
prompts, repeated with a number appended so that repeats differ), encoded with the target's chat template,
answered greedily with the target's own stop ids, up to `--max-new-tokens` tokens each: answers end at
different points, as in a real regeneration. Variants, all on the same prompts:
- the runtime at each of `--rows` rows (default 256 and 512), refilled in prefill waves (its default);
- the runtime at the old default settings: `--baseline-rows` (64) rows and no refill (the next 64 prompts
  start when all 64 have finished), the same-run baseline;
- Hugging Face `generate` at the batch of each `--rows` variant, on the first `--hf-batches` batches of the
  prompts (it is slow: its tokens/s come from those).
The runtime is warmed up (compilation, CUDA graph capture) before it is timed, `generate` on a short call.
Reported per variant: generated tokens (stop tokens not counted), seconds, tokens/s, and how many answers
equal those of the baseline (bf16 kernels of other batch shapes may break near-ties differently).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import write_result
from dflash_train.eval.chat import prompt_ids
from dflash_train.runtime.config import EngineConfig, stop_token_ids
from dflash_train.runtime.generation import Generated, Generator, hf_generate
from dflash_train.target import TargetModel

DEMO_PROMPTS = Path(__file__).resolve().parents[1] / "data" / "prompts" / "demo_prompts.jsonl"
QUICK = {"rows": "4,8", "baseline_rows": 2, "prompts": 12, "max_new_tokens": 8, "hf_batches": 1}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="smollm2-135m-instruct", help="alias, local directory or .gguf")
    parser.add_argument("--data", type=Path, default=DEMO_PROMPTS, help='a .jsonl of {"prompt": ...} rows')
    parser.add_argument("--prompts", type=int, default=2048, help="prompts answered by each variant")
    parser.add_argument("--max-new-tokens", type=int, default=512)
    parser.add_argument("--rows", default="256,512", help="rows of the runtime variants (comma-separated)")
    parser.add_argument("--baseline-rows", type=int, default=64, help="rows of the old default (no refill)")
    parser.add_argument("--hf-batches", type=int, default=1, help="batches timed through `generate`")
    parser.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile of the decode step")
    parser.add_argument("--quick", action="store_true", help=f"tiny sizes for a CPU check: {QUICK}")
    args = parser.parse_args(argv)
    if args.quick:
        for name, value in QUICK.items():
            setattr(args, name, value)
    return args


def load_prompts(target: TargetModel, path: Path, count: int) -> list[list[int]]:
    texts = [json.loads(line)["prompt"] for line in path.read_text().splitlines() if line.strip()]
    numbered = [texts[i % len(texts)] + (f" ({i // len(texts) + 1})" if i >= len(texts) else "") for i in range(count)]
    return [prompt_ids(target.tokenizer, [{"role": "user", "content": text}], thinking=False) for text in numbered]


def timed(fn: Callable[[], Any], device: torch.device) -> tuple[float, Any]:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    started = time.perf_counter()
    result = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - started, result


def runtime_config(target: TargetModel, prompts: list[list[int]], rows: int, refill: bool,
                   args: argparse.Namespace) -> EngineConfig:
    """No refill: waves of all the rows, so a batch starts only once every row of the last one finished."""
    longest = max(len(p) for p in prompts)
    stops = tuple(stop_token_ids(target.tokenizer, target.model.generation_config))
    no_refill = {} if refill else {"prefill_rows": rows, "prefill_tokens": rows * longest}
    return EngineConfig(batch_size=rows, block_size=1, max_new_tokens=args.max_new_tokens,
                        max_length=longest + args.max_new_tokens + 1, stop_token_ids=stops,
                        compile=False if args.no_compile else None, **no_refill)  # type: ignore[arg-type]


def run_runtime(target: TargetModel, prompts: list[list[int]], rows: int, refill: bool,
                args: argparse.Namespace) -> tuple[dict[str, Any], list[Generated]]:
    generator = Generator(target, runtime_config(target, prompts, rows, refill, args))
    assert generator.engine is not None, "the runtime does not support this target"
    setup_s, _ = timed(lambda: generator.generate(prompts[:2], [0, 0]), target.device)  # compile, capture
    seconds, outputs = timed(lambda: generator.generate(prompts, [0] * len(prompts)), target.device)
    return row("runtime" if refill else "runtime (old default)", rows, "waves" if refill else "none", outputs,
               seconds) | {"setup_s": setup_s, "cuda_graph": generator.engine.uses_cuda_graph,
                           "compiled": generator.engine.uses_compile, "kernels": generator.engine.kernels}, outputs


def run_hf(target: TargetModel, prompts: list[list[int]], rows: int,
           args: argparse.Namespace) -> tuple[dict[str, Any], list[Generated]]:
    config = runtime_config(target, prompts, rows, True, args)
    pad = target.tokenizer.pad_token_id if target.tokenizer.pad_token_id is not None else 0
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
            "seconds": seconds, "tokens_per_s": tokens / seconds}


def same_answers(outputs: list[Generated], reference: list[Generated]) -> int:
    return sum(a == b for a, b in zip(outputs, reference, strict=False))


def print_table(results: list[dict[str, Any]], title: str) -> None:
    print(f"\n{title}")
    print(f"{'variant':<22} {'rows':>5} {'refill':>6} {'prompts':>7} {'tokens':>9} {'seconds':>8} {'tokens/s':>10} "
          f"{'x baseline':>10} {'same answers':>13}")
    for r in results:
        print(f"{r['variant']:<22} {r['rows']:>5} {r['refill']:>6} {r['prompts']:>7} {r['tokens']:>9,} "
              f"{r['seconds']:>8.2f} {r['tokens_per_s']:>10,.0f} {r['vs_baseline']:>9.2f}x "
              f"{r['same_answers']:>6}/{r['prompts']}")


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    from dflash_train.target import load_target

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    target = load_target(args.target, dtype=dtype, device=device)
    prompts = load_prompts(target, args.data, args.prompts)
    rows = [int(r) for r in args.rows.split(",")]
    baseline, reference = run_runtime(target, prompts, args.baseline_rows, False, args)
    results = [baseline]
    for batch in rows:
        result, outputs = run_runtime(target, prompts, batch, True, args)
        hf, hf_outputs = run_hf(target, prompts, batch, args)
        results += [result | {"same_answers": same_answers(outputs, reference)},
                    hf | {"same_answers": same_answers(hf_outputs, reference)}]
    baseline["same_answers"] = len(prompts)
    for r in results:
        r["vs_baseline"] = r["tokens_per_s"] / baseline["tokens_per_s"]
    title = (f"regeneration, {args.target} {str(dtype).removeprefix('torch.')} on {device.type}, greedy, "
             f"{len(prompts)} prompts, up to {args.max_new_tokens} new tokens")
    print_table(results, title)
    payload = {"config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
               "workload": title, "results": results}
    path = write_result("regenerate", payload)
    print(f"wrote {path}")
    return payload


if __name__ == "__main__":
    main()
