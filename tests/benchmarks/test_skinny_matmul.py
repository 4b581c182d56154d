"""`benchmarks/skinny_matmul.py` (GPU only): its candidate tilings fit in shared memory and are ones a dot
takes, its summary tables read a results file, each fused option it times is the product it names (run
interpreted on a CPU), and on a CPU the benchmark stops with one line."""

from __future__ import annotations

import pytest
import torch

from benchmarks.skinny_matmul import (
    FUSED_OPTIONS,
    QWEN3_8B_PRODUCTS,
    SHARED_BYTES,
    SMOLLM2_PRODUCTS,
    candidates,
    carried_shares,
    fused_fn,
    main,
    option_costs,
    option_flags,
    options_table,
    pdl_table,
    sweep_tilings,
    table,
    with_norm_pass,
)
from dflash_train.kernels import skinny_matmul
from dflash_train.kernels.skinny_fused import skinny_fused_reference
from dflash_train.kernels.skinny_matmul import BLOCK_M, Config
from tests.helpers.kernels import DEVICE, kernels_here, under_interpreter

test_under_interpreter = under_interpreter(f"{__file__}::test_each_option_is_the_fused_product_it_names")


def test_candidates_fit_in_shared_memory() -> None:
    configs = candidates()
    assert len(configs) == len(set(configs)) > 20
    for config in configs:
        assert config.num_stages * (config.block_n + BLOCK_M) * config.block_k * 2 <= SHARED_BYTES
    assert {config.block_n for config in configs} == {16, 32, 64, 128}
    short = candidates(576)  # SmolLM2's K: steps of 64 and shallower pipelines too
    assert {c.block_k for c in short} == {64, 128, 256, 512} and {c.num_stages for c in short} == {2, 3, 4}
    assert all(c.num_stages * (c.block_n + BLOCK_M) * c.block_k * 2 <= SHARED_BYTES for c in short)


def test_the_sweep_ranks_what_it_timed_and_stops_at_its_budget() -> None:
    """Each timing takes 1 s of a fake clock. Unlimited: every whole-K tiling, then K split 2/4/8 ways on
    the three best, ranked by summed µs, an out-of-resources tiling skipped. With a budget of 2.5 s: the
    tilings timed by then, ranked, no split, and a note that says how far it got."""
    now = [0.0]
    cost = {16: [5.0, 6.0], 32: [3.0, 4.0], 64: [4.0, 4.0], 128: [9.0, 9.0]}

    def timed(config: Config) -> list[float]:
        now[0] += 1.0
        if config.block_n == 128 and config.split_k == 1:
            raise RuntimeError("out of resources")
        return [t / config.split_k ** 0.5 for t in cost[config.block_n]]  # splitting helps here

    configs = [Config(n, 256) for n in (16, 32, 64, 128)]
    ranked, note = sweep_tilings("o_proj", configs, timed, None, clock=lambda: now[0])
    assert note == "" and len(ranked) == 3 + 9
    assert [config for _, _, config in ranked][:1] == [Config(32, 256, split_k=8)]
    whole = [config for _, _, config in ranked if config.split_k == 1]
    assert whole == [Config(32, 256), Config(64, 256), Config(16, 256)]  # 7, 8 and 11 µs
    assert all(total == sum(times) for total, times, _ in ranked)
    now[0] = 0.0
    ranked, note = sweep_tilings("o_proj", configs, timed, 2.5, clock=lambda: now[0])
    assert [config for _, _, config in ranked] == [Config(32, 256), Config(64, 256), Config(16, 256)]
    assert note == "stopped by --budget-s 2.5 after 3 of 4 whole-K tilings"


def test_unknown_products_are_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--shape", "smollm2", "--products", "qkv,attn"])
    assert "--products: unknown attn; choose from qkv, o_proj, gate_up, down, lm_head" in capsys.readouterr().err
    assert SMOLLM2_PRODUCTS["down"] == (576, 1536)


def test_table() -> None:
    entry = {"n": 4096, "k": 4096, "best_config": [16, 256, 2, 4], "checks": {"row_invariant_16": True}}
    for m in (1, 16):
        for key in ("cublas", "table", "best"):
            entry[f"{key}_m{m}_us"], entry[f"{key}_m{m}_tb_s"] = 10.0, 3.4
    text = table({"products": {"o_proj": entry}})
    assert "o_proj" in text and "(16, 256, 2, 4)" in text and "CONFIGS: {(4096, 4096): (16, 256, 2, 4)}" in text
    assert QWEN3_8B_PRODUCTS["o_proj"] == (4096, 4096)


