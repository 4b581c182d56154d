"""The split-key attention kernel (`dflash_train.kernels.static_attention`) under other plans: how a launch
cuts the keys into splits (tiles a split), warps a split program, keys a tile and query rows a program, at a
decode step (1 query token) and a verify block (16), at Qwen3-8B's heads (32 query, 8 KV, D 128) and
SmolLM2-135M's (9, 3, 64):

    python -m benchmarks.static_attention                    # both shapes, every plan (about 4 minutes)
    python -m benchmarks.static_attention --shape smollm2 --out /tmp/attention.json

`merge_in_split` plans (the partial results merged by the last split program of each row, no second
launch) are timed for the three fastest plans and the default.

Why: in a Qwen3-8B-shaped DFlash cycle the 16-token verify's attention took about twice a decode step's
over the same 1,024 slots, in each of 41 layers (target and drafter), while the cache it reads is 4 MB a
layer, a small fraction of that time at the memory bandwidth (docs/benchmarks.md, 'Where the cycle's time
went').

How: a layer's call is timed as a CUDA graph of one call per layer over that many distinct caches (or more,
until they hold twice the L2, so that each call reads its cache from memory as in a step), median of the
replays per call; the default plan (`default_plan`) is the baseline, in the same run. Every plan's output is
checked against the fp32 reference (`max_error`).
"""

from __future__ import annotations

import argparse
import itertools
import json
import pathlib
from dataclasses import dataclass
from typing import Any

import torch

from benchmarks.common import RESULTS_DIR, graph_us, stamp
from dflash_train.kernels import static_attention as sa

# shape -> (query heads, KV heads, head dim, layers a step)
SHAPES = {"qwen3-8b": (32, 8, 128, 36), "smollm2": (9, 3, 64, 30)}
TOKENS = (1, 16)
TILES_PER_SPLIT = (1, 2, 4, 8)
WARPS = (2, 4, 8)
BLOCK_NS = (32, 64, 128)
QUERY_ROWS = (0, 16, 32)  # 0: a KV head's every query row in one program
REPEATS = 200  # calls of a merging plan compared bit for bit with its first
OUT_OF_L2_BYTES = 128 * 2**20  # the caches of one graph together: twice the H200's L2


def plans(keys: int, rows: int) -> list[sa.Plan]:
    """Every (tiles a split, warps, tile width, query rows a program) candidate whose split fits the cache at
    least once, at a launch of `rows` query rows a KV head (padded)."""
    candidates = []
    for tiles, warps, block_n, query_rows in itertools.product(TILES_PER_SPLIT, WARPS, BLOCK_NS, QUERY_ROWS):
        split_len = tiles * block_n
        if split_len < 2 * keys and query_rows < rows:
            candidates.append(sa.Plan(split_len, warps, block_n, query_rows))
    return candidates


