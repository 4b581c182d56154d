"""What every Triton kernel test file shares: where its kernels run, the re-run under the interpreter, and
compiling a kernel for the GPU without one.

On a GPU the kernels run in the test process. On CPU they run under TRITON_INTERPRET=1, which only works
when set before triton is first imported; a file imported without it re-runs itself in a subprocess that
sets it from the start (`under_interpreter`), and its kernel tests (`kernels_here`) are skipped here.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from dflash_train.kernels._triton import HAS_TRITON, interpreter_ready, run_pytest_under_interpreter

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
IN_PROCESS = DEVICE == "cuda" or interpreter_ready()
kernels_here = pytest.mark.skipif(not (HAS_TRITON and IN_PROCESS), reason="run by test_under_interpreter")


def under_interpreter(test_file: str) -> Callable[[], None]:
    """A test that runs `test_file` in a fresh process with TRITON_INTERPRET=1 (skipped where not needed)."""

    @pytest.mark.skipif(not HAS_TRITON or IN_PROCESS, reason="the kernels run in this process")
    def test_under_interpreter() -> None:
        result = run_pytest_under_interpreter(test_file)
        assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]

    return test_under_interpreter


def compile_for_h100(kernel: object, constants: dict[str, object], pointer_types: dict[str, str],
                     float_type: str) -> None:
    """Compile a kernel body to sm_90 machine code here (no GPU needed), with every scalar argument
    typed as a launcher would type it: torch.compile hands Python floats over as fp64."""
    import inspect

    import triton
    from triton.backends.compiler import GPUTarget

    names = list(inspect.signature(kernel).parameters)  # type: ignore[arg-type]
    signature = {name: pointer_types.get(name, "constexpr" if name in constants else
                                         (float_type if name == "scale" else "i32")) for name in names}
    constexprs = {(names.index(name),): value for name, value in constants.items()}
    source = triton.compiler.ASTSource(triton.jit(kernel), signature=signature, constexprs=constexprs)
    triton.compile(source, target=GPUTarget("cuda", 90, 32))
