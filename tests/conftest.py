"""Test-wide settings.

Layout: tests/<package>/test_<module>.py mirrors dflash_train/<package>/<module>.py (prompts, regeneration,
data, features, training, eval, runtime, kernels, objective, models, checkpoint, target); tests/commands/
holds the command-line tests and those that cross every command (full disk, output folders, corrupt files,
fuzzed inputs); tests/benchmarks/ tests benchmarks/; tests/recipes/ runs the recipe scripts, the README's
commands and the demo end to end, and tests recipes/scoring/; tests of top-level modules (errors.py, the
import layers) sit here in tests/. Every folder
is a package (tests.data.test_prepare), so one basename may appear in several folders.

Fixtures shared by the files of one folder live in that folder's conftest.py, those of several folders here;
plain helpers (tiny models, reference implementations, skip markers, paths) live in tests/helpers/, and no
test module imports another.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from dflash_train.kernels._triton import HAS_TRITON
from dflash_train.target import TargetModel
from tests.helpers.kernels import (
    IN_PROCESS,
    INTERPRETED_TARGET,
    InterpretedProcess,
    InterpretedRun,
)
from tests.helpers.tiny_models import TINY_ARCHS, make_tiny_target

_INTERPRETED = pytest.StashKey[InterpretedProcess]()  # the session's interpreted kernel tests, once started


@pytest.fixture(autouse=True, scope="session")
def _one_thread() -> Iterator[None]:
    # Tiny models gain nothing from intra-op threads, and on a busy 2-core machine OpenMP spin-waits
    # make them several times slower. Subprocesses started by tests (a benchmark's variants, the CLI, the
    # training launches) get one thread too: the interpreted kernel tests keep the other core busy for most of
    # the session. A thread count set for the session (OMP_NUM_THREADS) is kept.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS") or "1")
        yield
    torch.set_num_threads(threads)


def _interpreted_targets(items: list[pytest.Item]) -> list[str]:
    return [getattr(item.function, INTERPRETED_TARGET) for item in items
            if hasattr(getattr(item, "function", None), INTERPRETED_TARGET)]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The interpreted checks last, each file's other tests in their order: the first check waits for the
    interpreted process, which would leave the session's own core idle if it came before the other tests."""
    interpreted = [item for item in items if hasattr(getattr(item, "function", None), INTERPRETED_TARGET)]
    if interpreted:
        moved = set(map(id, interpreted))
        items[:] = [item for item in items if id(item) not in moved] + interpreted


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the interpreted kernel tests as soon as the session knows which it runs: in a process of their
    own they take minutes, which overlap the other tests' on a machine with a second core."""
    targets = _interpreted_targets(session.items)
    if targets and HAS_TRITON and not IN_PROCESS and not session.config.option.collectonly:
        session.config.stash[_INTERPRETED] = InterpretedProcess(targets, Path(tempfile.mkdtemp(prefix="interpreted-")))


def pytest_sessionfinish(session: pytest.Session) -> None:
    running = session.config.stash.get(_INTERPRETED, None)
    if running is not None:
        running.stop()
        shutil.rmtree(running.report.parent, ignore_errors=True)


@pytest.fixture(scope="session")
def interpreted(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> InterpretedRun:
    """The kernel tests of every file this session checks under the Triton interpreter (`under_interpreter`
    in tests/helpers/kernels.py), in one process started when collection ended (or now, if it was not)."""
    running = request.config.stash.get(_INTERPRETED, None)
    if running is None:
        running = InterpretedProcess(_interpreted_targets(request.session.items), tmp_path_factory.mktemp("interpreted"))
    return running.result()


@pytest.fixture(scope="module", params=TINY_ARCHS)
def tiny(request: pytest.FixtureRequest) -> TargetModel:
    """A tiny target of each architecture (the target and feature-capture tests)."""
    return make_tiny_target(request.param)
