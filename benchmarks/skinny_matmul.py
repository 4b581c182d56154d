"""The skinny-matmul kernel (`dflash_train.kernels.skinny_matmul`) against cuBLAS at Qwen3-8B's decode
products (fused qkv, o_proj, gate_up, down, lm_head; `--shape smollm2`: SmolLM2-135M's; `--shape qwen3-30b-a3b`:
that MoE's attention, router and head products), at 1 row (a decode step at batch 1) and 16 (a verify
block), bf16, on one GPU:

    python -m benchmarks.skinny_matmul                   # the kernel's table against cuBLAS, and the checks
    python -m benchmarks.skinny_matmul --sweep           # + every candidate tiling per shape (a few minutes)
    python -m benchmarks.skinny_matmul --sweep --shape smollm2 --budget-s 60 --out benchmarks/results/skinny_matmul-smollm2.json
    python -m benchmarks.skinny_matmul --options         # + what each folded-in operation of the fused path costs
    python -m benchmarks.skinny_matmul --pdl             # + each product launched as a programmatic dependent launch

A product is timed as a CUDA graph of calls over several copies of its weight, together larger than the
L2, so that each call reads its weight from HBM as in a decode step, with no launch gap between calls; the
median of the graph's replays per call, and the weight's bytes over that time (`*_tb_s`). The sweep ranks
tilings by their time at 1 row plus at 16 (one tiling serves both: batch invariance) and prints a table to
paste into `CONFIGS`. Checks, with the tilings in force: the error against an fp32 product; row 0 bitwise
the same alone, among 16 rows and among 40 (eager and under torch.compile); whether cuBLAS's is.

`--options` times, per product, the operations the fused decode path (`skinny_fused`) folds into it, each
against the plain product in the same run: the RMSNorm prologue (NORM) on q/k/v, gate/up and lm_head, the
SwiGLU epilogue (SWIGLU) on gate/up and the residual add (RESIDUAL) on o_proj and down, each at the tiling
the runtime gives it; the NORM options again with other tilings of the norm pass ("NORM@512x8": tiles 512
wide, 8 in flight; `Config.norm_k`, `norm_stages`), since that pass is what the norm costs; and the norm's
statistics carried instead: o_proj and down writing each row's sums of squares by output tile (STATS_OUT),
the norm products reading them (STATS_IN) in place of their pass. The extra µs of an option, against the
separate kernel it replaces (a launch of its own, with its latency), says whether folding it in pays.

`--pdl` times each product's chain again with every call a programmatic dependent launch (sm_90+): a call
starts while the one before it ends and asks L2 for its first weight tiles until x is ready, which may
hide the few µs each small product loses to starting up (experimental; the runtime does not launch so).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import pathlib
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.common import RESULTS_DIR, stamp
from benchmarks.common import graph_us as common_graph_us
from dflash_train.kernels import skinny_matmul as sm

QWEN3_8B_PRODUCTS = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (24576, 4096),
                     "down": (4096, 12288), "lm_head": (151936, 4096)}
# SmolLM2-135M's: products of a few µs each, where a kernel's latency counts for more than its bandwidth
SMOLLM2_PRODUCTS = {"qkv": (960, 576), "o_proj": (576, 576), "gate_up": (3072, 576), "down": (576, 1536),
                    "lm_head": (49152, 576)}
# Qwen3-30B-A3B's dense products (its experts run on their own kernel, `decode_experts`): the attention's and
# the router's, which cuBLAS runs well below the bandwidth at one row (docs/benchmarks.md, `any_target`)
QWEN3_30B_A3B_PRODUCTS = {"qkv": (5120, 2048), "o_proj": (2048, 4096), "router": (128, 2048),
                          "lm_head": (151936, 2048)}
SHAPES = {"qwen3-8b": QWEN3_8B_PRODUCTS, "smollm2": SMOLLM2_PRODUCTS, "qwen3-30b-a3b": QWEN3_30B_A3B_PRODUCTS}
ROWS = (1, 16)
SPLITS = (2, 4, 8)  # K slices tried on each shape's three best whole-K tilings
L2_BYTES = 60 * 2**20  # the H200's (50 MB on an H100): the copies of a weight together hold 4x this
SHARED_BYTES = 227 * 2**10  # shared memory a program may take on Hopper


def candidates(k: int = 4096) -> list[sm.Config]:
    """Tilings whose pipeline fits in shared memory (weight and x tiles, `num_stages` deep); for a short K
    (SmolLM2's 576) also steps of 64, and shallower pipelines, which a K of a few steps may prefer."""
    configs = []
    steps = (64, 128, 256, 512) if k <= 2048 else (128, 256, 512)
    depths = (2, 3, 4) if k <= 2048 else (3, 4)
    for block_n, block_k, warps, stages in itertools.product((16, 32, 64, 128), steps, (2, 4, 8), depths):
        if stages * (block_n + sm.BLOCK_M) * block_k * 2 <= SHARED_BYTES:
            configs.append(sm.Config(block_n, block_k, warps, stages))
    return configs


def graph_us(fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], x: torch.Tensor,
             weights: list[torch.Tensor], replays: int) -> float:
    """Median µs per call of `fn(x, w)` for each w, captured as one CUDA graph."""
    return common_graph_us([functools.partial(fn, x, w) for w in weights], replays)


