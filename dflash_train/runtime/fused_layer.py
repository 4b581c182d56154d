"""A target decoder layer run with its q/k/v projections as one matmul and gate/up as another.

At batch 1 a decode step is a string of matrix-vector products, each bound by reading its weight; small
ones stream far below the memory bandwidth that large ones reach (Qwen3-8B's 8 MB k and v projections
against its 100 MB MLP matrices: docs/benchmarks.md, 'Figures behind code choices'). One product over the
concatenated [q; k; v] weight, and one over [gate; up], read the same bytes in fewer, larger kernels.

No weight is copied: the fused tensors are built once per layer, and the layer's own `q_proj`, `k_proj`,
... are re-pointed at row slices of them, so the model's parameters, its own forward and its weight hash
are unchanged, and the memory is the same. The layer forward below is the one of the Llama family in
transformers (Llama, Mistral, Qwen2 with q/k/v biases, Qwen3 with q/k norms): pre-norm attention and
SwiGLU MLP, each with a residual; the static target checks it against the model's own forward.

With `fused_prologue` on the cache (the runtime's Triton kernels), what runs between the q/k/v matmul and
the attention (q/k norms, RoPE, the K/V cache write) is one kernel, `dflash_train.kernels.rope_cache`,
instead of several; the PyTorch path below stays the reference, and takes over for a layer the kernel
does not cover (a q/k norm other than an RMSNorm over the head, RoPE over part of the head).

With the Triton kernels, the layer's four products (q/k/v, o_proj, gate/up, down) run on
`dflash_train.kernels.skinny_matmul` when the step has at most `MAX_ROWS` rows (decode and verify) and the
cache's `skinny_shapes` admits the weight: by default the shapes whose tiling was swept on this GPU's
architecture (where the kernel streams the weight faster than cuBLAS), every shape with
`StaticTarget(skinny_matmul="all")`. The kernel rounds a row the same whatever the other rows; prefill keeps
torch's matmul.

With `skinny_fusion` on the cache as well (opt-in: `StaticTarget(skinny_matmul=True, skinny_fusion=True)`),
those steps run the whole layer as four products of `dflash_train.kernels.skinny_fused`, the RMSNorms folded
into the q/k/v and gate/up products, SwiGLU into gate/up and both residual adds into o_proj and down, and
with the prologue kernel on, the attention prologue in the q/k/v product's epilogue
(`dflash_train.kernels.qkv_rope_cache`): with the two attention kernels, six launches a layer. Layers whose norms or activation are
not the Llama family's RMSNorm and SiLU keep the path above (`fusion_supported`).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from dflash_train.kernels.qkv_rope_cache import qkv_rope_cache_triton
from dflash_train.kernels.rope_cache import rope_cache_triton, supports_rope
from dflash_train.kernels.skinny_fused import skinny_fused_stats_triton, skinny_fused_triton
from dflash_train.kernels.skinny_matmul import TUNED_ROWS, skinny_matmul_triton
from dflash_train.kernels.skinny_matmul import fits as skinny_fits
from dflash_train.models.layers import MLP as DraftMLP

FUSED_ATTRIBUTE = "_dflash_fused_projections"
# The q/k/v product carries the attention prologue (`qkv_rope_cache`) only for weights up to this size: that
# kernel has one program per query head and per key head (40 for Qwen3-8B at batch 1), enough to stream a
# small target's weight but few for a large one's 50 MB, which the skinny product spreads over hundreds of
# programs instead (then the prologue is a launch of its own).
PROLOGUE_IN_PRODUCT_MAX_BYTES = 16 * 2**20


class LayerCache(Protocol):
    """The cache a fused layer writes its K/V to (`target_forward._WriteCache`)."""

    fused_prologue: bool  # q/k norms + RoPE + cache write by the fused kernel
    skinny_shapes: frozenset[tuple[int, int]] | None  # weights [N, K] whose products of few rows run on the
    # skinny-matmul kernel (None: every weight)
    skinny_fusion: bool  # those products with the norms, SwiGLU and residual adds folded in
    prefetch_weights: bool  # the attention kernel asks L2 for o_proj's weight while it reads the cache
    attention_counters: torch.Tensor  # zeroed counters, for attention plans that merge in their split kernel
    rows: torch.Tensor  # [n] cache row of each input row
    positions: torch.Tensor  # [n, T] position (= cache slot) of each token

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int) -> tuple[
            torch.Tensor, torch.Tensor]: ...

    def storage(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]: ...

    def visible(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]: ...


def fuse_linears(linears: Sequence[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight [sum of outputs, in], bias or None) over `linears`, whose parameters become row views of them."""
    weight = torch.cat([linear.weight.detach() for linear in linears])
    biases = [linear.bias for linear in linears]
    bias = None
    if any(b is not None for b in biases):
        bias = torch.cat([b.detach() if b is not None else weight.new_zeros(linear.out_features)
                          for b, linear in zip(biases, linears, strict=True)])
    start = 0
    for linear in linears:
        rows = slice(start, start + linear.out_features)
        linear.weight = nn.Parameter(weight[rows], requires_grad=False)
        if linear.bias is not None:
            linear.bias = nn.Parameter(bias[rows], requires_grad=False)  # type: ignore[index]
        start += linear.out_features
    return weight, bias


