"""The split-key attention kernel against a brute-force reference, and the reference against the SDPA path
the static target runs otherwise (boolean masks from positions), so that both stay tied to the model.

On CPU the kernels run under TRITON_INTERPRET=1; when this process imported triton without it, the file
re-runs itself in a subprocess that sets it from the start.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from dflash_train.kernels._triton import HAS_TRITON, interpreting
from dflash_train.kernels.static_attention import (
    bounds_from_positions,
    fits,
    split_plan,
    static_attention_reference,
    static_attention_triton,
)
from dflash_train.runtime.static_target import static_attention
from tests.helpers.kernels import DEVICE, compile_for_h100, kernels_here, under_interpreter

test_under_interpreter = under_interpreter(__file__)


def make_case(n: int, heads: int, kv_heads: int, tokens: int, keys: int, dim: int, dtype: torch.dtype,
              seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    # q as the attention layers hand it over: [n, heads, T, D] transposed from [n, T, heads, D] (not contiguous)
    q = (torch.randn(n, tokens, heads, dim, generator=gen) * 2).to(dtype).transpose(1, 2)
    k = (torch.randn(n, kv_heads, keys, dim, generator=gen) * 2).to(dtype)
    v = torch.randn(n, kv_heads, keys, dim, generator=gen).to(dtype)
    start = torch.randint(0, keys - tokens + 1, (n, 1), generator=gen)
    positions = start + torch.arange(tokens)  # consecutive new tokens, as in decode and verify
    return q, k, v, positions


def test_reference_matches_the_sdpa_path() -> None:
    """The reference with bounds = the SDPA path with the static target's boolean masks (causal and window)."""
    q, k, v, positions = make_case(2, 6, 2, 5, 40, 8, torch.float32, seed=0)
    slots = torch.arange(40)
    for window in (None, 4):
        visible = slots[None, None] <= positions[..., None]
        if window is not None:
            visible = visible & (slots[None, None] > positions[..., None] - window)
        sdpa, _ = static_attention(None, q, k, v, visible[:, None], scaling=0.3)  # type: ignore[arg-type]
        ours = static_attention_reference(q, k, v, bounds_from_positions(positions, window), scale=0.3)
        torch.testing.assert_close(ours, sdpa, atol=1e-5, rtol=1e-5)


