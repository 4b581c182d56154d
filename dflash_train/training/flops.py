"""Model FLOPs of a drafter training step, and the peak rate MFU divides them by (docs/design.md §10).

    FLOPs = P·3·F_layers + P_head·2·F_head + 3·F_attn_visible + T·3·F_ctx

P block rows, P_head supervised rows (the frozen head only needs the input gradient: 2×, not 3×),
T context tokens; attention counts only visible (query, key) pairs. Forward FLOPs = 2 · MACs.

Peak rate: the dense (no sparsity) bf16 tensor-core rate of the device, by device name. Where this project
measured a device's bf16 matmul ceiling (`benchmarks.common.measure_matmul_tflops`), that rate is used;
otherwise the vendor's data-sheet figure, which real matmuls do not reach (design.md §10 gives the H200's
measured rate against its data sheet), so MFU against a data-sheet rate reads lower. ``DFLASH_PEAK_TFLOPS`` overrides the table for any
device; on a device it does not know, MFU is not reported.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from dflash_train.models.config import DFlashConfig

logger = logging.getLogger(__name__)

PEAK_TFLOPS_ENV = "DFLASH_PEAK_TFLOPS"


@dataclass(frozen=True)
class PeakRate:
    """A device's dense bf16 rate in FLOP/s, and where the figure comes from."""

    flops: float
    source: str  # "measured", "data sheet" or the override variable's name


# Matched in order against `torch.cuda.get_device_name()` (e.g. "NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB"):
# an entry applies when each of its words is a word of the name, so "L4" is not an "L40S" and "H20" not an
# "H200"; variants (PCIe, NVL) come before the bare chip name that would also match them.
PEAK_BF16: tuple[tuple[str, PeakRate], ...] = (
    ("H200 NVL", PeakRate(835e12, "data sheet")),
    ("H200", PeakRate(790e12, "measured")),  # data sheet: 989 (SXM)
    ("H100 PCIe", PeakRate(756e12, "data sheet")),
    ("H100 NVL", PeakRate(835e12, "data sheet")),
    ("H100", PeakRate(743e12, "measured")),  # SXM; data sheet: 989
    ("GH200", PeakRate(989e12, "data sheet")),
    ("H20", PeakRate(148e12, "data sheet")),
    ("B200", PeakRate(2250e12, "data sheet")),
    ("A100", PeakRate(312e12, "data sheet")),
    ("L40S", PeakRate(362e12, "data sheet")),
    ("L40", PeakRate(181e12, "data sheet")),
    ("L4", PeakRate(121e12, "data sheet")),
    ("A10", PeakRate(125e12, "data sheet")),
    ("RTX 4090", PeakRate(165e12, "data sheet")),  # fp32 accumulation, as torch's bf16 matmuls
    ("MI300X", PeakRate(1307e12, "data sheet")),
)


def training_step_flops(
    config: DFlashConfig, context_tokens: int, block_rows: int, head_rows: int, visible_pairs: int
) -> float:
    h, d, kv = config.hidden_size, config.head_dim, config.num_key_value_heads
    heads, inter, layers = config.num_attention_heads, config.intermediate_size, config.num_hidden_layers
    layer_params = h * heads * d * 2 + h * kv * d * 2 + 3 * h * inter  # q, o, k, v, gate/up/down
    f_layers = 2 * layer_params * layers
    f_head = 2 * h * config.vocab_size
    f_attn = 4 * d * heads * visible_pairs * layers  # QK^T and PV over visible pairs
    f_ctx = 2 * (config.num_context_features * h * h + layers * 2 * h * kv * d)  # fc + context k/v
    return block_rows * 3 * f_layers + head_rows * 2 * f_head + 3 * f_attn + context_tokens * 3 * f_ctx


def visible_pairs(anchors_valid_counts: list[tuple[list[int], int]], block_size: int) -> int:
    """Visible (query, key) pairs of the DFlash mask: each valid block of anchor a sees a context
    keys and its own B keys, for each of its B queries. Input: per sequence (valid anchors, S); in a
    packed row an anchor is counted from its chat's start, the context it sees."""
    total = 0
    for anchors, _ in anchors_valid_counts:
        total += sum(block_size * (a + block_size) for a in anchors)
    return total


def peak_bf16_rate(device_name: str, env: Mapping[str, str] | None = None) -> PeakRate | None:
    """The peak rate of one device named `device_name`: the override variable if set, else the table's
    entry, else None (an unknown device: no MFU rather than a wrong one)."""
    env = os.environ if env is None else env
    override = env.get(PEAK_TFLOPS_ENV)
    if override:
        return PeakRate(_parse_tflops(override) * 1e12, PEAK_TFLOPS_ENV)
    words = _words(device_name)
    return next((rate for name, rate in PEAK_BF16 if _words(name) <= words), None)


