"""The fused distillation kernel (`dflash_train.kernels.distill_loss`) at the training step's chunk shape, by
vocabulary tile and warps, against the device's copy bandwidth and the PyTorch reference, all in one run:

    python -m benchmarks.distill_loss                   # SmolLM2's vocabulary, the trainer's chunk of rows
    python -m benchmarks.distill_loss --tiny            # a CPU smoke test (TRITON_INTERPRET=1, small shapes)

The kernel reads both logits twice (statistics, then the gradient) and writes the gradient over the drafter's:
five row-lengths of the logits' dtype a row. It is bound by memory, so each launch configuration is reported
as the bytes it moves a second and as a share of a plain device-to-device copy of the same bytes measured in
the same run (the ceiling a streaming kernel can reach). Every configuration's loss is checked against the
default configuration's before it is timed.
"""

from __future__ import annotations

import argparse
import itertools
import os
from typing import Any

import torch

from benchmarks.common import median, time_calls, write_result
from dflash_train.kernels import distill_loss as dl
from dflash_train.objective.distill import distill_chunk_rows

SMOLLM2_VOCAB = 49152
PASSES = 5  # row-lengths of logits the kernel streams with a gradient: x and t read twice, the gradient written


def copy_gb_s(numel: int, dtype: torch.dtype, device: torch.device, iters: int) -> float:
    """GB/s of a device-to-device copy of `numel` elements (read and write counted)."""
    src = torch.randn(numel, device=device).to(dtype)
    dst = torch.empty_like(src)
    ms = median(time_calls(lambda: dst.copy_(src), device, warmup=3, iters=iters))
    return 2 * src.numel() * src.element_size() / (ms * 1e-3) / 1e9


def inputs(rows: int, vocab: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator(device=device).manual_seed(0)
    logits = (torch.randn(rows, vocab, device=device, generator=gen) * 3).to(dtype)
    teacher = (torch.randn(rows, vocab, device=device, generator=gen) * 3).to(dtype)
    labels = torch.randint(vocab, (rows,), device=device, generator=gen)
    return logits, teacher, labels


def measure(config: tuple[int, int] | None, rows: int, vocab: int, dtype: torch.dtype, device: torch.device,
            iters: int, reference_loss: torch.Tensor | None) -> dict[str, Any]:
    """Milliseconds a call of one launch configuration (None: the PyTorch reference), and its loss's largest
    relative difference from `reference_loss`."""
    logits, teacher, labels = inputs(rows, vocab, dtype, device)
    fresh = logits.clone()
    if config is None:
        def call() -> Any:
            return dl.distill_grad_reference(logits, teacher, labels, "kl", 1.0, 1.0)
    else:
        block_v, warps = config

        def call() -> Any:
            return dl.distill_grad_triton(logits, teacher, labels, "kl", 1.0, 1.0, block_v=block_v, num_warps=warps)
    loss = call()[0]
    logits.copy_(fresh)  # the gradient overwrote them: time on the same logits as the check
    error = 0.0 if reference_loss is None else float(((loss - reference_loss).abs() / reference_loss.abs()).max())
    ms = median(time_calls(call, device, warmup=2, iters=iters))  # rewriting a gradient costs the same
    moved = PASSES * rows * vocab * logits.element_size()
    return {"ms": ms, "gb_s": moved / (ms * 1e-3) / 1e9, "loss_max_rel_diff": error, "loss": loss}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=SMOLLM2_VOCAB)
    parser.add_argument("--rows", type=int, default=None, help="rows a call (default: the trainer's chunk)")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--tiny", action="store_true", help="small shapes on a CPU under TRITON_INTERPRET=1")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("without a GPU the kernel runs only interpreted: TRITON_INTERPRET=1 python -m "
                         "benchmarks.distill_loss --tiny")
    vocab = 512 if args.tiny else args.vocab
    rows = args.rows or (8 if args.tiny else distill_chunk_rows(vocab, fused=True))
    iters = 2 if args.tiny else args.iters
    dtype = torch.bfloat16
    configs = [(128, 4), (256, 8)] if args.tiny else list(itertools.product((2048, 4096, 8192), (4, 8, 16)))
    ceiling = copy_gb_s(PASSES * rows * vocab // 2, dtype, device, iters)
    default = measure((dl.BLOCK_V, dl.NUM_WARPS), rows, vocab, dtype, device, iters, None)
    results = [{"config": "torch reference", **measure(None, rows, vocab, dtype, device, iters, default["loss"])}]
    for block_v, warps in configs:
        found = measure((block_v, warps), rows, vocab, dtype, device, iters, default["loss"])
        results.append({"config": f"BLOCK_V={block_v} num_warps={warps}", "block_v": block_v, "num_warps": warps,
                        "default": (block_v, warps) == (dl.BLOCK_V, dl.NUM_WARPS), **found})
    print(f"{rows} rows x {vocab} vocabulary, bf16, KL at T=1 with its gradient; copy ceiling {ceiling:.0f} GB/s")
    print(f"{'launch':<28} {'ms':>8} {'GB/s':>8} {'of copy':>8} {'vs default':>10} {'loss diff':>10}")
    for row in results:
        row.pop("loss")
        row["of_copy"] = row["gb_s"] / ceiling
        row["vs_default"] = default["ms"] / row["ms"]
        print(f"{row['config']:<28} {row['ms']:>8.3f} {row['gb_s']:>8.0f} {row['of_copy']:>7.1%} "
              f"{row['vs_default']:>9.2f}x {row['loss_max_rel_diff']:>10.1e}")
    path = write_result("distill_loss", {"rows": rows, "vocab": vocab, "copy_gb_s": ceiling, "results": results},
                        smoke=args.tiny)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
