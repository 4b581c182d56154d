"""The frozen target: a Hugging Face causal LM and its tokenizer, with its decoder-layer outputs read as
features (the layer-id contract is in ``capture``)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from functools import reduce
from typing import Any

import torch
from torch import Tensor, nn
from transformers import PreTrainedModel
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from dflash_train.target.capture import (
    LayerOutputs,
    StopForward,
    register_hooks,
    remove_hooks,
    rows_not_packed,
)
from dflash_train.target.layer_ids import validate_target_layer_ids

DECODER_LAYER_PATHS: tuple[str, ...] = (
    "model.layers",
    "model.model.layers",
    "model.language_model.layers",
    "model.model.language_model.layers",
    "model.language_model.model.layers",
    "language_model.model.layers",
    "language_model.layers",
    "model.decoder.layers",
    "decoder.layers",
    "transformer.h",
    "transformer.layers",
    "transformer.blocks",
    "gpt_neox.layers",
    "backbone.layers",
    "layers",
    "h",
)


def find_decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The list of decoder layers of ``model``, looked up at the attribute paths common in ``transformers``."""
    for path in DECODER_LAYER_PATHS:
        layers = reduce(lambda obj, name: getattr(obj, name, None), path.split("."), model)
        if isinstance(layers, nn.ModuleList) and len(layers) > 0:
            return layers
    raise ValueError(
        f"Cannot find the decoder layers of {type(model).__name__}: looked for {', '.join(DECODER_LAYER_PATHS)}; "
        f"use a causal LM whose decoder layers live at one of these paths."
    )



class TargetModel:
    """A frozen Hugging Face causal LM and its tokenizer, with access to its decoder-layer outputs."""

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
        model.eval()
        model.requires_grad_(False)
        self.model = model
        self.tokenizer = tokenizer
        self.decoder_layers = find_decoder_layers(model)

    @property
    def config(self) -> Any:
        return self.model.config

    @property
    def num_layers(self) -> int:
        return len(self.decoder_layers)

    @property
    def hidden_size(self) -> int:
        return int(self.config.get_text_config().hidden_size)

    @property
    def embed_tokens(self) -> nn.Module:
        return self.model.get_input_embeddings()

    @property
    def lm_head(self) -> nn.Module:
        head = self.model.get_output_embeddings()
        if head is None:
            raise ValueError(f"{type(self.model).__name__} has no output embeddings; load it as a causal LM.")
        return head

    @property
    def vocab_size(self) -> int:
        """Rows of the input embedding, which can exceed ``len(tokenizer)``."""
        return int(self.embed_tokens.weight.shape[0])

    @property
    def embeddings_tied(self) -> bool:
        return self.lm_head.weight is self.embed_tokens.weight

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    def compile_decoder_layers(self) -> None:
        """torch.compile each decoder layer's forward, for fewer kernel launches per pass. The forward, not the
        module's call: the feature hooks, added and removed around every pass, stay outside the graph, which
        would otherwise be recompiled for each new set of hooks. The layers share their code, so the graph
        compiled for the first serves them all."""
        for layer in self.decoder_layers:
            layer.forward = torch.compile(layer.forward, dynamic=False)

    # torch.no_grad rather than inference_mode: the features feed a trainable drafter, and inference tensors
    # cannot be saved for its backward pass.
    @torch.no_grad()
    def capture_features(
        self,
        input_ids: Tensor,
        layer_ids: Sequence[int],
        attention_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
    ) -> Tensor:
        """``[B, S, K * H]`` outputs of the decoder layers ``layer_ids``, concatenated in that order.

        The forward pass stops right after the deepest requested layer, so neither the later layers nor the
        final norm nor the lm_head run, and no other layer's hidden states are kept.
        """
        store = LayerOutputs(validate_target_layer_ids(layer_ids, self.num_layers))
        handles = register_hooks(self.decoder_layers, store, stop_after_deepest=True)
        # Without given position ids the model numbers each row as one sequence: nothing to check for packing.
        unpacked = rows_not_packed() if position_ids is None else nullcontext()
        try:
            with unpacked:
                self.model(
                    input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
                )
        except StopForward:
            pass
        finally:
            remove_hooks(handles)
        return store.features()

    @torch.no_grad()
    def capture_features_and_final_states(
        self, input_ids: Tensor, layer_ids: Sequence[int], attention_mask: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """The features of ``capture_features`` and ``[B, S, H]`` final hidden states (after the final norm,
        what the lm_head reads), from one full pass of the decoder body: the soft targets of distillation."""
        with self.feature_hooks(layer_ids) as store, rows_not_packed():
            out = self.model.base_model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
            return store.features(), out.last_hidden_state

    @contextmanager
    def feature_hooks(self, layer_ids: Sequence[int]) -> Iterator[LayerOutputs]:
        """Record the outputs of ``layer_ids`` during full forward passes (e.g. with a KV cache) run inside.

        ``store.features()`` then returns ``[B, S, K * H]`` for the most recent pass.
        """
        store = LayerOutputs(validate_target_layer_ids(layer_ids, self.num_layers))
        handles = register_hooks(self.decoder_layers, store, stop_after_deepest=False)
        try:
            yield store
        finally:
            remove_hooks(handles)