def fused_projections(layer: nn.Module) -> dict[str, Any]:
    """The layer's fused weights, built on first use and kept on the layer (a second runner shares them);
    built again when the parameters no longer live in them (the model was moved or cast since)."""
    cached = getattr(layer, FUSED_ATTRIBUTE, None)
    if cached is None or not _still_views(layer, cached):
        attn, mlp = layer.self_attn, layer.mlp
        qkv, qkv_bias = fuse_linears([attn.q_proj, attn.k_proj, attn.v_proj])
        gate_up, gate_up_bias = fuse_linears([mlp.gate_proj, mlp.up_proj]) if swiglu_mlp(layer) else (None, None)
        cached = {"qkv": qkv, "qkv_bias": qkv_bias, "gate_up": gate_up, "gate_up_bias": gate_up_bias}
        object.__setattr__(layer, FUSED_ATTRIBUTE, cached)  # a plain attribute: not a parameter or buffer
    return cached


def _still_views(layer: nn.Module, cached: dict[str, Any]) -> bool:
    gate_up_views = cached["gate_up"] is None or layer.mlp.gate_proj.weight.data_ptr() == cached["gate_up"].data_ptr()
    return (layer.self_attn.q_proj.weight.data_ptr() == cached["qkv"].data_ptr() and gate_up_views
            and layer.self_attn.q_proj.weight.dtype == cached["qkv"].dtype)


def swiglu_mlp(layer: nn.Module) -> bool:
    """Whether the layer's MLP is one gate/up/down SwiGLU (else a mixture of experts, run as the model's own)."""
    return all(isinstance(getattr(layer.mlp, name, None), nn.Linear) for name in ("gate_proj", "up_proj", "down_proj"))


