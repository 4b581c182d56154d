"""What every Triton kernel test file shares: where its kernels run, the re-run under the interpreter, and
compiling a kernel for the GPU without one.

On a GPU the kernels run in the test process. On CPU they run under TRITON_INTERPRET=1, which only works
when set before triton is first imported; a file imported without it re-runs itself in a subprocess that
sets it from the start (`under_interpreter`), and its kernel tests (`kernels_here`) are skipped here. One
subprocess runs every file of the session that needs it (the `interpreted` fixture of tests/conftest.py):
a process of its own per file would pay torch's and triton's imports again each time (4 s on 2 cores). It
starts when collection ends and runs beside the other tests, on the core they leave idle.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ElementTree
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from dflash_train.kernels._triton import HAS_TRITON, interpreter_ready
from tests.helpers.paths import REPO

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
IN_PROCESS = DEVICE == "cuda" or interpreter_ready()
kernels_here = pytest.mark.skipif(not (HAS_TRITON and IN_PROCESS), reason="run by test_under_interpreter")


# The attribute of a test made by `under_interpreter` that names what it checks (a file, or file::test).
INTERPRETED_TARGET = "interpreted_target"


@dataclass(frozen=True)
class InterpretedCase:
    address: str  # JUnit's classname.name, tests.kernels.test_x.test_y[params]; a file that failed to import: its module
    name: str  # the test with its parameters, test_y[params]
    failure: str | None  # the failure or error report, None if the test passed or was skipped


@dataclass(frozen=True)
class InterpretedRun:
    """One pytest process under TRITON_INTERPRET=1 over several targets: how it ended, and each test's outcome."""

    returncode: int
    output: str
    cases: list[InterpretedCase]

    def check(self, target: str) -> None:
        """Fails unless the tests of `target` (a file, or file::test) ran there and none failed."""
        module, _, test = target.partition("::")
        dotted = ".".join(Path(module).resolve().relative_to(REPO).with_suffix("").parts)

        def belongs(case: InterpretedCase) -> bool:
            if case.address == dotted:  # the file itself: it failed to import
                return True
            return case.address.startswith(dotted + ".") and (
                not test or case.name == test or case.name.startswith(test + "["))

        mine = [case for case in self.cases if belongs(case)]
        # 0: all passed, 1: some test failed; anything else (interrupted, internal error, killed) may have
        # cut the run short of this target's tests.
        assert self.returncode in (0, 1) and mine, f"exit {self.returncode}\n{self.output[-6000:]}"
        failed = [f"{case.address}\n{case.failure}" for case in mine if case.failure is not None]
        assert not failed, "\n\n".join(failed)[-8000:]


class InterpretedProcess:
    """`targets` in one pytest process under TRITON_INTERPRET=1, started at once and left running: the session
    starts it when collection ends, so that it runs on the second core while the other tests run on the first
    (the suite runs single-threaded), and waits for it when the first interpreted check comes up."""

    def __init__(self, targets: Sequence[str], folder: Path) -> None:
        self.report, self.log = folder / "junit.xml", folder / "output.txt"
        command = [sys.executable, "-m", "pytest", *dict.fromkeys(targets), "-q", "-p", "no:cacheprovider",
                   "--junitxml", str(self.report), "--continue-on-collection-errors"]
        # One thread: the process shares the machine with the session's own tests.
        env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
        with self.log.open("w") as log:
            self.process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
        self._result: InterpretedRun | None = None

    def result(self, timeout: float = 3600.0) -> InterpretedRun:
        if self._result is None:
            returncode = self.process.wait(timeout)
            self._result = interpreted_outcomes(returncode, self.log.read_text(), self.report)
        return self._result

    def stop(self) -> None:
        """Ends a run nobody waited for (a session cut short)."""
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


def interpreted_outcomes(returncode: int, output: str, report: Path) -> InterpretedRun:
    """How an interpreted pytest process ended, with each test's outcome from its JUnit XML `report`."""
    cases = []
    if report.is_file():
        for case in ElementTree.parse(report).iter("testcase"):
            classname, name = case.get("classname", ""), case.get("name", "")
            problems = [child for child in case if child.tag in ("failure", "error")]
            failure = "\n".join(f"{p.get('message', '')}\n{p.text or ''}" for p in problems) if problems else None
            cases.append(InterpretedCase(f"{classname}.{name}" if classname else name, name, failure))
    return InterpretedRun(returncode, output, cases)


def under_interpreter(test_file: str) -> Callable[[InterpretedRun], None]:
    """A test that checks `test_file` (or file::test) passed under TRITON_INTERPRET=1, in the session's one
    interpreted process (skipped where not needed)."""

    @pytest.mark.skipif(not HAS_TRITON or IN_PROCESS, reason="the kernels run in this process")
    def test_under_interpreter(interpreted: InterpretedRun) -> None:
        interpreted.check(test_file)

    setattr(test_under_interpreter, INTERPRETED_TARGET, test_file)
    return test_under_interpreter


def compile_for_h100(kernel: object, constants: dict[str, object], pointer_types: dict[str, str],
                     float_type: str) -> str:
    """Compile a kernel body to sm_90 machine code here (no GPU needed), with every scalar argument
    typed as a launcher would type it: torch.compile hands Python floats over as fp64. The PTX must hold no
    fused multiply-add on 16-bit floats: the modules round a product before adding to it, and such an FMA
    (the compiler's contraction of the two) rounds once (`dflash_train.kernels.device.kept`). -> the PTX."""
    import inspect

    import triton
    from triton.backends.compiler import GPUTarget

    names = list(inspect.signature(kernel).parameters)  # type: ignore[arg-type]
    signature = {name: pointer_types.get(name, "constexpr" if name in constants else
                                         (float_type if name == "scale" else "i32")) for name in names}
    constexprs = {(names.index(name),): value for name, value in constants.items()}
    source = triton.compiler.ASTSource(triton.jit(kernel), signature=signature, constexprs=constexprs)
    ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32)).asm["ptx"]
    fused = sorted(set(re.findall(r"\bfma\.rn[.a-z]*\.(?:bf16|f16)(?:x2)?\b", ptx)))
    assert not fused, f"{kernel.__name__} fuses a rounded product and a sum: {fused}"  # type: ignore[attr-defined]
    return ptx


def pointers_written(kernel: object, kwargs: dict[str, object], monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The pointer arguments that inductor's analysis of a kernel body finds written, on a CPU machine: under
    torch.compile those are the kernel's outputs, and an argument wrongly found written would be copied at
    every call. Skips where this torch names the analysis differently."""
    import triton
    from triton.backends.compiler import GPUTarget

    wrap = pytest.importorskip("torch._higher_order_ops.triton_kernel_wrap")
    if not hasattr(wrap, "identify_accessed_tensors"):
        pytest.skip("this torch names its kernel analysis differently")

    class H200:  # the analysis asks the active driver for the target to generate the kernel's IR
        def get_current_target(self) -> GPUTarget:
            return GPUTarget("cuda", 90, 32)

    monkeypatch.setattr(triton.runtime.driver, "_active", H200())
    accesses = wrap.identify_accessed_tensors(triton.jit(kernel), kwargs, {})
    return sorted(dep.name for dep in accesses.read_writes.writes)


def randn(*shape: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Standard normal values drawn in fp32 from `gen` (the same numbers whatever the dtype), then cast."""
    return torch.randn(*shape, generator=gen).to(dtype)