def hf_sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bounds: torch.Tensor, scale: float,
                      sinks: torch.Tensor) -> torch.Tensor:
    """gpt-oss's own eager attention (transformers' `eager_attention_forward`: softmax over the scores and the
    sink, the sink's column dropped) in fp32, under the additive mask `bounds` stands for: the sinks' semantics
    taken from the model's code, apart from this repository's. -> [n, T, heads, D]."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    slots = torch.arange(k.shape[2])
    lo, hi = bounds[:, 0, :, None].long().cpu(), bounds[:, 1, :, None].long().cpu()
    mask = torch.zeros(q.shape[0], 1, q.shape[2], k.shape[2]).masked_fill(~((slots >= lo) & (slots <= hi))[:, None],
                                                                         float("-inf"))
    module = SimpleNamespace(num_key_value_groups=q.shape[1] // k.shape[1], sinks=sinks.float().cpu(), training=False)
    out, _ = eager_attention_forward(module, q.float().cpu(), k.float().cpu(), v.float().cpu(), mask, scale)
    return out


def make_sinks(heads: int, dtype: torch.dtype) -> torch.Tensor:
    """Sink logits from below the test cases' scores to above their largest (the cases' scores spread about 4 on
    either side of 0), one a head: heads where the sink takes little and heads where it takes most."""
    return torch.linspace(-3.0, 14.0, heads).to(dtype)


@pytest.mark.parametrize("window", [None, 4])
def test_the_reference_with_sinks_is_gpt_oss_attention_and_the_pytorch_path(window: int | None) -> None:
    """The brute-force reference with sinks = transformers' gpt-oss eager attention = the static target's
    PyTorch path with sinks (boolean masks from positions, a module carrying `sinks`)."""
    q, k, v, positions = make_case(2, 6, 2, 5, 40, 8, torch.float32, seed=0)
    bounds, sinks = bounds_from_positions(positions, window), make_sinks(6, torch.float32)
    ours = static_attention_reference(q, k, v, bounds, scale=0.3, sinks=sinks)
    torch.testing.assert_close(ours, hf_sink_attention(q, k, v, bounds, 0.3, sinks), atol=1e-5, rtol=1e-5)
    slots = torch.arange(40)
    visible = (slots >= bounds[:, 0, :, None]) & (slots <= bounds[:, 1, :, None])
    torch_path, _ = static_attention(SimpleNamespace(sinks=sinks), q, k, v, visible[:, None], scaling=0.3)  # type: ignore[arg-type]
    torch.testing.assert_close(torch_path, ours, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(ours, static_attention_reference(q, k, v, bounds, scale=0.3), atol=1e-2)


def test_sinks_of_another_shape_are_refused() -> None:
    q, k, v, positions = make_case(1, 4, 2, 1, 20, 8, torch.float32, seed=0)
    bounds = bounds_from_positions(positions, None)
    for sinks in (torch.zeros(2), torch.zeros(4, dtype=torch.int32), torch.zeros(8)[::2]):
        with pytest.raises(AssertionError, match="one logit a query head"):
            static_attention_triton(q, k, v, bounds, 0.2, sinks=sinks)


def test_split_plan_covers_every_key_once() -> None:
    for programs, keys, processors in [(8, 1280, 132), (1, 5, 4), (3, 1000, 132), (64, 4096, 132), (1, 64, 1)]:
        split_len, splits = split_plan(programs, keys, processors)
        assert split_len % 64 == 0 and split_len * splits >= keys > split_len * (splits - 1)
    assert split_plan(8, 1280, 132)[1] > 8  # several programs per KV head at batch 1


def test_fits() -> None:
    assert fits(32, 8, 16) and fits(32, 8, 1) and not fits(32, 8, 64) and not fits(9, 3, 100)


@kernels_here
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("n", "heads", "kv_heads", "tokens", "keys", "dim", "window"), [
    (1, 4, 1, 1, 7, 16, None),  # decode, fewer keys than a tile
    (2, 6, 2, 5, 200, 16, None),  # several splits per row, 3 query heads per KV head
    (1, 8, 8, 16, 300, 32, 20),  # verify block with a sliding window (most splits see nothing)
    (3, 9, 3, 3, 130, 24, None),  # head_dim not a power of two, uneven split
])
def test_kernel_matches_reference(dtype: torch.dtype, n: int, heads: int, kv_heads: int, tokens: int, keys: int,
                                  dim: int, window: int | None) -> None:
    q, k, v, positions = make_case(n, heads, kv_heads, tokens, keys, dim, dtype, seed=keys + tokens)
    bounds = bounds_from_positions(positions, window)
    expected = static_attention_reference(q, k, v, bounds, scale=dim ** -0.5)
    got = static_attention_triton(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), bounds.to(DEVICE), dim ** -0.5)
    assert got.shape == (n, tokens, heads, dim) and got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.cpu(), expected, atol=tol, rtol=tol)


@kernels_here
@pytest.mark.parametrize("plan", [(32, 4, 32), (64, 2, 32), (128, 8, 64), (256, 4, 128), (512, 4, 64), (64, 4, 64, 16),
                                  (128, 4, 32, 32)])
@pytest.mark.parametrize("groups", [4, 3])
def test_every_plan_matches_the_reference(plan: tuple[int, ...], groups: int) -> None:
    """Any cut of the work (split length, warps, tile width, query rows a program) computes the same
    attention: a verify block of 16 over 300 slots, one split for the longest plan; at 4 query heads per KV
    head (Qwen3) and 3 (SmolLM2: 48 rows padded to 64, a program of only padding rows at 16 a program)."""
    from dflash_train.kernels.static_attention import Plan, static_attention_planned

    q, k, v, positions = make_case(2, 2 * groups, 2, 16, 300, 32, torch.float32, seed=11)
    bounds = bounds_from_positions(positions, None)
    expected = static_attention_reference(q, k, v, bounds, scale=0.2)
    got = static_attention_planned(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), bounds.to(DEVICE), 0.2, Plan(*plan))
    torch.testing.assert_close(got.cpu(), expected, atol=1e-5, rtol=1e-5)


@kernels_here
@pytest.mark.parametrize("plan", [(32, 4, 32), (64, 4, 64, 16), (512, 4, 64)])
@pytest.mark.parametrize("groups", [4, 3])
def test_the_split_kernel_merging_its_own_splits_matches_the_reference(plan: tuple[int, ...], groups: int) -> None:
    """A plan that merges in the split kernel's last program (no second launch): the reference's attention,
    twice in a row on one counter buffer (the last program leaves it zeroed), at one split and at many, with
    query-row tiles, and a program of only padding rows (3 groups)."""
    from dflash_train.kernels.static_attention import Plan, static_attention_planned

    q, k, v, positions = make_case(2, 2 * groups, 2, 16, 300, 32, torch.float32, seed=12)
    bounds = bounds_from_positions(positions, None)
    expected = static_attention_reference(q, k, v, bounds, scale=0.2)
    counters = torch.zeros(16, dtype=torch.int32, device=DEVICE)
    merged = Plan(*plan)._replace(merge_in_split=True)
    for _ in range(2):
        got = static_attention_planned(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), bounds.to(DEVICE), 0.2, merged,
                                       counters)
        torch.testing.assert_close(got.cpu(), expected, atol=1e-5, rtol=1e-5)
        assert not counters.any()
    with pytest.raises(AssertionError, match="zeroed int32 counter"):
        static_attention_planned(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), bounds.to(DEVICE), 0.2, merged)


def test_a_plan_cuts_splits_into_whole_tiles() -> None:
    from dflash_train.kernels.static_attention import Plan, default_plan, static_attention_planned

    assert default_plan(8, 1280, 64, 132) == Plan(64, 4, 64)  # no head dim given: the rule
    assert default_plan(8, 1280, 64, 132, 128) == Plan(128, 4, 32)  # Qwen3-8B's verify block: tuned
    assert default_plan(8, 1280, 16, 132, 128) == Plan(32, 2, 32)
    assert default_plan(8, 32768, 16, 132, 128).split_len == 512  # a long cache: at most 64 splits
    assert default_plan(32, 1280, 16, 132, 128, batch=4).split_len == 128  # batch 1's number of programs
    assert default_plan(3, 1280, 16, 132, 64) == default_plan(3, 1280, 16, 132)  # SmolLM2's decode step: the rule
    q, k, v, positions = make_case(1, 4, 1, 1, 100, 16, torch.float32, seed=1)
    with pytest.raises(AssertionError, match="whole number of key tiles"):
        static_attention_planned(q, k, v, bounds_from_positions(positions, None), 0.2, Plan(96, 4, 64))
    with pytest.raises(AssertionError, match="a power of two, at least 16"):
        static_attention_planned(q, k, v, bounds_from_positions(positions, None), 0.2, Plan(64, 4, 64, 8))


@kernels_here
@pytest.mark.parametrize(("dtype", "sink_dtype"), [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                                   (torch.bfloat16, torch.bfloat16)])
@pytest.mark.parametrize(("n", "heads", "kv_heads", "tokens", "keys", "window", "plan"), [
    (2, 8, 2, 1, 200, None, None),  # decode step, 4 query heads per KV head, the default plan's splits
    (2, 8, 2, 1, 200, 20, (32, 4, 32)),  # the same in a window: most of the 7 splits see nothing
    (1, 4, 1, 16, 300, None, (512, 4, 64)),  # verify block, all 4 heads on one KV head, one split
    (2, 6, 2, 5, 300, 100, (64, 4, 64, 16)),  # a window starting mid tile, query rows over 2 programs
    (2, 6, 2, 5, 300, 100, (64, 4, 64, 16, True)),  # the same merged by the split kernel's last program
    (1, 4, 2, 3, 150, None, (64, 4, 64, 0, True)),  # merged in one launch, every row in one program
])
def test_kernel_with_sinks_matches_gpt_oss_attention(dtype: torch.dtype, sink_dtype: torch.dtype, n: int, heads: int,
                                                     kv_heads: int, tokens: int, keys: int, window: int | None,
                                                     plan: tuple[int | bool, ...] | None) -> None:
    """gpt-oss's sink logits folded into the merge of the splits: transformers' own eager attention, at one
    split and many, in the combine launch or the split kernel's last program, with and without a sliding
    window; sinks in fp32 or the model's dtype."""
    from dflash_train.kernels.static_attention import Plan, static_attention_planned

    q, k, v, positions = make_case(n, heads, kv_heads, tokens, keys, 16, dtype, seed=keys + tokens + heads)
    bounds, sinks = bounds_from_positions(positions, window), make_sinks(heads, sink_dtype)
    expected = hf_sink_attention(q, k, v, bounds, 0.25, sinks)
    args = (q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), bounds.to(DEVICE), 0.25)
    if plan is None:
        got = static_attention_triton(*args, sinks=sinks.to(DEVICE))
    else:
        counters = torch.zeros(16, dtype=torch.int32, device=DEVICE)
        got = static_attention_planned(*args, Plan(*plan), counters, sinks=sinks.to(DEVICE))
        assert not counters.any()
    assert got.shape == (n, tokens, heads, 16) and got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float().cpu(), expected, atol=tol, rtol=tol)
    without = static_attention_reference(q, k, v, bounds, 0.25)  # the sinks matter at these logits
    assert not torch.allclose(got.float().cpu(), without.float(), atol=0.1)


