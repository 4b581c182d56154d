"""Where a step's GPU time goes: its launches grouped by call, kernel time against gaps, kernel time by category,
and one call's launches in order. Used by `benchmarks.decode`, `benchmarks.decode_batch` and
`benchmarks.train_packing`; on a CPU, top-level operators stand in for kernels so the code stays exercised."""

from __future__ import annotations

import bisect
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch


def kernel_profile(step: Callable[[], Any], device: torch.device, iters: int = 10) -> str:
    """The GPU kernels of `iters` calls (graph replays included), heaviest first: where a step's time goes
    (on the CPU: its operators)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for _ in range(iters):
            step()
        if cuda:
            torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="cuda_time_total" if cuda else "cpu_time_total", row_limit=30,
                                     max_name_column_width=90)


# The profiler range around each profiled call: the GPU work between two of them is one call's.
CALL_MARKER = "decode_call"


# Ordered: the first pattern found in a kernel's lower-cased name names its category. The project's Triton
# kernels go by their function names (inductor keeps a user kernel's name); inductor's own `triton_*` kernels
# are named after the operations fused into them, so of those only a matmul or an rsqrt (an RMS norm) can be
# told apart. "reduce" (cuBLAS split-K reductions, aten reductions) comes before "cublas" for that reason;
# cuBLAS's own split-K GEMMs (nvjet ..._splitK_...) stay matmuls.
KERNEL_CATEGORIES = (
    ("attention", r"_split_kernel|_combine_kernel|flash|fmha|attention|sdpa|softmax"),
    ("norm/rope/prologue", r"_rope_cache_kernel|_context_kv_kernel|rms_?norm|layer_?norm|rsqrt|rope|rotary"),
    ("reduction/split-K", r"reduce|argmax|argmin|topk"),
    ("matmul", r"gemm|gemv|cutlass|cublas|nvjet|xmma|(?<![a-z])(add|b)?mm(?![a-z])|linear|matmul"),
    ("other fused", r"^triton_"),
    ("copy", r"memcpy|memset|copy|index|gather|scatter"),
)


@dataclass(frozen=True)
class Launch:
    """One kernel, memory copy or set on the GPU (on a CPU: one top-level operator), in profiler µs."""

    name: str
    start_us: float
    duration_us: float


def group_by_call(call_starts: Sequence[float], launches: Sequence[Launch]) -> list[list[Launch]]:
    """`launches` split by call: each goes to the last call started before it (earlier ones are dropped)."""
    starts = sorted(call_starts)
    calls: list[list[Launch]] = [[] for _ in starts]
    for launch in sorted(launches, key=lambda item: item.start_us):
        index = bisect.bisect_right(starts, launch.start_us) - 1
        if index >= 0:
            calls[index].append(launch)
    return calls


def call_intervals(intervals: Sequence[tuple[float, float]]) -> tuple[float, float, float]:
    """(sum of the durations, time covered by at least one interval, first start to last end) of one
    call's (start, duration) intervals: kernels overlapping on two streams count once in the second."""
    total = covered = 0.0
    first, covered_to = math.inf, -math.inf
    for start, duration in sorted(intervals):
        end = start + duration
        total += duration
        covered += max(0.0, end - max(start, covered_to))
        first, covered_to = min(first, start), max(covered_to, end)
    return total, covered, (covered_to - first) if intervals else 0.0


def gpu_time(calls: Sequence[Sequence[tuple[float, float]]]) -> dict[str, float]:
    """Means over `calls` (each a list of (start_us, duration_us)) of: launches, the time kernels run
    (`kernel_ms`, overlaps counted once; `overlap_ms`: what overlapping adds to their plain sum), the busy
    span (first start to last end), the gaps inside it (span - kernel time) and the gap per launch (µs)."""
    n = max(len(calls), 1)
    sums = [0.0, 0.0, 0.0, 0.0]  # launches, sum of durations, covered, span
    for intervals in calls:
        total, covered, span = call_intervals(intervals)
        for i, value in enumerate((len(intervals), total, covered, span)):
            sums[i] += value
    launches, total, covered, span = (value / n for value in sums)
    return {"launches": launches, "kernel_ms": covered / 1e3, "overlap_ms": (total - covered) / 1e3,
            "busy_ms": span / 1e3, "gap_ms": (span - covered) / 1e3,
            "gap_per_launch_us": (span - covered) / launches if launches else 0.0}


def kernel_category(name: str, table: Sequence[tuple[str, str]] = KERNEL_CATEGORIES) -> str:
    lowered = name.lower()
    return next((category for category, pattern in table if re.search(pattern, lowered)), "other")


