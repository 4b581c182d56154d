"""The target's features inside the training step: offline ones as loaded, online ones from the target's pass.

Online, the frozen target runs on each batch (unpacked or packed rows) and its captured layers become the
drafter's context features; with soft targets its final hidden states come back too. Packed rows keep each
chat to itself through the attention `training.target_attention` picks (flex or varlen), optionally replayed
from CUDA graphs (`training.target_cuda_graphs`). A compiler, kernel or capture failure costs speed, never
the run: one line says so and the rest of the run takes the plain path.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import nullcontext

import torch

from dflash_train.features.capture import (
    capture_features_and_final_states,
    compute_features,
    packed_features_and_final_states,
)
from dflash_train.features.graphed import GraphedFeatures
from dflash_train.features.packed_attention import FLEX
from dflash_train.features.packing_probe import attention_modules, recorded, relative_errors
from dflash_train.features.varlen import VARLEN, packed_sequences
from dflash_train.target.attention import attention_implementation

Features = tuple[torch.Tensor, torch.Tensor | None]  # [b, S, K*H] context features, [b, S, H] final states


class OnlineFeatures:
    """`features(batch, real, host_positions)`: a batch's context features and, with soft targets, the
    target's final states. `attention` is the target's attention over packed rows (flex, varlen, or None for
    SDPA); `graphs` the CUDA graphs of its packed pass, once `build_graphs` made them."""

    def __init__(self, target: torch.nn.Module, layer_ids: Sequence[int], attention: str | None,
                 soft_targets: bool, whole_rows: bool, say: Callable[[str], None]) -> None:
        self.target = target
        self.layer_ids = list(layer_ids)
        self.attention = attention
        self.soft_targets = soft_targets
        self.whole_rows = whole_rows  # compiled target layers specialise on the length: give them whole rows
        self.graphs: GraphedFeatures | None = None
        self._say = say

    def build_graphs(self, packed_online: bool, rows: int, row_tokens: int, device: torch.device) -> None:
        """CUDA graphs of the packed pass, where they apply (online features of packed rows, varlen attention,
        a CUDA device); elsewhere a note and none."""
        if not packed_online or self.attention != VARLEN or device.type != "cuda":
            self._say("training.target_cuda_graphs applies to online features of packed rows on CUDA with "
                      "training.target_attention=varlen: the target runs uncaptured")
            return
        self.graphs = GraphedFeatures(lambda ids, positions: self.target_pass(ids, positions, VARLEN), rows,
                                      row_tokens, device)

    def __call__(self, batch: dict[str, torch.Tensor], real: int,
                 host_positions: torch.Tensor | None = None) -> Features:
        """`real` is the longest unpadded sequence of the batch; `host_positions` the packed rows' position ids
        on the host. Packed rows go through `attention`, and through SDPA from its first failure on."""
        if "features" in batch:
            return batch["features"], None
        attention = self.attention if "position_ids" in batch else None
        if attention is None:
            return self._target_features(batch, real, None, host_positions)
        try:
            return self._target_features(batch, real, attention, host_positions)
        except Exception as error:  # a compiler or kernel failure costs speed, not the run
            self.attention = None
            self._say(f"{attention} attention failed for the target ({_reason(error)}); packed rows use SDPA from "
                      "now on (training.target_attention=sdpa skips the try)")
            return self._target_features(batch, real, None, host_positions)

    def _target_features(self, batch: dict[str, torch.Tensor], real: int, attention: str | None,
                         host_positions: torch.Tensor | None) -> Features:
        # The target runs only up to the longest real sequence: a batch padded to one shape for compiled
        # attention would otherwise push mostly padding through it. Its outputs are padded back with zeros.
        # Rows are right-padded, so, as in extraction, no attention mask: causal attention keeps the pads
        # out of every real token, and a mask would only cost host syncs in Hugging Face's mask check.
        # Packed rows pass their per-chat position ids: Hugging Face then keeps each chat to itself. Under
        # flex attention they run whole: compiled flex attention and its block mask specialise on the
        # length, and the padding is a sequence of its own there (collate_packed numbers it so); varlen
        # attention cuts the chats out of the rows by their boundaries (features/varlen.py).
        graphed = attention == VARLEN and self.graphs is not None
        whole = attention == FLEX or self.whole_rows or graphed
        real = batch["input_ids"].shape[1] if whole else real
        ids = batch["input_ids"][:, :real]
        positions = batch["position_ids"][:, :real] if "position_ids" in batch else None
        chats = nullcontext()
        if attention == VARLEN:
            host = host_positions if host_positions is not None else batch["position_ids"].cpu()
            if graphed and positions is not None and (replayed := self._graphed_pass(ids, positions, host)):
                return replayed
            chats = packed_sequences(host[:, :real], ids.device)
        with chats:
            features, final = self.target_pass(ids, positions, attention)
        padding = batch["input_ids"].shape[1] - real
        if padding:
            features = torch.nn.functional.pad(features, (0, 0, 0, padding))
            final = None if final is None else torch.nn.functional.pad(final, (0, 0, 0, padding))
        return features, final

    def target_pass(self, ids: torch.Tensor, positions: torch.Tensor | None, attention: str | None) -> Features:
        """(features, final states or None) of the target's pass over `ids`: the very call offline extraction
        makes (bit-identical features for unpacked rows)."""
        with torch.no_grad(), attention_implementation(self.target.model, attention):
            if not self.soft_targets:
                return compute_features(self.target, ids, self.layer_ids, position_ids=positions), None
            if positions is None:
                features, final = capture_features_and_final_states(self.target, ids, self.layer_ids)
            else:
                features, final = packed_features_and_final_states(self.target, ids, positions, self.layer_ids)
            return features.to(torch.bfloat16), final

    def packing_error(self, vocab_size: int, lengths: tuple[int, int], device: torch.device) -> float:
        """The largest relative error, over the target's attention layers, of a packed row's attention output
        against each chat's own, on two random chats of `lengths` in one row, every layer fed the inputs it had
        alone (`features/packing_probe.py`): rounding only where the attention keeps chats and windows apart."""
        gen = torch.Generator().manual_seed(0)
        chats = [torch.randint(vocab_size, (1, n), generator=gen).to(device) for n in lengths]
        modules = attention_modules(self.target.decoder_layers)
        alone_inputs: dict[int, list[torch.Tensor]] = {}
        alone_outputs: dict[int, list[torch.Tensor]] = {}
        with recorded(modules, alone_inputs, alone_outputs):
            for chat in chats:
                self.target_pass(chat, None, None)
        fed = {index: torch.cat(inputs, dim=1) for index, inputs in alone_inputs.items()}
        positions = torch.cat([torch.arange(n) for n in lengths])[None]
        packed_outputs: dict[int, list[torch.Tensor]] = {}
        chats_apart = packed_sequences(positions, device) if self.attention == VARLEN else nullcontext()
        with recorded(modules, {}, packed_outputs, replace=fed), chats_apart:
            self.target_pass(torch.cat(chats, dim=1), positions.to(device), self.attention)
        return max(relative_errors(packed_outputs, alone_outputs).values(), default=0.0)

    def _graphed_pass(self, ids: torch.Tensor, positions: torch.Tensor,
                      host_positions: torch.Tensor) -> Features | None:
        """The packed pass replayed from the CUDA graphs, or None after a failure, which turns the graphs off
        for the rest of the run (a capture that fails leaves nothing half-done)."""
        assert self.graphs is not None
        try:
            return self.graphs(ids, positions, host_positions)
        except Exception as error:
            self.graphs = None
            self._say(f"CUDA graphs of the target's pass failed ({_reason(error)}); the target runs uncaptured "
                      "from now on (training.target_cuda_graphs=false)")
            return None


def _reason(error: Exception) -> str:
    """An exception as one short line: its type and the first line of its message."""
    return f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0][:200]}"
