"""The frozen target: a Hugging Face causal LM and its tokenizer, and where its decoder layers are. Reading
their outputs as the drafter's features is ``dflash_train.features.capture``'s (the layer-id contract is
there too)."""

from __future__ import annotations

from functools import reduce
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from dflash_train.compiling import compile_fixed_shapes

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
    """A frozen Hugging Face causal LM and its tokenizer, with its decoder layers (whose outputs
    ``dflash_train.features.capture`` reads)."""

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
            layer.forward = compile_fixed_shapes(layer.forward)
