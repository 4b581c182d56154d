"""Test-wide settings.

Layout: tests/<package>/test_<module>.py mirrors dflash_train/<package>/<module>.py (data, eval, runtime,
inference, kernels, objective, training, models, checkpoint, target); tests/commands/ holds the command-line
tests and those that cross every command (full disk, output folders, corrupt files, fuzzed inputs);
tests/benchmarks/ tests benchmarks/; tests/recipes/ runs the recipe scripts, the README's commands and the
demo end to end; tests of top-level modules (errors.py, the import layers) sit here in tests/. Every folder
is a package (tests.data.test_prepare), so one basename may appear in several folders.

Fixtures shared by the files of one folder live in that folder's conftest.py; plain helpers (tiny models,
reference implementations, skip markers, paths) live in tests/helpers/, and no test module imports another.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tests.helpers.kernels import INTERPRETED_TARGET, InterpretedRun, run_interpreted


@pytest.fixture(autouse=True, scope="session")
def _one_thread() -> Iterator[None]:
    # Tiny models gain nothing from intra-op threads, and on a busy 2-core machine OpenMP spin-waits
    # make them several times slower. Subprocesses started by tests pick their own thread counts.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def interpreted(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> InterpretedRun:
    """The kernel tests of every file this session checks under the Triton interpreter (`under_interpreter`
    in tests/helpers/kernels.py), run in one process when the first of them is checked."""
    targets = [getattr(item.function, INTERPRETED_TARGET) for item in request.session.items
               if hasattr(getattr(item, "function", None), INTERPRETED_TARGET)]
    return run_interpreted(targets, tmp_path_factory.mktemp("interpreted") / "junit.xml")
