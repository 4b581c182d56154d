"""A MoE layer's experts at decode and verify sizes: the decode-experts kernel (`dflash_train.kernels.decode_experts`)
against transformers' grouped products (`grouped_mm`, what a MoE model loads with on CUDA) and its batched one,
in the same run, at the layer shapes of Qwen3-30B-A3B and gpt-oss-20b, bf16, on one GPU:

    python -m benchmarks.decode_experts                         # both shapes, 1..256 tokens, < 2 min on an H100
    python -m benchmarks.decode_experts --sweep --budget-s 300  # + the kernel's tilings, up and down products
    python -m benchmarks.decode_experts --tokens 16 --reached 16  # a verify's 16 tokens routed to 16 experts

Shapes (transformers' own experts modules, random weights): `qwen3-30b-a3b`: 128 experts, hidden 2048, width
768, 8 per token, [gate; up] halves with SiLU; `gpt-oss-20b`: 32 experts, hidden 2880, width 2880, 4 per token,
transposed weights with biases and the model's clamped gate.

Each call is timed as a CUDA graph over `LAYERS` copies of the experts (different weights, together larger than
the L2), as in a graphed decode step; medians of µs per call. Routing: each token's k experts drawn at random,
the same for every implementation; with `--reached N`, from the same N experts for every token, as a model's
router may gather a verify's similar tokens (more pairs an expert than even routing gives). The floor: the
bytes of the experts the step reaches (each counted once) over the device-to-device copy bandwidth measured
in the run. Checks: each implementation's output against
the kernel's (bf16 tolerance), and one token's output bitwise the same alone and among others (the kernel's).
"""

from __future__ import annotations

import argparse
import itertools
import time
from collections.abc import Callable
from typing import Any

import torch
from transformers import GptOssConfig, Qwen3MoeConfig
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

from benchmarks.common import graph_us, median, time_calls, write_result
from dflash_train.kernels import decode_experts as de
from dflash_train.runtime.experts import decode_experts_forward, kernel_gate

SHAPES: dict[str, tuple[type[torch.nn.Module], Any]] = {
    "qwen3-30b-a3b": (Qwen3MoeExperts, Qwen3MoeConfig(hidden_size=2048, moe_intermediate_size=768, num_experts=128,
                                                      num_experts_per_tok=8)),
    "gpt-oss-20b": (GptOssExperts, GptOssConfig(hidden_size=2880, intermediate_size=2880, num_local_experts=32,
                                                num_experts_per_tok=4)),
}
TOKENS = (1, 2, 4, 16, 32, 64, 128, 256)
LAYERS = 4
IMPLEMENTATIONS = ("kernel", "grouped_mm", "batched_mm")


def say(message: str) -> None:
    print(f"decode_experts: {message}", flush=True)


def build_layers(name: str, device: torch.device) -> list[torch.nn.Module]:
    module_class, config = SHAPES[name]
    layers = []
    for seed in range(LAYERS):
        torch.manual_seed(seed)
        with torch.device(device):
            module = module_class(config).to(torch.bfloat16)
        for parameter in module.parameters():
            fan_in = parameter.shape[-1] if parameter.dim() == 3 else 1
            parameter.data.normal_(0.0, fan_in ** -0.5 if parameter.dim() == 3 else 0.02)
        module.requires_grad_(False)
        layers.append(module)
    return layers


