"""Where things are, wherever a test file sits in tests/."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
GOLDEN = REPO / "tests" / "golden"  # golden files: chat templates as published, a SmolLM2 mask
CPU_RECIPE = REPO / "recipes" / "smollm2-135m-dflash-b16-cpu.yaml"
