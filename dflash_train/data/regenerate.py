"""Regenerate the responses of chat prompts with the target itself, resumably, split across ranks.

Plan (from the input alone, identical for every rank and every resumed run): prompts are read, cut to
the conversation up to the first user turn, deduplicated, tokenised with the chat template (the same
template and thinking setting as at serving), sorted by length, and cut into units of ``batch_size``
rows. Unit ``k`` is one batch; rank ``r`` of ``w`` runs units ``k % w == r``; each finished unit is one
shard ``part-<k>.jsonl`` written atomically. A resumed run skips units whose shard exists, so no row is
lost or duplicated, and a unit's output depends only on its rows and ``seed + k``: a resumed run writes
exactly what an uninterrupted one would have.

Output rows: ``{"messages": [...prompt, {"role": "assistant", "content": ...}], "finish_reason",
"prompt_tokens", "completion_tokens", "source", "source_index", "row_id"}`` — an OpenAI-messages corpus
that ``dflash-train prepare`` reads directly.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from dflash_train.data.chat import ChatTokenizer, template_hash
from dflash_train.data.corpora import CorpusSpec, open_corpus
from dflash_train.data.prepare import iter_messages
from dflash_train.data.quality import DataReport
from dflash_train.data.records import BadRecord, Message
from dflash_train.data.shards import (
    REGEN_MANIFEST,
    check_same_settings,
    regenerated_files,
    regenerated_shard_path,
    write_atomically,
    write_json_atomically,
)


@dataclass
class PromptRow:
    row_id: int
    messages: list[Message]
    prompt_ids: list[int]
    source: str
    source_index: int


@dataclass
class Completion:
    text: str
    finish_reason: str
    completion_tokens: int


class Backend(Protocol):
    def complete(self, rows: list[PromptRow], seed: int) -> list[Completion]: ...


@dataclass
class RegenerateConfig:
    sources: list[CorpusSpec]
    max_new_tokens: int = 1024
    temperature: float = 0.0
    seed: int = 0
    thinking: bool | None = None
    batch_size: int = 64
    max_prompt_tokens: int = 2048
    dedupe: bool = True
    settings: dict[str, Any] = field(default_factory=dict)  # recorded; a resume must match them


def plan_prompts(chat: ChatTokenizer, config: RegenerateConfig) -> tuple[list[PromptRow], DataReport]:
    report = DataReport("regenerate: prompts")
    rows, seen = [], set()
    for spec in config.sources:
        corpus = open_corpus(spec)
        for index, _, prompt in iter_messages(corpus, spec, report, prompt_only=True):
            try:
                chat.check_no_special_text(prompt)
                ids = chat.encode_prompt(prompt)
            except BadRecord as bad:
                report.drop(bad.reason)
                continue
            key = hashlib.sha1(json.dumps(prompt, sort_keys=True).encode()).digest()
            if config.dedupe and key in seen:
                report.drop("duplicate_prompt")
                continue
            if len(ids) > config.max_prompt_tokens:
                report.drop("prompt_too_long")
                continue
            seen.add(key)
            rows.append(PromptRow(len(rows), prompt, ids, corpus.name, index))
            report.kept += 1
    return rows, report


def plan_units(rows: list[PromptRow], batch_size: int) -> list[list[int]]:
    """Row indices of each unit: longest prompts first (ties by row id), ``batch_size`` per unit."""
    order = sorted(range(len(rows)), key=lambda i: (-len(rows[i].prompt_ids), i))
    return [order[i: i + batch_size] for i in range(0, len(order), batch_size)]


def _start(backend: Backend, batch: list[PromptRow], seed: int) -> Callable[[], list[Completion]]:
    """Start a unit; the returned call waits for its completions. Back ends with ``start`` (the server
    back end) begin at once, so several units can be in flight; the others run when waited for."""
    start = getattr(backend, "start", None)
    return start(batch, seed) if start is not None else (lambda: backend.complete(batch, seed))


def run_units(
    backend: Backend, rows: list[PromptRow], units: list[list[int]], out_dir: Path, rank: int, world: int,
    seed: int, progress: Callable[[int, int, float], None] | None = None,
) -> int:
    """Run this rank's unfinished units, in order, up to ``backend.window`` at a time (so a server is kept
    busy while a unit's slowest rows finish); returns the number of tokens generated."""
    todo = [k for k in range(len(units)) if k % world == rank and not regenerated_shard_path(out_dir, k).exists()]
    window = max(1, getattr(backend, "window", 1))
    generated, done = 0, 0
    in_flight: deque[tuple[int, list[PromptRow], Callable[[], list[Completion]], float]] = deque()
    if progress:
        progress(0, len(todo), 0.0)
    for k in [*todo, None]:
        if k is not None:
            batch = [rows[i] for i in units[k]]
            in_flight.append((k, batch, _start(backend, batch, seed + k), time.perf_counter()))
        while in_flight and (len(in_flight) >= window or k is None):
            unit, batch, wait, started = in_flight.popleft()
            completions = wait()
            lines = [json.dumps(_output_row(r, c), ensure_ascii=False) for r, c in zip(batch, completions, strict=True)]
            write_atomically(regenerated_shard_path(out_dir, unit),
                             lambda tmp, lines=lines: tmp.write_text("\n".join(lines) + "\n"))
            tokens = sum(c.completion_tokens for c in completions)
            generated, done = generated + tokens, done + 1
            if progress:
                progress(done, len(todo), tokens / max(time.perf_counter() - started, 1e-9))
    return generated