class FusedLayer:
    """Forward of one decoder layer with fused projections; attention through `attention_fn`."""

    def __init__(self, layer: nn.Module, attention_fn: Callable[..., tuple[torch.Tensor, Any]]) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.layer, self.attn, self.mlp, self.attention_fn = layer, attn, mlp, attention_fn
        self.weights = fused_projections(layer)
        self.splits = [attn.q_proj.out_features, attn.k_proj.out_features, attn.v_proj.out_features]
        self.head_dim, self.scaling, self.layer_idx = attn.head_dim, attn.scaling, attn.layer_idx
        self.q_norm, self.k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
        self.apply_rope = importlib.import_module(type(attn).__module__).apply_rotary_pos_emb
        self.heads = attn.q_proj.out_features // self.head_dim
        self.prologue_supported = _norms_supported(self.q_norm, self.k_norm, self.head_dim)
        self.fusion_supported = fusion_supported(layer)

    def __call__(self, hidden: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor],
                 attention_mask: torch.Tensor, cache: LayerCache) -> torch.Tensor:
        if self._fuses(hidden, cache):
            return self._fused_call(hidden, position_embeddings, attention_mask, cache)[0]
        hidden = hidden + self._attention(self.layer.input_layernorm(hidden), position_embeddings, attention_mask,
                                          cache)
        return hidden + self._mlp(hidden, cache)

    def deferred(self, hidden: torch.Tensor, pending: torch.Tensor,
                 position_embeddings: tuple[torch.Tensor, torch.Tensor], attention_mask: torch.Tensor,
                 cache: LayerCache) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The same layer with the residual adds moved one step later: its input is hidden + pending (the
        previous layer's MLP output, zeros before the first layer), and it returns (that input, the residual
        stream after attention, the MLP's output), leaving the last add to the next layer or the output.
        Compiled one layer at a time, the add then joins the next RMSNorm in one kernel instead of being a
        kernel of its own at the end of every layer."""
        x = hidden + pending
        h = x + self._attention(self.layer.input_layernorm(x), position_embeddings, attention_mask, cache)
        return x, h, self._mlp(h, cache)

    def _mlp(self, hidden: torch.Tensor, cache: LayerCache) -> torch.Tensor:
        x = self.layer.post_attention_layernorm(hidden)
        if self.weights["gate_up"] is None:  # experts: the model's own block (router, experts, shared expert)
            out = self.mlp(x)
            return out[0] if isinstance(out, tuple) else out
        gate_up = linear(x, self.weights["gate_up"], self.weights["gate_up_bias"], cache.skinny_shapes)
        gate, up = gate_up.chunk(2, dim=-1)
        return project(self.mlp.down_proj, self.mlp.act_fn(gate) * up, cache.skinny_shapes)

    def _attention(self, x: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor],
                   attention_mask: torch.Tensor, cache: LayerCache) -> torch.Tensor:
        qkv = linear(x, self.weights["qkv"], self.weights["qkv_bias"], cache.skinny_shapes)
        out = self._attend(qkv, position_embeddings, attention_mask, cache)
        return project(self.attn.o_proj, out, cache.skinny_shapes)

    def _attend(self, qkv: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor],
                attention_mask: torch.Tensor, cache: LayerCache) -> torch.Tensor:
        """From the q/k/v product [n, T, q+k+v] to the attention's output [n, T, heads * D], the cache written."""
        if self._use_kernel(qkv, position_embeddings[0], cache):
            q, keys, values = self._prologue_kernel(qkv, position_embeddings, cache)
        else:
            q, keys, values = self._prologue_torch(qkv, position_embeddings, cache)
        return self._attention_output(q, keys, values, attention_mask, cache)

    def _attention_output(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                          attention_mask: torch.Tensor, cache: LayerCache) -> torch.Tensor:
        """q [n, heads, T, D] over the visible keys and values -> [n, T, heads * D]; the o_proj weight that
        follows asked of L2 meanwhile where the cache says so (a contiguous weight: not a fused view)."""
        weight = self.attn.o_proj.weight
        prefetch = {"prefetch": weight} if cache.prefetch_weights and weight.is_contiguous() else {}
        out, _ = self.attention_fn(self.attn, q, keys, values, attention_mask, scaling=self.scaling, **prefetch,
                                   counters=cache.attention_counters)
        return out.reshape(q.shape[0], q.shape[2], -1)

    def _fuses(self, hidden: torch.Tensor, cache: LayerCache) -> bool:
        """Whether this step runs the layer as four fused products (shapes and dtypes only: static under
        torch.compile): asked for, a layer the kernel reproduces, few rows, norm weights in hidden's dtype."""
        if not (cache.skinny_fusion and self.fusion_supported and skinny_fits(rows_of(hidden))):
            return False
        norms = (self.layer.input_layernorm, self.layer.post_attention_layernorm)
        return all(norm.weight.dtype == hidden.dtype for norm in norms)

    def carried(self, hidden: torch.Tensor, shares: torch.Tensor | None,
                position_embeddings: tuple[torch.Tensor, torch.Tensor], attention_mask: torch.Tensor,
                cache: LayerCache) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The layer with its norms' statistics carried between its fused products (`skinny_matmul`'s module
        docstring): `shares` [rows, P] of hidden's rows' sums of squares, from the layer before (None: the
        q/k/v product's norm takes its own pass). -> (the layer's output, its shares for the next layer's norm);
        a step the fused products do not run: (the output, None)."""
        if not self._fuses(hidden, cache):
            return self(hidden, position_embeddings, attention_mask, cache), None
        return self._fused_call(hidden, position_embeddings, attention_mask, cache, shares, carry=True)

    def _fused_call(self, hidden: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor],
                    attention_mask: torch.Tensor, cache: LayerCache, shares: torch.Tensor | None = None,
                    carry: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The layer as `__call__` computes it, on four fused products (module docstring); with `carry`, each
        norm reads the statistics the product before it left (`carried`). -> (output, its shares or None)."""
        before_attention, before_mlp = self.layer.input_layernorm, self.layer.post_attention_layernorm
        o_proj, down_proj = self.attn.o_proj, self.mlp.down_proj
        qkv_weight = self.weights["qkv"]
        if self._use_kernel(hidden, position_embeddings[0], cache) and prologue_in_product(qkv_weight):
            cos, sin = position_embeddings
            keys, values = cache.storage(self.layer_idx)
            q_weight, k_weight, eps, k_eps = self._norm_arguments()
            q = qkv_rope_cache_triton(hidden, qkv_weight, self.weights["qkv_bias"], before_attention.weight,
                                      norm_eps(before_attention), self.heads, q_weight, k_weight, eps, cos, sin,
                                      cache.positions, cache.rows, keys, values, k_eps=k_eps)
            out = self._attention_output(q.transpose(1, 2), *cache.visible(self.layer_idx), attention_mask, cache)
        else:
            qkv, _ = fused_product(carry, hidden, qkv_weight, self.weights["qkv_bias"], stats_in=shares,
                                   norm_weight=before_attention.weight, norm_eps=norm_eps(before_attention))
            out = self._attend(qkv, position_embeddings, attention_mask, cache)
        h, h_shares = fused_product(carry, out, o_proj.weight, o_proj.bias, residual=hidden, stats_out=True)
        act, _ = fused_product(carry, h, self.weights["gate_up"], self.weights["gate_up_bias"], stats_in=h_shares,
                               norm_weight=before_mlp.weight, norm_eps=norm_eps(before_mlp), swiglu=True)
        return fused_product(carry, act, down_proj.weight, down_proj.bias, residual=h, stats_out=True)

    def _use_kernel(self, qkv: torch.Tensor, cos: torch.Tensor, cache: LayerCache) -> bool:
        """Shapes and dtypes only (static under torch.compile): the kernel rounds as the PyTorch path only
        when the norm weights have the activations' dtype."""
        if not (cache.fused_prologue and self.prologue_supported):
            return False
        norms = [norm.weight.dtype for norm in (self.q_norm, self.k_norm) if norm is not None]
        return supports_rope(cos, self.head_dim) and all(dtype == qkv.dtype for dtype in norms)

    def _prologue_kernel(self, qkv: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor],
                         cache: LayerCache) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q [n, heads, T, D], visible keys, visible values) with one launch for norms, RoPE and cache write."""
        cos, sin = position_embeddings
        keys, values = cache.storage(self.layer_idx)
        q_weight, k_weight, eps, k_eps = self._norm_arguments()
        q = rope_cache_triton(qkv, self.heads, q_weight, k_weight, eps, cos, sin, cache.positions, cache.rows, keys,
                              values, k_eps=k_eps)
        return (q.transpose(1, 2), *cache.visible(self.layer_idx))

    def _norm_arguments(self) -> tuple[torch.Tensor | None, torch.Tensor | None, float, float | None]:
        """(q_norm weight, k_norm weight, q_norm eps, k_norm eps) for the kernel; Nones without norms."""
        if self.q_norm is None or self.k_norm is None:
            return None, None, 0.0, None
        return self.q_norm.weight, self.k_norm.weight, self.q_norm.variance_epsilon, self.k_norm.variance_epsilon

    def _prologue_torch(self, qkv: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor],
                        cache: LayerCache) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The same with the model's own norms and RoPE, and the cache's indexed write (the reference)."""
        n, t = qkv.shape[:2]
        q, k, v = (p.view(n, t, -1, self.head_dim) for p in qkv.split(self.splits, dim=-1))
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = position_embeddings
        q, k = self.apply_rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin)  # [n, heads, T, D]
        keys, values = cache.update(k, v.transpose(1, 2), self.layer_idx)
        return q, keys, values


