"""Packed vs padded training at SmolLM2 shapes: chat-passes per minute, valid block tokens/s, MFU, cold start.

    python -m benchmarks.train_packing                       # random SmolLM2-shaped target, synthetic chats
    python -m benchmarks.train_packing --prepared DIR --target DIR   # real regenerated chats and target

Each variant runs the real `Trainer` in its own process with an empty compilation cache, so its first
step is a cold start (compilation included), as on a fresh machine. Chats, without `--prepared`, have
lengths drawn from a log-normal distribution with a mean of about 480 tokens (regenerated SmolLM2 chats
average ~475), cut to 64..2048, the first 30 % of each unsupervised (system prompt and question). Every
variant draws up to `--num-anchors` anchors per chat, so anchors per supervised token are equal and
only the layout differs: `padded` is the unpacked path (16 chats a step, each padded to 2,048).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import H200_BF16_PEAK, write_result

VARIANTS: dict[str, list[str]] = {
    "padded": ["data.max_length=2048", "training.batch_size=16", "training.compile=true"],
    "packed": ["data.max_length=2048", "data.pack_tokens=8192", "training.batch_size=2", "training.compile=true"],
    "packed-4x-rows": ["data.max_length=2048", "data.pack_tokens=16384", "training.batch_size=4",
                        "training.compile=true"],
    "packed-eager-layers": ["data.max_length=2048", "data.pack_tokens=8192", "training.batch_size=2",
                             "training.compile=false"],
}
RESULT_PREFIX = "RESULT "


def save_smollm2_shaped_target(path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

    config = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, head_dim=64, vocab_size=49152, tie_word_embeddings=True,
                         rope_theta=1e5, max_position_embeddings=8192)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(path)
    vocab = {f"t{i}": i for i in range(1000)} | {"<|im_end|>": 2, "<empty_output>": 16}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>").save_pretrained(path)


def save_synthetic_chats(path: Path, chats: int, target: Path) -> None:
    import datasets
    from transformers import AutoTokenizer

    from dflash_train.data.prepared import tokenizer_hash

    gen = torch.Generator().manual_seed(0)
    lengths = torch.exp(torch.randn(chats, generator=gen) * 0.6 + 6.0).clamp(64, 2048).long().tolist()
    ids = [torch.randint(17, 49152, (n,), generator=gen).tolist() for n in lengths]
    masks = [[0] * (3 * n // 10) + [1] * (n - 3 * n // 10) for n in lengths]
    datasets.Dataset.from_dict({"input_ids": ids, "loss_mask": masks}).save_to_disk(str(path))
    meta = {"target": str(target), "tokenizer_hash": tokenizer_hash(AutoTokenizer.from_pretrained(target))}
    (path / "dflash_data.json").write_text(json.dumps(meta))


def run_variant(name: str, target: Path, prepared: Path, work: Path, steps: int, num_anchors: int) -> dict[str, Any]:
    """One variant in this process: setup, the cold first step, then `steps` steps with prefetching."""
    from dflash_train.training.config import load_config
    from dflash_train.training.trainer import Trainer

    overrides = [f"model.target={target}", "model.mask_token_id=16", f"data.prepared={prepared}",
                 "data.validation_fraction=0", f"training.num_anchors={num_anchors}", "tracking.report_to=none",
                 f"training.output_dir={work / 'run'}", "training.resume=none", "training.max_steps=100000",
                 "training.eval_every=0", "training.save_every=100000000", *VARIANTS[name]]
    started = time.perf_counter()
    trainer = Trainer(load_config(None, overrides))
    setup_s = time.perf_counter() - started
    pool = ThreadPoolExecutor(1)
    upcoming = pool.submit(trainer._load_step, trainer.step)
    rows: list[dict[str, float]] = []
    for _ in range(steps + 1):
        began = time.perf_counter()
        loaded = upcoming.result()
        upcoming = pool.submit(trainer._load_step, trainer.step + 1)
        metrics = trainer.train_step(loaded)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        rows.append({"seconds": time.perf_counter() - began, "chats": sum(len(ids) for ids, _ in loaded),
                     "tokens": metrics["tokens"], "slots": metrics["supervised_slots"], "flops": metrics["flops"]})
    pool.shutdown()
    first, steady = rows[0], rows[1:]
    step_s = statistics.median(r["seconds"] for r in steady)
    total_s = sum(r["seconds"] for r in steady)
    peak = H200_BF16_PEAK if torch.cuda.is_available() and "H200" in torch.cuda.get_device_name() else None
    return {
        "variant": name, "setup_s": setup_s, "first_step_s": first["seconds"], "step_s_median": step_s,
        "chats_per_step": statistics.mean(r["chats"] for r in steady),
        "chat_passes_per_min": 60 * sum(r["chats"] for r in steady) / total_s,
        "tokens_per_s": sum(r["tokens"] for r in steady) / total_s,
        "valid_block_tokens_per_s": sum(r["slots"] for r in steady) / total_s,
        "mfu": (sum(r["flops"] for r in steady) / total_s / peak) if peak else None,
        "pack_token_fill": metrics.get("pack_token_fill"), "pack_anchor_fill": metrics.get("pack_anchor_fill"),
    }


def launch(name: str, args: argparse.Namespace, target: Path, prepared: Path, work: Path) -> dict[str, Any] | None:
    """A variant in a fresh process with an empty compilation cache; None if it failed."""
    run_dir = work / f"{name}-{time.time_ns()}"  # a fresh folder: a cold compilation cache every time
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(run_dir / "inductor"), PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "benchmarks.train_packing", "--one", name, "--target", str(target),
           "--prepared", str(prepared), "--workdir", str(run_dir), "--steps", str(args.steps),
           "--num-anchors", str(args.num_anchors)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_PREFIX):
            return json.loads(line[len(RESULT_PREFIX):])
    print(f"{name}: failed (exit {proc.returncode})\n{proc.stderr[-3000:]}", flush=True)
    return None


def print_row(result: dict[str, Any], baseline: dict[str, Any] | None) -> None:
    ratio = result["chat_passes_per_min"] / baseline["chat_passes_per_min"] if baseline else 1.0
    mfu = f"{result['mfu']:.1%}" if result["mfu"] is not None else "-"
    print(f"{result['variant']:<22} {result['chats_per_step']:>7.1f} {result['step_s_median']:>8.3f} "
          f"{result['chat_passes_per_min']:>10,.0f} {ratio:>6.2f}x {result['valid_block_tokens_per_s']:>12,.0f} "
          f"{mfu:>6} {result['first_step_s']:>8.1f} {result['setup_s']:>7.1f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", type=Path, default=None)
    parser.add_argument("--prepared", type=Path, default=None)
    parser.add_argument("--chats", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--num-anchors", type=int, default=512)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # run one variant here (child process)
    args = parser.parse_args()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="dflash_pack_"))
    if args.one:
        result = run_variant(args.one, args.target, args.prepared, work, args.steps, args.num_anchors)
        print(RESULT_PREFIX + json.dumps(result), flush=True)
        return
    target = args.target or work / "target"
    if args.target is None and not (target / "tokenizer.json").exists():
        save_smollm2_shaped_target(target)
    prepared = args.prepared or work / "prepared"
    if args.prepared is None and not (prepared / "dflash_data.json").exists():
        save_synthetic_chats(prepared, args.chats, target)
    print(f"\nTraining layouts, SmolLM2 shapes, N={args.num_anchors} anchors per chat, {args.steps} steps each")
    print(f"{'variant':<22} {'chats/st':>7} {'step s':>8} {'chats/min':>10} {'vs pad':>7} {'block tok/s':>12} "
          f"{'MFU':>6} {'first s':>8} {'setup s':>7}", flush=True)
    results, baseline, path = [], None, None
    names = [name.strip() for name in args.variants.split(",")]
    unknown = [name for name in names if name not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}: choose from {', '.join(VARIANTS)}")
    for name in names:
        result = launch(name, args, target, prepared, work)
        if result is None:
            continue
        baseline = baseline or (result if name == "padded" else None)
        results.append(result)
        print_row(result, baseline)
        # Written after every variant: a run cut short by a time limit keeps what it measured.
        path = write_result("train_packing", {"config": {k: str(v) for k, v in vars(args).items()},
                                              "results": results,
                                              "goal": ">= 4x the padded path's chat-passes per minute"})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
