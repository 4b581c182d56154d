"""Built-in batched regeneration vs Hugging Face `generate` at the same batch size, SmolLM2-135M (H200).

    python -m benchmarks.regenerate                     # writes benchmarks/results/regenerate.json
    python -m benchmarks.regenerate --batch-sizes 1,32 --new-tokens 128

Both generate exactly --new-tokens greedy tokens per row (stop tokens ignored, so the work is equal) for
the same left-padded random prompts (lengths uniform in [--min-prompt, --max-prompt]). The built-in
generator (`dflash_train.data.generation.BatchGenerator`: static KV cache, one CUDA graph per shape,
on-device stopping) is timed after one warm-up call that captures its graph; `generate` gets one
warm-up call too. Goal: built-in >= 5x `generate`'s generated tokens/s. Also reported: how many rows
of the two outputs agree token for token (bf16 kernels may break near-ties differently).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

from benchmarks.common import write_result
from dflash_train.data.generation import BatchGenerator, GenerationSettings, left_pad


def random_prompts(batch: int, low: int, high: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(17, vocab, (int(torch.randint(low, high + 1, (1,), generator=g)),), generator=g).tolist()
            for _ in range(batch)]


def timed(fn: Any) -> tuple[float, Any]:
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start, out


@torch.no_grad()
def hf_fixed_length(model: Any, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    ids, mask = left_pad(prompts, 0, torch.device("cuda"))
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                         do_sample=False, temperature=None, top_p=None, top_k=None, pad_token_id=0)
    return out[:, ids.shape[1]:].tolist()


def run_batch(model: Any, batch: int, args: argparse.Namespace, vocab: int) -> dict[str, Any]:
    prompts = random_prompts(batch, args.min_prompt, args.max_prompt, vocab, seed=batch)
    settings = GenerationSettings(args.new_tokens, stop_ids=(-1,), pad_id=0)  # -1 never occurs: fixed length
    generator = BatchGenerator(model, settings)
    generator.generate(prompts)  # warm-up: captures the CUDA graph of this shape
    hf_fixed_length(model, prompts[:1], 4)
    ours_s, ours = timed(lambda: generator.generate(prompts))
    hf_s, theirs = timed(lambda: hf_fixed_length(model, prompts, args.new_tokens))
    tokens = batch * args.new_tokens
    same = sum(a.token_ids == b for a, b in zip(ours, theirs, strict=True))
    return {"batch": batch, "tokens": tokens, "builtin_s": ours_s, "hf_generate_s": hf_s,
            "builtin_tokens_per_s": tokens / ours_s, "hf_generate_tokens_per_s": tokens / hf_s,
            "speedup": hf_s / ours_s, "rows_identical": same}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", default="1,16,64")
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--min-prompt", type=int, default=32)
    parser.add_argument("--max-prompt", type=int, default=512)
    parser.add_argument("--target", default="smollm2-135m-instruct",
                        help="alias, local directory or .gguf of SmolLM2-135M-Instruct (a node without the alias's wheel)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/regenerate.py needs a CUDA device")
    from dflash_train.target import load_target

    target = load_target(args.target, dtype=torch.bfloat16, device="cuda")
    results = [run_batch(target.model, int(b), args, target.vocab_size) for b in args.batch_sizes.split(",")]
    print(f"\nregeneration, SmolLM2-135M-Instruct bf16, greedy, {args.new_tokens} new tokens per row")
    print(f"{'batch':>5} {'built-in tok/s':>15} {'HF generate tok/s':>18} {'speedup':>8} {'identical rows':>15}")
    for r in results:
        print(f"{r['batch']:>5} {r['builtin_tokens_per_s']:>15,.0f} {r['hf_generate_tokens_per_s']:>18,.0f} "
              f"{r['speedup']:>7.1f}x {r['rows_identical']:>9}/{r['batch']}")
    path = write_result("regenerate", {"config": vars(args), "goal": ">= 5x HF generate", "results": results})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