def routing(tokens: int, experts: int, top_k: int, device: torch.device,
            reached: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's `top_k` distinct experts and weights, drawn among `reached` experts (default: all)."""
    generator = torch.Generator().manual_seed(tokens)
    # even routing draws as it always has, so its points compare with earlier runs'
    pool = torch.arange(experts) if reached is None else torch.randperm(experts, generator=generator)[:reached]
    if len(pool) < top_k:
        raise SystemExit(f"decode_experts: error: --reached {reached} is below the {top_k} experts a token takes")
    index = pool[torch.rand(tokens, len(pool), generator=generator).topk(top_k, dim=-1).indices]
    weights = torch.softmax(torch.randn(tokens, top_k, generator=generator), dim=-1)
    return index.to(device), weights.to(device, torch.bfloat16)


def implementation(which: str) -> Callable[..., torch.Tensor]:
    return decode_experts_forward if which == "kernel" else ALL_EXPERTS_FUNCTIONS[which]


def reached_bytes(layer: torch.nn.Module, index: torch.Tensor) -> int:
    """Bytes of the experts `index` reaches in one layer, each expert once."""
    per_expert = sum(p[0].numel() * p.element_size() for p in layer.parameters() if p.dim() >= 2)
    return int(index.unique().numel()) * per_expert


def copy_bandwidth(device: torch.device) -> float:
    source = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    ms = median(time_calls(lambda: target.copy_(source), device, warmup=3, iters=10))
    return 2 * source.numel() / (ms * 1e-3)


def sizes(layer: torch.nn.Module) -> tuple[int, int, int]:
    """(hidden size, experts, experts per token) of an experts module."""
    hidden = layer.gate_up_proj.shape[1 if layer.is_transposed else 2]
    return hidden, layer.gate_up_proj.shape[0], int(layer.config.num_experts_per_tok)


def time_point(layers: list[torch.nn.Module], tokens: int, bandwidth: float, replays: int,
               reached: int | None = None) -> dict[str, Any]:
    device = layers[0].gate_up_proj.device
    hidden, experts, top_k = sizes(layers[0])
    x = torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16)
    index, weights = routing(tokens, experts, top_k, device, reached)
    point: dict[str, Any] = {"tokens": tokens, "pairs": tokens * top_k, "experts_reached": int(index.unique().numel()),
                             "floor_us": reached_bytes(layers[0], index) / bandwidth * 1e6}
    reference = decode_experts_forward(layers[0], x, index, weights).float()
    for which in IMPLEMENTATIONS:
        run = implementation(which)
        try:
            calls = [lambda layer=layer, run=run: run(layer, x, index, weights) for layer in layers]
            point[f"{which}_us"] = graph_us(calls, replays)
            point[f"{which}_max_diff"] = float((run(layers[0], x, index, weights).float() - reference).abs().max())
        except Exception as error:  # a library build without that path: a finding, not the end of the run
            point[f"{which}_error"] = f"{type(error).__name__}: {str(error)[:200]}"
    if "kernel_us" in point:
        point["kernel_over_floor"] = point["kernel_us"] / point["floor_us"]
        for which in IMPLEMENTATIONS[1:]:
            if f"{which}_us" in point:
                point[f"{which}_over_kernel"] = point[f"{which}_us"] / point["kernel_us"]
    point["batch_invariant"] = batch_invariant(layers[0], x, index, weights)
    return point


