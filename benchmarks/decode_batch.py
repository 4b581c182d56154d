"""Batch scaling of the decode loop: tokens/s with and without a drafter at batch 1, 4, 16 and 64, and the
batch where the drafter's speedup crosses 1x.

    python -m benchmarks.decode_batch            # one H200, < 10 min -> results/decode_batch.{json,png}
    python -m benchmarks.decode_batch --quick    # CPU, seconds: tiny shapes (the script's smoke test)
    python -m benchmarks.decode_batch --compile-scope step --out benchmarks/results/decode_batch-step.json
    python -m benchmarks.decode_batch --matmul fused --batches 1,4 --out benchmarks/results/decode_batch-fused.json

What to run on the GPU: the first command, alone on the machine. It measures the smallest and the
largest batch of both shapes first, then the ones between; writes the JSON after every point and prints
the table as it goes; and starts no point that would end after `--budget-s` (default 480 s, judged by
the longest point so far). Skipped points are listed in the JSON; `--shapes` / `--batches` with another
`--out` measure them in a second command.

Shapes (random weights, bf16, each with a random 5-layer drafter, block 16, the runtime's defaults:
Triton kernels, torch.compile, CUDA graphs): Qwen3-8B (36 layers, hidden 4096, 32/8 heads of 128,
intermediate 12,288, vocabulary 151,936) and SmolLM2-135M (Llama: 30 layers, hidden 576, 9/3 heads of
64, intermediate 1,536, vocabulary 49,152, tied embeddings).

Per (shape, batch) every row is prefilled with `--context` random tokens, then the loop's step (a CUDA
graph replay) is timed with all rows decoding: tokens/s = rows x tokens per cycle / time per cycle, one
token per cycle without a drafter, tau (the replayed distribution's mean a+1) with one. The table also
gives each variant's set-up seconds: compile (the warm-up cycles, where torch.compile and Triton
compile), CUDA-graph capture and prefill. Each (shape, batch, drafter or not) compiles its own graph:
compilation was most of the run's time with whole-step graphs. The runtime's default, `--compile-scope
layer`, compiles one decoder layer per variant, reused by every layer (`EngineConfig.compile_scope`):
several times faster, whatever the depth (docs/benchmarks.md, `decode_batch`); `--compile-scope step`
measures the whole-step graphs. The JSON records the scope.

Acceptance replay (`ReplayEngine`): a random drafter's drafts are all rejected, so a measured speedup
would say nothing about a trained one. Instead each cycle's accepted length a+1 is drawn from a given
distribution (`--acceptance`: a tau, for a truncated geometric distribution whose every draft slot is
accepted with the same conditional rate; comma-separated counts of a+1 = 1, 2, ...; or the JSON of an
eval, whose `histogram` is used). The draws are made up front, one sequence per cache row, and the cycle
reads the row's next one on the device (no host sync, CUDA-graph safe). The cycle does the work of a
drafter with that acceptance: draft, verify the block, the verify's vocabulary argmax (its fused kernel
with Triton), commit a+1 tokens, drafter context K/V of the block; only the comparison with the drafts is
replaced. The committed tokens are the target's own (its argmax at slots 0..a of the verified block, not
the drafts), but not the target's greedy decode, since the block it saw held random drafts: losslessness
is checked with real drafters only (`dflash-train eval`, `benchmarks/decode.py --section smollm2`).
Default: tau 6.0, the acceptance length this project aims for with a trained drafter (docs/results.md).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import pathlib
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from benchmarks.common import results_directory, stamp
from benchmarks.decode_timing import random_draft, time_ms
from benchmarks.shapes import SHAPES, random_target
from dflash_train.kernels.greedy_verify import block_argmax_triton, commit_tokens
from dflash_train.models import DFlashDraftModel
from dflash_train.runtime.config import COMPILE_SCOPES, MATMULS, SKINNY_FOR_MATMUL
from dflash_train.runtime.engine import DecodeEngine, EngineConfig, resolve_kernels
from dflash_train.runtime.static_target import StaticTarget
from dflash_train.target import TargetModel

DEFAULT_TAU = 6.0
PREFILL_ROWS = 16  # rows per prefill forward (activation memory at Qwen3-8B shapes)


# ---------------------------------------------------------------------------------------- acceptance


@dataclass(frozen=True)
class Acceptance:
    """A distribution of a cycle's accepted length a+1: probabilities[k-1] = P(a+1 = k), k = 1..B."""

    probabilities: tuple[float, ...]
    source: str

    @property
    def tau(self) -> float:
        return sum(k * p for k, p in enumerate(self.probabilities, start=1))

    @classmethod
    def geometric(cls, tau: float, block_size: int) -> Acceptance:
        """Every draft slot accepted with the same rate r given the one before it (truncated at the block):
        P(a+1 = k) = r^(k-1) (1 - r) for k < B, r^(B-1) for k = B; r chosen so that the mean is tau."""
        if not 1.0 <= tau <= block_size:
            raise ValueError(f"tau must lie in [1, {block_size}], not {tau}")
        low, high = 0.0, 1.0
        for _ in range(100):  # mean = sum of r^k over k < B, increasing in r
            rate = (low + high) / 2
            low, high = (rate, high) if sum(rate ** k for k in range(block_size)) < tau else (low, rate)
        rate = (low + high) / 2
        probabilities = [rate ** (k - 1) * (1 - rate) for k in range(1, block_size)] + [rate ** (block_size - 1)]
        return cls(tuple(probabilities), f"geometric, tau {tau:g}")

    @classmethod
    def from_counts(cls, counts: Sequence[float], block_size: int, source: str) -> Acceptance:
        if len(counts) > block_size or any(c < 0 for c in counts) or sum(counts) <= 0:
            raise ValueError(f"acceptance counts must be {block_size} or fewer non-negative numbers, not all 0")
        total = float(sum(counts))
        padded = list(counts) + [0.0] * (block_size - len(counts))
        return cls(tuple(c / total for c in padded), source)

    @classmethod
    def parse(cls, spec: str, block_size: int) -> Acceptance:
        """A tau ("6.0"), counts of a+1 = 1, 2, ... ("10,20,5"), or an eval JSON with a `histogram`."""
        if pathlib.Path(spec).is_file():
            histogram = _find_histogram(json.loads(pathlib.Path(spec).read_text()))
            if histogram is None:
                raise ValueError(f"{spec} holds no acceptance `histogram`")
            return cls.from_counts(histogram, block_size, spec)
        if "," in spec:
            return cls.from_counts([float(c) for c in spec.split(",")], block_size, f"counts {spec}")
        return cls.geometric(float(spec), block_size)

    def draws(self, rows: int, cycles: int, seed: int) -> torch.Tensor:
        """[rows, cycles] int64 samples of a+1, independent."""
        generator = torch.Generator().manual_seed(seed)
        probabilities = torch.tensor(self.probabilities, dtype=torch.float64)
        samples = torch.multinomial(probabilities, rows * cycles, replacement=True, generator=generator)
        return (samples + 1).view(rows, cycles)


