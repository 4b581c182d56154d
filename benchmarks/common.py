"""Shared helpers for benchmarks: CUDA-event timing, environment stamp, JSON results."""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import pathlib
import statistics
import subprocess
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from dflash_train.training.flops import peak_flops

RESULTS_DIR = pathlib.Path(__file__).parent / "results"
# DFLASH_BENCH_RESULTS writes the JSON files elsewhere (e.g. a scratch folder on a remote machine).


ANALYSIS_LOGGER = "torch._dynamo"  # where torch.compile reports its reading of Triton kernels


def device_peak_flops() -> float | None:
    """The current CUDA device's peak bf16 FLOP/s, as the trainer's MFU uses it; None where it is not known."""
    return peak_flops(torch.device("cuda")) if torch.cuda.is_available() else None


def git_commit() -> str:
    """The commit under test, "+modified" where tracked files differ from it (a copy of the tree whose .git
    is older than its files); DFLASH_TRAIN_COMMIT covers copies without .git."""
    if os.environ.get("DFLASH_TRAIN_COMMIT"):
        return os.environ["DFLASH_TRAIN_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True)
        clean = subprocess.run(["git", "diff", "--quiet", "HEAD", "--"], capture_output=True).returncode == 0
        return out.stdout.strip() + ("" if clean else "+modified")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


@contextlib.contextmanager
def kernel_analysis_fallbacks() -> Iterator[list[str]]:
    """The Triton kernels whose analysis torch.compile gave up on while the block ran: it then takes every
    tensor the kernel is given as written and copies each one (a weight too) at every call, which a decode
    step shows as time in copy kernels, with no error. The list fills as the warnings come."""
    found: list[str] = []

    class Catch(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "assuming every input is mutated" in record.getMessage():
                found.append(record.getMessage())

    logger, handler = logging.getLogger(ANALYSIS_LOGGER), Catch()
    logger.addHandler(handler)
    try:
        yield found
    finally:
        logger.removeHandler(handler)


def stamp() -> dict[str, Any]:
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return {
        "device": device,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": git_commit(),
        "torch": torch.__version__,
    }


def time_cuda(fn: Callable[[], Any], warmup: int, iters: int) -> list[float]:
    """Per-call milliseconds measured with CUDA events, after `warmup` untimed calls."""
    return time_calls(fn, torch.device("cuda"), warmup, iters)


def time_calls(fn: Callable[[], Any], device: torch.device, warmup: int, iters: int) -> list[float]:
    """Per-call milliseconds: CUDA events on a GPU, the wall clock on a CPU."""
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            began = time.perf_counter()
            fn()
            times.append((time.perf_counter() - began) * 1e3)
    return times


def median(values: list[float]) -> float:
    return statistics.median(values)


def graph_us(calls: list[Callable[[], Any]], replays: int) -> float:
    """Median µs per call of `calls` run in order, captured once as one CUDA graph (no launch gap between
    them, as in a graphed decode step), over `replays` replays timed with CUDA events."""
    for call in calls:  # compiles, and warms up cuBLAS's handles
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    del graph
    return median(times) * 1e3 / len(calls)


def measure_matmul_tflops(n: int = 8192, iters: int = 10) -> float:
    """The bf16 matmul ceiling of this device, measured now (it varies from day to day)."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    ms = median(time_cuda(lambda: a @ b, warmup=3, iters=iters))
    return 2 * n**3 / (ms * 1e-3) / 1e12


def results_directory(smoke: bool = False) -> pathlib.Path:
    """Where a benchmark writes its JSON: $DFLASH_BENCH_RESULTS if set, else benchmarks/results/, or for a
    smoke run (--tiny, --quick) its git-ignored smoke/ folder, so a check of a script on a CPU never replaces
    the figures measured on a GPU."""
    chosen = os.environ.get("DFLASH_BENCH_RESULTS")
    if chosen:
        return pathlib.Path(chosen)
    return RESULTS_DIR / "smoke" if smoke else RESULTS_DIR


def write_result(name: str, payload: dict[str, Any], smoke: bool = False) -> pathlib.Path:
    directory = results_directory(smoke)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}.json"
    path.write_text(json.dumps({**stamp(), **payload}, indent=2) + "\n")
    return path
