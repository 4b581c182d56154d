"""Building a run's pieces: the frozen target, the drafter (new or `init_from`), optimizer, schedule."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import torch

from dflash_train.checkpoint.io import load_draft
from dflash_train.features import packed_attention
from dflash_train.features.layer_ids import validate_drafter_layer_ids
from dflash_train.features.online import OnlineFeatures
from dflash_train.models import DFlashConfig, DFlashDraftModel
from dflash_train.models.init_from_target import init_layers_from_target
from dflash_train.safetensors_io import DamagedFileError
from dflash_train.target import TargetModel, choose_mask_token, load_target
from dflash_train.target.architecture import architecture, packing_problem
from dflash_train.training.config import TrainConfig
from dflash_train.training.launch import sharding_launch
from dflash_train.training.muon import build_muon_with_adamw

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def build_target(config: TrainConfig, device: torch.device) -> TargetModel:
    return load_target(config.model.target, dtype=DTYPES[config.model.target_dtype], device=device)


def check_packing_fits_target(config: TrainConfig, target: TargetModel) -> None:
    """Online features of packed rows are exact only where no target layer carries state from one chat into
    the next (offline features are extracted chat by chat, and unpacked rows hold one chat each)."""
    if config.data.pack_tokens is None or config.data.features is not None:
        return
    problem = packing_problem(architecture(target.config))
    if problem:
        raise ValueError(f"data.pack_tokens packs several chats into one row, but {problem}: unset "
                         "data.pack_tokens, or extract features offline (`dflash-train extract`) and train on "
                         "data.features")


PACKING_TOLERANCE = 0.02  # relative error of packed against chat-by-chat features: bf16 rounding stays far below


def check_packed_features(config: TrainConfig, target: TargetModel, features: OnlineFeatures) -> None:
    """Two chats in one row through the target's packed pass must give each chat's own features: refuse the run
    where they don't (an attention that ignores the chats' boundaries or a layer's window, say). The chats are
    longer than the target's window, so a window that is ignored shows. Flex attention is compiled for the
    training rows' shape and is not probed with another; the model's own mask code keeps chats apart under it
    except where the attention has sink logits, whose models build their masks without the chats' positions."""
    if config.data.pack_tokens is None or config.data.features is not None:
        return
    arch = architecture(target.config)
    if features.attention == packed_attention.FLEX:
        if arch.attention_sinks:
            raise ValueError(f"{arch.model_type} targets mix packed chats under flex attention (their attention "
                             "has sink logits): use training.target_attention=varlen, or unset data.pack_tokens")
        return
    window = arch.sliding_window or 32
    length = max(8, min(window + 16, config.data.pack_tokens // 2))
    error = features.packing_error(target.vocab_size, (length, length - 5), target.device)
    if error > PACKING_TOLERANCE:
        attention = config.training.target_attention
        fix = "unset data.pack_tokens" if attention == "varlen" else \
            "use training.target_attention=varlen, or unset data.pack_tokens"
        raise ValueError(f"packed rows give this target's attention other outputs than its chats alone (relative "
                         f"error {error:.2f} with training.target_attention={attention}): {fix}")


def build_draft(config: TrainConfig, target: TargetModel) -> DFlashDraftModel:
    m = config.model
    if m.init_from:
        draft = _load_init(m.init_from)
        draft.config = refit_config(draft.config, config, target)
        check_draft_fits_target(draft.config, target, m.block_size)
        reinitialize(draft, m.reinit)
    elif m.reinit:
        raise ValueError("model.reinit only applies with model.init_from")
    else:
        choice = choose_mask_token(target.tokenizer, target.vocab_size, explicit=m.mask_token_id)
        draft_config = DFlashConfig.from_target_config(
            target.config, mask_token_id=choice.id, num_hidden_layers=m.num_draft_layers,
            block_size=m.block_size, target_layer_ids=m.target_layer_ids,
        )
        draft = DFlashDraftModel(draft_config)
        if m.init_layers_from_target:
            init_layers_from_target(draft, target.config, target.decoder_layers, m.init_layer_ids)
    unmatched = [prefix for prefix in m.freeze if not any(name.startswith(prefix) for name, _ in draft.named_parameters())]
    if unmatched:  # a typo would otherwise train everything, as if nothing had been asked
        raise ValueError(f"model.freeze: {unmatched} match no parameter; use names like 'layers.' or 'fc.'")
    for name, param in draft.named_parameters():
        if any(name.startswith(prefix) for prefix in m.freeze):
            param.requires_grad_(False)
    if not any(p.requires_grad for p in draft.parameters()):
        raise ValueError(f"model.freeze={m.freeze} freezes every parameter; nothing would train")
    return draft


def refit_config(draft: DFlashConfig, config: TrainConfig, target: TargetModel) -> DFlashConfig:
    """The `init_from` drafter's config for this run: `model.target_layer_ids` (a new target: other layers
    read through the same fc width) and `model.mask_token_id` (a new tokenizer's row) put in. A new config,
    built by the config's own validated constructor, so ids that are repeated, unordered, negative or past
    the target's last readable layer are refused here, in one line, not at the first capture."""
    m, changes = config.model, {}
    settings = [f"model.{key}" for key in ("target_layer_ids", "mask_token_id") if getattr(m, key) is not None]
    if m.target_layer_ids is not None:
        if len(m.target_layer_ids) != draft.num_context_features:
            raise ValueError(
                f"model.target_layer_ids has {len(m.target_layer_ids)} ids but the drafter's fc reads "
                f"{draft.num_context_features} layers; give {draft.num_context_features} ids")
        changes.update(target_layer_ids=list(m.target_layer_ids), num_target_layers=target.num_layers)
    if m.mask_token_id is not None:
        changes["mask_token_id"] = choose_mask_token(target.tokenizer, target.vocab_size, explicit=m.mask_token_id).id
    try:
        return dataclasses.replace(draft, **changes)
    except ValueError as error:
        raise ValueError(f"model.init_from with {' and '.join(settings) or 'its own settings'}: {error}") from None


def reinitialize(draft: DFlashDraftModel, prefixes: list[str]) -> None:
    """Fresh initial values for the modules under `prefixes` (e.g. the context fusion for a new target)."""
    matched = False
    for name, module in draft.named_modules():
        if name and any(f"{name}.".startswith(prefix) for prefix in prefixes):
            for param_name, param in module.named_parameters(recurse=False):
                with torch.no_grad():
                    if param_name == "weight" and param.dim() == 1:
                        param.fill_(1.0)  # norms
                    elif param.dim() > 1:
                        param.normal_(0.0, 0.02)
                    else:
                        param.zero_()
                matched = True
    if prefixes and not matched:
        raise ValueError(f"model.reinit={prefixes} matches no module; use names like 'fc.' or 'layers.0.'")


def _load_init(path: str) -> DFlashDraftModel:
    try:
        return load_draft(path, dtype=torch.float32)
    except DamagedFileError as error:  # say which setting pointed at the damaged file
        raise ValueError(f"model.init_from={path}: {error}") from error


def check_draft_fits_target(draft: DFlashConfig, target: TargetModel, block_size: int) -> None:
    problems = []
    if draft.hidden_size != target.hidden_size:
        problems.append(f"hidden size {draft.hidden_size} != target's {target.hidden_size}")
    if draft.vocab_size != target.vocab_size:
        problems.append(f"vocab {draft.vocab_size} != target's {target.vocab_size}")
    try:  # ids <= L-2: docs/design.md §2
        validate_drafter_layer_ids(draft.target_layer_ids, target.num_layers)
    except ValueError as error:
        problems.append(str(error).rstrip("."))
    if draft.mask_token_id >= target.vocab_size:
        problems.append(f"mask token {draft.mask_token_id} is outside the target's {target.vocab_size} rows")
    if draft.block_size != block_size:
        problems.append(f"block size {draft.block_size} != model.block_size {block_size}")
    if problems:
        raise ValueError(
            "model.init_from does not fit this target: " + "; ".join(problems)
            + " (for a target with other layers: set model.target_layer_ids and model.reinit: [fc., hidden_norm.])"
        )


def build_optimizer(draft: torch.nn.Module, config: TrainConfig) -> torch.optim.Optimizer:
    t = config.training
    if t.optimizer == "muon":
        refuse_sharded_muon()
        return build_muon_with_adamw(draft, t.muon_learning_rate, t.learning_rate, tuple(t.adam_betas),
                                     t.weight_decay)
    params = [p for p in draft.parameters() if p.requires_grad]
    fused = all(p.is_cuda for p in params)
    return torch.optim.AdamW(params, lr=t.learning_rate, betas=tuple(t.adam_betas), weight_decay=t.weight_decay,
                             fused=fused or None)


def refuse_sharded_muon() -> None:
    """Muon orthogonalises each weight matrix whole; DeepSpeed and FSDP hold shards of it (and DeepSpeed
    wraps only optimizers it knows)."""
    if (name := sharding_launch()) is not None:
        raise ValueError(f"training.optimizer: muon does not run under {name}: launch with a DDP or "
                         "single-process config, or use training.optimizer: adamw")


def build_schedule(optimizer: torch.optim.Optimizer, total_steps: int | Callable[[], int], config: TrainConfig) -> Any:
    """Linear warmup, then cosine decay to `min_lr_ratio` of the peak. `total_steps` may be a callable:
    a time-budgeted run learns its length after a few steps, and the schedule follows."""
    total = total_steps if callable(total_steps) else (lambda: total_steps)
    floor = config.training.min_lr_ratio

    def factor(step: int) -> float:
        warmup = max(1, int(config.training.warmup_ratio * total()))
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total() - warmup))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