@dataclass
class Case:
    """One (shape, tokens) launch: a query block, distinct caches to read from memory, the reference output,
    and the counters a merging plan needs (zeroed; each launch leaves them so)."""

    q: torch.Tensor
    caches: list[tuple[torch.Tensor, torch.Tensor]]
    bounds: torch.Tensor
    scale: float
    expected: torch.Tensor
    counters: torch.Tensor

    def row(self, plan: sa.Plan, replays: int) -> dict[str, Any]:
        """The plan's µs a call over every cache in one graph, and its largest error against the reference."""
        def call(k: torch.Tensor, v: torch.Tensor) -> Any:
            return lambda: sa.static_attention_planned(self.q, k, v, self.bounds, self.scale, plan, self.counters)

        out = sa.static_attention_planned(self.q, *self.caches[0], self.bounds, self.scale, plan, self.counters)
        us = graph_us([call(k, v) for k, v in self.caches], replays)
        length = self.caches[0][0].shape[2]
        row = {**plan._asdict(), "splits": -(-length // plan.split_len), "us": us,
               "max_error": float((out.float() - self.expected).abs().max())}
        if plan.merge_in_split:  # a missed acquire/release would show as a call that differs from the first
            row["repeatable"] = all(torch.equal(call(*self.caches[0])(), out) for _ in range(REPEATS))
        return row


def make_case(shape: str, tokens: int, context: int, length: int) -> Case:
    heads, kv_heads, dim, layers = SHAPES[shape]
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    copies = max(layers, -(-OUT_OF_L2_BYTES // (2 * kv_heads * length * dim * 2)))  # read from HBM, as in a step
    caches = [(torch.randn(1, kv_heads, length, dim, device="cuda", dtype=torch.bfloat16, generator=gen),
               torch.randn(1, kv_heads, length, dim, device="cuda", dtype=torch.bfloat16, generator=gen))
              for _ in range(copies)]
    q = torch.randn(1, tokens, heads, dim, device="cuda", dtype=torch.bfloat16, generator=gen).transpose(1, 2)
    positions = torch.arange(context, context + tokens, device="cuda")[None]
    bounds, scale = sa.bounds_from_positions(positions, None), dim ** -0.5
    expected = sa.static_attention_reference(q, *caches[0], bounds, scale).float()
    counters = torch.zeros(kv_heads * 8, dtype=torch.int32, device="cuda")  # up to 8 query-row tiles a KV head
    return Case(q, caches, bounds, scale, expected, counters)


def measure(shape: str, tokens: int, context: int, length: int, replays: int) -> dict[str, Any]:
    """Every plan at one (shape, tokens): µs a call, error against the fp32 reference, and the default's;
    then the three fastest and the default again with the merge done by the split kernel's last program."""
    heads, kv_heads, dim, _ = SHAPES[shape]
    case = make_case(shape, tokens, context, length)
    block_m = sa.query_rows(heads, kv_heads, tokens)
    processors = torch.cuda.get_device_properties(0).multi_processor_count
    default = sa.default_plan(kv_heads, length, block_m, processors, dim)
    rule = sa.default_plan(kv_heads, length, block_m, processors)  # the plan without the tuned table
    rows = [case.row(plan, replays) for plan in plans(length, block_m)]

    def row_of(plan: sa.Plan) -> dict[str, Any]:
        return next(row for row in rows if plan_of(row) == plan)

    base, untuned, best = row_of(default), row_of(rule), min(rows, key=lambda row: row["us"])
    fastest = sorted(rows, key=lambda row: row["us"])[:3]
    merged = [case.row(plan._replace(merge_in_split=True), replays)
              for plan in dict.fromkeys([plan_of(row) for row in fastest] + [default])]
    return {"shape": shape, "tokens": tokens, "heads": heads, "kv_heads": kv_heads, "head_dim": dim,
            "context": context, "cache_length": length, "default": base, "untuned": untuned, "best": best,
            "best_over_default": best["us"] / base["us"], "default_over_untuned": base["us"] / untuned["us"],
            "best_merged": min(merged, key=lambda row: row["us"]), "plans": rows + merged}


def plan_of(row: dict[str, Any]) -> sa.Plan:
    return sa.Plan(*(row[name] for name in sa.Plan._fields))


def plan_text(row: dict[str, Any]) -> str:
    return ", ".join(str(row[name]) for name in sa.Plan._fields)


def table(results: list[dict[str, Any]]) -> str:
    lines = ["| shape | tokens | untuned rule (split, warps, tile, rows, merged) | µs | default (tuned table) | µs | "
             "best plan | µs | best merging in its split kernel | µs | default / rule | best / default |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for entry in results:
        rule, base, best, merged = entry["untuned"], entry["default"], entry["best"], entry["best_merged"]
        lines.append(f"| {entry['shape']} | {entry['tokens']} | {plan_text(rule)} | {rule['us']:.2f} | "
                     f"{plan_text(base)} | {base['us']:.2f} | {plan_text(best)} | {best['us']:.2f} | "
                     f"{plan_text(merged)} | {merged['us']:.2f} | "
                     f"{entry['default_over_untuned']:.2f} | {entry['best_over_default']:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.static_attention", description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=[*SHAPES, "all"], default="all")
    parser.add_argument("--context", type=int, default=1024, help="slots before the new tokens")
    parser.add_argument("--length", type=int, default=1280, help="the static cache's slots")
    parser.add_argument("--replays", type=int, default=50)
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS_DIR / "static_attention.json")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.exit(2, f"{parser.prog}: error: needs a CUDA GPU (the kernel's CPU checks are tests/kernels)\n")
    shapes = list(SHAPES) if args.shape == "all" else [args.shape]
    results = []
    for shape, tokens in itertools.product(shapes, TOKENS):
        results.append(measure(shape, tokens, args.context, args.length, args.replays))
        print(f"static_attention: {shape} T={tokens}: default {results[-1]['default']['us']:.2f} µs, "
              f"best {results[-1]['best']['us']:.2f} µs {results[-1]['best']}", flush=True)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({**stamp(), "results": results}, indent=2) + "\n")
    print(table(results))
    return results


if __name__ == "__main__":
    main()
