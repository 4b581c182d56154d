"""How long torch.compile took in a run's first step, so a slow start is explained rather than guessed at.

A cold compile of a wide drafter (flex attention forward and backward, Triton kernels) can take minutes;
the inductor cache makes the next launch on the same machine start in seconds. The split comes from
dynamo's own timers (an internal API: without it, nothing is reported).
"""

from __future__ import annotations

try:  # dynamo's own timers: a private API that may move, and the report is optional
    from torch._dynamo.utils import compile_times
except ImportError:
    compile_times = None  # type: ignore[assignment]

MIN_SECONDS = 1.0  # less compile time than this in the first step is not worth a line


def compile_seconds() -> dict[str, float]:
    """Seconds spent so far compiling forward graphs (dynamo + inductor) and backward graphs."""
    if compile_times is None:
        return {}
    try:
        names, values = compile_times(repr="csv")
    except Exception:  # noqa: BLE001  (a private API that may change: the report is optional)
        return {}
    table = dict(zip(names, values, strict=False))

    def total(name: str) -> float:
        return sum(float(v) for v in str(table.get(name, "0")).split(",") if v.strip())

    return {"forward": total("_compile.compile_inner"), "backward": total("compile_fx.<locals>.bw_compiler")}


def first_step_line(step_seconds: float, before: dict[str, float], after: dict[str, float]) -> str | None:
    """'first step 225.4 s: torch.compile 200.1 s (forward 120.3, backward 79.8), the rest 25.3 s'."""
    if not after:
        return None
    spent = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    compiling = sum(spent.values())
    if compiling < MIN_SECONDS:
        return None  # a warm cache, or nothing compiled: nothing worth a line
    return (f"first step {step_seconds:.1f} s: torch.compile {compiling:.1f} s (forward {spent['forward']:.1f}, "
            f"backward {spent['backward']:.1f}), the rest {step_seconds - compiling:.1f} s")
