"""Measure a drafter's acceptance length (τ) and speedup on prompt sets, checking that greedy speculative
decoding reproduces the target's own output on every prompt, token for token in any dtype.

    dflash-train eval --target smollm2-135m-instruct --draft runs/smollm2/final --dataset mt-bench \\
        --dataset humaneval --num-prompts 20 --max-new-tokens 256 --out eval/report.json
    dflash-train eval --target Qwen/Qwen3-8B --draft z-lab/Qwen3-8B-DFlash-b16 --dataset humaneval \\
        --block-size 16 --device cuda --dtype bfloat16 --batch-size 4
    dflash-train eval --target smollm2-135m-instruct --draft random --dataset prompts.jsonl --device cpu
    dflash-train eval --target smollm2-135m-instruct --draft runs/smollm2/final --dataset mt-bench \
        --temperature 0,0.7,1 --out eval/temperatures.json

Both the target alone and target + drafter run through the same fast loop (static caches, decisions on
the device, CUDA graphs and Triton kernels on GPU). The speedup is measured against the target alone
decoding one token per step; the lossless check compares against a third pass, the target alone through
the drafter run's own verify pass with every draft refused, which makes it exact in bf16 too
(`dflash_train.eval.run`). `--draft random` builds an untrained drafter: τ near 1, useful to check the loop
and the lossless property. Writes the JSON report, a PNG next to it, and a summary table. A comma list of
temperatures decodes the same prompts with the same seed at each, into one report (`dflash_train.eval.sweep`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

from dflash_train.checkpoint import draft_from_checkpoint, read_checkpoint
from dflash_train.checkpoint.io import DraftCheckpoint
from dflash_train.commands import run_command
from dflash_train.commands.data_args import (
    add_target_argument,
    device_arg,
    positive_int,
    resolve_device,
    temperature_list,
)
from dflash_train.commands.data_args import temperature as scale_arg
from dflash_train.disk import note_output
from dflash_train.eval.compat import check_compatible
from dflash_train.eval.console import print_summary, progress_bars
from dflash_train.eval.phases import PhaseTimer
from dflash_train.eval.report import build_report, is_eval_report, write_outputs
from dflash_train.eval.run import MAX_AUTOTUNE, EvalSettings, Evaluator
from dflash_train.eval.sweep import SweepRun
from dflash_train.models import DFlashConfig, DFlashDraftModel
from dflash_train.models.layers import RotaryEmbedding
from dflash_train.outputs import check_output_file
from dflash_train.prompts.eval_sets import PromptSet, load_prompt_set
from dflash_train.runtime.config import (
    COMPILE_SCOPE_HELP,
    COMPILE_SCOPES,
    DRAFT_ATTENTIONS,
    KERNELS,
    MATMULS,
    VERIFICATIONS,
    EngineConfig,
    stop_token_ids,
)
from dflash_train.target import (
    TargetModel,
    ensure_converted_gguf,
    is_legacy_fingerprint,
    load_target,
    resolve_mask_token_id,
    resolve_target_source,
    target_fingerprint,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_target_argument(parser)
    parser.add_argument("--draft", required=True, help="drafter checkpoint directory or Hub id; 'random' for an "
                                                       "untrained drafter")
    parser.add_argument("--dataset", action="append", required=True,
                        help="humaneval, mt-bench, alpaca-eval, ifeval, math-synthetic, or a .jsonl file; repeatable")
    parser.add_argument("--block-size", type=positive_int, default=None, help="default: the drafter's block size")
    parser.add_argument("--max-new-tokens", type=positive_int, default=256)
    parser.add_argument("--num-prompts", type=positive_int, default=None, help="K conversations of each set, spread evenly over it (MT-Bench: every category)")
    parser.add_argument("--temperature", dest="temperatures", type=temperature_list, default=[0.0],
                        help="0: greedy (lossless check); a comma list (0,0.7,1) decodes the same prompts with the same "
                             "seed at each, into one report with τ and speedup against temperature")
    parser.add_argument("--draft-temperature-scale", type=scale_arg, default=1.0, metavar="S",
                        help="at a temperature T > 0, sample drafts at S*T (0: the drafter's argmax); the output "
                             "stays the target's at T")
    parser.add_argument("--verification", choices=VERIFICATIONS, default="token",
                        help="at a temperature > 0, test each draft on its own in order (token, as serving runtimes "
                             "do) or the block's drafts together (block: the same output distribution, never fewer "
                             "drafts kept on average)")
    parser.add_argument("--thinking", choices=("on", "off"), default="off", help="where the chat template has it")
    parser.add_argument("--batch-size", type=positive_int, default=1, help="requests in flight at once")
    parser.add_argument("--device", type=device_arg, default=None,
                        help="default: cuda:$LOCAL_RANK if a GPU is present (one eval per GPU beside others), else cpu")
    parser.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float16", "float32"),
                        help="auto: bfloat16 on cuda, float32 on cpu")
    parser.add_argument("--kernels", default="auto", choices=KERNELS,
                        help="auto: triton on CUDA when installed, else torch")
    parser.add_argument("--draft-attention", default="kernel", choices=DRAFT_ATTENTIONS,
                        help="the drafter's block attention in the loop: kernel (split-key kernel over its context "
                             "cache, with --kernels triton) or sdpa (its own forward under a dense mask)")
    parser.add_argument("--matmul", default="auto", choices=MATMULS,
                        help="with --kernels triton, the products of decode and verify steps of at most 64 rows: auto "
                             "(the skinny kernel for the weight shapes its tilings were swept for on this GPU's "
                             "architecture, cuBLAS for the others), torch (cuBLAS), skinny (a kernel that streams the weight) or fused (skinny with each layer's "
                             "norms, SwiGLU, residual adds and attention prologue folded in: 6 launches a layer; target and "
                             "drafter)")
    parser.add_argument("--no-cuda-graphs", action="store_true")
    parser.add_argument("--no-compile", action="store_true",
                        help="skip torch.compile (CUDA graphs still apply): starts in seconds, decodes a little slower; "
                             "for correctness checks such as a float32 lossless run")
    parser.add_argument("--compile-scope", choices=COMPILE_SCOPES, default=None, help=COMPILE_SCOPE_HELP)
    parser.add_argument("--max-autotune", action="store_true",
                        help="compile with inductor's autotuned matmuls: minutes more compiling, a somewhat faster "
                             "step (docs/eval.md)")
    parser.add_argument("--ignore-eos", action="store_true", help="always generate --max-new-tokens tokens")
    parser.add_argument("--no-lossless-check", action="store_true",
                        help="skip the lossless check's pass (the target alone through the drafter run's verify "
                             "pass, about one more target-only pass over the prompts); lossless reads n/a")
    parser.add_argument("--no-teacher-forced", action="store_true",
                        help="skip the teacher-forced τ̂ (the drafter's accuracy on the target's own answers, a "
                             "forward over every answer after decoding); its fields read null")
    parser.add_argument("--target-cache", type=Path, default=None, metavar="DIR",
                        help="keep the target-alone pass (answers and speed) in DIR and reuse one decoded before with "
                             "the same target, device, settings and prompts: evaluating many drafters decodes the target "
                             "alone once (the lossless check still runs; the report marks reused sets)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--random-draft-layers", type=positive_int, default=5, help="layers of a --draft random drafter")
    parser.add_argument("--out", default="eval_report.json", help="report JSON; the PNG goes next to it")
    parser.add_argument("--no-plot", action="store_true")
    parser.add_argument("--no-progress", action="store_true")


def _validate(args: argparse.Namespace) -> None:
    # Counts, sizes and temperatures are checked while the arguments are read (positive_int, temperature_list).
    if args.max_autotune and args.no_compile:
        raise ValueError("--max-autotune tunes what torch.compile builds: drop --no-compile or --max-autotune")
    if args.compile_scope is not None and args.no_compile:
        raise ValueError("--compile-scope chooses what torch.compile builds: drop --no-compile or --compile-scope")
    if args.matmul not in ("auto", "torch") and args.kernels == "torch":
        raise ValueError(f"--matmul {args.matmul} runs on the Triton kernels: drop --kernels torch or --matmul")
    if args.target_cache is not None and args.target_cache.exists() and not args.target_cache.is_dir():
        raise ValueError(f"--target-cache {args.target_cache} is a file: give a folder (made if missing)")
    check_report_paths(args)  # written last: a bad path would fail after the whole evaluation


def check_report_paths(args: argparse.Namespace) -> None:
    """The report and its figure may replace an earlier eval report's, and nothing else: not an input (a prompt
    file, a GGUF target), not a file of another kind, not a figure no report beside it owns."""
    out = Path(args.out)
    check_output_file(out)
    if out.suffix.lower() == ".png":
        raise ValueError(f"--out {out}: the report is JSON and its figure goes next to it as .png; give a .json path")
    inputs = [args.target, args.draft, *args.dataset]
    if out.exists() and any(Path(item).exists() and Path(item).resolve() == out.resolve() for item in inputs):
        raise ValueError(f"--out {out} is one of this evaluation's inputs; pick another --out")
    earlier_report = out.exists() and is_eval_report(out)
    if out.exists() and not earlier_report:
        raise ValueError(f"--out {out} exists and is not an eval report (an earlier report is replaced); "
                         "move it or pick another --out")
    figure = out.with_suffix(".png")
    if not args.no_plot and figure.exists() and not earlier_report:
        raise ValueError(f"--out {out} would replace {figure}, which no eval report beside it owns; move it, "
                         "pick another --out or pass --no-plot")


def _device_and_dtype(args: argparse.Namespace) -> tuple[torch.device, torch.dtype]:
    device = torch.device(resolve_device(args.device))
    name = args.dtype if args.dtype != "auto" else ("bfloat16" if device.type == "cuda" else "float32")
    return device, getattr(torch, name)


def _load_target(name: str, device: torch.device, dtype: torch.dtype, phases: PhaseTimer) -> TargetModel:
    """`load_target`, with a .gguf file's conversion (once per file and dtype, then a cache lookup that
    hashes the file) timed apart from reading the converted weights."""
    source = resolve_target_source(name)
    if source.endswith(".gguf"):
        with phases.phase("load/gguf_conversion"):
            source = str(ensure_converted_gguf(Path(source), dtype))
    with phases.phase("load/target"):
        return load_target(source, dtype=dtype, device=device)


def _load_draft(args: argparse.Namespace, checkpoint: DraftCheckpoint | None, target: TargetModel,
                device: torch.device, dtype: torch.dtype) -> DFlashDraftModel:
    if checkpoint is not None:
        return draft_from_checkpoint(checkpoint, device=device, dtype=dtype).eval()
    mask_id = resolve_mask_token_id(target.tokenizer, target.vocab_size)
    config = DFlashConfig.from_target_config(target.config, mask_token_id=mask_id,
                                             num_hidden_layers=args.random_draft_layers,
                                             block_size=args.block_size or 16)
    torch.manual_seed(args.seed)
    draft = DFlashDraftModel(config).to(device=device, dtype=dtype)
    draft.rotary_emb = RotaryEmbedding(config).to(device)  # keep RoPE frequencies in fp32
    return draft.eval()


def _runtime_config(args: argparse.Namespace, target: TargetModel, block_size: int, batch_size: int,
                    temperature: float | None = None) -> EngineConfig:
    """The runtime's settings for every engine (block size and the caches' length are set by the evaluator; the
    temperature by a sweep, from the lowest of --temperature by default)."""
    temperature = min(args.temperatures) if temperature is None else temperature
    stops = () if args.ignore_eos else tuple(stop_token_ids(target.tokenizer, target.model.generation_config))
    return EngineConfig(batch_size=batch_size, block_size=block_size, max_new_tokens=args.max_new_tokens,
                        temperature=temperature, seed=args.seed, stop_token_ids=stops, kernels=args.kernels,
                        cuda_graphs=not args.no_cuda_graphs, compile=False if args.no_compile else None,
                        compile_options=MAX_AUTOTUNE if args.max_autotune else (), compile_scope=args.compile_scope or "layer",
                        draft_attention=args.draft_attention, matmul=args.matmul,
                        draft_temperature_scale=args.draft_temperature_scale, verification=args.verification)


def _warn_if_trained_for_another_target(draft: DFlashDraftModel, target: TargetModel, target_name: str) -> None:
    """One warning line (not an error: the run still measures the loop and the lossless property) when the
    drafter's checkpoint records another target's fingerprint: it learned to read the features of a model
    that is not this one, so its τ says little about what it would reach with its own."""
    recorded_by = (getattr(draft, "source_config", None) or {}).get("dflash_train") or {}
    recorded = recorded_by.get("target_fingerprint")
    # Nothing to compare: a published or random drafter, or an older checkpoint's hash, which depended on the
    # dtype the target was loaded in and would differ for the same model.
    if not isinstance(recorded, str) or is_legacy_fingerprint(recorded):
        return
    found = target_fingerprint(target.model)
    if found != recorded:
        trained_with = f" ({recorded_by['target']})" if recorded_by.get("target") else ""
        print(f"dflash-train eval: warning: the drafter was trained with another target{trained_with} than "
              f"{target_name} (target fingerprint {recorded}, this one {found}); expect a low τ, or pass the "
              f"target it was trained with", file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    phases = PhaseTimer()
    _validate(args)
    note_output(Path(args.out).parent)  # a full disk is reported with the report folder's free space
    with phases.phase("load/prompts"):  # fail fast on bad names
        prompt_sets = [load_prompt_set(name, args.num_prompts) for name in args.dataset]
    device, dtype = _device_and_dtype(args)
    with phases.phase("load/draft"):  # before the target: a wrong drafter path fails at once
        checkpoint = None if args.draft == "random" else read_checkpoint(args.draft)
    target = _load_target(args.target, device, dtype, phases)
    with phases.phase("load/draft"):
        draft = _load_draft(args, checkpoint, target, device, dtype)
        _warn_if_trained_for_another_target(draft, target, args.target)  # hashes the target's weights
    block_size = args.block_size or draft.config.block_size
    check_compatible(draft, target, block_size)
    # More rows than requests would only compute idle rows every cycle.
    batch_size = min(args.batch_size, max(len(s.conversations) for s in prompt_sets))
    temperatures = sorted(args.temperatures)  # the report's own figures are the lowest temperature's
    settings = EvalSettings(_runtime_config(args, target, block_size, batch_size, temperatures[0]),
                            thinking=args.thinking == "on", lossless_check=not args.no_lossless_check,
                            target_cache=args.target_cache, teacher_forced=not args.no_teacher_forced)
    with progress_bars(enabled=not args.no_progress) as progress:
        evaluator = Evaluator(target, draft, settings, progress, phases)
        runs = [SweepRun(t, _evaluate_sets(evaluator, prompt_sets, t, args.seed, len(temperatures) > 1))
                for t in temperatures]
    report = build_report(args, target, evaluator, runs)
    paths = write_outputs(report, Path(args.out), plot=not args.no_plot, phases=phases)
    print_summary(report, [str(p) for p in paths])
    return 0


def _evaluate_sets(evaluator: Evaluator, prompt_sets: list[PromptSet], temperature: float, seed: int,
                   sweep: bool) -> dict[str, Any]:
    """Every prompt set at `temperature`, each set's results under its report key. Every temperature starts
    from the same seed; in a sweep, a set's phases and progress lines name the temperature too."""
    evaluator.use_temperature(temperature)
    torch.manual_seed(seed)
    evaluator.reserve(prompt_sets)
    results: dict[str, Any] = {}
    for prompt_set in prompt_sets:
        key = prompt_set.name if prompt_set.name not in results else f"{prompt_set.name}#{len(results)}"
        results[key] = evaluator.evaluate_set(prompt_set, f"{key}@T={temperature:g}" if sweep else key)
    return results


def main(argv: list[str] | None = None) -> int:
    """`python -m dflash_train.commands.eval ...`: the same as `dflash-train eval ...`."""
    return run_command("eval", sys.modules[__name__], sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    sys.exit(main())
