"""Which flex-attention kernel tiles build for the drafter's packed training mask, and how fast each runs its
forward and backward, all in one run:

    python -m benchmarks.flex_tiles             # the speedrun's shapes: 2 rows of 8,192 context tokens
    python -m benchmarks.flex_tiles --tiny      # a CPU smoke test (small shapes, uncompiled, forward only:
                                                # flex attention has no backward on a CPU)

The drafter's mask is made of 128-token tiles; `training.flex_tile=64` halves them so that fewer masked-out
scores are computed, and asks flex attention's kernels for tiles that fit (`models/attention.py`). Whether the
compiler can build those kernels depends on the release: each option set here is compiled on its own, its
error kept if it fails, its output and query gradient checked against the 128-token tiles', then timed. The last
sets run with inductor's backward candidates fitted to 64-token masks (`models/flex_backward_configs.py`, what the
trainer does for them), and the 128-token tiles again under that fit (two candidates then, timed by inductor).
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
from torch.nn.attention.flex_attention import flex_attention

from benchmarks.common import median, time_calls, write_result
from dflash_train.models.attention import SMALL_TILE_KERNEL_OPTIONS
from dflash_train.models.flex_backward_configs import fit_backward_configs_to_small_tiles
from dflash_train.objective.masks import packed_flex_mask

WIDE_BACKWARD = {"BLOCK_M": 64, "BLOCK_N": 64, "bwd_BLOCK_M1": 64, "bwd_BLOCK_N1": 64, "bwd_BLOCK_M2": 64,
                 "bwd_BLOCK_N2": 64}
NARROW_BACKWARD = {"BLOCK_M": 64, "BLOCK_N": 64, "bwd_BLOCK_M1": 32, "bwd_BLOCK_N1": 32, "bwd_BLOCK_M2": 32,
                   "bwd_BLOCK_N2": 32}
# name: (mask tile, kernel options, backward configs fitted to 64-token masks); the first is the reference the
# others are checked against. The fitted sets run last: the fit is inductor's for the rest of the process.
OPTION_SETS: dict[str, tuple[int, dict[str, Any] | None, bool]] = {
    "128 (default)": (128, None, False),
    "64, the trainer's options": (64, SMALL_TILE_KERNEL_OPTIONS, False),
    "64, backward tiles of 64": (64, WIDE_BACKWARD, False),
    "64, backward tiles of 32": (64, NARROW_BACKWARD, False),
    "64, one pipeline stage": (64, {**SMALL_TILE_KERNEL_OPTIONS, "num_stages": 1}, False),
    "64, forward tiles only": (64, {"BLOCK_M": 64, "BLOCK_N": 64}, False),
    "64, the trainer's options, configs fitted": (64, SMALL_TILE_KERNEL_OPTIONS, True),
    "64, backward tiles of 64, configs fitted": (64, WIDE_BACKWARD, True),
    "128, configs fitted": (128, None, True),
}


def packed_rows(rows: int, context: int, anchors: int, block: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Rows of chats 256 to 2,048 tokens long (the last cut at the row's end), `anchors` sorted anchors a row
    spread over them, each anchor's chat and each token's."""
    gen = torch.Generator().manual_seed(seed)
    context_sequence = torch.empty(rows, context, dtype=torch.long)
    anchor_at = torch.empty(rows, anchors, dtype=torch.long)
    for row in range(rows):
        start, chat = 0, 0
        while start < context:
            length = int(torch.randint(min(256, context), min(2048, context) + 1, (1,), generator=gen))
            context_sequence[row, start:start + length] = chat
            start, chat = start + length, chat + 1
        anchor_at[row] = torch.randperm(context - block, generator=gen)[:anchors].sort().values + 1
    anchor_sequence = context_sequence.gather(1, anchor_at)
    return {"anchors": anchor_at, "valid": torch.ones(rows, anchors, dtype=torch.bool),
            "anchor_sequence": anchor_sequence, "context_sequence": context_sequence}


