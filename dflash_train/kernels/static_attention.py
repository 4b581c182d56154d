"""Attention of a few new tokens over the target's static KV cache (decode and verify), split along the keys.

A decode step has one query per row and a verify step 16, against a cache of thousands of slots. A prefill
attention kernel gives each query tile one program that walks every key: at batch 1 that is one program
per head, a few dozen on a GPU with 132 SMs, and the step waits on their latency (cuDNN's kernel took a
large share of a Qwen3-8B-shaped decode step for one query over about a thousand slots: docs/benchmarks.md,
`decode`). Here, as in flash-decoding, the keys are cut into splits and each (row, KV head, split) gets a program; a second
launch merges the splits' partial softmaxes. The query heads that share a KV head are processed together
(grouped-query attention without repeating K/V). How a launch cuts the work (split length, warps, key-tile
width, query rows a program) is its `Plan`: the fastest measured on an H200 for the decode and verify
shapes of the reference targets (`TUNED_PLANS`, `benchmarks.static_attention`), a rule elsewhere.

Which slots a query sees comes from `bounds` [n, 2, T] (first and last visible slot of each query, both
inclusive): causal attention is [0, position], a sliding window [position - window + 1, position]. Slots
past the last visible one are never read, so a step costs what the context holds, not what the cache can
hold. Key tiles sit at fixed cache positions (multiples of BLOCK_N), so at a given launch shape a query's
output does not depend on the other queries of its block: the same bits as a block's first token or last.
Scores come from the tensor cores' bf16 dot with fp32 sums; softmax runs in fp32 (exp of scores minus the
running max); probabilities are rounded to the cache's dtype for the P·V product, as flash attention does;
the output is rounded once. fp32 inputs are multiplied in full fp32 precision.

Sink logits (gpt-oss, `sinks` [heads]): one more logit per query head that joins the softmax's denominator
with no value behind it, as transformers' eager attention for gpt-oss computes it (softmax over the scores
and the sink, the sink's column then dropped). A split sees a slice of the keys only, so the sink joins
where the splits' partial softmaxes are merged: once per query, whichever the cut, and whatever its window.

The next weight (opt-in, `prefetch`): at a decode step the attention reads a few MB of cache while the
memory bus is otherwise idle, and the product after it (o_proj: 33.5 MB in Qwen3-8B, streamed well below the
rate the large products reach) waits on its own ramp-up. Given a weight, the split kernel's programs
first ask L2 for it in bulk (`prefetch_l2_bulk`), each a share, so that the product finds it there. The
result does not change; `benchmarks.decode --variants prefetch_o_proj` times what it is worth.
"""

# Deliberately no postponed annotations (PEP 563): Triton reads the `tl.constexpr` annotations of kernels.
import functools
from typing import NamedTuple

import torch
from torch.library import triton_op, wrap_triton

from dflash_train.kernels._triton import HAS_TRITON, interpreting, jit, next_power_of_2, tl, triton
from dflash_train.kernels.device import prefetch_l2_bulk

BLOCK_N = 64  # keys per tile; a split is a whole number of tiles
MAX_QUERY_ROWS = 128  # query heads per KV head x new tokens handled by one program (larger: use SDPA)


def bounds_from_positions(positions: torch.Tensor, window: int | None) -> torch.Tensor:
    """positions [n, T] -> bounds [n, 2, T] int32: the first and last slot each query sees."""
    hi = positions
    lo = torch.zeros_like(positions) if window is None else (positions - (window - 1)).clamp(min=0)
    return torch.stack([lo, hi], dim=1).to(torch.int32)


def mask_from_bounds(bounds: torch.Tensor, keys: int) -> torch.Tensor:
    """`bounds_from_positions`' bounds [b, 2, T] -> the bool mask [b, 1, T, keys] of the same visible slots."""
    slots = torch.arange(keys, device=bounds.device)
    first, last = bounds[:, 0, :, None], bounds[:, 1, :, None]  # [b, T, 1]
    return ((slots >= first) & (slots <= last))[:, None]


