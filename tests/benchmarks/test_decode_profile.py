"""The profile arithmetic of `benchmarks/profiling.py` on hand-computed intervals: kernel time, busy span and gaps
per call (overlapping kernels counted once), calls told apart by their start times, kernels sorted into
categories by name; and the CPU stand-in through the real profiler."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch.autograd import DeviceType
from torch.autograd.profiler_util import Interval

from benchmarks.profiling import (
    CALL_MARKER,
    Launch,
    call_intervals,
    call_timeline,
    gpu_time,
    group_by_call,
    kernel_categories,
    kernel_category,
    launches_per_step,
    profiled_calls,
    split_by_call,
)


def test_gaps_between_kernels_of_one_call() -> None:
    # 0-10, 15-20, 25-35: 25 µs of kernels over a 35 µs span, two gaps of 5
    assert call_intervals([(15.0, 5.0), (0.0, 10.0), (25.0, 10.0)]) == (25.0, 25.0, 35.0)
    timing = gpu_time([[(0.0, 10.0), (15.0, 5.0), (25.0, 10.0)]])
    assert timing["launches"] == 3 and timing["kernel_ms"] == pytest.approx(0.025)
    assert timing["busy_ms"] == pytest.approx(0.035) and timing["gap_ms"] == pytest.approx(0.010)
    assert timing["gap_per_launch_us"] == pytest.approx(10 / 3) and timing["overlap_ms"] == 0


def test_overlapping_kernels_count_once() -> None:
    # 0-10 and 5-15 on two streams cover 0-15 (15 µs, 5 of them twice), then 30-35: gap 15-30
    assert call_intervals([(0.0, 10.0), (5.0, 10.0), (30.0, 5.0)]) == (25.0, 20.0, 35.0)
    timing = gpu_time([[(0.0, 10.0), (5.0, 10.0), (30.0, 5.0)]])
    assert timing["kernel_ms"] == pytest.approx(0.020) and timing["overlap_ms"] == pytest.approx(0.005)
    assert timing["gap_ms"] == pytest.approx(0.015)
    # a kernel inside another: no gap, the span is the outer one
    assert call_intervals([(0.0, 20.0), (5.0, 5.0)]) == (25.0, 20.0, 20.0)
    assert gpu_time([[(0.0, 20.0), (5.0, 5.0)]])["gap_ms"] == 0


def test_means_over_several_calls() -> None:
    # call 1: kernels 15 µs, span 20, gap 5; call 2: kernels 10 µs, span 16, gap 6 (the pause between calls
    # is nobody's gap)
    timing = gpu_time([[(0.0, 10.0), (15.0, 5.0)], [(100.0, 4.0), (110.0, 6.0)]])
    assert timing["launches"] == 2 and timing["kernel_ms"] == pytest.approx(0.0125)
    assert timing["busy_ms"] == pytest.approx(0.018) and timing["gap_ms"] == pytest.approx(0.0055)
    assert timing["gap_per_launch_us"] == pytest.approx(2.75)


def test_timeline_lists_one_call_in_order_with_median_durations() -> None:
    # three graphed calls alike (durations 2/4/9 and 5/6/7: medians 4 and 6) and one that differs, left out
    calls = [[Launch("gemm", 100.0, d1), Launch("attn", 110.0, d2)] for d1, d2 in ((2.0, 6.0), (9.0, 5.0), (4.0, 7.0))]
    calls.append([Launch("other", 300.0, 100.0)])
    lines = call_timeline(calls).splitlines()
    assert lines[0].startswith("# 3 of 4 calls alike")
    assert [line.split() for line in lines[1:]] == [["0", "0.0", "4.00", "gemm"], ["1", "10.0", "6.00", "attn"]]
    assert call_timeline([]) == call_timeline([[]]) == ""


def test_no_launches_gives_zeros() -> None:
    for calls in ([], [[]]):
        assert set(gpu_time(calls).values()) == {0.0}


def test_launches_go_to_the_call_started_last_before_them() -> None:
    launches = [Launch(name, start, 1.0) for name, start in (("a", 5.0), ("b", 150.0), ("c", 99.0), ("d", 250.0),
                                                             ("before", -3.0))]
    calls = group_by_call([100.0, 0.0, 200.0], launches)
    assert [[launch.name for launch in call] for call in calls] == [["a", "c"], ["b"], ["d"]]


@pytest.mark.parametrize(("name", "category"), [
    ("ampere_bf16_s16816gemm_bf16_128x64_ldg8_f2f_stages_32x6_tn", "matmul"),
    ("nvjet_hsh_64x8_64x16_4x1_v_bz_splitK_TNT", "matmul"),  # cuBLAS's split-K GEMM itself
    ("void cublasLt::splitKreduce_kernel<32, 16, int, __nv_bfloat16>(cublasLt::KernelParams)", "reduction/split-K"),
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::ArgMaxOps<float>>>",
     "reduction/split-K"),
    ("triton_tem_fused_mm_0", "matmul"), ("triton_tem_fused_addmm_1", "matmul"), ("aten::linear", "matmul"),
    ("_split_kernel", "attention"), ("_combine_kernel_0", "attention"),
    ("pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128>>", "attention"),
    ("fmha_cutlassF_bf16_aligned_64x64_rf_sm80", "attention"),  # before cutlass's matmuls
    ("_rope_cache_kernel", "norm/rope/prologue"), ("_context_kv_kernel_0", "norm/rope/prologue"),
    ("triton_per_fused__to_copy_add_mean_mul_pow_rsqrt_0", "norm/rope/prologue"),  # an RMS norm, not a copy
    ("triton_poi_fused_add_cat_index_put_1", "other fused"),
    ("Memcpy DtoD (Device -> Device)", "copy"), ("Memset (Device)", "copy"),
    ("void at::native::elementwise_kernel<128, 4, at::native::direct_copy_kernel_cuda>", "copy"),
    ("_accept_commit_kernel", "other"),  # "mm" inside a word is no matmul
])
def test_kernel_categories_by_name(name: str, category: str) -> None:
    assert kernel_category(name) == category


def test_kernel_time_by_category_per_call_heaviest_first() -> None:
    call = [Launch("nvjet_gemm", 0.0, 30.0), Launch("_split_kernel", 30.0, 4.0), Launch("nvjet_gemm", 40.0, 50.0),
            Launch("Memset (Device)", 95.0, 2.0)]
    categories = kernel_categories([call, call])
    assert list(categories) == ["matmul", "attention", "copy"]
    assert categories["matmul"] == {"ms": pytest.approx(0.080), "launches": 2.0}
    assert categories["copy"] == {"ms": pytest.approx(0.002), "launches": 1.0}


def test_cpu_stand_in_groups_operators_by_call() -> None:
    def step() -> None:
        torch.ones(3).add(1).mul(2)

    profiled = profiled_calls(step, torch.device("cpu"), iters=4)
    calls = profiled.calls
    assert [[launch.name for launch in call] for call in calls] == [["aten::ones", "aten::add", "aten::mul"]] * 4
    assert all(launch.duration_us >= 0 for call in calls for launch in call)
    assert len(profiled.wall_us) == 4  # each range holds its operators
    for call, wall in zip(calls, profiled.wall_us, strict=True):
        assert wall >= call[-1].start_us + call[-1].duration_us - call[0].start_us
    assert launches_per_step(step, torch.device("cpu")) == 3


def event(name: str, device: DeviceType, start: float, end: float, annotation: bool = False) -> SimpleNamespace:
    return SimpleNamespace(name=name, device_type=device, time_range=Interval(start, end),
                           is_user_annotation=annotation, cpu_parent=None)


def test_gpu_events_split_by_the_host_ranges() -> None:
    """A GPU trace as the profiler gives it: host ranges, their copies on the GPU's timeline, host operators
    and the kernels of two replays of a graph."""
    cpu, gpu = DeviceType.CPU, DeviceType.CUDA
    events = [
        event(CALL_MARKER, cpu, 0.0, 100.0), event("cudaGraphLaunch", cpu, 5.0, 9.0),
        event(CALL_MARKER, gpu, 10.0, 60.0, annotation=True),  # the range on the GPU: no call, no kernel
        event("nvjet_gemm", gpu, 12.0, 40.0), event("_split_kernel", gpu, 42.0, 50.0),
        event(CALL_MARKER, cpu, 120.0, 200.0), event(CALL_MARKER, gpu, 130.0, 150.0, annotation=True),
        event("nvjet_gemm", gpu, 131.0, 140.0), event("Memset (Device)", gpu, 141.0, 142.0),
    ]
    profiled = split_by_call(events, cuda=True)
    assert [[launch.name for launch in call] for call in profiled.calls] == [
        ["nvjet_gemm", "_split_kernel"], ["nvjet_gemm", "Memset (Device)"]]
    assert profiled.wall_us == [100.0, 80.0]
    timing = gpu_time([[(launch.start_us, launch.duration_us) for launch in call] for call in profiled.calls])
    # call 1: kernels 28 + 8 µs over 12-50 (gap 2); call 2: 9 + 1 over 131-142 (gap 1)
    assert timing["kernel_ms"] == pytest.approx(0.023) and timing["gap_ms"] == pytest.approx(0.0015)