def attention_inputs(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator(device=device).manual_seed(0)
    queries, keys = args.anchors * args.block_size, args.context + args.anchors * args.block_size
    q = torch.randn(args.rows, args.heads, queries, args.head_dim, device=device, generator=gen, dtype=dtype)
    k = torch.randn(args.rows, args.kv_heads, keys, args.head_dim, device=device, generator=gen, dtype=dtype)
    v = torch.randn(args.rows, args.kv_heads, keys, args.head_dim, device=device, generator=gen, dtype=dtype)
    grad = torch.randn_like(q)
    return q, k, v, grad


def run_option_set(name: str, rows: dict[str, torch.Tensor], tensors: tuple[torch.Tensor, ...],
                   args: argparse.Namespace, reference: tuple[torch.Tensor, torch.Tensor] | None
                   ) -> tuple[dict[str, Any], tuple[torch.Tensor, torch.Tensor] | None]:
    """One option set: built or its error, its largest differences from `reference`, milliseconds a call."""
    tile, options, fitted = OPTION_SETS[name]
    if fitted:
        fit_backward_configs_to_small_tiles()
    q, k, v, grad = tensors
    device = q.device
    on_device = {key: value.to(device) for key, value in rows.items()}
    mask = packed_flex_mask(on_device["anchors"], on_device["valid"], on_device["anchor_sequence"],
                            on_device["context_sequence"], args.block_size, tile)
    torch._dynamo.reset()  # each option set compiles from nothing: a failure of one cannot reuse another's kernel
    attend = flex_attention if args.tiny else torch.compile(flex_attention, dynamic=False)
    q = q.detach().requires_grad_(not args.tiny)

    def forward_backward() -> torch.Tensor:
        q.grad = None
        out = attend(q, k, v, block_mask=mask, enable_gqa=True,
                     kernel_options=None if args.tiny else options)
        if q.requires_grad:
            out.backward(grad)
        return out

    try:
        out = forward_backward()
    except Exception as error:  # a kernel the compiler cannot build: the reason, not the run
        first = (str(error).strip().splitlines() or [""])[0][:300]
        return {"option_set": name, "tile": tile, "options": options, "built": False,
                "error": f"{type(error).__name__}: {first}"}, None
    full = mask.full_kv_num_blocks
    result = {"option_set": name, "tile": tile, "options": options, "built": True,
              "tiles_computed": int(mask.kv_num_blocks.sum()) + (int(full.sum()) if full is not None else 0)}
    if reference is not None:
        result["max_diff_out"] = float((out.detach() - reference[0]).abs().max())
        result["max_diff_q_grad"] = float((q.grad - reference[1]).abs().max()) if q.requires_grad else None
    result["ms_forward_backward"] = median(time_calls(forward_backward, device, warmup=2, iters=args.iters))
    return result, (out.detach().clone(), q.grad.clone() if q.requires_grad else out.detach())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=2)
    parser.add_argument("--context", type=int, default=8192, help="context tokens a row (the recipe's pack_tokens)")
    parser.add_argument("--anchors", type=int, default=624, help="anchors a row")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--tiny", action="store_true", help="small shapes on the CPU, uncompiled (a smoke test)")
    args = parser.parse_args(argv)
    if args.tiny:
        args.rows, args.context, args.anchors, args.heads, args.kv_heads, args.head_dim, args.iters = 1, 512, 8, 2, 1, 16, 2
    device = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    if device.type == "cpu" and not args.tiny:
        print("benchmarks.flex_tiles times GPU kernels: run it on a CUDA device, or pass --tiny")
        raise SystemExit(2)
    rows = packed_rows(args.rows, args.context, args.anchors, args.block_size)
    tensors = attention_inputs(args, device, torch.float32 if args.tiny else torch.bfloat16)
    results, reference = [], None
    for name in OPTION_SETS:
        result, kept = run_option_set(name, rows, tensors, args, reference)
        reference = reference or kept
        results.append(result)
        print_row(result, results[0])
    path = write_result("flex_tiles", {"config": vars(args), "results": results},
                        smoke=args.tiny)
    print(f"wrote {path}")


def print_row(result: dict[str, Any], baseline: dict[str, Any]) -> None:
    if not result["built"]:
        print(f"{result['option_set']:<28} not built: {result['error']}", flush=True)
        return
    ratio = (baseline["ms_forward_backward"] / result["ms_forward_backward"]) if baseline.get("built") else float("nan")
    diffs = f"out {result.get('max_diff_out') or 0.0:.1e}, dq {result.get('max_diff_q_grad') or 0.0:.1e}"
    print(f"{result['option_set']:<28} {result['ms_forward_backward']:>8.3f} ms  {ratio:>5.2f}× the 128-token tiles  "
          f"{result['tiles_computed']:>8} tiles  ({diffs})", flush=True)


if __name__ == "__main__":
    main()
