"""Regeneration back ends: the target in this process through the runtime, and any OpenAI-compatible server.

The server back end sends each prompt's messages to ``POST {base_url}/chat/completions`` (vLLM, SGLang,
llama.cpp's ``llama-server`` and others serve it), ``concurrency`` requests at a time, and retries
transient failures. The server applies the chat template; ``thinking`` is passed as
``chat_template_kwargs.enable_thinking``, which vLLM and SGLang forward to the template. A reasoning
parser's separate ``reasoning_content`` is put back in front of the answer as ``<think>...</think>``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from dflash_train.regeneration.generation import Generated, Generator
from dflash_train.regeneration.regenerate import Completion, PromptRow
from dflash_train.runtime.config import EngineConfig
from dflash_train.runtime.sampling import request_seed
from dflash_train.target import TargetModel


class LocalBackend:
    """Generates with the target in this process, through the runtime without a drafter: units are queued
    as they start and decoded together, ``config.batch_size`` rows at once, each row refilled with the next
    waiting prompt when it finishes. ``window`` units are in flight: twice as many prompts as rows and one
    unit more, so that rows rarely wait while the oldest unit's slowest answers finish. Row ``r`` of a unit
    with seed ``s`` draws from seed (s, r's row id), whatever row or company it runs in, so a resumed run
    writes what an uninterrupted one would have."""

    def __init__(self, target: TargetModel, config: EngineConfig, unit_rows: int) -> None:
        tokenizer = target.tokenizer
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(config.stop_token_ids, default=0)
        self.generator = Generator(target, config, pad)
        self.tokenizer = tokenizer
        self.window = 1 + 2 * -(-config.batch_size // unit_rows)

    def start(self, rows: list[PromptRow], seed: int) -> Callable[[], list[Completion]]:
        wait = self.generator.submit([row.prompt_ids for row in rows], [request_seed(seed, row.row_id) for row in rows])
        return lambda: [self._completion(out) for out in wait()]

    def complete(self, rows: list[PromptRow], seed: int) -> list[Completion]:
        return self.start(rows, seed)()

    def _completion(self, out: Generated) -> Completion:
        text = self.tokenizer.decode(out.token_ids, skip_special_tokens=True)
        return Completion(text, out.finish_reason, len(out.token_ids))


class OpenAIBackend:
    """``window`` units are in flight at once on one pool of ``concurrency`` connections, so the server never
    idles while the slowest rows of a unit finish."""

    window = 4

    def __init__(self, base_url: str, model: str, max_new_tokens: int, temperature: float = 0.0,
                 thinking: bool | None = None, concurrency: int = 16, api_key: str | None = None,
                 timeout_s: float = 600.0, retries: int = 3, top_p: float = 1.0) -> None:
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.model = model
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature
        self.top_p = top_p
        self.thinking = thinking
        self.retries = retries
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.Client(timeout=timeout_s, headers=headers,
                                   limits=httpx.Limits(max_connections=concurrency))
        self.pool = ThreadPoolExecutor(concurrency, thread_name_prefix="openai-backend")

    def start(self, rows: list[PromptRow], seed: int) -> Callable[[], list[Completion]]:
        futures = [self.pool.submit(self._one, row, seed + i) for i, row in enumerate(rows)]
        return lambda: [future.result() for future in futures]

    def complete(self, rows: list[PromptRow], seed: int) -> list[Completion]:
        return self.start(rows, seed)()

    def _payload(self, row: PromptRow, seed: int) -> dict[str, Any]:
        payload: dict[str, Any] = {"model": self.model, "messages": row.messages, "max_tokens": self.max_new_tokens,
                                   "temperature": self.temperature, "seed": seed}
        if self.top_p < 1.0:
            payload["top_p"] = self.top_p
        if self.thinking is not None:
            payload["chat_template_kwargs"] = {"enable_thinking": self.thinking}
        return payload

    def _one(self, row: PromptRow, seed: int) -> Completion:
        for attempt in range(self.retries + 1):
            try:
                response = self.client.post(self.url, json=self._payload(row, seed))
                if response.status_code < 500:
                    break
            except httpx.TransportError as error:
                if attempt == self.retries:
                    raise ValueError(f"{self.url}: {error}; is the server running?") from error
            time.sleep(min(2**attempt, 30))
        if response.status_code != 200:
            raise ValueError(f"{self.url} answered {response.status_code}: {response.text[:200]}")
        choice = response.json()["choices"][0]
        message = choice["message"]
        text = message.get("content") or ""
        reasoning = message.get("reasoning_content") or message.get("reasoning")
        if reasoning:
            text = f"<think>\n{reasoning.strip()}\n</think>\n\n{text.lstrip()}"
        tokens = (response.json().get("usage") or {}).get("completion_tokens", 0)
        return Completion(text, "length" if choice.get("finish_reason") == "length" else "stop", int(tokens))