def _output_row(row: PromptRow, completion: Completion) -> dict[str, Any]:
    return {
        "row_id": row.row_id,
        "messages": [*row.messages, {"role": "assistant", "content": completion.text}],
        "finish_reason": completion.finish_reason,
        "prompt_tokens": len(row.prompt_ids),
        "completion_tokens": completion.completion_tokens,
        "source": row.source,
        "source_index": row.source_index,
    }


def manifest_settings(chat: ChatTokenizer, config: RegenerateConfig, num_rows: int, num_units: int) -> dict[str, Any]:
    return {
        "format": "dflash-regenerated-v1",
        "chat_template_hash": template_hash(chat.tokenizer),
        "thinking": config.thinking,
        "temperature": config.temperature,
        "max_new_tokens": config.max_new_tokens,
        "seed": config.seed,
        "batch_size": config.batch_size,
        "sources": [spec.source for spec in config.sources],
        "num_rows": num_rows,
        "num_units": num_units,
        **config.settings,
    }


def regenerate(
    backend: Backend, chat: ChatTokenizer, config: RegenerateConfig, out_dir: Path, rank: int = 0, world: int = 1,
    progress: Callable[[int, int, float], None] | None = None,
) -> dict[str, Any]:
    """Plan, check/write the manifest, run this rank's units; returns the manifest (with counts)."""
    rows, report = plan_prompts(chat, config)
    if not rows:
        raise ValueError(f"no usable prompts in {[s.source for s in config.sources]}: {report.as_dict()['dropped']}")
    units = plan_units(rows, config.batch_size)
    settings = manifest_settings(chat, config, len(rows), len(units))
    manifest_path = out_dir / REGEN_MANIFEST
    check_same_settings(manifest_path, settings, "regenerated responses")
    if rank == 0 and not manifest_path.exists():
        write_json_atomically(manifest_path, {**settings, "prompts": report.as_dict()})
    tokens = run_units(backend, rows, units, out_dir, rank, world, config.seed, progress)
    finished = len(regenerated_files(out_dir))
    manifest = {**settings, "prompts": report.as_dict(), "units_finished": finished,
                "complete": finished == len(units)}
    if manifest["complete"]:
        write_json_atomically(manifest_path, manifest)
    report.totals["tokens generated by this run"] = tokens
    report.print()
    return manifest
