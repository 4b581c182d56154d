"""Model FLOPs of a drafter training step (SPEC §6), for MFU.

    FLOPs = P·3·F_layers + P_head·2·F_head + 3·F_attn_visible + T·3·F_ctx

P block rows, P_head supervised rows (the frozen head only needs the input gradient: 2×, not 3×),
T context tokens; attention counts only visible (query, key) pairs. Forward FLOPs = 2 · MACs.
"""

from __future__ import annotations

from dflash_train.models.config import DFlashConfig


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