def kernel_fn(config: sm.Config | None, pdl: bool = False) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    def run(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        flags = dict(NORM=False, SWIGLU=False, RESIDUAL=False, HAS_BIAS=False)
        return sm.launch(x, w, w, w, x, 0.0, w.shape[0], flags, config, pdl)

    return run


def cublas(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.linear(x, w)


# Tilings of NORM's pass over x tried beside the product's own ("@WIDTHxSTAGES": Config.norm_k, norm_stages)
NORM_PASSES = ("@512x8", "@1024x4", "@256x16")
# The operations the fused path folds into each product (`skinny_fused`; "+": together)
# and the norm's statistics carried from the residual products (STATS_OUT) to the norm products (STATS_IN),
# which then skip their pass over x (`sm.launch`'s stats_out, stats_in)
FUSED_OPTIONS: dict[str, tuple[str, ...]] = {
    "qkv": ("NORM", *(f"NORM{p}" for p in NORM_PASSES), "NORM+STATS_IN"),
    "o_proj": ("RESIDUAL", "RESIDUAL+STATS_OUT"),
    "gate_up": ("SWIGLU", "NORM", "NORM+SWIGLU", *(f"NORM+SWIGLU{p}" for p in NORM_PASSES), "NORM+SWIGLU+STATS_IN"),
    "down": ("RESIDUAL", "RESIDUAL+STATS_OUT"), "lm_head": ("NORM", *(f"NORM{p}" for p in NORM_PASSES), "NORM+STATS_IN")}
OPTION_FLAGS = ("NORM", "SWIGLU", "RESIDUAL")
CARRIED = ("STATS_IN", "STATS_OUT")  # option parts that are tensors handed to the kernel, not its flags


def option_flags(option: str) -> dict[str, bool]:
    """The kernel's compile-time flags for an option name ("plain", "NORM", "NORM+SWIGLU@512x8", ...)."""
    parts = option_parts(option)
    unknown = parts - set(OPTION_FLAGS) - set(CARRIED)
    if unknown:
        raise ValueError(f"unknown option {', '.join(sorted(unknown))}: use plain or "
                         f"{'+'.join((*OPTION_FLAGS, *CARRIED))} parts")
    if "STATS_IN" in parts and "NORM" not in parts:
        raise ValueError(f"{option}: STATS_IN is the statistics of a NORM product")
    return {**{flag: flag in parts for flag in OPTION_FLAGS}, "HAS_BIAS": False}


def option_parts(option: str) -> set[str]:
    return set(option.partition("@")[0].split("+")) - {"plain"}


def carried_shares(x: torch.Tensor) -> torch.Tensor:
    """What a residual product as wide as x (o_proj's shape: it writes the rows a norm reads) leaves with
    stats_out: each row's sum of squares of x by that product's output tiles, [rows, tiles] fp32."""
    m, k = x.shape
    tiles = sm.stats_width(k, k)
    width = -(-k // tiles)
    padded = F.pad(x.float(), (0, tiles * width - k))
    return padded.pow(2).view(m, tiles, width).sum(-1).contiguous()


def fused_fn(option: str, gamma: torch.Tensor, residuals: dict[int, torch.Tensor], config: sm.Config | None = None,
             shares: dict[int, torch.Tensor] | None = None) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The kernel with `option`'s flags, at `config` or else the tiling the runtime would use; STATS_IN reads
    `shares` of x's rows (`carried_shares`, by rows), made beforehand so that no other kernel is timed;
    STATS_OUT writes its own."""
    flags, parts = option_flags(option), option_parts(option)

    def run(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        n = w.shape[0] // 2 if flags["SWIGLU"] else w.shape[0]
        residual = residuals[x.shape[0]] if flags["RESIDUAL"] else x
        stats_in = shares[x.shape[0]] if "STATS_IN" in parts and shares is not None else None
        if "STATS_IN" in parts and stats_in is None:
            raise ValueError(f"{option}: no shares of x given")
        stats_out = None
        if "STATS_OUT" in parts:  # an allocation, no kernel: free inside a captured graph
            tiles = -(-n // (config or sm.config_for(n, x.shape[1], flags["SWIGLU"])).block_n)
            stats_out = torch.empty(x.shape[0], tiles, device=x.device, dtype=torch.float32)
        return sm.launch(x, gamma, w, w, residual, 1e-6, n, flags, config, stats_in=stats_in, stats_out=stats_out)

    return run


def with_norm_pass(config: sm.Config, option: str) -> sm.Config:
    """`config` with the norm pass's tiling an option names after "@" ("NORM@512x8": 512 wide, 8 in flight)."""
    _, at, spec = option.partition("@")
    if not at:
        return config
    width, _, stages = spec.partition("x")
    return config._replace(norm_k=int(width), norm_stages=int(stages))


def option_costs(name: str, timed: Callable[[str], list[float]]) -> dict[str, dict[str, Any]]:
    """The plain product and each of the product's FUSED_OPTIONS, timed (`timed`: µs at each of ROWS), with
    each option's extra µs over the plain product; an option that fails (a tiling the GPU cannot compile)
    keeps its error and the others go on."""
    plain = timed("plain")
    out: dict[str, dict[str, Any]] = {"plain": {f"m{m}_us": t for m, t in zip(ROWS, plain, strict=True)}}
    for option in FUSED_OPTIONS.get(name, ()):
        try:
            times = timed(option)
        except Exception as error:  # e.g. out of shared memory: a finding, not the end of the run
            out[option] = {"error": f"{type(error).__name__}: {str(error)[:200]}"}
            continue
        out[option] = {**{f"m{m}_us": t for m, t in zip(ROWS, times, strict=True)},
                       **{f"m{m}_extra_us": t - p for m, t, p in zip(ROWS, times, plain, strict=True)}}
    return out


def weight_copies(n: int, k: int, gen: torch.Generator) -> list[torch.Tensor]:
    """Copies of one [n, k] weight together 4x the L2, so that each call reads its copy from HBM."""
    return [torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) * k ** -0.5
            for _ in range(max(2, -(-4 * L2_BYTES // (n * k * 2))))]


def measure_options(name: str, n: int, k: int, replays: int) -> dict[str, Any]:
    gen = torch.Generator(device="cuda").manual_seed(2)
    weights = weight_copies(n, k, gen)
    xs = {m: torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen) for m in ROWS}
    gamma = (torch.rand(k, device="cuda", generator=gen) + 0.5).to(torch.bfloat16)
    residuals = {m: torch.randn(m, n, device="cuda", dtype=torch.bfloat16, generator=gen) for m in ROWS}
    shares = {m: carried_shares(x) for m, x in xs.items()}

    def tiling(option: str) -> sm.Config:  # the runtime's (a SwiGLU product's for its output N / 2 wide)
        swiglu = option_flags(option)["SWIGLU"]  # with the norm pass's of an "@WIDTHxSTAGES" option
        return with_norm_pass(sm.config_for(n // 2 if swiglu else n, k, swiglu), option)

    def timed(option: str, copies: list[torch.Tensor] = weights) -> list[float]:
        run = fused_fn(option, gamma, residuals, tiling(option), shares)
        return [graph_us(run, xs[m], copies, replays) for m in ROWS]

    costs: dict[str, Any] = option_costs(name, timed)
    for option, entry in costs.items():
        entry["config"] = list(tiling(option))
    return costs


def measure_pdl(n: int, k: int, replays: int) -> dict[str, Any]:
    """The product's chain at the table's tiling, plain and as programmatic dependent launches, same run;
    whether both give the same bits."""
    gen = torch.Generator(device="cuda").manual_seed(3)
    weights = weight_copies(n, k, gen)
    xs = {m: torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen) for m in ROWS}
    out: dict[str, Any] = {}
    try:
        for m in ROWS:
            out[f"m{m}_us"] = graph_us(kernel_fn(None), xs[m], weights, replays)
            out[f"m{m}_pdl_us"] = graph_us(kernel_fn(None, pdl=True), xs[m], weights, replays)
        out["same_bits"] = bool(torch.equal(kernel_fn(None, pdl=True)(xs[16], weights[0]),
                                            kernel_fn(None)(xs[16], weights[0])))
    except Exception as error:  # a Triton or driver without programmatic dependent launch: say so, go on
        out["error"] = f"{type(error).__name__}: {str(error)[:200]}"
    return out


def pdl_table(results: dict[str, Any]) -> str:
    """Per product: µs a call plain and as dependent launches, at each of ROWS, and their ratio."""
    rows = [f"{'product':<8} {'rows':>4} {'plain µs':>9} {'PDL µs':>7} {'PDL/plain':>9}  same bits"]
    for name, e in results["products"].items():
        pdl = e.get("pdl")
        if pdl is None:
            continue
        if "error" in pdl:
            rows.append(f"{name:<8} {pdl['error']}")
            continue
        for m in ROWS:
            rows.append(f"{name:<8} {m:>4} {pdl[f'm{m}_us']:>9.1f} {pdl[f'm{m}_pdl_us']:>7.1f} "
                        f"{pdl[f'm{m}_pdl_us'] / pdl[f'm{m}_us']:>9.3f}  {pdl['same_bits']}")
    return "\n".join(rows)


Ranked = list[tuple[float, list[float], sm.Config]]  # (µs summed over ROWS, µs per ROWS, tiling), best first


def sweep_tilings(name: str, configs: list[sm.Config], timed: Callable[[sm.Config], list[float]],
                  budget_s: float | None, clock: Callable[[], float] = time.perf_counter) -> tuple[Ranked, str]:
    """Every tiling of `configs` timed (`timed`: µs at each of ROWS), then K split into SPLITS slices on the
    three best (more programs in flight for a narrow output, a second kernel to add them); stopped once
    `budget_s` seconds have gone (each new tiling compiles: a small K has many candidates, each a few µs
    to time but a second or more to compile), with a note of how far it got (else "")."""
    start, ranked, note = clock(), [], ""

    def over_budget(tried: int, total: int, stage: str) -> bool:
        nonlocal note
        if budget_s is None or clock() - start <= budget_s:
            return False
        note = f"stopped by --budget-s {budget_s:g} after {tried} of {total} {stage}"
        print(f"skinny_matmul: {name}: {note}", flush=True)
        return True

    for tried, config in enumerate(configs):
        if over_budget(tried, len(configs), "whole-K tilings"):
            break
        try:
            times = timed(config)
        except Exception as error:  # out of resources for this tiling: skip it
            print(f"skinny_matmul: {name} {tuple(config)}: {type(error).__name__}", flush=True)
            continue
        ranked.append((sum(times), times, config))
    ranked.sort(key=lambda item: item[0])
    splits = [config._replace(split_k=split) for _, _, config in ranked[:3] for split in SPLITS]
    for tried, config in enumerate(splits):
        if note or over_budget(tried, len(splits), "split-K tilings"):
            break
        times = timed(config)
        ranked.append((sum(times), times, config))
    return sorted(ranked, key=lambda item: item[0]), note


def measure(name: str, n: int, k: int, sweep: bool, replays: int, budget_s: float | None = None) -> dict[str, Any]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    nbytes = n * k * 2
    weights = weight_copies(n, k, gen)
    xs = {m: torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen) for m in ROWS}
    out: dict[str, Any] = {"n": n, "k": k, "copies": len(weights)}
    for m in ROWS:
        out[f"cublas_m{m}_us"] = graph_us(cublas, xs[m], weights, replays)
        out[f"table_m{m}_us"] = graph_us(kernel_fn(None), xs[m], weights, replays)
        for key in ("cublas", "table"):
            out[f"{key}_m{m}_tb_s"] = nbytes / out[f"{key}_m{m}_us"] / 1e6
    out["table_config"] = list(sm.config_for(n, k))
    if sweep:
        def timed(config: sm.Config, copies: list[torch.Tensor] = weights) -> list[float]:
            return [graph_us(kernel_fn(config), xs[m], copies, replays) for m in ROWS]

        ranked, note = sweep_tilings(name, candidates(k), timed, budget_s)
        if note:
            out["sweep_cut"] = note
        out["sweep"] = [{"config": list(config), **{f"m{m}_us": t for m, t in zip(ROWS, times, strict=True)}}
                        for _, times, config in ranked]
        out["best_config"] = list(ranked[0][2])
        for m, t in zip(ROWS, ranked[0][1], strict=True):
            out[f"best_m{m}_us"], out[f"best_m{m}_tb_s"] = t, nbytes / t / 1e6
    del weights
    return out


def checks(n: int, k: int) -> dict[str, Any]:
    """Error against fp32, and row 0's bits alone / among 16 / among 40, eager and compiled; cuBLAS's too."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) * k ** -0.5
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16, generator=gen)
    x = torch.randn(40, k, device="cuda", dtype=torch.bfloat16, generator=gen)
    x16 = torch.randn(16, k, device="cuda", dtype=torch.bfloat16, generator=gen)
    x16[5] = x[0]
    x40 = x.roll(37, dims=0)  # row 0 at index 37, in the third row tile
    exact = x.float() @ w.float().T + b.float()
    y = sm.skinny_matmul_triton(x, w, b)
    alone = sm.skinny_matmul_triton(x[:1], w, b)[0]
    compiled = torch.compile(sm.skinny_matmul_triton, dynamic=False)
    result = {
        "relative_error_vs_fp32": float((y.float() - exact).norm() / exact.norm()),
        "row_invariant_16": bool(torch.equal(sm.skinny_matmul_triton(x16, w, b)[5], alone)),
        "row_invariant_40": bool(torch.equal(sm.skinny_matmul_triton(x40, w, b)[37], alone)),
        "compiled_row_invariant": bool(torch.equal(compiled(x[:1], w, b)[0], alone)
                                       and torch.equal(compiled(x16, w, b)[5], alone)),
        "cublas_row_invariant_16": bool(torch.equal(F.linear(x16, w, b)[5], F.linear(x[:1], w, b)[0])),
    }
    torch._dynamo.reset()
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sweep", action="store_true", help="time every candidate tiling (a few minutes)")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-8b", help="whose products (default qwen3-8b)")
    parser.add_argument("--products", default=None,
                        help=f"comma-separated, of {', '.join(QWEN3_8B_PRODUCTS)} (default: all)")
    parser.add_argument("--replays", type=int, default=20)
    parser.add_argument("--budget-s", type=float, default=None,
                        help="with --sweep: stop trying tilings of a product after this many seconds and rank "
                             "those timed (SmolLM2's products have ~140 candidates, each compiled)")
    parser.add_argument("--options", action="store_true",
                        help="also time the fused path's prologue and epilogues on each product (under a minute)")
    parser.add_argument("--pdl", action="store_true",
                        help="also time each product launched as programmatic dependent launches (sm_90+)")
    parser.add_argument("--out", default=None, help="JSON path (default: benchmarks/results/skinny_matmul.json)")
    args = parser.parse_args(argv)
    products = SHAPES[args.shape]
    unknown = sorted(set((args.products or "").split(",")) - set(products) - {""})
    if unknown:
        parser.error(f"--products: unknown {', '.join(unknown)}; choose from {', '.join(products)}")
    if not torch.cuda.is_available():
        parser.exit(2, "skinny_matmul: needs a CUDA device (the CPU tests run the kernel interpreted)\n")
    path = pathlib.Path(args.out or pathlib.Path(os.environ.get("DFLASH_BENCH_RESULTS", RESULTS_DIR))
                        / "skinny_matmul.json")
    results: dict[str, Any] = {**stamp(), "products": {}}
    results["shape"] = args.shape
    for name in (args.products or ",".join(products)).split(","):
        n, k = products[name]
        entry = results["products"][name] = measure(name, n, k, args.sweep, args.replays, args.budget_s)
        if args.sweep:  # the checks with the best tiling in force
            sm.CONFIGS[(n, k)] = sm.Config(*entry["best_config"])
        entry["checks"] = checks(n, k)
        if args.options:
            entry["options"] = measure_options(name, n, k, args.replays)
        if args.pdl:
            entry["pdl"] = measure_pdl(n, k, args.replays)
        print(f"skinny_matmul: {name} " + json.dumps({key: value for key, value in entry.items() if key != "sweep"}),
              flush=True)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(results, indent=2) + "\n")
    print(table(results))
    if args.options:
        print(options_table(results))
    if args.pdl:
        print(pdl_table(results))
    return results


def table(results: dict[str, Any]) -> str:
    rows = [f"{'product':<8} {'rows':>4} {'cuBLAS µs':>10} {'TB/s':>5} {'table µs':>9} {'TB/s':>5}"
            + (f" {'best µs':>8} {'TB/s':>5}  best config" if any("best_config" in e for e in results["products"].values())
               else "")]
    for name, e in results["products"].items():
        for m in ROWS:
            row = (f"{name:<8} {m:>4} {e[f'cublas_m{m}_us']:>10.1f} {e[f'cublas_m{m}_tb_s']:>5.2f} "
                   f"{e[f'table_m{m}_us']:>9.1f} {e[f'table_m{m}_tb_s']:>5.2f}")
            if "best_config" in e:
                row += f" {e[f'best_m{m}_us']:>8.1f} {e[f'best_m{m}_tb_s']:>5.2f}  {tuple(e['best_config'])}"
            rows.append(row)
    checks_line = {name: e["checks"] for name, e in results["products"].items()}
    configs = {(e["n"], e["k"]): tuple(e["best_config"]) for e in results["products"].values() if "best_config" in e}
    return "\n".join([*rows, f"checks: {json.dumps(checks_line)}", f"CONFIGS: {configs}"])



def options_table(results: dict[str, Any]) -> str:
    """Per product and option: µs at each of ROWS and the extra over the plain product, with the tiling."""
    rows = [f"{'product':<8} {'option':<26} {'µs 1 row':>9} {'+µs':>6} {'µs 16 rows':>10} {'+µs':>6}  tiling"]
    for name, e in results["products"].items():
        for option, c in e.get("options", {}).items():
            if "error" in c:
                rows.append(f"{name:<8} {option:<26} {c['error']}")
                continue
            extra = [f"{c[f'm{m}_extra_us']:>+6.1f}" if f"m{m}_extra_us" in c else f"{'':>6}" for m in ROWS]
            rows.append(f"{name:<8} {option:<26} {c['m1_us']:>9.1f} {extra[0]} {c['m16_us']:>10.1f} {extra[1]}  "
                        f"{tuple(c.get('config', ()))}")
    return "\n".join(rows)


if __name__ == "__main__":
    main()