@kernels_here
def test_kernel_reads_no_slot_past_the_last_visible_one() -> None:
    """Slots after a query's position hold garbage in the static cache (stale or never written): the
    kernel must not let it in, not even as NaN through a masked product."""
    q, k, v, positions = make_case(1, 4, 2, 2, 256, 16, torch.float32, seed=3)
    positions = torch.tensor([[100, 101]])
    k[:, :, 102:], v[:, :, 102:] = float("nan"), float("nan")
    bounds = bounds_from_positions(positions, None)
    got = static_attention_triton(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), bounds.to(DEVICE), 0.25).cpu()
    k[:, :, 102:], v[:, :, 102:] = 0.0, 0.0
    torch.testing.assert_close(got, static_attention_reference(q, k, v, bounds, 0.25), atol=1e-5, rtol=1e-5)


@kernels_here
@pytest.mark.parametrize("arch", ["llama", "qwen3", "mistral", "qwen3_moe", "gpt_oss", "gemma3_text", "qwen3_5",
                                  "nemotron_h", "falcon_h1"])
def test_static_target_on_the_kernel_matches_the_full_forward(arch: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The target runner with kernels="triton" (prefill of some rows, then a verify block per row at
    different positions; a sliding window for mistral, gpt_oss and gemma3_text) against the model's own forward:
    every attention of the runner on the kernel, gpt_oss's with its sink logits, gemma3_text's from its own
    layers (their scale, local and global rotary embeddings); the hybrids' steps on the Gated DeltaNet and
    Mamba-2 kernels beside it (Nemotron-H's ungated experts left to the model's own code)."""
    from dflash_train.runtime import cache_attention
    from tests.helpers.static_target import check_prefill_and_verify

    kernel, sinks_given = cache_attention.static_attention_triton, []

    def recording(*args: object, **kwargs: object) -> torch.Tensor:
        sinks_given.append(kwargs.get("sinks"))
        return kernel(*args, **kwargs)

    monkeypatch.setattr(cache_attention, "static_attention_triton", recording)
    check_prefill_and_verify(arch, kernels="triton", device=DEVICE)
    assert sinks_given and all((sinks is not None) == (arch == "gpt_oss") for sinks in sinks_given)


@kernels_here
def test_the_runtime_runs_merging_plans_on_its_counters(monkeypatch: pytest.MonkeyPatch) -> None:
    """With every default plan merging in its split kernel, the target runner (prefill, then verify blocks)
    still computes the model's own forward and the drafter's kernel layers the drafter's own, each launch on
    the runner's counters, left zeroed."""
    from dflash_train.kernels import static_attention as sa
    from tests.helpers.draft_blocks import blocks_through
    from tests.helpers.static_target import check_prefill_and_verify

    monkeypatch.setattr(sa, "default_plan", lambda *args, **kwargs: sa.Plan(32, 4, 32, 0, True))
    monkeypatch.setattr(sa, "_tuned_to_merge", lambda q, k: True)
    merged: list[torch.Tensor] = []
    real = sa._static_attention_merged_op

    def counting(*args: object) -> torch.Tensor:
        merged.append(args[-1])  # the counters
        return real(*args)

    monkeypatch.setattr(sa, "_static_attention_merged_op", counting)
    check_prefill_and_verify("qwen3", kernels="triton", device=DEVICE)
    assert merged and not any(counters.any() for counters in merged)
    merged.clear()
    kernel_hidden, drafter = blocks_through("kernel")
    sdpa_hidden, _ = blocks_through("sdpa")
    for ours, reference in zip(kernel_hidden, sdpa_hidden, strict=True):
        torch.testing.assert_close(ours, reference, atol=2e-5, rtol=1e-5)
    assert merged and all(counters is drafter.attention_counters for counters in merged)
    assert not drafter.attention_counters.any()


def test_only_a_tuned_merging_plan_takes_the_one_launch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    from dflash_train.kernels import static_attention as sa

    q, k = torch.zeros(1, 32, 16, 128), torch.zeros(1, 8, 64, 128)  # Qwen3-8B's verify block: 64 query rows
    assert not sa._tuned_to_merge(q, k)  # no tabled plan merges yet
    monkeypatch.setitem(sa.TUNED_PLANS, (64, 128), sa.Plan(128, 4, 32, 0, True))
    assert sa._tuned_to_merge(q, k) and not sa._tuned_to_merge(q[:, :, :1], k)  # the decode step's keeps two


def test_the_runner_uses_bounds_only_where_the_kernel_fits() -> None:
    from dflash_train.runtime.static_target import StaticTarget
    from tests.helpers.tiny_models import make_tiny_target

    runner = StaticTarget(make_tiny_target("llama", num_layers=1), batch_size=1, max_length=512, kernels="triton")
    groups = runner.heads // runner.kv_heads
    decode = runner._masks(torch.zeros(1, 1, dtype=torch.long), 512)[None]
    prefill = runner._masks(torch.arange(400)[None], 400)[None]
    assert decode.dtype == torch.int32 and decode.shape == (1, 2, 1)
    assert prefill.dtype == torch.bool and 400 * groups > 128
    with pytest.raises(ValueError, match="kernels must be"):
        StaticTarget(make_tiny_target("llama", num_layers=1), batch_size=1, max_length=8, kernels="flash")


@pytest.mark.skipif(not HAS_TRITON or interpreting(), reason="needs triton's compiler")
@pytest.mark.parametrize(("element", "float_type"), [("bf16", "fp64"), ("bf16", "fp32"), ("fp32", "fp64")])
@pytest.mark.parametrize(("tokens", "groups", "dim"), [(1, 4, 128), (16, 3, 64)])
def test_kernels_compile_for_the_gpu(element: str, float_type: str, tokens: int, groups: int, dim: int) -> None:
    """A kernel that only fails in the GPU compiler (types the interpreter lets through) fails here, on CPU."""
    from dflash_train.kernels._triton import next_power_of_2
    from dflash_train.kernels.static_attention import BLOCK_N, _combine_kernel, _split_kernel

    block_m, block_d = max(16, next_power_of_2(groups * tokens)), max(16, next_power_of_2(dim))
    shapes = dict(T=tokens, GROUPS=groups, D=dim, ROWS=block_m, BLOCK_D=block_d)
    pointers = {"q_ptr": f"*{element}", "k_ptr": f"*{element}", "v_ptr": f"*{element}", "bounds_ptr": "*i32",
                "part_o_ptr": "*fp32", "part_lse_ptr": "*fp32", "out_ptr": f"*{element}"}
    constants = {**shapes, "BLOCK_M": 16, "BLOCK_N": BLOCK_N, "IEEE": element == "fp32", "UPCAST": False, "PREFETCH": False,
                 "PF_PARTS": 128, "PF_ELEMENT_BYTES": 2}
    # sink logits in the model's dtype or in fp32 (either may be handed over)
    sink_type = f"*{element}" if float_type == "fp64" else "*fp32"
    for sinks in (False, True):
        typed = {**pointers, "sinks_ptr": sink_type}
        split_pointers = {**typed, "pf_ptr": "*bf16", "counter_ptr": "*i32"}
        for merge in (False, True):
            compile_for_h100(_split_kernel, {**constants, "MERGE": merge, "SINKS": sinks}, split_pointers, float_type)
        compile_for_h100(_combine_kernel, {**shapes, "BLOCK_S": 32, "SINKS": sinks}, typed, float_type)


def split_kernel_arguments(prefetch: bool) -> dict[str, object]:
    """A Qwen3-8B-shaped decode launch of the split kernel (1 query, 32 heads on 8 KV heads, 1,024 slots)."""
    from dflash_train.kernels.static_attention import BLOCK_N

    bf16 = dict(dtype=torch.bfloat16)
    cache = dict(sk_n=8 * 1024 * 128, sk_h=1024 * 128, sk_s=128, sk_d=1)
    return dict(q_ptr=torch.empty(1, 32, 1, 128, **bf16), k_ptr=torch.empty(1, 8, 1024, 128, **bf16),
                v_ptr=torch.empty(1, 8, 1024, 128, **bf16), bounds_ptr=torch.empty(1, 2, 1, dtype=torch.int32),
                part_o_ptr=torch.empty(16 * 16 * 128), part_lse_ptr=torch.empty(16 * 16),
                pf_ptr=torch.empty(4096, 4096, **bf16), counter_ptr=torch.empty(8, dtype=torch.int32),
                sinks_ptr=torch.empty(32, **bf16), out_ptr=torch.empty(1, 1, 32, 128, **bf16), sq_n=4096, sq_h=128, sq_t=128, sq_d=1, **cache,
                **{name.replace("sk", "sv"): value for name, value in cache.items()}, kv_heads=8, keys=1024,
                split_len=64, num_splits=16, scale=0.088, pf_numel=4096 * 4096, pf_chunk=1024, T=1, GROUPS=4, D=128,
                ROWS=16, BLOCK_M=16, BLOCK_N=BLOCK_N, BLOCK_D=128, IEEE=False, UPCAST=False, PREFETCH=prefetch, PF_PARTS=128,
                PF_ELEMENT_BYTES=2, MERGE=False, SINKS=False)


@pytest.mark.skipif(not HAS_TRITON or interpreting(), reason="needs triton's compiler")
def test_the_next_weight_is_asked_of_l2_before_the_cache_is_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """With PREFETCH the split kernel's bulk L2 requests come before its first product over the cache, and
    torch.compile's analysis of it still finds only the partial results written (a weight taken as written
    would be copied at every call); without, no request is in the code."""
    from dflash_train.kernels.static_attention import _split_kernel
    from tests.helpers.kernels import pointers_written

    arguments = split_kernel_arguments(prefetch=True)
    constants = {name: arguments[name] for name in ("T", "GROUPS", "D", "ROWS", "BLOCK_M", "BLOCK_N", "BLOCK_D", "IEEE",
                                                     "UPCAST", "PREFETCH", "PF_PARTS", "PF_ELEMENT_BYTES", "MERGE",
                                                     "SINKS")}
    pointers = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "bounds_ptr": "*i32", "part_o_ptr": "*fp32",
                "part_lse_ptr": "*fp32", "pf_ptr": "*bf16", "counter_ptr": "*i32", "sinks_ptr": "*bf16",
                "out_ptr": "*bf16"}
    ptx = compile_for_h100(_split_kernel, constants, pointers, "fp32")
    assert -1 < ptx.find("cp.async.bulk.prefetch.L2.global") < ptx.find("mma")
    assert "cp.async.bulk.prefetch" not in compile_for_h100(_split_kernel, {**constants, "PREFETCH": False},
                                                            pointers, "fp32")
    for prefetch in (True, False):
        written = pointers_written(_split_kernel, split_kernel_arguments(prefetch), monkeypatch)
        assert written == ["part_lse_ptr", "part_o_ptr"]


