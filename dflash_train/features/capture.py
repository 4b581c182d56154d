"""Reading a target's decoder-layer outputs during its forward pass: the capture calls every feature of
training, extraction, evaluation and the reference loop goes through (`capture_features`, `feature_hooks`,
and the passes that also return the final hidden states), the forward hooks under them, and the guard that
spares forwards over unpacked rows Hugging Face's per-forward packing check.

Contract: target layer id ``k`` is the output of decoder layer ``k`` (0-based). For ``k < L - 1`` this is
Hugging Face's ``hidden_states[k + 1]`` with ``output_hidden_states=True``; for the last layer it is the
output before the final norm (Hugging Face's last entry is taken after it).

The packing check: on every forward with no attention mask and no cache, Hugging Face's mask code asks
whether the position ids describe several sequences packed into one row (``find_packed_sequence_indices``),
and answers with ``.all()`` on a GPU tensor: a host sync. The sync drains the GPU's queue once per forward,
so while the host then prepares the next batch (and launches its first kernels) the GPU idles; for a small
target that is a tenth of extraction's time. Our captures pass one sequence per row, for which the check
answers ``None`` ("not packed"), so inside :func:`rows_not_packed` it answers that without looking. Packed
training passes per-chat position ids and runs outside it: there the check finds the chats and keeps each
to itself. Nothing else in the mask code changes: causal, sliding-window and padding masks are built as
before. The answer holds for the whole process while a capture runs: a forward on packed rows in another
thread at the same moment would need its own attention mask.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from dflash_train.features.layer_ids import validate_target_layer_ids

if TYPE_CHECKING:
    from dflash_train.target.model import TargetModel

# --------------------------------------------------------------------------------------------------------------
# Feature hooks
# --------------------------------------------------------------------------------------------------------------


class StopForward(Exception):
    """Raised by the deepest feature hook so that no later layer, final norm or lm_head runs."""


class LayerOutputs:
    """Outputs of the hooked decoder layers from the most recent forward pass."""

    def __init__(self, layer_ids: Sequence[int]) -> None:
        self.layer_ids = list(layer_ids)
        self._outputs: dict[int, Tensor] = {}

    def record(self, layer_id: int, output: Tensor | tuple[Tensor, ...]) -> None:
        # Decoder layers of transformers >= 5 return the hidden states; older ones a tuple led by them.
        self._outputs[layer_id] = output[0] if isinstance(output, tuple) else output

    def features(self) -> Tensor:
        """``[B, S, K * H]``: the captured layer outputs, concatenated in the order of ``layer_ids``."""
        missing = [layer_id for layer_id in self.layer_ids if layer_id not in self._outputs]
        if missing:
            raise RuntimeError(
                f"No output captured for target layers {missing}; run the target inside the hooks first."
            )
        return torch.cat([self._outputs[layer_id] for layer_id in self.layer_ids], dim=-1)

    def clear(self) -> None:
        self._outputs.clear()


def _make_hook(store: LayerOutputs, layer_id: int, stop: bool) -> Callable[..., None]:
    def hook(module: nn.Module, args: Any, output: Tensor | tuple[Tensor, ...]) -> None:
        store.record(layer_id, output)
        if stop:
            raise StopForward

    return hook


def register_hooks(layers: nn.ModuleList, store: LayerOutputs, stop_after_deepest: bool) -> list[RemovableHandle]:
    """Hooks recording the outputs of ``store.layer_ids`` into ``store``; with ``stop_after_deepest`` the
    deepest one raises :class:`StopForward` once it has recorded."""
    deepest = max(store.layer_ids)
    return [
        layers[layer_id].register_forward_hook(
            _make_hook(store, layer_id, stop_after_deepest and layer_id == deepest)
        )
        for layer_id in store.layer_ids
    ]


def remove_hooks(handles: list[RemovableHandle]) -> None:
    for handle in handles:
        handle.remove()


# --------------------------------------------------------------------------------------------------------------
# Forwards over unpacked rows
# --------------------------------------------------------------------------------------------------------------

_CHECK = "find_packed_sequence_indices"
_lock = threading.Lock()
_depth = 0
_original: Any = None


def _not_packed(position_ids: Any) -> None:
    return None


@contextmanager
def rows_not_packed() -> Iterator[None]:
    """Within: Hugging Face treats every row as one sequence without checking (re-entrant)."""
    global _depth, _original
    module = sys.modules.get("transformers.masking_utils")
    if module is None or not hasattr(module, _CHECK):  # another transformers version: nothing to skip
        yield
        return
    with _lock:
        if _depth == 0:
            _original = getattr(module, _CHECK)
            setattr(module, _CHECK, _not_packed)
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                setattr(module, _CHECK, _original)


# --------------------------------------------------------------------------------------------------------------
# Capture calls
# --------------------------------------------------------------------------------------------------------------


# torch.no_grad rather than inference_mode: the features feed a trainable drafter, and inference tensors
# cannot be saved for its backward pass.
@torch.no_grad()
def capture_features(
    target: TargetModel,
    input_ids: Tensor,
    layer_ids: Sequence[int],
    attention_mask: Tensor | None = None,
    position_ids: Tensor | None = None,
) -> Tensor:
    """``[B, S, K * H]`` outputs of the target's decoder layers ``layer_ids``, concatenated in that order.

    The forward pass stops right after the deepest requested layer, so neither the later layers nor the
    final norm nor the lm_head run, and no other layer's hidden states are kept.
    """
    store = LayerOutputs(validate_target_layer_ids(layer_ids, target.num_layers))
    handles = register_hooks(target.decoder_layers, store, stop_after_deepest=True)
    # Without given position ids the model numbers each row as one sequence: nothing to check for packing.
    unpacked = rows_not_packed() if position_ids is None else nullcontext()
    try:
        with unpacked:
            target.model(
                input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
            )
    except StopForward:
        pass
    finally:
        remove_hooks(handles)
    return store.features()


def compute_features(target: TargetModel, input_ids: Tensor, layer_ids: Sequence[int],
                     attention_mask: Tensor | None = None, position_ids: Tensor | None = None) -> Tensor:
    """``[B, S, K*H]`` bf16 features: the only capture call of both online training and extraction, so
    the two see bit-identical features for the same batch. Packed rows pass their per-chat position ids
    (Hugging Face then keeps each chat's attention inside the chat)."""
    return capture_features(target, input_ids, layer_ids, attention_mask, position_ids).to(torch.bfloat16)


@contextmanager
def feature_hooks(target: TargetModel, layer_ids: Sequence[int]) -> Iterator[LayerOutputs]:
    """Record the outputs of ``layer_ids`` during full forward passes (e.g. with a KV cache) run inside.

    ``store.features()`` then returns ``[B, S, K * H]`` for the most recent pass.
    """
    store = LayerOutputs(validate_target_layer_ids(layer_ids, target.num_layers))
    handles = register_hooks(target.decoder_layers, store, stop_after_deepest=False)
    try:
        yield store
    finally:
        remove_hooks(handles)


@torch.no_grad()
def capture_features_and_final_states(
    target: TargetModel, input_ids: Tensor, layer_ids: Sequence[int], attention_mask: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """The features of ``capture_features`` and ``[B, S, H]`` final hidden states (after the final norm,
    what the lm_head reads), from one full pass of the decoder body: the soft targets of distillation."""
    with feature_hooks(target, layer_ids) as store, rows_not_packed():
        out = target.model.base_model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        return store.features(), out.last_hidden_state


@torch.no_grad()
def packed_features_and_final_states(
    target: TargetModel, input_ids: Tensor, position_ids: Tensor, layer_ids: Sequence[int]
) -> tuple[Tensor, Tensor]:
    """The target's features and final hidden states of packed rows (soft targets): one full pass of the
    decoder body with per-chat position ids, from which Hugging Face builds the per-chat causal mask."""
    with feature_hooks(target, layer_ids) as store:
        out = target.model.base_model(input_ids=input_ids, position_ids=position_ids, use_cache=False)
        return store.features(), out.last_hidden_state
