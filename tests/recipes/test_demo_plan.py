"""The demo's plan: every stage runs on the chosen target (`--target`), and `--data` replaces the prompts."""

from __future__ import annotations

from pathlib import Path

import pytest

from dflash_train.demo import GPU_SIZES, TARGET, DemoSizes, main, plan_stages


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
