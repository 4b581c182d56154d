"""DFlash drafter: remote code for `AutoModel.from_pretrained(DIR, trust_remote_code=True)`.

A DFlash drafter is a few Qwen3-style layers that propose a whole block of B tokens in one forward
pass, conditioned on the target model's hidden states. It owns no embedding and no lm_head: the
block `[last committed token, MASK x (B-1)]` is embedded with the target's `embed_tokens`, and its
logits come from the target's `lm_head`. The target verifies the block; the output is exactly the
target's own decoding (greedy, or sampled with standard speculative rejection sampling).

    import torch
    from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer
    draft = AutoModel.from_pretrained(DIR, trust_remote_code=True, dtype=torch.bfloat16)
    target = AutoModelForCausalLM.from_pretrained(TARGET, dtype=torch.bfloat16)
    tok = AutoTokenizer.from_pretrained(TARGET)
    ids = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)["input_ids"]
    out = draft.spec_generate(target, ids, max_new_tokens=256, stop_token_ids=[tok.eos_token_id],
                              temperature=0.0)
    print(tok.decode(out[0, ids.shape[1]:]), draft.last_acceptance_lengths)

Self-contained: imports only torch and transformers (4.57 and 5.x).
"""

from __future__ import annotations

import copy
import inspect

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel, Qwen3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

# ----------------------------------------------------------------------------------------------
# Config: DFlash settings live at top level (block_size, num_target_layers) and in dflash_config.
# ----------------------------------------------------------------------------------------------


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """One target layer per draft layer, spread over 1 .. L-3 (Python's round: half to even)."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [round(1 + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers)]


def dflash_settings(config: Qwen3Config) -> tuple[int, list[int], int]:
    """(mask_token_id, target_layer_ids, block_size) of a drafter config."""
    dflash = getattr(config, "dflash_config", None) or {}
    mask = dflash.get("mask_token_id", getattr(config, "mask_token_id", None))
    if mask is None:
        raise ValueError("config.json has no dflash_config.mask_token_id")
    layer_ids = dflash.get("target_layer_ids") or getattr(config, "target_layer_ids", None)
    if not layer_ids:
        layer_ids = default_target_layer_ids(config.num_target_layers, config.num_hidden_layers)
    block_size = getattr(config, "block_size", None) or dflash.get("block_size") or 16
    return int(mask), [int(i) for i in layer_ids], int(block_size)


def rope_frequencies(config: Qwen3Config) -> tuple[torch.Tensor, float]:
    """(RoPE inverse frequencies [head_dim / 2] in fp32, the factor cos and sin are scaled by): default RoPE,
    or transformers' own functions for linear, llama3 and YaRN (whose factor, its attention temperature, is
    not 1)."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and "rope_theta" in params:  # transformers 5 layout
        theta, scaling = params["rope_theta"], params
    else:  # transformers 4 layout
        theta, scaling = config.rope_theta, getattr(config, "rope_scaling", None) or {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        dim = config.head_dim
        return (1.0 / (float(theta) ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))).float(), 1.0
    if rope_type not in ("linear", "llama3", "yarn"):
        raise ValueError(f"rope type {rope_type!r} is not supported by this drafter (default, linear, llama3, yarn)")
    inv_freq, factor = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
    return inv_freq.float(), float(factor)


# ----------------------------------------------------------------------------------------------
# Layers: Qwen3's, except that keys/values also come from the target context (marked DFlash:).
# ----------------------------------------------------------------------------------------------


class DFlashRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_cos_sin(rope: tuple[torch.Tensor, float], positions: torch.Tensor, dtype: torch.dtype):
    """rope (inverse frequencies, factor), positions [b, T] -> cos, sin [b, T, head_dim]."""
    inv_freq, factor = rope
    freqs = positions.float()[..., None] * inv_freq.to(positions.device)
    emb = torch.cat([freqs, freqs], dim=-1)
    return (emb.cos() * factor).to(dtype), (emb.sin() * factor).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [b, heads, T, D], cos/sin [b, T, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos.unsqueeze(1) + rotated * sin.unsqueeze(1)


class DFlashContextCache:
    """Per-layer K/V of committed context tokens, each [b, kv_heads, T, D]; `crop` rolls back."""

    def __init__(self, num_layers: int) -> None:
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers

    def get_seq_length(self) -> int:
        return 0 if self.keys[0] is None else self.keys[0].shape[2]

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.keys[layer] is not None:
            k = torch.cat([self.keys[layer], k], dim=2)
            v = torch.cat([self.values[layer], v], dim=2)
        self.keys[layer], self.values[layer] = k, v
        return k, v

    def crop(self, length: int) -> None:
        self.keys = [None if k is None else k[:, :, :length] for k in self.keys]
        self.values = [None if v is None else v[:, :, :length] for v in self.values]


class DFlashAttention(nn.Module):
    def __init__(self, config: Qwen3Config) -> None:
        super().__init__()
        h, d, bias = config.hidden_size, config.head_dim, config.attention_bias
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, d
        self.q_proj = nn.Linear(h, self.num_heads * d, bias=bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=bias)
        self.q_norm = DFlashRMSNorm(d, config.rms_norm_eps)
        self.k_norm = DFlashRMSNorm(d, config.rms_norm_eps)

    def _heads(self, x: torch.Tensor, heads: int) -> torch.Tensor:
        b, t, _ = x.shape
        return x.view(b, t, heads, self.head_dim).transpose(1, 2)  # [b, heads, T, D]

    def key_values(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Rows x [b, T, H] -> keys (k_norm + RoPE), values, each [b, kv_heads, T, D]."""
        k = self.k_norm(self._heads(self.k_proj(x), self.num_kv_heads))
        v = self._heads(self.v_proj(x), self.num_kv_heads)
        return apply_rope(k, cos, sin).to(v.dtype), v

    def forward(self, x, cos, sin, context_k, context_v) -> torch.Tensor:
        """Block rows x [b, Q, H]; context K/V [b, kv_heads, C, D] -> [b, Q, H]."""
        k, v = self.key_values(x, cos, sin)
        q = apply_rope(self.q_norm(self._heads(self.q_proj(x), self.num_heads)), cos, sin).to(v.dtype)
        # DFlash: keys/values are [context ; block]; the block attends to all of them (no mask).
        k = torch.cat([context_k, k], dim=2)
        v = torch.cat([context_v, v], dim=2)
        groups = self.num_heads // self.num_kv_heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q, k, v)  # [b, heads, Q, D]
        b, _, t, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim))


class DFlashMLP(nn.Module):
    def __init__(self, config: Qwen3Config) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DFlashDecoderLayer(nn.Module):
    def __init__(self, config: Qwen3Config) -> None:
        super().__init__()
        self.self_attn = DFlashAttention(config)
        self.mlp = DFlashMLP(config)
        self.input_layernorm = DFlashRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = DFlashRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, h, cos, sin, context_k, context_v) -> torch.Tensor:
        # DFlash: only block rows flow through the layer; context rows enter as K/V alone.
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, context_k, context_v)
        return h + self.mlp(self.post_attention_layernorm(h))


# ----------------------------------------------------------------------------------------------
# The drafter
# ----------------------------------------------------------------------------------------------


class DFlashDraftModel(PreTrainedModel):
    config_class = Qwen3Config
    # Lets transformers strip a stray `model.` prefix from stored tensor names.
    base_model_prefix = "model"
    _no_split_modules = ["DFlashDecoderLayer"]

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__(config)
        self.mask_token_id, self.target_layer_ids, self.block_size = dflash_settings(config)
        hidden = config.hidden_size
        self.fc = nn.Linear(len(self.target_layer_ids) * hidden, hidden, bias=False)
        self.hidden_norm = DFlashRMSNorm(hidden, config.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashDecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = DFlashRMSNorm(hidden, config.rms_norm_eps)
        self.last_acceptance_lengths: list[int] = []
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        # Only for tensors missing from the checkpoint: a complete export never reaches this.
        std = getattr(self.config, "initializer_range", 0.02)
        if isinstance(module, nn.Linear):
            module.weight.data.normal_(mean=0.0, std=std)
            if module.bias is not None:
                module.bias.data.zero_()
        elif isinstance(module, DFlashRMSNorm):
            module.weight.data.fill_(1.0)

    def forward(
        self,
        noise_embedding: torch.Tensor,
        target_hidden: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        past_key_values: DFlashContextCache | None = None,
    ) -> torch.Tensor:
        """Draft one block.

        noise_embedding [b, Q, H]: the embedded block `[last token, MASK ...]`.
        target_hidden [b, C, K*H]: target features of the C context tokens not yet in the cache.
        position_ids [b, C + Q]: absolute positions of those C tokens, then of the Q block tokens.
        past_key_values: a `DFlashContextCache`, extended here by the C context tokens (block K/V are
        never cached: they only become context once the target commits them).
        Returns the final-normed hidden states [b, Q, H]; logits = the target's lm_head on them.
        """
        cache = past_key_values if past_key_values is not None else DFlashContextCache(len(self.layers))
        b, q_len, _ = noise_embedding.shape
        dtype = self.fc.weight.dtype
        if target_hidden is None:
            target_hidden = noise_embedding.new_zeros(b, 0, self.fc.in_features)
        c_len = target_hidden.shape[1]
        if position_ids is None:
            start = cache.get_seq_length()
            position_ids = torch.arange(start, start + c_len + q_len, device=noise_embedding.device)[None].expand(b, -1)
        rope = rope_frequencies(self.config)
        context = self.hidden_norm(self.fc(target_hidden.to(dtype)))  # [b, C, H]
        ctx_cos, ctx_sin = rope_cos_sin(rope, position_ids[:, :c_len], dtype)
        cos, sin = rope_cos_sin(rope, position_ids[:, c_len:], dtype)
        h = noise_embedding.to(dtype)
        for index, layer in enumerate(self.layers):
            k, v = layer.self_attn.key_values(context, ctx_cos, ctx_sin)
            context_k, context_v = cache.append(index, k, v)
            h = layer(h, cos, sin, context_k, context_v)
        return self.norm(h)

    @torch.no_grad()
    def spec_generate(
        self,
        target: nn.Module,
        input_ids: torch.LongTensor,
        max_new_tokens: int = 2048,
        stop_token_ids: list[int] | None = None,
        temperature: float = 0.0,
        mask_token_id: int | None = None,
    ) -> torch.LongTensor:
        """Speculative decoding of `target` (a Hugging Face causal LM), batch 1.

        Returns `[1, prompt + new]` token ids: at temperature 0 exactly the target's greedy decoding;
        above 0 a sample of the target's own distribution (speculative rejection sampling). Stops
        after `max_new_tokens` or the first stop token (kept). Acceptance lengths (accepted drafts +
        the target's bonus token, per cycle) are left in `self.last_acceptance_lengths`.
        """
        self.eval()
        mask_id = self.mask_token_id if mask_token_id is None else mask_token_id
        verifier = _Verifier(target, self.target_layer_ids, temperature)
        prompt_len, device = input_ids.shape[1], input_ids.device
        logits, features = verifier.run(input_ids, torch.arange(prompt_len, device=device)[None])
        tokens = [verifier.pick(logits[0, -1:])[0]]
        draft_cache = DFlashContextCache(len(self.layers))
        pending, pending_pos = features, torch.arange(prompt_len, device=device)[None]
        start, stop, lengths = prompt_len, set(stop_token_ids or []), []
        while len(tokens) < max_new_tokens and tokens[-1] not in stop:
            positions = torch.arange(start, start + self.block_size, device=device)[None]  # [1, B]
            block = torch.full((1, self.block_size), mask_id, dtype=torch.long, device=device)
            block[0, 0] = tokens[-1]
            draft_probs = None
            if self.block_size > 1:
                hidden = self(verifier.embed(block), pending, torch.cat([pending_pos, positions], 1), draft_cache)
                draft_logits = verifier.head(hidden[0, 1:])  # [B-1, V]
                block[0, 1:], draft_probs = verifier.propose(draft_logits)
            logits, features = verifier.run(block, positions)
            accepted, bonus = verifier.accept(block[0, 1:], draft_probs, logits[0])
            committed = block[0, 1 : accepted + 1].tolist() + [bonus]
            for index, token in enumerate(committed):  # stop at the first stop token
                if token in stop:
                    committed = committed[: index + 1]
                    break
            verifier.rollback(start + accepted + 1, block[:, : accepted + 1], positions[:, : accepted + 1])
            pending, pending_pos = features[:, : accepted + 1], positions[:, : accepted + 1]
            start += accepted + 1
            tokens.extend(committed)
            lengths.append(accepted + 1)
        self.last_acceptance_lengths = lengths
        new = torch.tensor([tokens[:max_new_tokens]], dtype=input_ids.dtype, device=device)
        return torch.cat([input_ids, new], dim=1)


# ----------------------------------------------------------------------------------------------
# The target side of the verify loop
# ----------------------------------------------------------------------------------------------


def speculative_accept(
    drafts: torch.Tensor, q: torch.Tensor, p: torch.Tensor, generator: torch.Generator | None = None
) -> tuple[int, int]:
    """Standard speculative rejection sampling over one block; keeps the target distribution exactly.

    drafts [n]: draft tokens, drafts[k] ~ q[k]; q [n, V]: draft probabilities; p [n + 1, V]: target
    probabilities, p[k] conditioned on the block up to drafts[k - 1]. Draft k is accepted with
    probability min(1, p[k, x] / q[k, x]); at the first rejection the replacement is drawn from
    normalise(max(p[k] - q[k], 0)); if all n are accepted the bonus is drawn from p[n].
    Returns (accepted count a, the token committed after them).
    """
    for k in range(drafts.shape[0]):
        x = int(drafts[k])
        u = torch.rand((), generator=generator, device=p.device)
        if u * q[k, x] <= p[k, x]:  # u < p/q without dividing by a tiny q
            continue
        residual = (p[k] - q[k]).clamp_min(0)
        if float(residual.sum()) <= 0:  # p == q: cannot happen after a rejection, but stay safe
            residual = p[k]
        return k, int(torch.multinomial(residual / residual.sum(), 1, generator=generator))
    return drafts.shape[0], int(torch.multinomial(p[-1], 1, generator=generator))


class _Verifier:
    """Runs the target with a KV cache, reads the features the drafter needs, accepts drafts."""

    def __init__(self, target: nn.Module, layer_ids: list[int], temperature: float) -> None:
        self.target, self.layer_ids, self.temperature = target, layer_ids, float(temperature)
        self.cache = None  # the model builds its own cache class on the first run (hybrid models need theirs)
        self.snapshot = None  # the cache before the last block, where a cache that cannot be cut goes back to
        # transformers >= 5.2x names the cache argument `cache`, older versions `past_key_values`.
        self.cache_arg = "cache" if "cache" in inspect.signature(target.forward).parameters else "past_key_values"
        self.embed = target.get_input_embeddings()
        self.lm_head = target.get_output_embeddings()

    def run(self, ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Target on ids [1, T] -> logits [1, T, V] (fp32), features [1, T, K*H].

        Feature k is the output of decoder layer k = hidden_states[k + 1] (ids never reach the last
        layer, whose hidden state is taken after the final norm)."""
        if self.cache is not None and not self.crops:
            self.snapshot = copy.deepcopy(self.cache)
        out = self._forward(ids, positions, output_hidden_states=True)
        features = torch.cat([out.hidden_states[i + 1] for i in self.layer_ids], dim=-1)
        return out.logits.float(), features

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden.to(self.lm_head.weight.dtype)).float()

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        return torch.softmax(logits / self.temperature, dim=-1)

    def pick(self, logits: torch.Tensor) -> list[int]:
        """One token per row of logits [n, V]."""
        if self.temperature <= 0:
            return logits.argmax(dim=-1).tolist()
        return torch.multinomial(self.probs(logits), 1)[:, 0].tolist()

    def propose(self, draft_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Draft tokens [n] (and their probabilities [n, V] when sampling) from draft logits [n, V]."""
        if self.temperature <= 0:
            return draft_logits.argmax(dim=-1), None
        q = self.probs(draft_logits)
        return torch.multinomial(q, 1)[:, 0], q

    def accept(self, drafts: torch.Tensor, q: torch.Tensor | None, logits: torch.Tensor) -> tuple[int, int]:
        """drafts [B-1] against target logits [B, V] -> (accepted count a, committed token after them)."""
        if self.temperature <= 0:
            target_tokens = logits.argmax(dim=-1)  # [B]: the target's greedy choice after each slot
            a = int((drafts == target_tokens[: drafts.shape[0]]).int().cumprod(dim=0).sum())
            return a, int(target_tokens[a])
        if q is None:  # block size 1: nothing drafted, the target samples its next token
            return 0, self.pick(logits[:1])[0]
        return speculative_accept(drafts, q, self.probs(logits))

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, **kwargs) -> object:
        out = self.target(input_ids=ids, position_ids=positions, use_cache=True, **{self.cache_arg: self.cache},
                          **kwargs)
        self.cache = out.past_key_values
        return out

    @property
    def crops(self) -> bool:
        """Whether every cache layer keeps all past keys and values, so that cutting it is exact (sliding
        windows, linear attention, convolution and Mamba states cannot be cut back)."""
        layers = getattr(self.cache, "layers", None)
        return bool(layers) and hasattr(self.cache, "crop") and all(
            type(layer).__name__ == "DynamicLayer" for layer in layers)

    def rollback(self, length: int, committed: torch.Tensor, positions: torch.Tensor) -> None:
        """Keep the cache's first `length` positions, the last block's `committed` tokens [1, a+1] at
        `positions` included: cut it (a negative `crop` means "remove this many" on every version), or go
        back to the copy taken before the block and read the committed tokens again."""
        excess = self.cache.get_seq_length() - length
        if excess <= 0:
            return
        if self.crops:
            self.cache.crop(-excess)
            return
        self.cache = self.snapshot
        self._forward(committed, positions)
