"""PyTorch's varlen kernel called as each release's signature asks (`dflash_train.features.varlen_kernel`), with
stand-in kernels on CPU: causal by flag or by window, the scale where it can be given, and grouped key/value
heads passed as they are only where the kernel says it takes them or is found to attend them as it does
them repeated."""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn.functional as F

from dflash_train.features import varlen_kernel as module
from dflash_train.features.varlen_kernel import varlen_kernel

BOUNDS = (0, 5, 8, 16, 25, 32)  # five chats, 32 tokens
HEADS, KV_HEADS, DIM = 4, 2, 8


def flat_qkv() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return tuple(torch.randn(32, heads, DIM, generator=generator) for heads in (HEADS, KV_HEADS, KV_HEADS))


def reference(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """Each chat alone through causal SDPA, each key/value head serving the query heads of its group."""
    out = torch.empty_like(query)
    groups = query.shape[1] // key.shape[1]
    for start, end in zip(BOUNDS, BOUNDS[1:], strict=False):
        q, k, v = (t[start:end].transpose(0, 1) for t in (query, key, value))
        k, v = k.repeat_interleave(groups, 0), v.repeat_interleave(groups, 0)
        out[start:end] = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=DIM ** -0.5).transpose(0, 1)
    return out


def stand_in(signature: str, grouped: str = "taken"):  # noqa: ANN201 - a kernel with one of PyTorch's signatures
    """A varlen kernel with the signature of a PyTorch release; `grouped` says what it does with fewer key/value
    heads than query heads: attends each group ("taken"), raises ("refused") or pairs the heads wrongly
    ("misread"). It records each call."""
    calls: list[dict] = []

    def compute(query, key, value, cu_q, causal, scale):  # [T, h, D]
        out = torch.empty_like(query)
        groups = query.shape[1] // key.shape[1]
        if groups > 1 and grouped == "refused":
            raise ValueError("Expect query and key/value to have the same number of heads")
        bounds = cu_q.tolist()
        for start, end in zip(bounds, bounds[1:], strict=False):
            q, k, v = (t[start:end].transpose(0, 1) for t in (query, key, value))
            spread = (lambda t: t.repeat(groups, 1, 1)) if grouped == "misread" else (
                lambda t: t.repeat_interleave(groups, 0))
            out[start:end] = F.scaled_dot_product_attention(q, spread(k), spread(v), is_causal=causal,
                                                            scale=scale).transpose(0, 1)
        return out

    if signature == "2.10":
        def kernel(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
            calls.append({"is_causal": is_causal, "kv_heads": key.shape[1], "max_q": max_q})
            return compute(query, key, value, cu_seq_q, is_causal, None)
    elif signature == "2.11":
        def kernel(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                   window_size=(-1, -1)):
            calls.append({"window_size": window_size, "kv_heads": key.shape[1], "scale": scale, "max_q": max_q})
            return compute(query, key, value, cu_seq_q, window_size == (-1, 0), scale)
    else:
        def kernel(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                   window_size=(-1, -1), enable_gqa=False):
            calls.append({"window_size": window_size, "kv_heads": key.shape[1], "enable_gqa": enable_gqa,
                          "scale": scale, "max_q": max_q})
            return compute(query, key, value, cu_seq_q, window_size == (-1, 0), scale)
    kernel.calls = calls  # type: ignore[attr-defined]
    return kernel


def installed(monkeypatch: pytest.MonkeyPatch, kernel) -> None:  # noqa: ANN001 - a stand-in kernel
    monkeypatch.setattr(module, "_lookup", lambda: (kernel, frozenset(inspect.signature(kernel).parameters)))


def attend(kernel_device: str = "cuda") -> torch.Tensor:
    call = varlen_kernel(torch.device(kernel_device), DIM ** -0.5, DIM)
    assert call is not None
    query, key, value = flat_qkv()
    out = call(query, key, value, torch.tensor(BOUNDS, dtype=torch.int32), 9, DIM ** -0.5)
    torch.testing.assert_close(out, reference(query, key, value))
    return out


@pytest.mark.parametrize("signature, grouped, kv_heads_given, probes", [
    ("2.10", "taken", KV_HEADS, 2),  # no flag, but the kernel attends the groups: passed as they are
    ("2.11", "taken", KV_HEADS, 2),
    ("2.11", "refused", HEADS, 2),
    ("2.11", "misread", HEADS, 2),  # a kernel that runs but pairs heads wrongly is not trusted with them
    ("2.12", "taken", KV_HEADS, 0),  # the flag says it
])
def test_grouped_heads_are_passed_as_they_are_only_where_the_kernel_takes_them(
        signature: str, grouped: str, kv_heads_given: int, probes: int, monkeypatch: pytest.MonkeyPatch) -> None:
    kernel = stand_in(signature, grouped)
    installed(monkeypatch, kernel)
    attend()
    attend()  # a second forward asks no more
    calls = kernel.calls  # type: ignore[attr-defined]
    real = [c for c in calls if c["max_q"] == 9]
    assert [c["kv_heads"] for c in real] == [kv_heads_given] * 2
    assert len(calls) - len(real) == probes
    if signature == "2.10":
        assert real[0]["is_causal"] is True
    else:
        assert real[0]["window_size"] == (-1, 0) and real[0]["scale"] == DIM ** -0.5
    if signature == "2.12":
        assert real[0]["enable_gqa"] is True


def test_inside_a_graph_capture_the_heads_are_repeated_and_nothing_is_tried(monkeypatch: pytest.MonkeyPatch) -> None:
    """A capture's stream cannot wait for the trial's answer; the first call outside one asks."""
    kernel = stand_in("2.11")
    installed(monkeypatch, kernel)
    monkeypatch.setattr(module, "_capturing", lambda tensor: True)
    attend()
    assert [c["kv_heads"] for c in kernel.calls] == [HEADS]  # type: ignore[attr-defined]
    monkeypatch.setattr(module, "_capturing", lambda tensor: False)
    attend()
    assert [c["kv_heads"] for c in kernel.calls if c["max_q"] == 9] == [HEADS, KV_HEADS]  # type: ignore[attr-defined]


def test_where_the_kernel_cannot_run_the_call_there_is_none(monkeypatch: pytest.MonkeyPatch) -> None:
    installed(monkeypatch, stand_in("2.10"))
    assert varlen_kernel(torch.device("cuda"), 0.5, DIM) is None  # another scale than the only one it takes
    assert varlen_kernel(torch.device("cuda"), DIM ** -0.5, DIM, window=4) is None  # no window either
    installed(monkeypatch, stand_in("2.12"))
    assert varlen_kernel(torch.device("cpu"), DIM ** -0.5, DIM) is None
    assert varlen_kernel(torch.device("cuda"), DIM ** -0.5, DIM, torch.float32) is None  # FlashAttention: 16-bit
    monkeypatch.setattr(module, "_lookup", lambda: None)  # a PyTorch without the kernel
    assert varlen_kernel(torch.device("cuda"), DIM ** -0.5, DIM) is None


def test_the_run_log_says_which_path_each_head_shape_took(monkeypatch: pytest.MonkeyPatch) -> None:
    """One line per head shape tried, after the kernel was asked: as they are where it took them, repeated where
    it did not (the stand-ins each with a shape of their own here: 4 over 2, and 6 over 3)."""
    monkeypatch.setattr(module, "_grouped_heads_taken", {})
    installed(monkeypatch, stand_in("2.11", "taken"))
    attend()
    misread = stand_in("2.11", "misread")
    installed(monkeypatch, misread)
    call = varlen_kernel(torch.device("cuda"), DIM ** -0.5, DIM)
    generator = torch.Generator().manual_seed(1)
    query, key, value = (torch.randn(32, heads, DIM, generator=generator) for heads in (6, 3, 3))
    call(query, key, value, torch.tensor(BOUNDS, dtype=torch.int32), 9, DIM ** -0.5)
    assert module.grouped_heads_report() == [
        f"varlen attention on cpu: 2 key/value heads for 4 query heads of {DIM} (float32) passed as they are",
        f"varlen attention on cpu: 3 key/value heads for 6 query heads of {DIM} (float32) passed repeated (the kernel "
        "did not attend them grouped as it does repeated)"]
