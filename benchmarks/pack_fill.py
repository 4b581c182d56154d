"""How full packed rows are, by packing rule, on simulated chat lengths (CPU, seconds):

    python -m benchmarks.pack_fill              # 160k chats of each shape
    python -m benchmarks.pack_fill --chats 20000

A packed row has two budgets: its tokens (the target's pass) and its anchor slots (the drafter's blocks; an
empty slot still runs through the drafter). This compares, on the same chats in the same epoch order, the rows
of the trainer's rule (`pack_rows`: the most even of the first fitting chats in a window, capacity at the data's
anchors per token) with first fit, with and without an eighth of anchor slack. Per rule: the anchor slots a row
has, how full its tokens and slots are, chats a row, and seconds to pack. Chats are log-normal: "speedrun" is
shaped like the speedrun's regenerated chats (a third of the answers at the 512-token cap), "short" and "long"
bracket it. Anchors per chat are min(64, answer tokens less a block), as the speedrun's recipe draws them.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np

from benchmarks.common import write_result
from dflash_train.training.packing import derive_anchors_per_row, pack_rows

PACK_TOKENS = 8192
DEFAULT_CHATS = 160_000
NUM_ANCHORS = 64
BLOCK = 16
# name: (prompt tokens' log-median and spread, answers' log-median and spread, share of answers at the cap, cap)
SHAPES: dict[str, tuple[float, float, float, float, float, int]] = {
    "speedrun": (60, 0.8, 180, 0.9, 0.3, 512),
    "short": (30, 0.6, 60, 0.8, 0.0, 512),
    "long": (300, 1.0, 300, 0.7, 0.0, 1024),
}
# name: (choices weighed, anchor slack over the data's anchors per token)
RULES: dict[str, tuple[int, float]] = {
    "first fit, slack 1.125": (1, 1.125),
    "first fit, no slack": (1, 1.0),
    "balanced, no slack (trainer)": (16, 1.0),
}


def simulated_chats(shape: str, count: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, anchors) per chat, capped at 2,048 tokens."""
    prompt_median, prompt_spread, answer_median, answer_spread, capped, cap = SHAPES[shape]
    rng = np.random.default_rng(seed)
    prompts = np.clip(rng.lognormal(np.log(prompt_median), prompt_spread, count), 8, 1500)
    answers = np.clip(rng.lognormal(np.log(answer_median), answer_spread, count), 2, cap)
    answers = np.where(rng.random(count) < capped, cap, answers).astype(int)
    lengths = np.minimum(prompts.astype(int) + answers, 2048)
    return lengths, np.minimum(np.maximum(answers - BLOCK, 0), NUM_ANCHORS)


def fill(shape: str, rule: str, count: int) -> dict[str, Any]:
    lengths, anchors = simulated_chats(shape, count)
    choices, slack = RULES[rule]
    at_mean = derive_anchors_per_row(lengths, anchors, PACK_TOKENS)
    per_row = -(-int(np.ceil(at_mean * slack)) // 16) * 16
    order = np.random.default_rng(1).permutation(count).tolist()
    started = time.perf_counter()
    rows = pack_rows(order, lengths.tolist(), anchors.tolist(), PACK_TOKENS, per_row, choices=choices)
    seconds = time.perf_counter() - started
    rows = rows[:-5]  # the epoch's last rows are what is left over
    return {"shape": shape, "rule": rule, "chats": count, "anchor_slots": per_row,
            "token_fill": float(np.mean([lengths[r].sum() for r in rows])) / PACK_TOKENS,
            "anchor_fill": float(np.mean([anchors[r].sum() for r in rows])) / per_row,
            "chats_per_row": float(np.mean([len(r) for r in rows])), "pack_seconds": seconds,
            "mean_tokens": float(lengths.mean()), "mean_anchors": float(anchors.mean())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chats", type=int, default=DEFAULT_CHATS)
    args = parser.parse_args()
    results = []
    print(f"Packed rows of {PACK_TOKENS:,} tokens, {args.chats:,} simulated chats a shape")
    print(f"{'shape':9} {'rule':30} {'slots':>6} {'tokens':>7} {'slots':>7} {'chats/row':>9} {'vs trainer':>10} "
          f"{'pack s':>7}")
    for shape in SHAPES:
        rows = [fill(shape, rule, args.chats) for rule in RULES]
        trainer = rows[-1]
        for row in rows:
            row["chats_per_slot_vs_trainer"] = ((row["chats_per_row"] / row["anchor_slots"])
                                                / (trainer["chats_per_row"] / trainer["anchor_slots"]))
            print(f"{shape:9} {row['rule']:30} {row['anchor_slots']:>6} {row['token_fill']:>7.1%} "
                  f"{row['anchor_fill']:>7.1%} {row['chats_per_row']:>9.2f} {row['chats_per_slot_vs_trainer']:>10.3f} "
                  f"{row['pack_seconds']:>7.2f}")
        results += rows
    print("vs trainer: chats a row per anchor slot, over the trainer's rule's (below 1: more empty drafter work)")
    path = write_result("pack_fill", {"config": {"chats": args.chats, "pack_tokens": PACK_TOKENS,
                                                 "num_anchors": NUM_ANCHORS}, "results": results},
                        smoke=args.chats != DEFAULT_CHATS)  # a smaller draw never replaces the figures
    print(f"results: {path}")


if __name__ == "__main__":
    main()