def query_rows(heads: int, kv_heads: int, tokens: int) -> int:
    """A KV head's query rows in one launch (its query heads x new tokens), padded to a power of two >= 16."""
    return max(16, next_power_of_2(heads // kv_heads * tokens))


def fits(heads: int, kv_heads: int, tokens: int) -> bool:
    """Whether `tokens` new tokens per row fit one program's query tile (else the caller uses SDPA)."""
    return next_power_of_2((heads // kv_heads) * tokens) <= MAX_QUERY_ROWS


def static_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bounds: torch.Tensor,
                               scale: float, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Brute force in fp32. q [n, heads, T, D]; k/v [n, kv_heads, S, D]; bounds [n, 2, T]; sinks [heads] or
    None (a logit per head in the softmax, no value with it) -> [n, T, heads, D]."""
    n, heads, t, _ = q.shape
    groups = heads // k.shape[1]
    slots = torch.arange(k.shape[2], device=q.device)
    lo, hi = bounds[:, 0].long(), bounds[:, 1].long()  # [n, T]
    visible = (slots >= lo[..., None]) & (slots <= hi[..., None])  # [n, T, S]
    keys = k.float().repeat_interleave(groups, dim=1)
    values = v.float().repeat_interleave(groups, dim=1)
    scores = torch.einsum("nhtd,nhsd->nhts", q.float(), keys) * scale
    scores = scores.masked_fill(~visible[:, None], float("-inf"))
    if sinks is None:
        weights = scores.softmax(dim=-1).nan_to_num(0.0)  # a query that sees nothing: zeros
    else:
        sink = sinks.float()[None, :, None, None].expand(n, heads, t, 1)
        weights = torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :-1]
    out = torch.einsum("nhts,nhsd->nhtd", weights, values)
    return out.transpose(1, 2).to(q.dtype)


def _split_kernel(
    q_ptr, k_ptr, v_ptr, bounds_ptr, part_o_ptr, part_lse_ptr, pf_ptr, counter_ptr, sinks_ptr, out_ptr,
    sq_n, sq_h, sq_t, sq_d, sk_n, sk_h, sk_s, sk_d, sv_n, sv_h, sv_s, sv_d,
    kv_heads, keys, split_len, num_splits, scale, pf_numel, pf_chunk,
    T: tl.constexpr, GROUPS: tl.constexpr, D: tl.constexpr, ROWS: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr, PREFETCH: tl.constexpr,
    PF_PARTS: tl.constexpr, PF_ELEMENT_BYTES: tl.constexpr, MERGE: tl.constexpr, SINKS: tl.constexpr,
):
    # IEEE: fp32 inputs, fp32 products. UPCAST: bf16/fp16 inputs multiplied as fp32 (the interpreter's dot
    # cannot multiply bf16); else the tensor cores' bf16/fp16 dot with fp32 sums, as flash attention.
    pid = tl.program_id(0)  # row * kv_heads + kv_head
    split = tl.program_id(1)
    row = pid // kv_heads
    kv_head = pid % kv_heads
    # query row r of ROWS (this program's BLOCK_M of them): head kv_head * GROUPS + r // T, token r % T
    r = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    r_ok = r < GROUPS * T
    head = kv_head * GROUPS + r // T
    token = r % T
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    q = tl.load(q_ptr + row * sq_n + head[:, None] * sq_h + token[:, None] * sq_t + d[None, :] * sq_d,
                mask=r_ok[:, None] & d_ok[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    lo = tl.load(bounds_ptr + row * 2 * T + token, mask=r_ok, other=1)  # padding rows: lo > hi, sees nothing
    hi = tl.load(bounds_ptr + row * 2 * T + T + token, mask=r_ok, other=0)
    # Tiles start at multiples of BLOCK_N whatever the block's first visible slot (a sliding window moves it):
    # a query's keys then fall into the same tiles, and sum in the same order, wherever it sits in a block,
    # which the lossless check relies on (`dflash_train.runtime.engine`). Tiles it cannot see add exact zeros.
    first = tl.min(tl.where(r_ok, lo, keys), axis=0)
    start = tl.maximum(split * split_len, first // BLOCK_N * BLOCK_N)
    if PREFETCH:  # the next weight's share of this program (pf_chunk elements a part), asked of L2 first;
        # the zeros it returns join the loop's start so that the requests go out before the loop
        part = (pid * num_splits + split).to(tl.int64) * PF_PARTS + tl.arange(0, PF_PARTS)
        begin = part * pf_chunk
        count = tl.minimum(tl.maximum(pf_numel - begin, 0), pf_chunk)
        start += tl.sum(prefetch_l2_bulk(pf_ptr + begin, (count * PF_ELEMENT_BYTES).to(tl.int32)), axis=0)
    end = tl.minimum(tl.minimum((split + 1) * split_len, keys), tl.max(hi, axis=0) + 1)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    m_safe = tl.zeros([BLOCK_M], tl.float32)
    total = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    k_base = k_ptr + row.to(tl.int64) * sk_n + kv_head * sk_h
    v_base = v_ptr + row.to(tl.int64) * sv_n + kv_head * sv_h
    for s0 in range(start, end, BLOCK_N):
        s = s0 + tl.arange(0, BLOCK_N)
        s_ok = s < end
        kt = tl.load(k_base + s[None, :] * sk_s + d[:, None] * sk_d, mask=s_ok[None, :] & d_ok[:, None], other=0.0)
        if UPCAST:
            kt = kt.to(tl.float32)
        if IEEE:  # noqa: SIM108 (a constexpr branch: one of the two is compiled)
            scores = tl.dot(q, kt, input_precision="ieee")
        else:
            scores = tl.dot(q, kt)
        scores = (scores * scale).to(tl.float32)  # torch.compile passes Python floats as fp64
        visible = (s[None, :] >= lo[:, None]) & (s[None, :] <= hi[:, None]) & s_ok[None, :]
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen nothing yet stays at 0
        p = tl.exp(scores - m_safe[:, None])
        alpha = tl.exp(m - m_safe)
        total = total * alpha + tl.sum(p, axis=1)
        vt = tl.load(v_base + s[:, None] * sv_s + d[None, :] * sv_d, mask=s_ok[:, None] & d_ok[None, :], other=0.0)
        if UPCAST:
            vt = vt.to(tl.float32)
        if IEEE:  # noqa: SIM108 (a constexpr branch: one of the two is compiled)
            acc = acc * alpha[:, None] + tl.dot(p, vt, input_precision="ieee")
        else:  # probabilities rounded to the cache's dtype for the tensor cores
            acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt)
        m = m_new
    seen = total > 0
    lse = tl.where(seen, m_safe + tl.log(tl.where(seen, total, 1.0)), float("-inf"))
    out = acc / tl.where(seen, total, 1.0)[:, None]
    part = pid * num_splits + split
    tl.store(part_lse_ptr + part * ROWS + r, lse)
    tl.store(part_o_ptr + (part * ROWS + r[:, None]) * BLOCK_D + d[None, :], out)
    if MERGE:  # the last of these rows' splits to finish merges them all, in split order: no second launch
        tl.debug_barrier()  # every thread's partial results stored before the release below
        counter = counter_ptr + pid * (ROWS // BLOCK_M) + tl.program_id(2)
        if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == num_splits - 1:
            tl.debug_barrier()  # no thread reads another split's results before the acquire above
            _merge_splits(part_o_ptr, part_lse_ptr, sinks_ptr, out_ptr, pid, row, r, r_ok, head, token, d,
                          kv_heads * GROUPS, num_splits, T, D, ROWS, BLOCK_M, BLOCK_D, SINKS)
            tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")  # ready for the next launch


def _merge_splits(part_o_ptr, part_lse_ptr, sinks_ptr, out_ptr, pid, row, r, r_ok, head, token, d, heads,
                  num_splits, T: tl.constexpr, D: tl.constexpr, ROWS: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_D: tl.constexpr, SINKS: tl.constexpr):
    """`_combine_kernel`'s merge for one program's rows, splits summed one after another (loads through L2:
    the other programs' results were written from other multiprocessors)."""
    top = tl.full([BLOCK_M], float("-inf"), tl.float32)
    for sp in range(0, num_splits):
        top = tl.maximum(top, tl.load(part_lse_ptr + (pid * num_splits + sp) * ROWS + r, cache_modifier=".cg"))
    sink = tl.zeros([BLOCK_M], tl.float32)
    if SINKS:  # padding rows' heads lie past the last: they read none
        sink = tl.load(sinks_ptr + head, mask=r_ok, other=0.0).to(tl.float32)
        top = tl.maximum(top, sink)
    top = tl.where(top == float("-inf"), 0.0, top)  # rows no split saw: every weight 0
    denom = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for sp in range(0, num_splits):
        part = pid * num_splits + sp
        weight = tl.exp(tl.load(part_lse_ptr + part * ROWS + r, cache_modifier=".cg") - top)
        o = tl.load(part_o_ptr + (part * ROWS + r[:, None]) * BLOCK_D + d[None, :], cache_modifier=".cg")
        acc += o * weight[:, None]
        denom += weight
    if SINKS:  # the sink's share of the denominator, after the splits' as in `_combine_kernel`
        denom += tl.exp(sink - top)
    out = acc / tl.where(denom > 0, denom, 1.0)[:, None]
    dst = out_ptr + ((row.to(tl.int64) * T + token[:, None]) * heads + head[:, None]) * D + d[None, :]
    tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=r_ok[:, None] & (d[None, :] < D))


if HAS_TRITON:  # a device function, resolved when a kernel calling it compiles
    _merge_splits = triton.jit(_merge_splits)


def _combine_kernel(
    part_o_ptr, part_lse_ptr, sinks_ptr, out_ptr, kv_heads, num_splits,
    T: tl.constexpr, GROUPS: tl.constexpr, D: tl.constexpr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr, SINKS: tl.constexpr,
):
    pid = tl.program_id(0)
    r = tl.program_id(1)
    row = pid // kv_heads
    head = (pid % kv_heads) * GROUPS + r // T
    token = r % T
    sp = tl.arange(0, BLOCK_S)
    sp_ok = sp < num_splits
    d = tl.arange(0, BLOCK_D)
    parts = pid * num_splits + sp
    lse = tl.load(part_lse_ptr + parts * ROWS + r, mask=sp_ok, other=float("-inf"))
    top = tl.max(lse, axis=0)
    if SINKS:  # the sink joins the softmax here, once per query: a split sees only part of the keys
        sink = tl.load(sinks_ptr + head).to(tl.float32)
        top = tl.maximum(top, sink)
    top = tl.where(top == float("-inf"), 0.0, top)
    weight = tl.exp(lse - top)  # splits that saw nothing weigh 0
    o = tl.load(part_o_ptr + (parts[:, None] * ROWS + r) * BLOCK_D + d[None, :], mask=sp_ok[:, None], other=0.0)
    denom = tl.sum(weight, axis=0)
    if SINKS:  # a logit with no value: in the denominator only
        denom += tl.exp(sink - top)
    out = tl.sum(o * weight[:, None], axis=0) / tl.where(denom > 0, denom, 1.0)
    heads = kv_heads * GROUPS
    dst = out_ptr + ((row.to(tl.int64) * T + token) * heads + head) * D
    tl.store(dst + d, out.to(out_ptr.dtype.element_ty), mask=d < D)


@functools.lru_cache(maxsize=8)
def _processors(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def split_plan(programs: int, keys: int, processors: int, block_n: int = BLOCK_N) -> tuple[int, int]:
    """(split_len, num_splits): about two programs per processor, each at least one tile of keys."""
    wanted = max(1, min(_ceil_div(keys, block_n), _ceil_div(2 * processors, programs)))
    split_len = _ceil_div(_ceil_div(keys, wanted), block_n) * block_n
    return split_len, _ceil_div(keys, split_len)


class Plan(NamedTuple):
    """How one launch cuts the work: keys per split (a whole number of tiles), warps per split program, keys
    per tile, query rows per program (0: all of a KV head's, else a power of two of at least 16: a block's
    rows spread over more programs). Fixed by the launch shape alone, so that every query of a block sums its
    keys in the same order, whichever program it falls to."""

    split_len: int
    warps: int
    block_n: int = BLOCK_N
    query_rows: int = 0
    merge_in_split: bool = False  # the last split program merges (needs a zeroed counter buffer), else a second launch


# Plans measured fastest on an H200 (`benchmarks.static_attention`, 1,024 visible slots of 1,280, a layer's
# call in CUDA graphs), by (query rows a KV head, padded; head dim): Qwen3-8B's decode step and verify block,
# SmolLM2's verify block, each faster than the rule below; SmolLM2's decode step keeps the rule, which was as
# fast there (docs/benchmarks.md, 'Attention plans').
TUNED_PLANS = {(16, 128): Plan(32, 2, 32), (64, 128): Plan(128, 4, 32), (64, 64): Plan(128, 4, 128, 16)}
MAX_SPLITS = 64  # a longer cache lengthens the tuned splits instead: the combine reads every split


def default_plan(programs: int, keys: int, query_rows: int, processors: int, head_dim: int = 0,
                 batch: int = 1) -> Plan:
    """The tuned plan of (query_rows, head_dim) (tuned at batch 1: at batch n its splits n times as long,
    so that the launch keeps batch 1's number of programs, and at most MAX_SPLITS of them); elsewhere
    `split_plan`'s splits, 64-key tiles and 4 warps (8 were slower at every measured shape)."""
    tuned = TUNED_PLANS.get((query_rows, head_dim))
    if tuned is None:
        return Plan(split_plan(programs, keys, processors)[0], 4)
    shortest = _ceil_div(_ceil_div(keys, MAX_SPLITS), tuned.block_n) * tuned.block_n
    return tuned._replace(split_len=max(tuned.split_len * batch, shortest))


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def prefetch_chunk(numel: int, element_bytes: int, parts: int) -> int:
    """Elements of the weight each bulk request asks for: every part a share, a multiple of 16 bytes (the
    requests' granularity and alignment, the weight being 16-byte aligned)."""
    per_16_bytes = max(1, 16 // element_bytes)
    return _ceil_div(_ceil_div(numel, parts), per_16_bytes) * per_16_bytes


def _launch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bounds: torch.Tensor, scale: float,
            prefetch: torch.Tensor | None = None, plan: Plan | None = None,
            counters: torch.Tensor | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    n, heads, t, dim = q.shape
    kv_heads, keys = k.shape[1], k.shape[2]
    groups = heads // kv_heads
    rows = query_rows(heads, kv_heads, t)
    block_d = max(16, next_power_of_2(dim))
    plan = plan or default_plan(n * kv_heads, keys, rows, _processors(q.device), dim, n)
    assert plan.split_len % plan.block_n == 0, "a split is a whole number of key tiles"
    block_m = min(plan.query_rows or rows, rows)
    assert block_m >= 16 and rows % block_m == 0, "a program's query rows: a power of two, at least 16"
    split_len, num_splits, warps = plan.split_len, _ceil_div(keys, plan.split_len), plan.warps
    merge = plan.merge_in_split
    assert not merge or (counters is not None and counters.dtype == torch.int32
                         and counters.numel() >= n * kv_heads * (rows // block_m)), "a zeroed int32 counter a program"
    part_o = torch.empty(n * kv_heads * num_splits * rows * block_d, device=q.device, dtype=torch.float32)
    part_lse = torch.empty(n * kv_heads * num_splits * rows, device=q.device, dtype=torch.float32)
    out = torch.empty((n, t, heads, dim), device=q.device, dtype=q.dtype)
    split_kernel, combine_kernel = jit(_split_kernel), jit(_combine_kernel)
    if not interpreting():  # traced by torch.compile as part of the graph (interpreted kernels cannot be)
        split_kernel, combine_kernel = wrap_triton(split_kernel), wrap_triton(combine_kernel)
    asked = prefetch is not None and not interpreting()  # the interpreter has no inline assembly
    weight = prefetch if asked else q  # never read without PREFETCH
    parts = 32 * warps  # bulk requests a program: one a thread
    chunk = prefetch_chunk(weight.numel(), weight.element_size(), n * kv_heads * num_splits * parts)
    sink_logits = q if sinks is None else sinks  # never read without SINKS
    split_kernel[(n * kv_heads, num_splits, rows // block_m)](
        q, k, v, bounds, part_o, part_lse, weight, counters if merge else bounds, sink_logits, out,
        *q.stride(), *k.stride(), *v.stride(),
        kv_heads, keys, split_len, num_splits, scale, weight.numel(), chunk,
        T=t, GROUPS=groups, D=dim, ROWS=rows, BLOCK_M=block_m, BLOCK_N=plan.block_n, BLOCK_D=block_d,
        IEEE=q.dtype == torch.float32, UPCAST=interpreting() and q.dtype != torch.float32, PREFETCH=asked,
        PF_PARTS=parts, PF_ELEMENT_BYTES=weight.element_size(), MERGE=merge, SINKS=sinks is not None,
        num_warps=warps,
    )
    if merge:
        return out
    combine_kernel[(n * kv_heads, groups * t)](
        part_o, part_lse, sink_logits, out, kv_heads, num_splits,
        T=t, GROUPS=groups, D=dim, ROWS=rows, BLOCK_D=block_d, BLOCK_S=next_power_of_2(num_splits),
        SINKS=sinks is not None,
    )
    return out


@triton_op("dflash_train::static_attention", mutates_args=())
def _static_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bounds: torch.Tensor,
                         scale: float, prefetch: torch.Tensor | None = None,
                         sinks: torch.Tensor | None = None) -> torch.Tensor:
    return _launch(q, k, v, bounds, scale, prefetch, plan=_plan_for(q, k)._replace(merge_in_split=False),
                   sinks=sinks)


@triton_op("dflash_train::static_attention_merged", mutates_args={"counters"})
def _static_attention_merged_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bounds: torch.Tensor,
                                scale: float, sinks: torch.Tensor | None, counters: torch.Tensor) -> torch.Tensor:
    return _launch(q, k, v, bounds, scale, plan=_plan_for(q, k), counters=counters, sinks=sinks)


def _plan_for(q: torch.Tensor, k: torch.Tensor) -> Plan:
    """`default_plan` at this launch's shapes."""
    n, heads, t, dim = q.shape
    rows = query_rows(heads, k.shape[1], t)
    return default_plan(n * k.shape[1], k.shape[2], rows, _processors(q.device), dim, n)


def _tuned_to_merge(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether this launch's plan merges in its split kernel: only a tuned plan does. Shapes and the table
    alone (no device query), since torch.compile evaluates it while tracing the layer."""
    tuned = TUNED_PLANS.get((query_rows(q.shape[1], k.shape[1], q.shape[2]), q.shape[3]))
    return tuned is not None and tuned.merge_in_split


def counters_for(batch_size: int, kv_heads: int, device: torch.device) -> torch.Tensor:
    """Zeroed counters for launches of up to `batch_size` rows whose plan merges in its split kernel: one per
    (row, KV head, query-row tile); each launch leaves them zeroed. A runner owns one buffer for its layers,
    whose launches run one after another."""
    return torch.zeros(batch_size * kv_heads * (MAX_QUERY_ROWS // 16), dtype=torch.int32, device=device)


def static_attention_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bounds: torch.Tensor,
                            scale: float, prefetch: torch.Tensor | None = None,
                            counters: torch.Tensor | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as `static_attention_reference`; a custom op, so torch.compile keeps it in its graph.
    `prefetch`: a contiguous weight the next kernel reads, asked of L2 meanwhile (module docstring).
    `counters` (`counters_for`): lets a plan that merges in its split kernel run so (one launch, not two);
    without them, or with a weight to prefetch, the partial results are merged by a second launch.
    `sinks`: a sink logit per query head [heads] (fp32 or the model's dtype), or None."""
    assert fits(q.shape[1], k.shape[1], q.shape[2]), "too many new tokens for one program: use SDPA"
    assert k.shape == v.shape and q.shape[0] == k.shape[0] and q.shape[-1] == k.shape[-1]
    assert prefetch is None or prefetch.is_contiguous(), "the weight to prefetch must be contiguous"
    _check_sinks(sinks, q.shape[1])
    if counters is not None and prefetch is None and _tuned_to_merge(q, k):
        return _static_attention_merged_op(q, k, v, bounds.contiguous(), float(scale), sinks, counters)
    return _static_attention_op(q, k, v, bounds.contiguous(), float(scale), prefetch, sinks)


def _check_sinks(sinks: torch.Tensor | None, heads: int) -> None:
    """The kernels index the sinks by query head, one element apart."""
    assert sinks is None or (sinks.shape == (heads,) and sinks.is_contiguous() and sinks.is_floating_point()), (
        f"sinks: a contiguous float tensor [{heads}] (one logit a query head)")


def static_attention_planned(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bounds: torch.Tensor, scale: float,
                             plan: Plan, counters: torch.Tensor | None = None,
                             sinks: torch.Tensor | None = None) -> torch.Tensor:
    """`static_attention_triton` (eager) with the work cut by `plan` instead of `default_plan`: for timing
    other plans (`benchmarks.static_attention`). A plan that merges in its split kernel takes `counters`:
    int32 zeros, one per (row, KV head, query-row tile), left zeroed for the next launch."""
    assert fits(q.shape[1], k.shape[1], q.shape[2]), "too many new tokens for one program: use SDPA"
    _check_sinks(sinks, q.shape[1])
    return _launch(q, k, v, bounds.contiguous(), float(scale), plan=plan, counters=counters, sinks=sinks)