def _words(name: str) -> set[str]:
    return set(re.findall(r"[a-z0-9]+", name.lower()))


def _parse_tflops(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise ValueError(f"{PEAK_TFLOPS_ENV}={text!r}: give the device's peak bf16 rate in TFLOP/s, e.g. 989")
    return value


def peak_flops(device: torch.device, num_devices: int = 1) -> float | None:
    """The summed peak FLOP/s of `num_devices` devices like `device`, the denominator of MFU; None where it
    is not known (a CPU without the override, an unknown GPU): MFU is then not reported."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    if name is None and not os.environ.get(PEAK_TFLOPS_ENV):
        return None
    rate = peak_bf16_rate(name or device.type)
    if rate is None:
        logger.warning("No peak bf16 rate known for %s, so MFU is not reported; set %s (TFLOP/s per device).",
                       name, PEAK_TFLOPS_ENV)
        return None
    return rate.flops * num_devices


@dataclass(frozen=True)
class TargetPassCost:
    """Forward FLOPs of the frozen target's pass inside a training step (online features): the work the step
    does besides the drafter's, so that the step's MFU counts all of it.

    `per_token` is 2 × the active parameters of the decoder layers the pass runs (routed experts at their
    top-k share; matrices only, as matmuls count them); `pair_costs` one entry per attention layer run, (FLOPs per visible (query, key) pair, its
    sliding window or None); `per_teacher_row` the target's lm_head over a supervised row, where the loss reads
    the target's distribution. Linear-attention layers count their projections only."""

    per_token: float
    pair_costs: tuple[tuple[float, int | None], ...]
    per_teacher_row: float

    def flops(self, chat_lengths: list[int], teacher_rows: int) -> float:
        attention = sum(cost * sum(causal_pairs(n, window) for n in chat_lengths) for cost, window in self.pair_costs)
        return self.per_token * sum(chat_lengths) + attention + self.per_teacher_row * teacher_rows


def causal_pairs(length: int, window: int | None) -> int:
    """Visible (query, key) pairs of causal attention over one chat, each query seeing at most `window` keys."""
    if window is None or window >= length:
        return length * (length + 1) // 2
    return window * (window + 1) // 2 + (length - window) * window


def target_pass_cost(config: Any, layers: Sequence[torch.nn.Module], layers_run: int,
                     reads_distribution: bool) -> TargetPassCost:
    """The target's pass cost from its (text) config and decoder layers: the first `layers_run` of them run;
    `reads_distribution` adds its lm_head over the supervised rows."""
    expert_share = _routed_expert_share(config)
    active = sum(_active_parameters(layer, expert_share) for layer in layers[:layers_run])
    heads = int(config.num_attention_heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    qk_dim = int(getattr(config, "qk_head_dim", None) or head_dim)  # MLA: query-key and value widths differ
    v_dim = int(getattr(config, "v_head_dim", None) or head_dim)
    per_pair = 2.0 * heads * (qk_dim + v_dim)
    window = getattr(config, "sliding_window", None)
    # Without a layer list (Mistral), a sliding window set and not switched off applies to every layer.
    slides = window and getattr(config, "use_sliding_window", True) is not False
    types = list(getattr(config, "layer_types", None)
                 or ["sliding_attention" if slides else "full_attention"] * len(layers))
    pair_costs = tuple((per_pair, int(window) if kind == "sliding_attention" and window else None)
                       for kind in types[:layers_run] if "linear" not in kind and "mamba" not in kind)
    head = 2.0 * config.hidden_size * config.vocab_size if reads_distribution else 0.0
    return TargetPassCost(2.0 * active, pair_costs, head)


def _routed_expert_share(config: Any) -> float:
    """top-k over the routed experts (1 for a dense target)."""
    experts = next((getattr(config, name) for name in ("num_experts", "num_local_experts", "n_routed_experts")
                    if getattr(config, name, None)), None)
    top_k = getattr(config, "num_experts_per_tok", None)
    return float(top_k) / float(experts) if experts and top_k else 1.0


def _active_parameters(layer: torch.nn.Module, expert_share: float) -> float:
    total = 0.0
    for name, parameter in layer.named_parameters():
        if parameter.dim() < 2 or name.endswith("bias"):  # norms and biases (experts' are 2-D): no matmuls
            continue
        parts = name.split(".")
        routed = "experts" in parts and not any("shared" in part for part in parts)
        total += parameter.numel() * (expert_share if routed else 1.0)
    return total
