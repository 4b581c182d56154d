"""The DFlash drafter: a few Qwen3-style layers that denoise a block of B tokens in one pass.

Conditioning: the target's features at `target_layer_ids` ([.., K*H]) are fused by
`ctx = hidden_norm(fc(x))` and injected as extra keys/values into every layer. The drafter owns no
embedding and no lm_head: callers embed block tokens with the target's frozen `embed_tokens` and
read logits with the target's frozen `lm_head` applied to the returned (final-normed) hidden states.

Two forward paths share the same weights:
- `forward`: training, many blocks of one sequence at once under the DFlash mask (see objective/).
- `extend_context` + `draft_block`: inference, context K/V cached once per committed token.
"""

from __future__ import annotations

import torch
from torch import nn

from dflash_train.models.attention import AttentionMask
from dflash_train.models.cache import DraftKVCache
from dflash_train.models.config import DFlashConfig
from dflash_train.models.layers import ContextRows, DFlashDecoderLayer, RMSNorm, RotaryEmbedding


class DFlashDraftModel(nn.Module):
    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        self.config = config
        hidden = config.hidden_size
        self.fc = nn.Linear(config.num_context_features * hidden, hidden, bias=False)
        self.hidden_norm = RMSNorm(hidden, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashDecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(hidden, eps=config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)
        self.layers_compiled = False
        self.reset_parameters()

    def compile_layers(self) -> None:
        """torch.compile each decoder layer. The layers share their compiled graphs (one structure), as long as
        their inputs agree in what dynamo guards on, `requires_grad` included: see `forward`."""
        for layer in self.layers:
            layer.compile()
        self.layers_compiled = True

    @torch.no_grad()
    def reset_parameters(self, std: float = 0.02) -> None:
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)

    @property
    def block_size(self) -> int:
        return self.config.block_size

    def fuse_context(self, features: torch.Tensor) -> torch.Tensor:
        """Target features [b, T, K*H] -> context rows [b, T, H]."""
        if not torch.is_autocast_enabled(features.device.type):  # e.g. bf16 stored features, fp32 drafter
            features = features.to(self.fc.weight.dtype)
        return self.hidden_norm(self.fc(features))

    def forward(
        self,
        block_embeds: torch.Tensor,
        block_positions: torch.Tensor,
        context_features: torch.Tensor,
        context_positions: torch.Tensor,
        mask: AttentionMask,
    ) -> torch.Tensor:
        """Training path.

        block_embeds [b, Q, H] (Q = N*B block rows), block_positions [b, Q],
        context_features [b, S, K*H], context_positions [b, S], mask over keys [context S | blocks Q].
        Returns final-normed hidden states [b, Q, H].
        """
        rows = self.fuse_context(context_features)
        context = ContextRows(rows, *self.rotary_emb(context_positions, rows.dtype))
        h = block_embeds.to(rows.dtype)
        if self.layers_compiled and torch.is_grad_enabled() and not h.requires_grad:
            # The block embeddings come from the target's frozen table, so the first layer's input alone would not
            # require grad, and torch.compile, which guards on that, would compile the layer a second time for it
            # (a second forward and backward compilation in the first step). Its unused gradient costs far less.
            h = h.detach().requires_grad_()
        cos, sin = self.rotary_emb(block_positions, h.dtype)
        for layer in self.layers:
            h = layer(h, cos, sin, context, mask)
        return self.norm(h)

    def new_cache(self, batch_size: int, max_length: int, dtype: torch.dtype | None = None) -> DraftKVCache:
        param = self.fc.weight
        return DraftKVCache(self.config, batch_size, max_length, dtype or param.dtype, param.device)

    def extend_context(self, cache: DraftKVCache, features: torch.Tensor, positions: torch.Tensor) -> None:
        """Append committed tokens' context K/V: features [b, T, K*H] at positions [b, T]."""
        context = self.fuse_context(features)
        cos, sin = self.rotary_emb(positions, context.dtype)
        for index, layer in enumerate(self.layers):
            k, v = layer.self_attn.key_values(context, cos, sin)
            cache.write(index, k, v)
        cache.advance(features.shape[1])

    def draft_block(
        self, cache: DraftKVCache, block_embeds: torch.Tensor, block_positions: torch.Tensor
    ) -> torch.Tensor:
        """Inference path: one block [b, B, H] attends to all cached context + itself (bidirectional).

        The cache is read, never written: block K/V are not context until the target commits them.
        Returns final-normed hidden states [b, B, H].
        """
        h = block_embeds.to(self.fc.weight.dtype)
        cos, sin = self.rotary_emb(block_positions, h.dtype)
        for index, layer in enumerate(self.layers):
            h = layer(h, cos, sin, cache.layer(index), None)
        return self.norm(h)
