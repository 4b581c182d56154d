"""Built-in batched generation: static KV cache, on-device stopping, one CUDA graph per batch shape.

Per step the host only launches work (a graph replay on CUDA) and reads nothing back; whether every row
has stopped is checked once every ``sync_every`` steps. Greedy, or sampled at ``temperature`` with the
Gumbel-max trick from a seeded device generator, so a batch's output depends only on its rows and seed.
Targets outside the Llama family fall back to Hugging Face ``generate`` (correct, slower).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from dflash_train.data.static_decoder import StaticDecoder, StaticKV, supports_static_decoding

CACHE_BUCKET = 256  # cache lengths are rounded up to this, so few distinct graph shapes are captured


@dataclass(frozen=True)
class GenerationSettings:
    max_new_tokens: int
    stop_ids: tuple[int, ...]
    pad_id: int
    temperature: float = 0.0
    sync_every: int = 16
    cuda_graphs: bool = True


@dataclass
class Generated:
    token_ids: list[int]  # the response, without the stop token
    finish_reason: str  # "stop" or "length"


def pick_tokens(logits: Tensor, temperature: float, generator: torch.Generator | None) -> Tensor:
    """``[B, V]`` logits -> ``[B]`` tokens: argmax, or Gumbel-max sampling (= softmax(logits / T))."""
    if temperature <= 0:
        return logits.argmax(dim=-1)
    uniform = torch.rand(logits.shape, generator=generator, device=logits.device).clamp_(min=1e-20)
    return (logits / temperature - torch.log(-torch.log(uniform))).argmax(dim=-1)


def split_outputs(out: Tensor, stop_ids: tuple[int, ...]) -> list[Generated]:
    results = []
    for row in out.tolist():
        stop = next((i for i, token in enumerate(row) if token in stop_ids), None)
        results.append(Generated(row if stop is None else row[:stop], "length" if stop is None else "stop"))
    return results


def left_pad(prompts: list[list[int]], pad_id: int, device: torch.device) -> tuple[Tensor, Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, prompt in enumerate(prompts):
        ids[i, width - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
        mask[i, width - len(prompt):] = 1
    return ids.to(device), mask.to(device)


class _GraphStep:
    """One decode step captured as a CUDA graph over a fixed cache; inputs are copied into its buffers."""

    def __init__(self, decoder: StaticDecoder, cache: StaticKV) -> None:
        batch, device = cache.key_valid.shape[0], cache.key_valid.device
        self.tokens = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.positions = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.slot = torch.zeros(1, dtype=torch.long, device=device)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up outside the graph (allocator, kernel selection)
            for _ in range(2):
                decoder.step(cache, self.tokens, self.positions, self.slot)
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = decoder.step(cache, self.tokens, self.positions, self.slot)

    def __call__(self, tokens: Tensor, positions: Tensor, slot: Tensor) -> Tensor:
        self.tokens.copy_(tokens)
        self.positions.copy_(positions)
        self.slot.copy_(slot)
        self.graph.replay()
        return self.logits


class BatchGenerator:
    """Generates continuations of token-id prompts with a frozen causal LM."""

    def __init__(self, model: nn.Module, settings: GenerationSettings) -> None:
        self.model = model
        self.settings = settings
        self.decoder = StaticDecoder(model)
        self._current: tuple[tuple[int, int], StaticKV, _GraphStep | None] | None = None

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def generate(self, prompts: list[list[int]], seed: int = 0) -> list[Generated]:
        s = self.settings
        cache_len = -(-(max(map(len, prompts)) + s.max_new_tokens) // CACHE_BUCKET) * CACHE_BUCKET
        if not supports_static_decoding(self.model, cache_len):
            return hf_generate(self.model, prompts, s, seed)
        ids, mask = left_pad(prompts, s.pad_id, self.device)
        cache, graph_step = self._cache_for(len(prompts), cache_len)
        generator = torch.Generator(device=self.device).manual_seed(seed) if s.temperature > 0 else None
        stop_ids = torch.tensor(s.stop_ids, device=self.device)
        lengths = mask.sum(-1, keepdim=True)  # [B, 1]: the position of the first new token
        out = torch.full((len(prompts), s.max_new_tokens), s.pad_id, dtype=torch.long, device=self.device)
        finished = torch.zeros(len(prompts), dtype=torch.bool, device=self.device)
        token = pick_tokens(self.decoder.prefill(cache, ids, mask), s.temperature, generator)
        step = graph_step or (lambda t, p, slot: self.decoder.step(cache, t, p, slot))
        for t in range(s.max_new_tokens):
            token = torch.where(finished, s.pad_id, token)
            out[:, t] = token
            finished |= torch.isin(token, stop_ids)
            if t + 1 == s.max_new_tokens or ((t + 1) % s.sync_every == 0 and bool(finished.all())):
                break
            slot = torch.full((1,), ids.shape[1] + t, dtype=torch.long, device=self.device)
            token = pick_tokens(step(token[:, None], lengths + t, slot), s.temperature, generator)
        return split_outputs(out.cpu(), s.stop_ids)

    def _cache_for(self, batch: int, cache_len: int) -> tuple[StaticKV, _GraphStep | None]:
        # Only the latest shape is kept: batches come longest first, so an older shape never returns, and
        # keeping every cache would hold several full-size KV caches at once.
        key = (batch, cache_len)
        if self._current is None or self._current[0] != key:
            self._current = None
            dtype = next(self.model.parameters()).dtype
            cache = self.decoder.new_cache(batch, cache_len, self.device, dtype)
            use_graph = self.settings.cuda_graphs and self.device.type == "cuda"
            self._current = (key, cache, _GraphStep(self.decoder, cache) if use_graph else None)
        return self._current[1], self._current[2]


@torch.no_grad()
def hf_generate(model: nn.Module, prompts: list[list[int]], s: GenerationSettings, seed: int = 0) -> list[Generated]:
    """The same contract through Hugging Face ``generate`` (the fallback, and the benchmark baseline)."""
    device = next(model.parameters()).device
    ids, mask = left_pad(prompts, s.pad_id, device)
    torch.manual_seed(seed)
    sampling = {"do_sample": True, "temperature": s.temperature, "top_k": 0, "top_p": 1.0} if s.temperature > 0 else {
        "do_sample": False, "temperature": None, "top_k": None, "top_p": None}
    out = model.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=s.max_new_tokens, eos_token_id=list(s.stop_ids),
        pad_token_id=s.pad_id, **sampling,
    )[:, ids.shape[1]:]
    padded = torch.full((len(prompts), s.max_new_tokens), s.pad_id, dtype=torch.long)
    padded[:, : out.shape[1]] = out.cpu()
    return split_outputs(padded, s.stop_ids)
