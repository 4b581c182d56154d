"""The smollm2 section of `benchmarks.decode`: SmolLM2-135M-Instruct with a drafter on chat prompts, our loop
against the reference loop, our target-only loop and Hugging Face `generate`, tokens compared one for one."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.decode_timing import random_draft
from benchmarks.shapes import TINY_QWEN3, random_target
from dflash_train.runtime.engine import DecodeEngine, EngineConfig
from dflash_train.target import TargetModel


def smollm2_setup(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> tuple[Any, Any, list, list]:
    """(target, drafter, prompts as token lists, stop ids): SmolLM2 + chat prompts, or a tiny stand-in."""
    from dflash_train.data.prompt_ids import prompt_ids, stop_token_ids
    from dflash_train.prompts.eval_sets import load_prompt_set
    from dflash_train.target import load_target, resolve_mask_token_id

    if args.tiny:
        target = random_target("qwen3", {**TINY_QWEN3, "num_hidden_layers": 6}, device, dtype)
        gen = torch.Generator().manual_seed(1)
        prompts = [torch.randint(0, 500, (n,), generator=gen).tolist() for n in (9, 14, 5)][: args.prompts]
        return target, random_draft(target, 2, 16, 511), prompts, []
    target = load_target(args.target, dtype=dtype, device=device)
    if args.draft:
        from dflash_train.checkpoint import load_draft

        draft = load_draft(args.draft, device=device, dtype=dtype)
    else:
        draft = random_draft(target, 5, 16, resolve_mask_token_id(target.tokenizer, target.vocab_size))
    half = (args.prompts + 1) // 2
    sets = [load_prompt_set("mt-bench", half), load_prompt_set("humaneval", args.prompts - half)]
    messages = [[{"role": "user", "content": c.turns[0]}] for s in sets for c in s.conversations]
    prompts = [prompt_ids(target.tokenizer, m, thinking=False) for m in messages]
    return target, draft, prompts, stop_token_ids(target.tokenizer, target.model.generation_config)


def timed(fn: Callable[[], Any], device: torch.device) -> tuple[Any, float]:
    if device.type == "cuda":
        torch.cuda.synchronize()
    began = time.perf_counter()
    value = fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return value, time.perf_counter() - began


def section_smollm2(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    from benchmarks.reference_loop import reference_generate

    target, draft, prompts, stop = smollm2_setup(args, device, dtype)
    new, block = args.max_new_tokens, draft.config.block_size
    length = -(-(max(map(len, prompts)) + new + 2 * block) // 256) * 256
    config = EngineConfig(block_size=block, max_new_tokens=new, max_length=length, stop_token_ids=tuple(stop))
    ours = DecodeEngine(target, draft, config)
    alone = DecodeEngine(target, None, config, runner=ours.runner)
    for engine in (ours, alone):  # warm-up: kernel compilation and graph capture are not timed
        engine.generate(prompts[:1])
    (outputs, ours_stats), ours_s = timed(lambda: ours.generate(prompts), device)
    (alone_outputs, alone_stats), alone_s = timed(lambda: alone.generate(prompts), device)
    reference_generate(target, draft, prompts[0], 8, stop, block)  # warm-up
    references, reference_s = timed(lambda: [reference_generate(target, draft, p, new, stop, block) for p in prompts],
                                    device)
    generated = sum(len(o.tokens) for o in outputs)
    result = {
        "draft": args.draft or "random", "block_size": block, "prompts": len(prompts), "max_new_tokens": new,
        "ours_tokens_per_s": generated / ours_s,
        "reference_loop_tokens_per_s": sum(len(t) for t, _ in references) / reference_s,
        "ours_target_only_tokens_per_s": sum(len(o.tokens) for o in alone_outputs) / alone_s,
        "identical_tokens": sum(o.tokens == t for o, (t, _) in zip(outputs, references, strict=True)),
        "identical_acceptance": sum(o.acceptance_lengths == a for o, (_, a) in zip(outputs, references, strict=True)),
        "lossless_vs_target_only": sum(o.tokens == b.tokens for o, b in zip(outputs, alone_outputs, strict=True)),
        "dtype": str(dtype).removeprefix("torch."),
        "tau": sum(sum(o.acceptance_lengths) / max(len(o.acceptance_lengths), 1) for o in outputs) / len(outputs),
        "reference_loop_tau": sum(sum(a) / max(len(a), 1) for _, a in references) / len(references),
        "cuda_graph": ours.uses_cuda_graph,
    }
    result["hf_generate_tokens_per_s"] = hf_generate_tokens_per_s(target, prompts, new, stop, device)
    result["ours_over_reference_loop"] = result["ours_tokens_per_s"] / result["reference_loop_tokens_per_s"]
    result["speedup_over_own_target_only"] = result["ours_tokens_per_s"] / result["ours_target_only_tokens_per_s"]
    # The eval's definition: decode tokens/s, prefill excluded.
    result["ours_decode_tokens_per_s"] = ours_stats.decode_tokens_per_s
    result["ours_target_only_decode_tokens_per_s"] = alone_stats.decode_tokens_per_s
    result["decode_speedup_over_own_target_only"] = ours_stats.decode_tokens_per_s / alone_stats.decode_tokens_per_s
    # Where a speedup goes: milliseconds per cycle of each loop (decode time over cycles run).
    for key, stats in (("ours_cycle_ms", ours_stats), ("ours_target_only_step_ms", alone_stats)):
        result[key] = (stats.wall_s - stats.prefill_s) / max(stats.cycles, 1) * 1e3
    return result


def hf_generate_tokens_per_s(target: TargetModel, prompts: list[list[int]], new: int, stop: list[int],
                             device: torch.device) -> float:
    def run() -> int:
        total = 0
        for prompt in prompts:
            ids = torch.tensor([prompt], device=device)
            out = target.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
                                        eos_token_id=stop or None, pad_token_id=stop[0] if stop else 0)
            total += out.shape[1] - len(prompt)
        return total

    tokens, seconds = timed(run, device)
    return tokens / seconds
