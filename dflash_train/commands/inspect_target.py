"""Show how a drafter would attach to a target: its shape, the default target layer ids, and the
mask token that the resolution order picks; the target's layer mix (attention, sliding window, linear attention,
convolution, Mamba; experts), which decode path runs it, and whether packed training rows are exact for it.

    dflash-train inspect --target smollm2-135m-instruct
    dflash-train inspect --target Qwen/Qwen3-8B --num-draft-layers 5 --block-size 16
"""

from __future__ import annotations

import argparse

from dflash_train.commands.data_args import add_target_argument, positive_int
from dflash_train.models import DFlashConfig
from dflash_train.runtime.cache_layout import cache_layout
from dflash_train.runtime.static_target import supports
from dflash_train.target import TargetModel, choose_mask_token, load_target
from dflash_train.target.architecture import architecture, packing_problem

CACHE_POSITIONS = 4096  # the context `inspect` sizes a row's cache at


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_target_argument(parser)
    parser.add_argument("--num-draft-layers", type=positive_int, default=5)
    parser.add_argument("--block-size", type=positive_int, default=16)
    parser.add_argument("--mask-token", default=None, help="explicit mask token id or string")


def decode_path(target: TargetModel) -> str:
    """Which runner decodes this target, and on the static runtime what a row's caches take (the figure to size
    `--batch-size` by): its KV caches at 4,096 positions and its state rings for a verify block of 16."""
    if not supports(target):
        return "the model's own forward and caches (exact, slower)"
    layout = cache_layout(target)
    kept = {"KV cache": any(layout.cached), "state rings": any(layout.ring_kept)}
    per_row = layout.bytes_per_row(target, CACHE_POSITIONS, 16) / 2**20
    return (f"static-cache runtime ({' and '.join(name for name, used in kept.items() if used)}: "
            f"{per_row:,.1f} MiB a row at {CACHE_POSITIONS:,} positions)")


def run(args: argparse.Namespace) -> int:
    target = load_target(args.target)
    explicit = int(args.mask_token) if args.mask_token and args.mask_token.isdigit() else args.mask_token
    choice = choose_mask_token(target.tokenizer, target.vocab_size, explicit=explicit)
    config = DFlashConfig.from_target_config(
        target.config, mask_token_id=choice.id, num_hidden_layers=args.num_draft_layers,
        block_size=args.block_size,
    )
    arch = architecture(target.config)
    rows = [
        ("target", args.target),
        ("architecture", type(target.model).__name__),
        ("layers / hidden / vocab rows", f"{target.num_layers} / {target.hidden_size} / {target.vocab_size}"),
        ("tied embeddings", str(target.embeddings_tied)),
        ("decoder layers", arch.summary),
        ("decode path", decode_path(target)),
        ("packed training rows", f"refused: {problem}" if (problem := packing_problem(arch)) else "exact"),
        ("target_layer_ids", str(config.target_layer_ids)),
        ("mask token", f"{choice.id} {choice.token!r} (rule: {choice.rule})"),
        ("drafter", f"{config.num_hidden_layers} layers, block {config.block_size}, "
                    f"heads {config.num_attention_heads}/{config.num_key_value_heads}, "
                    f"intermediate {config.intermediate_size}"),
        ("rope", f"theta {config.rope_theta:g}, scaling {config.rope_scaling}"),
    ]
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    return 0