def test_the_prefetch_parts_cover_the_weight_in_16_byte_units() -> None:
    from dflash_train.kernels.static_attention import prefetch_chunk

    for numel, element_bytes, parts in [(4096 * 4096, 2, 128 * 128), (1000, 2, 7), (10, 4, 64), (576 * 576, 2, 9 * 128)]:
        chunk = prefetch_chunk(numel, element_bytes, parts)
        assert (chunk * element_bytes) % 16 == 0 and chunk * parts >= numel  # aligned, and all of it asked for
        assert chunk < -(-numel // parts) + 16 // element_bytes  # no part asks for more than one unit extra


@kernels_here
def test_a_weight_to_prefetch_changes_no_result() -> None:
    """The argument is taken and checked wherever the kernel runs (asked of L2 only on a GPU, where the
    GPU tests compare the bits): same output with and without, and a strided weight refused."""
    from dflash_train.kernels.static_attention import bounds_from_positions, static_attention_triton

    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(shape, generator=gen).to(DEVICE) for shape in [(2, 4, 1, 32), (2, 2, 96, 32), (2, 2, 96, 32)])
    bounds = bounds_from_positions(torch.tensor([[40], [95]]), None).to(DEVICE)
    weight = torch.randn(64, 48, generator=gen).to(DEVICE)
    plain = static_attention_triton(q, k, v, bounds, 0.2)
    assert torch.equal(static_attention_triton(q, k, v, bounds, 0.2, prefetch=weight), plain)
    with pytest.raises(AssertionError, match="contiguous"):
        static_attention_triton(q, k, v, bounds, 0.2, prefetch=weight.T)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the L2 requests are made on a GPU only")