Shapes = frozenset[tuple[int, int]] | None  # weights [N, K] on the skinny kernel; None: every weight


def rows_of(x: torch.Tensor) -> int:
    return x.numel() // x.shape[-1]


def on_skinny_kernel(x: torch.Tensor, weight: torch.Tensor, shapes: Shapes) -> bool:
    """Whether x @ weight^T runs on the skinny-matmul kernel: few enough rows and a weight `shapes` admits
    (shapes only: static under torch.compile). Tuned shapes (a set) only up to the rows they were tuned at,
    `TUNED_ROWS`; every weight (None, asked for) up to the kernel's `MAX_ROWS`."""
    if shapes is None:
        return skinny_fits(rows_of(x))
    return 0 < rows_of(x) <= TUNED_ROWS and tuple(weight.shape) in shapes


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, shapes: Shapes) -> torch.Tensor:
    """F.linear, on the skinny-matmul kernel when `on_skinny_kernel`."""
    return skinny_matmul_triton(x, weight, bias) if on_skinny_kernel(x, weight, shapes) else F.linear(x, weight, bias)


def project(module: nn.Linear, x: torch.Tensor, shapes: Shapes) -> torch.Tensor:
    """`module(x)` (the module itself unless the kernel runs, so that the default path is unchanged)."""
    if isinstance(module, nn.Linear) and on_skinny_kernel(x, module.weight, shapes):
        return skinny_matmul_triton(x, module.weight, module.bias)
    return module(x)


