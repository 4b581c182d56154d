"""The runtime's settings, defined once for regeneration and evaluation, and the choices derived from them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from dflash_train.kernels._triton import HAS_TRITON, interpreter_ready

if TYPE_CHECKING:
    import torch

KERNELS = ("auto", "triton", "torch")
# What one torch.compile call covers: the whole forward ("step": inductor may fuse across layers, compile time
# grows with the depth), or one decoder layer whose compiled code every layer reuses ("layer": seconds to
# compile whatever the depth), with what lies before and after the layers compiled as two small graphs.
COMPILE_SCOPES = ("step", "layer")
DRAFT_ATTENTIONS = ("kernel", "sdpa")  # EngineConfig.draft_attention
VERIFICATIONS = ("token", "block")  # EngineConfig.verification
MATMULS = ("auto", "torch", "skinny", "fused")  # EngineConfig.matmul
# EngineConfig.matmul -> StaticTarget(skinny_matmul=...)
SKINNY_FOR_MATMUL = {"auto": "tuned", "torch": "off", "skinny": "all", "fused": "all"}
# The command-line help of --compile-scope (eval, regenerate): one wording of the trade-off.
COMPILE_SCOPE_HELP = ("what one torch.compile graph covers: layer (default) compiles one decoder layer whose code "
                      "every layer reuses, in seconds whatever the depth (5-17 s per engine for Qwen3-8B on an H200, "
                      "same step time); step compiles the whole decode step, so that inductor may fuse across "
                      "layers, in a time that grows with the depth (46-60 s per engine for Qwen3-8B)")


@dataclass(frozen=True)
class EngineConfig:
    batch_size: int = 1  # rows decoded at once; a finished row takes the next waiting request
    block_size: int = 16  # tokens verified per cycle with a drafter (1 without one)
    # The longest step the runner's state rings take back (hybrid targets' linear-attention layers): None, this
    # engine's block; set it to the drafted block where a target-only engine builds a runner a drafted one shares
    runner_step_tokens: int | None = None
    max_new_tokens: int = 128
    max_length: int = 2048  # positions held by the static caches: longest prompt + new tokens + block
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0  # nucleus sampling at temperature > 0 (1: the whole distribution)
    # At temperature T > 0, drafts are sampled at T times this (0: the drafter's argmax, a point mass), and the
    # rejection test reads that same distribution, so the output stays the target's at T whatever it is. Below 1
    # a drafter that cannot see which tokens slots before it drew (DFlash drafts a block at once) bets on its
    # likeliest token (docs/eval.md, 'Sampled decoding').
    draft_temperature_scale: float = 1.0
    # At temperature > 0, how a block's drafts are tested: "token", each on its own in order (what serving
    # runtimes do); "block", the block verification rule, which keeps the target's distribution as exactly and
    # keeps at least as many drafts on average (runtime/sampling.py)
    verification: Literal["token", "block"] = "token"
    seed: int = 0  # base of the per-request seeds when the caller gives none
    stop_token_ids: tuple[int, ...] = ()
    kernels: str = "auto"  # "triton", "torch", or "auto" (triton on CUDA when installed)
    cuda_graphs: bool = True  # used on CUDA only
    compile: bool | None = None  # torch.compile the cycle's target and drafter forwards; None: on CUDA only
    # inductor options for those compilations, e.g. (("freezing", True),): weights folded as constants, so
    # that inductor may concatenate the q/k/v and gate/up projections (a benchmark knob)
    compile_options: tuple[tuple[str, Any], ...] = ()
    # What one compiled graph covers (COMPILE_SCOPES above). "layer" by default: it compiles several times faster
    # than "step", at the same step and cycle times (docs/eval.md, 'The decode loop').
    compile_scope: Literal["step", "layer"] = "layer"
    # The drafter's block attention with kernels "triton": "kernel", the block's K/V written into the context
    # cache and attended by the split-key kernel (runtime/draft_layer.py); "sdpa", the drafter's own forward,
    # SDPA over its whole cache (the reference, and the benchmark's ablation).
    draft_attention: Literal["kernel", "sdpa"] = "kernel"
    # With kernels "triton": the rows' state update after each cycle as one kernel (kernels/decode_state.py)
    # instead of ~30 small PyTorch ops (the benchmark's ablation turns it off).
    fuse_state_update: bool = True
    # With kernels "triton" at temperature 0: the drafts' argmax by `block_argmax_triton` (the vocabulary in
    # chunks, then one kernel for every slot's chunks) instead of torch.argmax (the benchmark's ablation).
    fuse_draft_argmax: bool = True
    # With kernels "triton", the products of decode and verify steps (at most 64 rows): "auto", the skinny
    # kernel (kernels/skinny_matmul.py) for the weight shapes its tiling table was swept for on this GPU's
    # architecture and cuBLAS for the others (at Qwen3-8B's shapes a step faster than on cuBLAS alone);
    # "torch" (cuBLAS), "skinny" (the kernel for every product), or "fused": the skinny kernel with each
    # layer's RMSNorms, SwiGLU and residual adds folded in (kernels/skinny_fused.py) and the attention prologue
    # in the q/k/v product (kernels/qkv_rope_cache.py), target and drafter (slower than "auto": opt-in).
    matmul: Literal["auto", "torch", "skinny", "fused"] = "auto"
    # With kernels "triton", a MoE target's experts on steps of few tokens: "kernel", the decode-experts kernel
    # (kernels/decode_experts.py: each chosen expert's weights read once, no sort or gather); "model", the
    # implementation the model was loaded with (transformers' grouped products; the benchmark's ablation).
    experts: Literal["kernel", "model"] = "kernel"
    # A latent-attention target's (DeepSeek-V3's) decode and verify steps: "absorbed", attention in latent space
    # with the up-projections moved to the queries (runtime/latent_attention.py); "expanded", the model's own
    # path, every cached slot expanded to every head's keys and values (the benchmark's ablation).
    latent: Literal["absorbed", "expanded"] = "absorbed"
    lookahead: int = 2  # cycles queued before the host reads a finished-row flag
    # Requests prefilled together (a wave): a wave starts once that many rows are free, so large batches
    # refill in few forwards while the other rows keep their place. None: batch_size // 8, at least 1.
    prefill_rows: int | None = None
    prefill_tokens: int = 32768  # padded prompt tokens of one prefill forward at most (memory)
    # End a row inside a verbatim loop (runtime/loop_stop.py; finish reason "loop"): regeneration's --stop-loops.
    # Off in eval: its speed baseline and lossless check decode every prompt to the same length.
    stop_loops: bool = False

    def __post_init__(self) -> None:
        for name in ("batch_size", "block_size", "max_new_tokens", "max_length"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, not {getattr(self, name)}")
        if self.kernels not in KERNELS:
            raise ValueError(f"kernels must be one of {', '.join(KERNELS)}, not {self.kernels!r}")
        check_compile_scope(self.compile_scope)
        if self.draft_attention not in DRAFT_ATTENTIONS:
            raise ValueError(f"draft_attention must be kernel or sdpa, not {self.draft_attention!r}")
        if self.matmul not in MATMULS:
            raise ValueError(f"matmul must be one of {', '.join(MATMULS)}, not {self.matmul!r}")
        if self.latent not in ("absorbed", "expanded"):
            raise ValueError(f"latent must be absorbed or expanded, not {self.latent!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], not {self.top_p}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, not {self.temperature}")
        if self.verification not in VERIFICATIONS:
            raise ValueError(f"verification must be token or block, not {self.verification!r}")
        if not 0.0 <= self.draft_temperature_scale < float("inf"):
            raise ValueError(f"draft_temperature_scale must be a finite number >= 0, not {self.draft_temperature_scale}")

    @property
    def wave_rows(self) -> int:
        return min(self.prefill_rows or max(1, self.batch_size // 8), self.batch_size)


def check_compile_scope(scope: str) -> str:
    if scope not in COMPILE_SCOPES:
        raise ValueError(f"compile_scope must be one of {', '.join(COMPILE_SCOPES)}, not {scope!r}")
    return scope


def resolve_kernels(kernels: str, device: torch.device) -> str:
    """"auto" -> "triton" on CUDA with triton installed, else "torch"; "triton" on CPU needs the interpreter."""
    if kernels not in KERNELS:
        raise ValueError(f"kernels must be one of {', '.join(KERNELS)}, not {kernels!r}")
    if kernels == "auto":
        return "triton" if device.type == "cuda" and HAS_TRITON else "torch"
    if kernels == "triton" and device.type != "cuda" and not interpreter_ready():
        raise ValueError("kernels='triton' on CPU needs TRITON_INTERPRET=1 set before start; use kernels='torch'")
    return kernels


def stop_token_ids(tokenizer: Any, generation_config: Any = None) -> list[int]:
    """The tokenizer's EOS plus the model's generation-config EOS ids (Qwen3 lists two)."""
    ids = set()
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    eos = getattr(generation_config, "eos_token_id", None)
    if isinstance(eos, int):
        ids.add(eos)
    elif isinstance(eos, (list, tuple)):
        ids.update(int(i) for i in eos)
    return sorted(ids)