def test_asking_l2_for_a_weight_changes_no_bit_on_the_gpu() -> None:
    """On a GPU the bulk L2 requests are made (a Qwen3-8B o_proj's 33.5 MB): the same bits as without, at a
    decode step and a verify block."""
    from dflash_train.kernels.static_attention import bounds_from_positions, static_attention_triton

    gen = torch.Generator(device="cuda").manual_seed(6)
    weight = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16, generator=gen)
    k, v = (torch.randn(2, 8, 1024, 128, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
    for tokens in (1, 16):
        q = torch.randn(2, 32, tokens, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
        positions = torch.tensor([700, 1000 - tokens], device="cuda")[:, None] + torch.arange(tokens, device="cuda")
        bounds = bounds_from_positions(positions, None)
        plain = static_attention_triton(q, k, v, bounds, 128 ** -0.5)
        assert torch.equal(static_attention_triton(q, k, v, bounds, 128 ** -0.5, prefetch=weight), plain)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("tokens", [1, 16])
@pytest.mark.parametrize("window", [None, 128])
def test_sinks_on_the_gpu_at_gpt_oss_20b_shapes(tokens: int, window: int | None) -> None:
    """gpt-oss-20b's attention shape (64 query heads on 8 KV heads of 64, bf16 sinks, the 128-token window and
    full layers) on the GPU, eager and under torch.compile: transformers' eager attention within bf16's
    rounding, and the same bits for a query wherever it sits in its block."""
    gen = torch.Generator(device="cuda").manual_seed(7)
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(2, 8, 1280, 64, generator=gen, **bf16) for _ in range(2))
    q = torch.randn(2, 64, tokens, 64, generator=gen, **bf16)
    sinks = (torch.randn(64, generator=gen, device="cuda") * 2).to(torch.bfloat16)
    positions = torch.tensor([700, 1000], device="cuda")[:, None] + torch.arange(tokens, device="cuda")
    bounds = bounds_from_positions(positions, window)
    eager = static_attention_triton(q, k, v, bounds, 0.125, sinks=sinks)
    torch.testing.assert_close(eager.float().cpu(), hf_sink_attention(q, k, v, bounds, 0.125, sinks), atol=2e-2,
                               rtol=2e-2)
    compiled = torch.compile(lambda *args: static_attention_triton(*args, sinks=sinks), dynamic=False)
    assert torch.equal(compiled(q, k, v, bounds, 0.125), eager)
    if tokens > 1:  # the last query alone, at the same launch shape: its bits do not depend on the block
        alone = bounds.clone()
        alone[:, :, :-1] = bounds[:, :, -1:]
        assert torch.equal(static_attention_triton(q, k, v, alone, 0.125, sinks=sinks)[:, -1], eager[:, -1])