def _find_histogram(payload: Any) -> list[float] | None:
    """The first `histogram` list in an eval's JSON (nested per dataset or not)."""
    if isinstance(payload, dict):
        if isinstance(payload.get("histogram"), list):
            return payload["histogram"]
        payload = list(payload.values())
    if isinstance(payload, list):
        for item in payload:
            found = _find_histogram(item) if isinstance(item, (dict, list)) else None
            if found is not None:
                return found
    return None


class ReplayEngine(DecodeEngine):
    """The decode engine with set-up seconds recorded (`setup`: compile_s, capture_s) and, given an
    acceptance distribution and a drafter, greedy cycles whose accepted length is replayed from it
    (module docstring). Without either it is the engine itself."""

    def __init__(self, target: TargetModel, draft: DFlashDraftModel | None, config: EngineConfig,
                 acceptance: Acceptance | None = None, runner: StaticTarget | None = None, seed: int = 0) -> None:
        super().__init__(target, draft, config, runner=runner)
        self.setup = {"compile_s": 0.0, "capture_s": 0.0}
        self.replay: torch.Tensor | None = None
        if acceptance is not None and self.drafter is not None:
            if config.temperature > 0:
                raise ValueError("the acceptance replay is greedy only")
            if len(acceptance.probabilities) != self.block_size:
                raise ValueError(f"an acceptance distribution over 1..{len(acceptance.probabilities)} for "
                                 f"blocks of {self.block_size}")
            # A row runs at most max_new_tokens cycles per request (each commits at least one token).
            self.replay = acceptance.draws(config.batch_size, config.max_new_tokens + 1, seed).to(self.device)

    def _warm_up(self) -> None:
        started = time.perf_counter()
        try:
            super()._warm_up()
        finally:
            self.setup["compile_s"] += time.perf_counter() - started

    def _capture(self) -> None:
        started = time.perf_counter()
        super()._capture()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.setup["capture_s"] += time.perf_counter() - started

    def _verify(self, logits: torch.Tensor, block: torch.Tensor, out: torch.Tensor, n_out: torch.Tensor,
                done: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.replay is None:
            return super()._verify(logits, block, out, n_out, done)
        tokens = block_argmax_triton(logits) if self.kernels == "triton" else logits.argmax(dim=-1)  # [b, B]
        cycle = self.state.n_cycles.clamp(max=self.replay.shape[1] - 1)
        accept_len = self.replay.gather(1, cycle[:, None])[:, 0]  # a+1, [b]
        accepted = accept_len - 1
        # Committed: the target's tokens t_0 .. t_a (commit_tokens writes block[k+1] for k < a, then the bonus).
        shifted = torch.cat([block[:, :1], tokens[:, :-1]], dim=1)
        bonus = tokens.gather(1, accepted[:, None])[:, 0]
        commit_tokens(out, n_out, shifted, accepted, bonus, done)
        return accept_len, bonus


# ---------------------------------------------------------------------------------------- measurement


@dataclass(frozen=True)
class Settings:
    device: torch.device
    dtype: torch.dtype
    context: int
    warmup: int
    iters: int
    compile: bool | None
    acceptance: Acceptance
    quick: bool
    block_size: int = 16
    draft_layers: int = 5
    compile_scope: str = "layer"  # EngineConfig.compile_scope
    matmul: str = "auto"  # EngineConfig.matmul: the products of steps of at most 64 rows


def cycles_per_point(settings: Settings) -> int:
    """Cycles a row runs after its prefill: the first step, the warm-up steps and the timed ones."""
    return 1 + settings.warmup + settings.iters


def measure(target: TargetModel, draft: DFlashDraftModel | None, runner: StaticTarget, batch: int,
            settings: Settings) -> dict[str, Any]:
    """One variant at one batch: set-up seconds, time per cycle with every row decoding, tokens/s."""
    block = settings.block_size if draft is not None else 1
    # Rows never finish while timed: room for every cycle committing a whole block.
    new_tokens = (cycles_per_point(settings) + 2) * settings.block_size + 1
    config = EngineConfig(batch_size=batch, block_size=block, max_new_tokens=new_tokens, max_length=runner.max_length,
                          compile=settings.compile, compile_scope=settings.compile_scope)
    engine = ReplayEngine(target, draft, config, settings.acceptance, runner=runner)
    engine.prepare()
    prefill_s = prefill_all(engine, batch, settings, target.vocab_size)
    engine.step()
    cycle_ms = time_ms(engine.step, settings.device, settings.warmup, settings.iters)
    state = engine.state
    replayed = float((state.n_out - 1).sum() / state.n_cycles.sum().clamp(min=1))  # mean a+1 of the cycles run
    # The distribution's mean, not the few dozen draws replayed: a cycle's work does not depend on a (static
    # shapes; only the attention's context grows with it), and the draws' mean is noisy at small batches.
    tokens_per_cycle = settings.acceptance.tau if draft is not None else 1.0
    result = {
        "batch": batch, "drafter": draft is not None, "cycle_ms": cycle_ms, "tokens_per_cycle": tokens_per_cycle,
        "replayed_tokens_per_cycle": replayed, "tokens_per_s": batch * tokens_per_cycle / cycle_ms * 1e3,
        "prefill_s": prefill_s, **engine.setup,
        "cuda_graph": engine.uses_cuda_graph, "compiled": engine.uses_compile, "compile_error": engine.compile_error,
        "graph_error": engine.graph_error, "attention": runner.attention, "prologue": runner.prologue,
        "matmul": runner.matmul,
    }
    del engine
    gc.collect()
    return result


def prefill_all(engine: DecodeEngine, batch: int, settings: Settings, vocab: int) -> float:
    """Every row prefilled with its own `context` random tokens, PREFILL_ROWS rows per forward; seconds."""
    generator = torch.Generator().manual_seed(batch)
    prompts = torch.randint(0, vocab, (batch, settings.context), generator=generator).tolist()
    started = time.perf_counter()
    for first in range(0, batch, PREFILL_ROWS):
        rows = list(range(first, min(first + PREFILL_ROWS, batch)))
        engine.prefill(rows, [prompts[r] for r in rows])
    if settings.device.type == "cuda":
        torch.cuda.synchronize(settings.device)
    return time.perf_counter() - started


def cache_length(settings: Settings) -> int:
    needed = settings.context + (cycles_per_point(settings) + 3) * settings.block_size + 1
    return -(-needed // 256) * 256


def measure_batch(target: TargetModel, draft: DFlashDraftModel, batch: int, settings: Settings) -> list[dict[str, Any]]:
    """Both variants at one batch, sharing the target's runner (and its KV cache)."""
    kernels = resolve_kernels("auto", settings.device)
    runner = StaticTarget(target, batch, cache_length(settings), kernels=kernels,
                          skinny_matmul=SKINNY_FOR_MATMUL[settings.matmul], skinny_fusion=settings.matmul == "fused")
    points = [measure(target, None, runner, batch, settings), measure(target, draft, runner, batch, settings)]
    del runner
    release(settings.device)
    return points


def release(device: torch.device) -> None:
    """Compiled graphs, CUDA graphs and caches of the last batch go before the next one is built (each
    (shape, batch) compiles anew anyway, and dynamo's per-function recompile limit would be reached)."""
    torch._dynamo.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------- summary


def speedups(points: list[dict[str, Any]]) -> dict[int, float]:
    """batch -> tokens/s with the drafter over tokens/s without, for batches with both measured."""
    by_batch: dict[int, dict[bool, float]] = {}
    for point in points:
        by_batch.setdefault(point["batch"], {})[point["drafter"]] = point["tokens_per_s"]
    return {batch: rates[True] / rates[False] for batch, rates in sorted(by_batch.items()) if len(rates) == 2}


def crossing(speedup: dict[int, float]) -> dict[str, Any]:
    """Where the speedup crosses 1x: each pair of neighbouring measured batches on either side of it, and
    the batch where a line through them in (log2 batch, speedup) meets 1; `batch` is the first of them."""
    batches = sorted(speedup)
    if not batches:
        return {"batch": None, "crossings": [], "statement": "nothing measured"}
    crossings, statements = [], []
    for low, high in zip(batches, batches[1:], strict=False):
        s_low, s_high = speedup[low], speedup[high]
        if (s_low - 1) * (s_high - 1) > 0 or s_low == s_high:
            continue
        at = 2 ** (math.log2(low) + (1 - s_low) / (s_high - s_low) * (math.log2(high) - math.log2(low)))
        crossings.append({"batch": at, "between": [low, high]})
        statements.append(f"{'falls below' if s_low > s_high else 'rises above'} 1x between batch {low} "
                          f"({s_low:.2f}x) and {high} ({s_high:.2f}x), at about batch {at:.1f}")
    if crossings:
        return {"batch": crossings[0]["batch"], "crossings": crossings,
                "statement": "the speedup " + "; then ".join(statements) + " (log-linear interpolation)"}
    side = "above" if speedup[batches[0]] > 1 else "below"
    return {"batch": None, "crossings": [],
            "statement": f"{side} 1x at every measured batch ({', '.join(map(str, batches))})"}


def measuring_order(batches: Sequence[int]) -> list[int]:
    """The smallest and the largest batch first (whether the speedup crosses 1x at all), then the others in
    between (where): a run cut short by the time budget still answers the first question."""
    ordered = sorted(set(batches))
    return ordered[:1] + ordered[-1:] * (len(ordered) > 1) + ordered[1:-1]


TABLE_HEADER = ("| shape | batch | drafter | ms/cycle | tokens/cycle | tokens/s | speedup | compile s | capture s "
                "| prefill s |")


def table_row(shape: str, point: dict[str, Any], speedup: dict[int, float]) -> str:
    ratio = f"{speedup[point['batch']]:.2f}x" if point["drafter"] and point["batch"] in speedup else ""
    return (f"| {shape} | {point['batch']} | {'yes' if point['drafter'] else 'no'} | {point['cycle_ms']:.3f} | "
            f"{point['tokens_per_cycle']:.2f} | {point['tokens_per_s']:,.0f} | {ratio} | {point['compile_s']:.1f} | "
            f"{point['capture_s']:.1f} | {point['prefill_s']:.1f} |")


def summarise(results: dict[str, Any]) -> None:
    """Speedups, crossings and the table, from the points measured so far."""
    lines = [TABLE_HEADER, "|" + "---|" * (TABLE_HEADER.count("|") - 1)]
    for name, section in results["shapes"].items():
        section["points"].sort(key=lambda point: (point["batch"], point["drafter"]))
        section["speedup"] = speedups(section["points"])
        section["crossing"] = crossing(section["speedup"])
        lines += [table_row(name, point, section["speedup"]) for point in section["points"]]
    results["table"] = lines


# ---------------------------------------------------------------------------------------- run


def run(args: argparse.Namespace, settings: Settings, out: pathlib.Path) -> dict[str, Any]:
    shapes = [name.strip() for name in args.shapes.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    results: dict[str, Any] = {
        "acceptance": {"probabilities": list(settings.acceptance.probabilities), "tau": settings.acceptance.tau,
                       "source": settings.acceptance.source},
        "context": settings.context, "block_size": settings.block_size, "draft_layers": settings.draft_layers,
        "batches": batches, "dtype": str(settings.dtype).removeprefix("torch."), "quick": settings.quick,
        "compile_scope": settings.compile_scope, "matmul": settings.matmul,
        "budget_s": args.budget_s, "shapes": {}, "skipped": [],
    }
    models = {name: build(name, settings) for name in shapes}
    for name in shapes:
        model_type, shape, tiny = SHAPES[name]
        results["shapes"][name] = {"model_type": model_type, "shape": tiny if settings.quick else shape, "points": []}
    started, longest = time.perf_counter(), 0.0
    for batch in measuring_order(batches):
        for name in shapes:
            if time.perf_counter() - started + longest > args.budget_s:
                results["skipped"].append({"shape": name, "batch": batch})
                print(f"decode_batch: skipped {name} batch {batch} (budget {args.budget_s:.0f} s)", flush=True)
                continue
            began = time.perf_counter()
            target, draft = models[name]
            points = measure_batch(target, draft, batch, settings)
            longest = max(longest, time.perf_counter() - began)
            results["shapes"][name]["points"] += points
            summarise(results)
            for point in points:
                print(table_row(name, point, results["shapes"][name]["speedup"]), flush=True)
            save(results, out)
    results["wall_s"] = time.perf_counter() - started
    summarise(results)
    save(results, out)
    return results


def build(name: str, settings: Settings) -> tuple[TargetModel, DFlashDraftModel]:
    model_type, shape, tiny = SHAPES[name]
    shape = tiny if settings.quick else shape
    target = random_target(model_type, shape, settings.device, settings.dtype)
    draft = random_draft(target, 2 if settings.quick else settings.draft_layers, settings.block_size,
                         shape["vocab_size"] - 1)
    return target, draft


def save(results: dict[str, Any], out: pathlib.Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({**stamp(), **results}, indent=2) + "\n")


def plot(results: dict[str, Any], path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (rates, ratio) = plt.subplots(1, 2, figsize=(11, 4))
    for (name, section), color in zip(results["shapes"].items(), ("tab:blue", "tab:orange", "tab:green"),
                                      strict=False):
        for drafter, style in ((False, "--"), (True, "-")):
            points = [p for p in section["points"] if p["drafter"] == drafter]
            label = f"{name}, {'with drafter' if drafter else 'target only'}"
            rates.plot([p["batch"] for p in points], [p["tokens_per_s"] for p in points], style, marker="o",
                       color=color, label=label)
        speedup = section.get("speedup", {})
        ratio.plot(list(map(int, speedup)), list(speedup.values()), "-", marker="o", color=color, label=name)
        for found in section.get("crossing", {}).get("crossings", []):
            ratio.axvline(found["batch"], color=color, linestyle=":", linewidth=1)
    measured = any(section["points"] for section in results["shapes"].values())
    for axis in (rates, ratio):
        if measured:  # (log axes cannot show an empty run)
            axis.set_xscale("log", base=2)
            axis.legend(fontsize=8)
        axis.set_xlabel("batch (rows decoding)")
    if measured:
        rates.set_yscale("log")
    rates.set_ylabel("tokens/s")
    rates.set_title("decode throughput")
    ratio.axhline(1.0, color="grey", linewidth=1)
    ratio.set_ylabel("speedup with drafter")
    ratio.set_title(f"replayed acceptance: tau {results['acceptance']['tau']:.2f}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny shapes on the CPU, batches 1,2,4 (seconds)")
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {', '.join(SHAPES)}")
    parser.add_argument("--batches", default=None, help="comma-separated (default 1,4,16,64; --quick: 1,2,4)")
    parser.add_argument("--acceptance", default=str(DEFAULT_TAU),
                        help="replayed a+1: a tau, counts of a+1 = 1, 2, ... (comma-separated), or an eval JSON "
                             "with a `histogram`")
    parser.add_argument("--context", type=int, default=None, help="prompt tokens per row (default 1024; --quick 16)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps (default 5; --quick 1)")
    parser.add_argument("--iters", type=int, default=None, help="timed steps (default 20; --quick 3)")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                        help="torch.compile the cycle (default: on CUDA, as the runtime)")
    parser.add_argument("--compile-scope", choices=COMPILE_SCOPES, default="layer",
                        help="layer (the runtime's default): one decoder layer compiled and reused by every layer, "
                             "so that a point's compile time does not grow with the depth; step: the whole cycle's "
                             "forwards as one graph each (compare the compile s column of both)")
    parser.add_argument("--matmul", choices=MATMULS, default="auto",
                        help="the products of decode and verify steps of at most 64 rows (EngineConfig.matmul): auto "
                             "(the default: the skinny kernel for the tuned shapes), torch (cuBLAS), skinny or fused (norms, SwiGLU and residual adds folded in); "
                             "larger steps keep torch's (give another --out to keep the default's figures)")
    parser.add_argument("--budget-s", type=float, default=480.0,
                        help="start no point that would end after this many seconds (estimated from the longest "
                             "point so far)")
    parser.add_argument("--device", default=None, help="default: cuda if available, else cpu (--quick: cpu)")
    parser.add_argument("--out", default=None, help="JSON path (default: benchmarks/results/decode_batch.json)")
    args = parser.parse_args(argv)
    unknown = {name.strip() for name in args.shapes.split(",")} - set(SHAPES)
    if unknown:
        parser.error(f"--shapes: unknown {', '.join(sorted(unknown))}; choose from {', '.join(SHAPES)}")
    quick = args.quick
    args.batches = args.batches or ("1,2,4" if quick else "1,4,16,64")
    args.context = args.context or (16 if quick else 1024)
    args.warmup = args.warmup if args.warmup is not None else (1 if quick else 5)
    args.iters = args.iters or (3 if quick else 20)
    args.device = args.device or ("cpu" if quick or not torch.cuda.is_available() else "cuda")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    device = torch.device(args.device)
    settings = Settings(device=device, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32,
                        context=args.context, warmup=args.warmup, iters=args.iters, compile=args.compile,
                        acceptance=Acceptance.parse(args.acceptance, 16), quick=args.quick,
                        compile_scope=args.compile_scope, matmul=args.matmul)
    out = pathlib.Path(args.out or results_directory(smoke=args.quick) / "decode_batch.json")
    results = run(args, settings, out)
    plot(results, out.with_suffix(".png"))
    print("\n".join(results["table"]))
    for name, section in results["shapes"].items():
        print(f"{name}: {section['crossing']['statement']}")
    return results


if __name__ == "__main__":
    main()