def test_option_costs_are_timed_against_the_plain_product() -> None:
    timings = {"plain": [10.0, 11.0], "SWIGLU": [10.5, 11.0], "NORM": [16.0, 18.0], "NORM+SWIGLU": [17.0, 19.5]}
    asked: list[str] = []

    def timed(option: str) -> list[float]:
        asked.append(option)
        if option == "NORM+SWIGLU@1024x4":
            raise RuntimeError("out of resource: shared memory, Required: 262144")
        return timings.get(option, [12.0, 13.0])

    costs = option_costs("gate_up", timed)
    assert asked == ["plain", *FUSED_OPTIONS["gate_up"]]
    assert costs["NORM"] == {"m1_us": 16.0, "m16_us": 18.0, "m1_extra_us": 6.0, "m16_extra_us": 7.0}
    assert costs["SWIGLU"]["m16_extra_us"] == 0.0 and "m1_extra_us" not in costs["plain"]
    assert costs["NORM+SWIGLU@1024x4"] == {"error": "RuntimeError: out of resource: shared memory, Required: 262144"}
    assert costs["NORM+SWIGLU@512x8"]["m1_extra_us"] == 2.0
    for option in costs:
        costs[option]["config"] = [32, 128, 4, 3]
    lines = options_table({"products": {"gate_up": {"options": costs}}}).splitlines()
    assert lines[3].split()[:6] == ["gate_up", "NORM", "16.0", "+6.0", "18.0", "+7.0"]
    assert [line.split()[1:3] for line in lines if "1024x4" in line] == [["NORM+SWIGLU@1024x4", "RuntimeError:"]]


def test_an_option_names_the_norm_pass_tiling() -> None:
    plain = Config(64, 128, 4, 3)
    assert with_norm_pass(plain, "NORM+SWIGLU@512x8") == Config(64, 128, 4, 3, norm_k=512, norm_stages=8)
    assert with_norm_pass(plain, "NORM") == plain
    assert option_flags("NORM+SWIGLU@512x8") == option_flags("NORM+SWIGLU")


def test_the_pdl_table_gives_the_ratio_or_the_error() -> None:
    timed = {"m1_us": 12.0, "m16_us": 12.5, "m1_pdl_us": 9.0, "m16_pdl_us": 10.0, "same_bits": True}
    text = pdl_table({"products": {"o_proj": {"pdl": timed}, "down": {"pdl": {"error": "TypeError: launch_pdl"}},
                                   "qkv": {}}})
    lines = text.splitlines()
    assert lines[1].split() == ["o_proj", "1", "12.0", "9.0", "0.750", "True"]
    assert lines[2].split()[-2] == "0.800" and lines[3] == "down     TypeError: launch_pdl" and len(lines) == 4


def test_option_names_map_to_the_kernel_flags() -> None:
    assert option_flags("NORM+SWIGLU") == {"NORM": True, "SWIGLU": True, "RESIDUAL": False, "HAS_BIAS": False}
    assert not any(option_flags("plain").values())
    with pytest.raises(ValueError, match="unknown option BIAS"):
        option_flags("NORM+BIAS")
    assert all(option_flags(option) for options in FUSED_OPTIONS.values() for option in options)
    assert option_flags("RESIDUAL+STATS_OUT") == option_flags("RESIDUAL")
    with pytest.raises(ValueError, match="STATS_IN is the statistics of a NORM product"):
        option_flags("SWIGLU+STATS_IN")


def test_carried_shares_sum_to_the_rows_squares() -> None:
    """The shares a norm product reads stand for x's rows: by tiles of the residual product's output."""
    x = torch.randn(3, 200)
    shares = carried_shares(x)
    assert shares.shape == (3, skinny_matmul.stats_width(200, 200))
    torch.testing.assert_close(shares.sum(-1), x.pow(2).sum(-1))


@kernels_here
@pytest.mark.parametrize("option", ["plain", "NORM", "SWIGLU", "NORM+SWIGLU", "RESIDUAL", "NORM+SWIGLU@32x2",
                                    "NORM+SWIGLU+STATS_IN", "RESIDUAL+STATS_OUT"])
def test_each_option_is_the_fused_product_it_names(option: str) -> None:
    """What the benchmark times is the kernel with that option's work, against the fused reference (fp32)."""
    gen = torch.Generator().manual_seed(0)
    m, n, k = 5, 32, 48
    x, w = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen) / k ** 0.5
    gamma = torch.rand(k, generator=gen) + 0.5
    flags = option_flags(option)
    residual = torch.randn(m, n, generator=gen)
    x, w, gamma, residual = (t.to(DEVICE) for t in (x, w, gamma, residual))
    config = with_norm_pass(Config(16, 16), option) if "@" in option else None  # a K of 48: three norm tiles
    got = fused_fn(option, gamma, {m: residual}, config, {m: carried_shares(x)})(x, w)
    expected = skinny_fused_reference(x, w, None, gamma if flags["NORM"] else None, 1e-6, flags["SWIGLU"],
                                      residual if flags["RESIDUAL"] else None)
    assert got.shape == (m, n // 2 if flags["SWIGLU"] else n)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's answer")
def test_needs_a_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main([])
    assert "needs a CUDA device" in capsys.readouterr().err
