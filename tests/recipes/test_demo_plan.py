"""The demo's plan: every stage runs on the chosen target (`--target`), `--data` replaces the prompts, the CPU
sizes train a block-8 drafter on word problems, and the last table quotes the GPU speedrun."""

from __future__ import annotations

from pathlib import Path

import pytest
from rich.console import Console
from rich.table import Table

from dflash_train.demo import (
    CPU_SIZES,
    GPU_SIZES,
    SPEEDRUN,
    TARGET,
    DemoResult,
    DemoSizes,
    main,
    plan_stages,
    summary_tables,
)
from tests.helpers.paths import REPO


def test_every_stage_uses_the_chosen_target(tmp_path: Path) -> None:
    stages = {stage.name: stage.argv for stage in plan_stages(tmp_path, GPU_SIZES, "cuda", "/models/t.gguf")}
    for name in ("regenerate", "prepare", "eval", "export", "check"):
        argv = stages[name]
        assert argv[argv.index("--target") + 1] == "/models/t.gguf", name
    assert "model.target=/models/t.gguf" in stages["train"]
    default = {stage.name: stage.argv for stage in plan_stages(tmp_path, GPU_SIZES, "cuda")}
    assert f"model.target={TARGET}" in default["train"]
    assert default["regenerate"].count("--data") == len(GPU_SIZES.sources)


def test_data_replaces_the_sources(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, object] = {}

    def fake_run_demo(out: str, sizes: DemoSizes, device: str, target: str) -> None:
        seen.update(sizes=sizes, target=target)
        raise SystemExit(0)

    monkeypatch.setattr("dflash_train.demo.run_demo", fake_run_demo)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # what --device cpu sets; restored afterwards
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(SystemExit):
        main(["--device", "cpu", "--data", "my.jsonl", "--target", "t.gguf", "--out", str(tmp_path)])
    assert seen["sizes"].sources == ("my.jsonl",) and seen["target"] == "t.gguf"


def test_the_cpu_demo_trains_a_block_8_drafter_on_word_problems_and_evaluates_on_math(tmp_path: Path) -> None:
    stages = {stage.name: stage.argv for stage in plan_stages(tmp_path, CPU_SIZES, "cpu")}
    assert CPU_SIZES.block_size == 8 and "model.block_size=8" in stages["train"]
    prepare, evaluate = stages["prepare"], stages["eval"]
    assert prepare[prepare.index("--block-size") + 1] == "8"  # rows of 2 blocks of the drafter that trains
    assert stages["regenerate"][stages["regenerate"].index("--data") + 1] == "word-problems:steps"
    assert evaluate[evaluate.index("--dataset") + 1] == "math-synthetic"
    assert evaluate[evaluate.index("--batch-size") + 1] == str(CPU_SIZES.eval_prompts)  # all requests at once


def test_the_gpu_demo_keeps_its_block_16_batch_1_plan(tmp_path: Path) -> None:
    stages = {stage.name: stage.argv for stage in plan_stages(tmp_path, GPU_SIZES, "cuda")}
    assert GPU_SIZES.block_size == 16 and stages["prepare"][stages["prepare"].index("--block-size") + 1] == "16"
    assert "--batch-size" not in stages["eval"]  # batch 1: the speedup a single user sees


def fake_result(tmp_path: Path) -> DemoResult:
    row = {"requests": 10, "acceptance_length": 1.8, "acceptance_length_ci95": [1.7, 1.9], "tokens_per_s_with_draft": 30.0,
           "tokens_per_s_target_only": 75.0, "speedup": 0.4, "lossless": True, "lossless_requests": 10}
    report = {"settings": {"block_size": 8}, "datasets": {"math-synthetic": row}}
    return DemoResult(tmp_path, report, tmp_path / "report.json", tmp_path / "step-00000400", tmp_path / "export",
                      train_samples=200, train_steps=400, seconds={"regenerate": 200.0, "train": 340.0},
                      draft_layers=1)


def rendered(table: Table) -> str:
    console = Console(record=True, width=200)
    console.print(table)
    return console.export_text()


def test_the_last_table_sets_the_demo_beside_the_gpu_speedrun(tmp_path: Path) -> None:
    tables = summary_tables(fake_result(tmp_path), "cpu")
    first, last = rendered(tables[0]), rendered(tables[-1])
    assert "1-layer drafter, block 8" in first and "math-synthetic" in first and "1.70–1.90" in first
    assert "GPU speedrun" in last and "9.0" in last  # the demo's 540 s
    math = next(line for line in last.splitlines() if "τ math-synthetic" in line)
    assert "1.80 (0.40×)" in math and "4.36 (3.31×)" in math
    humaneval = next(line for line in last.splitlines() if "τ humaneval" in line)
    assert "not run" in humaneval and "4.09 (3.12×)" in humaneval


def test_the_speedrun_figures_are_the_readmes() -> None:
    """The figures the demo's last table quotes are the speedrun's latest run, as the README's Results give it."""
    readme = (REPO / "README.md").read_text()
    tau, speedup = SPEEDRUN.tau, SPEEDRUN.speedup
    names = ("humaneval", "mt-bench", "math-synthetic")
    assert f"{SPEEDRUN.minutes} minutes in all" in readme
    assert "τ " + " / ".join(f"{tau[n]:.2f}" for n in names) + " on HumanEval / MT-Bench / math" in readme
    assert "decode " + " / ".join(f"{speedup[n]:.2f}×" for n in names) + " faster at batch 1" in readme
    results = (REPO / "docs" / "results.md").read_text()
    assert f"**{SPEEDRUN.chats:,} chats**" in results and f"{SPEEDRUN.steps:,} steps" in results
