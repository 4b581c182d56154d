"""The eval report: JSON (settings, environment, per-dataset results) and its figure."""

from __future__ import annotations

import argparse
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
import transformers

from dflash_train.atomic import write_json_atomically
from dflash_train.eval.phases import PhaseTimer
from dflash_train.eval.plot import plot_report
from dflash_train.eval.run import Evaluator
from dflash_train.eval.sweep import SWEEP_DEFINITIONS, SweepRun, sweep_section
from dflash_train.json_files import json_object_or_none
from dflash_train.target import TargetModel

# What each figure of the report means, written into every report so that a reader of the JSON alone knows.
REPORT_DEFINITIONS: dict[str, str] = {
    "acceptance_length": "mean over requests of the mean a+1 per cycle (a accepted drafts + 1 bonus); "
                         "each turn is a request",
    "acceptance_length_ci95": "95 % percentile-bootstrap interval of acceptance_length, requests resampled "
                              "(2,000 resamples, seeded)",
    "acceptance_length_per_request": "[conversation, turn, acceptance_length of that request alone] of every "
                                     "request (null without a cycle), for paired comparisons of two drafters",
    "acceptance_length_cycle_weighted": "mean a+1 over all cycles",
    "acceptance_length_by_turn": "acceptance_length of the requests of turn 1, 2, ... (a multi-turn set)",
    "acceptance_length_by_category": "acceptance_length of the requests of each category the set's rows "
                                     "name (MT-Bench: writing, roleplay, ...); null without categories",
    "histogram": "cycles with a+1 = 1..block_size",
    "per_slot_acceptance": "fraction of cycles whose draft slot k (1..B-1) was accepted",
    "per_slot_conditional_acceptance": "P(slot k accepted | slot k-1 accepted)",
    "teacher_forced_slot_accuracy": "top-1 accuracy of draft slot k (1..B-1) for blocks anchored at every "
                                    "position of the target's own answers (the training validation metric)",
    "teacher_forced_acceptance_length": "1 + sum_k prod_{i<=k} teacher_forced_slot_accuracy_i: the τ those "
                                        "accuracies imply at uniformly spread positions, beside the decode "
                                        "loop's τ at the positions its cycles start",
    "lossless": "greedy output with the drafter equals, token for token on every request, the target "
                "alone run through the same verify pass with every draft refused (blocks of block_size "
                "tokens, one token committed per cycle, same batch size, kernels and compiled graph); "
                "exact in any dtype, so a divergence is a bug; null when sampling or with "
                "--no-lossless-check",
    "target_only_reused": "the set's target-alone pass (speed baseline, the answers later turns and the "
                          "teacher-forced accuracy use) was read from --target-cache, decoded by an earlier "
                          "eval with the same target, device, settings and prompts",
    "mismatches": "the first diverging requests: where the drafted output first leaves the lossless "
                  "check's output (target_tokens) and both lengths",
    "decode_seconds_lossless_check": "decoding time of the lossless check's target-only pass (not part of "
                                     "any speed figure)",
    "tokens_per_s": "new tokens per second of decoding (prefill excluded), same prompts, same run; "
                    "target_only is the target alone decoding one token per step",
    "phase_seconds": "wall-clock seconds of the run's phases, which never overlap: load/* (prompt sets, "
                     "GGUF conversion, target, drafter), warm_up/* (caches, runner check, compilation and "
                     "graph capture per engine), prompts/* (chat templates), decode/<dataset>/<engine> "
                     "(a whole pass, prefill included), teacher_forced/<dataset>, report/plot; total "
                     "from argument checking to the figure, process start-up excluded",
}


def build_report(args: argparse.Namespace, target: TargetModel, evaluator: Evaluator,
                 runs: list[SweepRun]) -> dict[str, Any]:
    """`runs`: the results at each temperature, lowest first; the report's own figures are the first's, and
    with more than one, the `temperature_sweep` section holds them all (eval/sweep.py)."""
    report = {
        "target": args.target,
        "draft": args.draft,
        "settings": _settings(args, target, evaluator, runs[0].temperature),
        "environment": _environment(target, evaluator),
        "runner_check": evaluator.runner_check,
        "definitions": dict(REPORT_DEFINITIONS),
        "datasets": runs[0].datasets,
    }
    if len(runs) > 1:
        report["settings"]["temperatures"] = [run.temperature for run in runs]
        report["definitions"].update(SWEEP_DEFINITIONS)
        report["temperature_sweep"] = sweep_section(runs)
    return report


def _settings(args: argparse.Namespace, target: TargetModel, evaluator: Evaluator,
              temperature: float) -> dict[str, Any]:
    """The settings the report's own figures were decoded with (those of `temperature`)."""
    settings = evaluator.settings
    return {
        "block_size": settings.block_size,
        "max_new_tokens": settings.max_new_tokens,
        "num_prompts": args.num_prompts,
        "temperature": temperature,
        "draft_temperature_scale": getattr(args, "draft_temperature_scale", 1.0),
        "verification": getattr(args, "verification", "token"),
        "thinking": settings.thinking,
        "thinking_switch_in_template": evaluator.thinking_switch,
        "batch_size": settings.batch_size,
        "stop_token_ids": evaluator.stop_ids,
        "dtype": str(target.dtype).removeprefix("torch."),
        "seed": args.seed,
        "lossless_check": settings.lossless_check and temperature == 0,
        "target_cache": str(settings.target_cache) if settings.target_cache is not None else None,
        "teacher_forced": settings.teacher_forced,
    }


def _environment(target: TargetModel, evaluator: Evaluator) -> dict[str, Any]:
    """The machine, library versions and fast paths the figures were decoded on (a fast path that failed says why)."""
    dflash = evaluator.engines.dflash if evaluator.engines else None
    return {
        "device": torch.cuda.get_device_name(target.device) if target.device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "kernels": dflash.kernels if dflash else None,
        "cuda_graphs": bool(dflash and dflash.uses_cuda_graph),
        "cuda_graph_error": dflash.graph_error if dflash else None,
        "torch_compile": bool(dflash and dflash.uses_compile),
        "torch_compile_error": dflash.compile_error if dflash else None,
        "target_attention": dflash.runner.attention if dflash else None,
        "matmul": dflash.runner.matmul if dflash else None,
        "draft_attention": dflash.drafter.attention if dflash and dflash.drafter is not None else None,
        "compile_options": dict(dflash.config.compile_options) if dflash else {},
        "compile_scope": dflash.config.compile_scope if dflash else None,
    }


def is_eval_report(path: Path) -> bool:
    """Whether `path` holds a report this module wrote (the one kind of file `eval --out` may replace)."""
    report = json_object_or_none(path)
    return report is not None and {"settings", "definitions", "datasets"} <= report.keys()


def write_outputs(report: dict[str, Any], out: Path, plot: bool = True,
                  phases: PhaseTimer | None = None) -> list[Path]:
    """The JSON report and its figure next to it; with `phases`, the report's `phase_seconds` (figure
    included, so it is drawn first; the JSON is written even if drawing fails)."""
    figures: list[Path] = []
    out.parent.mkdir(parents=True, exist_ok=True)  # the figure is written first, before the JSON would create it
    try:
        if plot:
            with phases.phase("report/plot") if phases else nullcontext():
                figures.append(plot_report(report, out.with_suffix(".png")))
    finally:
        if phases is not None:
            report["phase_seconds"] = phases.report()
        # Atomic: a report cut short (a full disk, a kill) would read as a finished evaluation.
        write_json_atomically(out, report)
    return [out, *figures]
