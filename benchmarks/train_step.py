"""One full drafter training step (forward, backward, optimizer) at Qwen3-8B shapes.

    python -m benchmarks.train_step                  # H200: all variants, writes results/train_step.json
    python -m benchmarks.train_step --seq-len 1024   # smaller problem

Drafter: 5 layers, hidden 4096, 32/8 heads, head_dim 128, intermediate 12288, K = 5 target layers;
frozen target embedding + lm_head (vocab 151,936) in bf16; random target features; one sequence of
S tokens with N anchors of block B; AdamW with fp32 master weights, bf16 autocast.

Variants, measured in the same run:
- optimised: flex-attention BlockMask (sparse), chunked fused head+CE over valid slots only,
  compiled decoder layers;
- optimised-eager: the same without torch.compile;
- naive: dense SDPA mask and full `[N*B, vocab]` fp32 logits (what a straightforward port does).
MFU uses the model-FLOPs count of docs/design.md §10 against the device's peak bf16 rate (the measured one
where `dflash_train.training.flops` has it); the matmul ceiling measured in the same run is printed beside it.
"""

from __future__ import annotations

import argparse
import gc
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.common import device_peak_flops, measure_matmul_tflops, median, time_cuda, write_result
from dflash_train.models import DFlashConfig, DFlashDraftModel
from dflash_train.objective import DFlashObjective, dense_mask
from dflash_train.objective.objective import ObjectiveOutput
from dflash_train.training.config import TrainingConfig
from dflash_train.training.flops import training_step_flops

QWEN3_8B = dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                intermediate_size=12288, vocab_size=151936, num_target_layers=36)


def naive_loss(objective: DFlashObjective, draft: DFlashDraftModel, embed: Any, head: torch.Tensor,
               input_ids: torch.Tensor, loss_mask: torch.Tensor, features: torch.Tensor, blocks: Any) -> Any:
    seq_len = input_ids.shape[1]
    mask = dense_mask(blocks.anchors, blocks.valid, seq_len, objective.block_size)
    with torch.no_grad():
        embeds = embed(blocks.input_ids)
    hidden = draft(embeds, blocks.positions, features, torch.arange(seq_len, device="cuda")[None], mask)
    logits = (hidden @ head.T).float()  # [1, N*B, V]: the whole thing
    slot = torch.arange(blocks.labels.shape[1], device="cuda") % objective.block_size
    w = torch.exp(-(slot - 1).float() / 7.0) * (blocks.labels[0] != -100)
    ce = F.cross_entropy(logits[0], blocks.labels[0], reduction="none", ignore_index=-100)
    return ObjectiveOutput((ce * w).sum() / w.sum(), slot.float(), slot.float(), 0)


def run_variant(name: str, args: argparse.Namespace, config: DFlashConfig) -> dict[str, Any]:
    torch.manual_seed(0)
    draft = DFlashDraftModel(config).cuda()  # fp32 master weights
    optimised = name.startswith("optimised")
    if name == "optimised" and not args.no_compile:
        draft.compile_layers()
    embed = torch.nn.Embedding(config.vocab_size, config.hidden_size, device="cuda", dtype=torch.bfloat16)
    embed.requires_grad_(False)
    head = torch.randn(config.vocab_size, config.hidden_size, device="cuda", dtype=torch.bfloat16) * 0.02
    opt = torch.optim.AdamW(draft.parameters(), lr=6e-4, weight_decay=0.0, fused=True)
    objective = DFlashObjective(block_size=args.block_size, mask_token_id=config.mask_token_id,
                                num_anchors=args.num_anchors, mask_kind="flex" if optimised else "dense")
    gen = torch.Generator(device="cuda").manual_seed(0)
    s = args.seq_len
    input_ids = torch.randint(0, config.vocab_size, (1, s), device="cuda", generator=gen)
    loss_mask = torch.ones(1, s, dtype=torch.bool, device="cuda")
    loss_mask[:, : s // 10] = False  # a prompt
    features = torch.randn(1, s, config.num_context_features * config.hidden_size, device="cuda",
                           dtype=torch.bfloat16, generator=gen)
    blocks = objective.make_blocks(input_ids, loss_mask, gen)

    def step() -> None:
        b = objective.make_blocks(input_ids, loss_mask, gen)  # anchors are re-drawn every step
        with torch.autocast("cuda", dtype=torch.bfloat16):
            if optimised:
                out = objective(draft, embed, head, input_ids, loss_mask, features, blocks=b)
            else:
                out = naive_loss(objective, draft, embed, head, input_ids, loss_mask, features, b)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    torch.cuda.reset_peak_memory_stats()
    try:
        times = time_cuda(step, warmup=args.warmup, iters=args.iters)
    except torch.OutOfMemoryError:
        return {"variant": name, "status": "OOM"}
    except Exception as error:  # report and go on to the next variant
        import traceback

        traceback.print_exc()
        return {"variant": name, "status": f"error: {type(error).__name__}"}
    peak = torch.cuda.max_memory_allocated() / 2**30
    visible = int(dense_mask(blocks.anchors, blocks.valid, s, args.block_size).sum())
    head_rows = int((blocks.labels != -100).sum())
    flops = training_step_flops(config, s, blocks.labels.shape[1], head_rows, visible)
    ms = median(times)
    peak_rate = device_peak_flops()
    result = {"variant": name, "status": "ok", "step_ms_median": ms, "step_ms_all": times,
              "model_tflop_per_step": flops / 1e12, "mfu": flops / (ms * 1e-3) / peak_rate if peak_rate else None,
              "peak_mem_gib": peak}
    return result


def _percent(fraction: float | None) -> str:
    return "-" if fraction is None else f"{100 * fraction:.1f}%"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-len", type=int, default=3072)
    parser.add_argument("--num-anchors", type=int, default=TrainingConfig.num_anchors)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-layers", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--variants", default="optimised,optimised-eager,naive")
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--name", default="train_step")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/train_step.py needs a CUDA device")
    config = DFlashConfig(**QWEN3_8B, num_hidden_layers=args.num_layers, mask_token_id=151669,
                          block_size=args.block_size)
    ceiling = measure_matmul_tflops()
    results = []
    for variant in args.variants.split(","):
        results.append(run_variant(variant, args, config))
        gc.collect()  # free the previous variant's weights and optimizer state
        torch.cuda.empty_cache()
    print(f"\nDFlash train step, Qwen3-8B shapes, S={args.seq_len} N={args.num_anchors} B={args.block_size}, "
          f"{args.num_layers} layers; bf16 matmul ceiling measured now: {ceiling:.0f} TFLOP/s")
    peak_rate = device_peak_flops()
    mfu_title = f"MFU vs {peak_rate / 1e12:.0f}" if peak_rate else "MFU"
    print(f"{'variant':<10} {'step ms (median)':>17} {'model TFLOP':>12} {mfu_title:>11} {'peak GiB':>9}")
    for r in results:
        if r["status"] != "ok":
            print(f"{r['variant']:<10} {r['status']:>17}")
            continue
        print(f"{r['variant']:<10} {r['step_ms_median']:>17.1f} {r['model_tflop_per_step']:>12.1f} "
              f"{_percent(r['mfu']):>11} {r['peak_mem_gib']:>9.1f}")
    ok = {r["variant"]: r for r in results if r["status"] == "ok"}
    if "optimised" in ok and "naive" in ok:
        print(f"speedup optimised/naive: {ok['naive']['step_ms_median'] / ok['optimised']['step_ms_median']:.2f}x")
    path = write_result(args.name, {"config": vars(args), "matmul_tflops_measured": ceiling, "results": results})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