def batch_invariant(layer: torch.nn.Module, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> bool:
    alone = decode_experts_forward(layer, x[-1:], index[-1:], weights[-1:])
    return bool(torch.equal(decode_experts_forward(layer, x, index, weights)[-1:], alone))


def product_shapes(layer: torch.nn.Module) -> dict[str, tuple[int, int]]:
    """The (output width N, reduction K) of the layer's up and down products, as `decode_experts` keys its
    tilings (the up product's N is the gated width where the kernel folds the gate in)."""
    hidden, _, _ = sizes(layer)
    inner = layer.down_proj.shape[1 if layer.is_transposed else 2]
    folded = kernel_gate(layer) is None or isinstance(kernel_gate(layer), de.ClampedGate)
    return {"up": (inner if folded else 2 * inner, hidden), "down": (hidden, inner)}


def sweep(layers: list[torch.nn.Module], replays: int, run_guard: Callable[[], bool],
          reached: int | None = None) -> dict[str, Any]:
    """Every candidate tiling of the up product, then of the down product (the other at its best so far), timed
    at 1 and 16 tokens (the 16 routed among `reached` experts); ranked by their sum (one tiling serves both:
    batch invariance). The best of each is left in `de.TILINGS` for the rest of the run."""
    device = layers[0].gate_up_proj.device
    hidden, experts, top_k = sizes(layers[0])
    inputs = {m: (torch.randn(m, hidden, device=device, dtype=torch.bfloat16),
                  *routing(m, experts, top_k, device, reached if m > 1 else None)) for m in (1, 16)}
    found: dict[str, Any] = {}
    for product, (n, k) in product_shapes(layers[0]).items():
        key, timings = (product, n, k), []
        for tiling in candidates():
            if not run_guard():
                break
            de.TILINGS[key] = tiling
            try:
                times = [graph_us([lambda layer=layer, m=m: decode_experts_forward(layer, *inputs[m])
                                   for layer in layers], replays) for m in (1, 16)]
            except Exception as error:  # out of shared memory or registers: skip the tiling
                say(f"{product} {tuple(tiling)}: {type(error).__name__}")
                continue
            timings.append({"tiling": list(tiling), "m1_us": times[0], "m16_us": times[1]})
        timings.sort(key=lambda t: t["m1_us"] + t["m16_us"])
        found[product] = {"n": n, "k": k, "best": timings[:8]}
        if timings:
            de.TILINGS[key] = de.Tiling(*timings[0]["tiling"])
        else:
            de.TILINGS.pop(key, None)
        say(f"{product} {n}x{k}: best {de.tiling_for(product, n, k)}")
    return found


def candidates() -> list[de.Tiling]:
    return [de.Tiling(n, k, w, s) for n, k, w, s in itertools.product((16, 32, 64), (64, 128, 256), (4,), (2, 3, 4))
            if s * (n * 2 + de.BLOCK_M) * k * 2 <= 200 * 1024]


def table(results: dict[str, Any]) -> str:
    lines = ["| shape | tokens | experts reached | floor µs | kernel µs | × floor | grouped_mm µs "
             "| grouped / kernel | batched_mm µs |", "|---|---|---|---|---|---|---|---|---|"]
    for name, result in results.items():
        for point in result["points"]:
            cells = [f"{point[key]:.2f}" if key in point else "–" for key in (
                "floor_us", "kernel_us", "kernel_over_floor", "grouped_mm_us", "grouped_mm_over_kernel",
                "batched_mm_us")]
            lines.append(f"| {name} | {point['tokens']} | {point.get('experts_reached', '–')} | "
                         + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", action="append", choices=tuple(SHAPES), help="repeat (default: both)")
    parser.add_argument("--tokens", type=int, action="append", help=f"tokens per call; repeat (default {TOKENS})")
    parser.add_argument("--sweep", action="store_true", help="time the kernel's candidate tilings first")
    parser.add_argument("--replays", type=int, default=50)
    parser.add_argument("--reached", type=int, default=None,
                        help="route every token among the same N experts (default: all experts)")
    parser.add_argument("--budget-s", type=float, default=480.0)
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    started = time.perf_counter()
    bandwidth = copy_bandwidth(device)
    say(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    results: dict[str, Any] = {}
    for name in args.shape or tuple(SHAPES):
        layers = build_layers(name, device)
        result: dict[str, Any] = {"shape": name, "layers": LAYERS, "copy_bandwidth": bandwidth,
                                  "reached": args.reached, "points": []}
        if args.sweep:
            result["sweep"] = sweep(layers, args.replays, lambda: time.perf_counter() - started < args.budget_s,
                                    args.reached)
        result["tilings"] = {product: list(de.tiling_for(product, *shape))
                             for product, shape in product_shapes(layers[0]).items()}
        for tokens in args.tokens or TOKENS:
            point = time_point(layers, tokens, bandwidth, args.replays, args.reached)
            say(f"{name} {tokens} tokens: " + ", ".join(f"{k} {v:.2f}" for k, v in point.items()
                                                       if isinstance(v, float)))
            result["points"].append(point)
            write_result(f"decode_experts-{name}" + (f"-reached{args.reached}" if args.reached else ""), result)
        results[name] = result
        del layers
        torch.cuda.empty_cache()
    print(table(results))


if __name__ == "__main__":
    main()
