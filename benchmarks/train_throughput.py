"""End-to-end trainer throughput vs the bare training step, at Qwen3-8B drafter shapes (H200).

    python -m benchmarks.train_throughput            # writes benchmarks/results/train_throughput.json

A random Qwen3-8B-wide target (hidden 4096, 32/8 heads, intermediate 12288, vocab 151,936) with
fewer layers (8: the drafter's 5 feature layers are [1..5]; the full 36 layers only change the
online-feature cost, reported separately) is saved to disk with a minimal tokenizer; random
3072-token chats are prepared and their features extracted offline (bf16) with `dflash-train
extract`. Then, in one run:
- bare: the foundation benchmark's optimised step (flex mask, chunked head/CE, compiled layers);
- trainer-offline: the real `Trainer` (prefetching loader, accelerate, metrics) on the feature store;
- trainer-online: the same reading tokens only, the 8-layer target computing features each step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import device_peak_flops, median, write_result

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, VOCAB = 4096, 32, 8, 128, 12288, 151936


def save_random_target(path: Path, num_layers: int) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen3Config

    config = Qwen3Config(hidden_size=HIDDEN, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                         head_dim=HEAD_DIM, intermediate_size=INTER, vocab_size=VOCAB,
                         num_hidden_layers=num_layers, max_position_embeddings=40960, tie_word_embeddings=False)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(path)
    vocab = {f"t{i}": i for i in range(1000)} | {"<|im_end|>": 1000}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>").save_pretrained(path)


def save_random_chats(path: Path, rows: int, seq_len: int, target: Path) -> None:
    import datasets
    from transformers import AutoTokenizer

    from dflash_train.data.prepared import tokenizer_hash

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (rows, seq_len), generator=gen).tolist()
    mask = [[0] * (seq_len // 10) + [1] * (seq_len - seq_len // 10)] * rows
    datasets.Dataset.from_dict({"input_ids": ids, "loss_mask": mask}).save_to_disk(str(path))
    meta = {"target": str(target), "tokenizer_hash": tokenizer_hash(AutoTokenizer.from_pretrained(target)), "rows": rows}
    (path / "dflash_data.json").write_text(json.dumps(meta))


def time_trainer(overrides: list[str], warmup: int, steps: int) -> dict[str, Any]:
    from dflash_train.training.config import load_config
    from dflash_train.training.trainer import Trainer

    trainer = Trainer(load_config(None, overrides))
    pool = ThreadPoolExecutor(1)
    upcoming = pool.submit(trainer._load_step, trainer.step)
    step_times, tokens = [], []
    for i in range(warmup + steps):
        started = time.perf_counter()
        loaded = upcoming.result()
        upcoming = pool.submit(trainer._load_step, trainer.step + 1)
        metrics = trainer.train_step(loaded)
        torch.cuda.synchronize()
        if i >= warmup:
            step_times.append(time.perf_counter() - started)
            tokens.append(metrics["tokens"])
    pool.shutdown()
    peak = device_peak_flops()
    return {"step_s_median": median(step_times), "tokens_per_s": sum(tokens) / sum(step_times),
            "mfu_last": metrics["flops"] / statistics.median(step_times) / peak if peak else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-len", type=int, default=3072)
    parser.add_argument("--rows", type=int, default=24)
    parser.add_argument("--target-layers", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--workdir", default=None)
    args = parser.parse_args()
    from benchmarks.train_step import QWEN3_8B, run_variant
    from dflash_train.cli import main as cli
    from dflash_train.models import DFlashConfig

    work = Path(args.workdir or tempfile.mkdtemp(prefix="dflash_tp_"))
    target, prepared, store = work / "target", work / "prepared", work / "features"
    if not (target / "tokenizer.json").exists():  # written last: a complete target directory
        save_random_target(target, args.target_layers)
    if not (prepared / "dflash_data.json").exists():
        save_random_chats(prepared, args.rows, args.seq_len, target)
    layer_ids = ",".join(str(i) for i in range(1, 6))
    if cli(["extract", "--out", str(store), "--data", str(prepared), "--target", str(target),
                                   "--layer-ids", layer_ids, "--device", "cuda:0"]) != 0:
        raise SystemExit("extraction failed")

    bare_args = argparse.Namespace(seq_len=args.seq_len, num_anchors=512, block_size=16, warmup=3, iters=10,
                                   no_compile=False)
    config = DFlashConfig(**QWEN3_8B, num_hidden_layers=5, mask_token_id=151669, block_size=16)
    bare = run_variant("optimised", bare_args, config)
    common = [f"model.target={target}", "model.mask_token_id=151669", "model.num_draft_layers=5",
              "model.block_size=16", f"model.target_layer_ids=[{layer_ids}]", f"data.max_length={args.seq_len}",
              "data.validation_fraction=0", "training.batch_size=1", "training.num_anchors=512",
              "training.compile=true", "training.attention=flex", "tracking.report_to=none",
              f"training.output_dir={work / 'run'}", "training.resume=none", "training.max_steps=1000"]
    offline = time_trainer(common + [f"data.features={store}"], args.warmup, args.steps)
    online = time_trainer(common + [f"data.prepared={prepared}"], args.warmup, args.steps)
    bare_tps = args.seq_len / (bare["step_ms_median"] / 1e3)
    rows = [("bare step", bare_tps, bare["step_ms_median"] / 1e3), ("trainer, offline", offline["tokens_per_s"],
            offline["step_s_median"]), ("trainer, online", online["tokens_per_s"], online["step_s_median"])]
    print(f"\nTrainer throughput, Qwen3-8B drafter shapes, S={args.seq_len}, N=512, B=16 (target: {args.target_layers} layers)")
    print(f"{'variant':<18} {'tokens/s':>10} {'step s (median)':>16} {'vs bare':>8}")
    for name, tps, step_s in rows:
        print(f"{name:<18} {tps:>10,.0f} {step_s:>16.3f} {tps / bare_tps:>7.1%}")
    path = write_result("train_throughput", {"config": vars(args), "bare": bare, "offline": offline,
                                             "online": online, "offline_vs_bare": offline["tokens_per_s"] / bare_tps,
                                             "online_vs_bare": online["tokens_per_s"] / bare_tps})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