def kernel_categories(calls: Sequence[Sequence[Launch]],
                      table: Sequence[tuple[str, str]] = KERNEL_CATEGORIES) -> dict[str, dict[str, float]]:
    """Per category of `table` (name, pattern: the first found in a kernel's lower-cased name wins), heaviest
    first: mean ms of kernel time (plain sums of durations) and launches per call."""
    totals: dict[str, list[float]] = {}
    for launch in (launch for call in calls for launch in call):
        entry = totals.setdefault(kernel_category(launch.name, table), [0.0, 0.0])
        entry[0] += launch.duration_us
        entry[1] += 1
    n = max(len(calls), 1)
    ranked = sorted(totals.items(), key=lambda item: -item[1][0])
    return {category: {"ms": us / n / 1e3, "launches": count / n} for category, (us, count) in ranked}


@dataclass(frozen=True)
class CallProfile:
    calls: list[list[Launch]]  # what each call put on the GPU
    wall_us: list[float]  # each call's profiler range on the host: the call and its synchronisation
    # the host time of the named ranges the code marks inside a call (`record_function`), summed over the calls
    ranges_us: dict[str, float] = field(default_factory=dict)


def profiled_calls(step: Callable[[], Any], device: torch.device, iters: int = 10) -> CallProfile:
    """What each of `iters` profiled calls of `step` put on the GPU: kernels, memory copies and sets
    (kernels inside a replayed CUDA graph included), grouped by call. Each call runs inside a profiler range
    and ends with a synchronisation, so no call's GPU work starts before its range or runs past the next
    one's start. On a CPU: the top-level operators of a call, a stand-in that keeps this code exercised."""
    from torch.profiler import ProfilerActivity, profile, record_function

    cuda = device.type == "cuda"
    # CPU activity on a GPU too: the ranges are host events (it costs the graphed loops nothing, a launch each)
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    with profile(activities=activities) as prof:
        for _ in range(iters):
            with record_function(CALL_MARKER):
                step()
                if cuda:
                    torch.cuda.synchronize(device)
    return split_by_call(prof.events(), cuda)


def split_by_call(events: Sequence[Any], cuda: bool) -> CallProfile:
    """The profiler's events (`torch.autograd.profiler_util.FunctionEvent`s) as a `CallProfile`: the calls
    are the host's `CALL_MARKER` ranges; the launches, GPU events (or on a CPU, top-level operators)."""
    from torch.autograd import DeviceType

    ranges = [event.time_range for event in events if event.name == CALL_MARKER and event.device_type == DeviceType.CPU]
    launches = [Launch(event.name, event.time_range.start, event.time_range.elapsed_us())
                for event in events if (on_gpu(event) if cuda else top_level_operator(event))]
    ranges.sort(key=lambda span: span.start)
    marked: dict[str, float] = {}
    for event in events:
        if event.is_user_annotation and event.device_type == DeviceType.CPU and event.name != CALL_MARKER:
            marked[event.name] = marked.get(event.name, 0.0) + event.time_range.elapsed_us()
    return CallProfile(group_by_call([span.start for span in ranges], launches),
                       [span.elapsed_us() for span in ranges], marked)


def on_gpu(event: Any) -> bool:
    """A kernel, memory copy or set (the profiler also puts record_function ranges on the GPU's timeline)."""
    from torch.autograd import DeviceType

    return (event.device_type == DeviceType.CUDA and not event.is_user_annotation
            and event.name != CALL_MARKER)


def top_level_operator(event: Any) -> bool:
    parent = event.cpu_parent
    return event.name.startswith("aten::") and (parent is None or not parent.name.startswith("aten::"))


def launches_per_step(step: Callable[[], Any], device: torch.device, iters: int = 3) -> float:
    """Kernels, memory copies and sets that one call of `step` puts on the GPU (`profiled_calls`)."""
    return gpu_time(as_intervals(profiled_calls(step, device, iters).calls))["launches"]


def as_intervals(calls: Sequence[Sequence[Launch]]) -> list[list[tuple[float, float]]]:
    return [[(launch.start_us, launch.duration_us) for launch in call] for call in calls]


def call_timeline(calls: Sequence[Sequence[Launch]]) -> str:
    """One call's launches in order (a graphed call puts the same sequence on the GPU each time): index, start
    after the call's first launch and median duration over the calls of that length (µs), name. Where a
    category's time goes when one kernel serves both the drafter and the target (the split-key attention)."""
    if not calls or not calls[0]:
        return ""
    same = [call for call in calls if [launch.name for launch in call] == [launch.name for launch in calls[0]]]
    first = calls[0][0].start_us
    lines = []
    for index, launch in enumerate(calls[0]):
        durations = sorted(call[index].duration_us for call in same)
        lines.append(f"{index:5d} {launch.start_us - first:10.1f} {durations[len(durations) // 2]:9.2f}  {launch.name}")
    return "\n".join([f"# {len(same)} of {len(calls)} calls alike; index, start us, median us, kernel", *lines])


def category_table(key: str, categories: dict[str, dict[str, float]]) -> str:
    rows = [f"  {category:<20} {entry['ms']:8.3f} ms {entry['launches']:8.1f}" for category, entry in categories.items()]
    return "\n".join([f"decode: {key} kernel time by category (per call: ms, launches)", *rows])
