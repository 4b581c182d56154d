"""Plain helpers shared by test files: tiny models, drafters, checkpoints and datasets, reference
implementations, skip markers and paths. No tests and no pytest fixtures live here (fixtures shared by
several files live in the `conftest.py` of the folder that holds them)."""