def fused_product(carry: bool, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  stats_in: torch.Tensor | None = None, stats_out: bool = False,
                  **options: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One of a layer's fused products -> (y, y's shares or None): with `carry`, the norm reads `stats_in` and
    the product writes its shares where `stats_out` asks (`skinny_fused_stats_triton`); without, neither."""
    if carry:
        return skinny_fused_stats_triton(x, weight, bias, stats_in=stats_in, stats_out=stats_out, **options)
    return skinny_fused_triton(x, weight, bias, **options), None


def _norms_supported(q_norm: nn.Module | None, k_norm: nn.Module | None, head_dim: int) -> bool:
    """Whether the fused kernel reproduces the layer's q/k norms: none (Llama, Mistral, Qwen2), or both an
    RMSNorm over the head as Qwen3's (a `weight` [head_dim] and a `variance_epsilon`)."""
    if q_norm is None and k_norm is None:
        return True
    return all(norm is not None and isinstance(getattr(norm, "variance_epsilon", None), float)
               and getattr(norm, "weight", None) is not None and tuple(norm.weight.shape) == (head_dim,)
               for norm in (q_norm, k_norm))


def norm_eps(norm: nn.Module) -> float:
    """An RMSNorm's epsilon: `variance_epsilon` in transformers' Llama family, `eps` in the drafter's."""
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    assert isinstance(eps, float), f"{type(norm).__name__} has no epsilon"
    return eps


def is_rms_norm(norm: nn.Module | None, width: int) -> bool:
    """An RMSNorm as the fused kernel computes it: weight * (x * rsqrt(mean(x^2) + eps)).to(dtype), the
    Llama/Mistral/Qwen classes of transformers and the drafter's own (Gemma's 1 + weight is not one)."""
    if norm is None or not type(norm).__name__.endswith("RMSNorm") or "Gemma" in type(norm).__name__:
        return False
    weight = getattr(norm, "weight", None)
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    return isinstance(eps, float) and weight is not None and tuple(weight.shape) == (width,)


def fusion_supported(layer: nn.Module) -> bool:
    """Whether `skinny_fused` reproduces the layer's norms and MLP: RMSNorms before attention and MLP, and a
    SiLU-gated MLP (transformers' `act_fn` a SiLU; the drafter's MLP, which has none, calls F.silu)."""
    width = layer.self_attn.o_proj.out_features
    if not isinstance(layer.mlp, DraftMLP) and not swiglu_mlp(layer):
        return False
    act = getattr(layer.mlp, "act_fn", None)
    silu = isinstance(layer.mlp, DraftMLP) if act is None else (
        act is F.silu or isinstance(act, nn.SiLU) or type(act).__name__ == "SiLUActivation")
    return silu and all(is_rms_norm(getattr(layer, name, None), width)
                        for name in ("input_layernorm", "post_attention_layernorm"))


def prologue_in_product(qkv_weight: torch.Tensor) -> bool:
    """Whether the fused path puts the attention prologue in the q/k/v product (`PROLOGUE_IN_PRODUCT_MAX_BYTES`)."""
    return qkv_weight.numel() * qkv_weight.element_size() <= PROLOGUE_IN_PRODUCT_MAX_BYTES
