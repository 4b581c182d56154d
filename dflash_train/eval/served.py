"""Acceptance length of a DFlash drafter as a serving runtime measures it: vLLM, llama.cpp's `llama-server`
(started with `--metrics`), or any OpenAI-compatible server exposing the same Prometheus speculative-decoding
counters (`vllm:spec_decode_*` or `llamacpp:spec_decode_*`).

Each prompt set is sent with the prompts `dflash-train eval` uses (same loaders, same `--num-prompts`
choice, same chat rendering, sent as token ids so the server sees the very prompt the eval decoded),
greedy, one request at a time. Later turns (MT-Bench's second) are asked after the served answer to the
earlier one, as the eval asks them after the target's own answer; greedy speculation is lossless, so the
served answer is the target's. `--temperature 0,0.7,1` measures each set at every temperature in one run, as
`dflash-train eval --temperature` sweeps: sampled requests carry a seed (`--seed` plus the request's index), so a
rerun against the same server asks the same draws. The counters are read around every request, so both of the eval's
figures come out: τ, the mean over requests of each request's 1 + accepted / drafts (as published DFlash
benchmarks average, `acceptance_length`), and τ per cycle, 1 + accepted / drafts over the whole set
(`acceptance_length_cycle_weighted`, the figure vLLM's own logs print).

    python -m dflash_train.eval.served --url http://127.0.0.1:8000 --tokenizer TARGET_DIR \
        --dataset mt-bench --dataset humaneval --num-prompts 40 --temperature 0,0.7,1 --json served.json
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer, GenerationConfig
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from dflash_train.atomic import write_json_atomically
from dflash_train.data.prompt_ids import prompt_ids, stop_token_ids
from dflash_train.json_files import json_object_or_none
from dflash_train.prompts.eval_sets import PromptSet, load_prompt_set

# The counters' names after the server's prefix: vLLM's, which llama-server copies under its own prefix.
PREFIXES = ("vllm:", "llamacpp:")
DRAFTS = "spec_decode_num_drafts_total"  # verify passes (cycles) with a draft
ACCEPTED = "spec_decode_num_accepted_tokens_total"
DRAFT_TOKENS = "spec_decode_num_draft_tokens_total"
PER_POSITION = "spec_decode_num_accepted_tokens_per_pos_total"
# Plain temperature sampling, as the eval samples: the servers' own defaults differ (llama-server's truncate the
# target's distribution to the top 40 tokens, 95 % of the mass and 5 % of the top token's probability).
PLAIN_SAMPLING = {"top_p": 1.0, "top_k": -1, "min_p": 0.0}
SAMPLE = re.compile(r"^([A-Za-z_:][\w:]*)(\{[^}]*\})?\s+(\S+)")
POSITION = re.compile(r'position="(\d+)"')
TIMEOUT_S = 600.0  # one greedy request on a CPU server can take minutes


class ServerError(RuntimeError):
    """A server that cannot be measured; its message is one line for the command line."""


@dataclass
class Counters:
    drafts: float = 0.0
    accepted: float = 0.0
    draft_tokens: float = 0.0
    per_position: dict[int, float] = field(default_factory=dict)

    def minus(self, before: Counters) -> Counters:
        positions = {k: v - before.per_position.get(k, 0.0) for k, v in self.per_position.items()}
        return Counters(self.drafts - before.drafts, self.accepted - before.accepted,
                        self.draft_tokens - before.draft_tokens, positions)


@dataclass
class Reply:
    text: str
    token_ids: list[int] | None  # None when the server does not return them
    completion_tokens: int
    seconds: float


@dataclass
class SetResult:
    dataset: str
    temperature: float
    requests: int
    drafts: int
    accepted: int
    acceptance_length: float | None  # mean over requests with a draft of 1 + accepted / drafts
    acceptance_length_cycle_weighted: float | None  # 1 + accepted / drafts over the set
    completion_tokens: int
    seconds: float
    tokens_per_s: float
    per_position_acceptance: list[float]  # fraction of drafts whose slot k was accepted, k = 1..
    outputs: list[dict[str, Any]]


def parse_metrics(text: str) -> Counters:
    """The speculative-decoding counters of a Prometheus text page (vLLM's or llama-server's), summed over label
    sets (one per engine or model); ServerError if the page has none (no drafter, or no such counters)."""
    counters, seen = Counters(), False
    for line in text.splitlines():
        match = SAMPLE.match(line)
        if match is None:
            continue
        prefix = next((p for p in PREFIXES if match.group(1).startswith(p)), None)
        if prefix is None:
            continue
        name, labels, value = match.group(1)[len(prefix):], match.group(2) or "", float(match.group(3))
        seen |= name == DRAFTS
        _add_sample(counters, name, labels, value)
    if not seen:
        raise ServerError(f"the server's /metrics has no vllm:{DRAFTS} or llamacpp:{DRAFTS}: is it serving with a "
                          "speculative config (llama-server: with --metrics)?")
    return counters


def _add_sample(counters: Counters, name: str, labels: str, value: float) -> None:
    if name == DRAFTS:
        counters.drafts += value
    elif name == ACCEPTED:
        counters.accepted += value
    elif name == DRAFT_TOKENS:
        counters.draft_tokens += value
    elif name == PER_POSITION and (position := POSITION.search(labels)):
        key = int(position.group(1))
        counters.per_position[key] = counters.per_position.get(key, 0.0) + value


def _http(url: str, body: dict[str, Any] | None = None) -> str:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
            return response.read().decode()
    except urllib.error.HTTPError as error:
        raise ServerError(f"{url}: HTTP {error.code} {error.reason}") from None
    except (urllib.error.URLError, OSError) as error:
        raise ServerError(f"{url}: {getattr(error, 'reason', error)}") from None


def read_counters(url: str) -> Counters:
    return parse_metrics(_http(f"{url}/metrics"))


def served_model(url: str) -> str:
    models = json.loads(_http(f"{url}/v1/models")).get("data") or []
    if not models:
        raise ServerError(f"{url}/v1/models lists no model; pass --model")
    return str(models[0]["id"])


def complete(url: str, model: str, ids: list[int], max_tokens: int, stop_ids: Sequence[int],
             temperature: float = 0.0, seed: int | None = None) -> Reply:
    """One completion of a prompt given as token ids: greedy at temperature 0, else sampled with `seed`."""
    body: dict[str, Any] = {"model": model, "prompt": ids, "max_tokens": max_tokens, "temperature": temperature,
                            "stop_token_ids": list(stop_ids), "return_token_ids": True}  # vLLM/SGLang extensions
    if temperature > 0:
        body.update(PLAIN_SAMPLING)
        if seed is not None:
            body["seed"] = seed
    start = time.perf_counter()
    reply = json.loads(_http(f"{url}/v1/completions", body))
    seconds = time.perf_counter() - start
    choice = reply["choices"][0]
    tokens = choice.get("token_ids")
    count = int((reply.get("usage") or {}).get("completion_tokens") or len(tokens or []))
    return Reply(choice.get("text") or "", list(tokens) if tokens is not None else None, count, seconds)


@dataclass
class Run:
    """What every request of a measurement shares."""

    url: str
    model: str
    tokenizer: PreTrainedTokenizerBase
    max_tokens: int
    stop_ids: list[int]
    temperature: float = 0.0
    seed: int = 0


def decode_set(run: Run, prompt_set: PromptSet) -> list[dict[str, Any]]:
    """Every turn of every conversation, turn by turn as the eval orders them: a later turn sees the
    served answer to the earlier one, as text (the eval decodes the target's answer the same way)."""
    histories = [list(c.prefix) for c in prompt_set.conversations]
    outputs: list[dict[str, Any]] = []
    for turn in range(max(len(c.turns) for c in prompt_set.conversations)):
        for index, conversation in enumerate(prompt_set.conversations):
            if turn >= len(conversation.turns):
                continue
            messages = histories[index] + [{"role": "user", "content": conversation.turns[turn]}]
            ids = prompt_ids(run.tokenizer, messages, thinking=False)
            before = read_counters(run.url)
            reply = complete(run.url, run.model, ids, run.max_tokens, run.stop_ids, run.temperature,
                             run.seed + len(outputs))
            delta = read_counters(run.url).minus(before)  # one request at a time: this request's cycles
            histories[index] = messages + [{"role": "assistant", "content": reply.text}]
            outputs.append({"conversation": index, "turn": turn, "prompt_tokens": len(ids), **asdict(reply),
                            "drafts": round(delta.drafts), "accepted": round(delta.accepted)})
    return outputs


def measure_set(run: Run, prompt_set: PromptSet) -> SetResult:
    before = read_counters(run.url)
    outputs = decode_set(run, prompt_set)
    delta = read_counters(run.url).minus(before)
    tokens = sum(o["completion_tokens"] for o in outputs)
    seconds = sum(o["seconds"] for o in outputs)
    per_cycle = 1 + delta.accepted / delta.drafts if delta.drafts else None
    drafted = [1 + o["accepted"] / o["drafts"] for o in outputs if o["drafts"]]  # as the eval: no cycle, no τ
    per_request = sum(drafted) / len(drafted) if drafted else None
    positions = [delta.per_position[k] / delta.drafts if delta.drafts else 0.0 for k in sorted(delta.per_position)]
    return SetResult(prompt_set.name, run.temperature, len(outputs), round(delta.drafts), round(delta.accepted), per_request,
                     per_cycle, tokens, seconds, tokens / seconds if seconds else 0.0, positions, outputs)


def table(results: Sequence[SetResult]) -> str:
    lines = ["| set | T | requests | drafts | accepted | τ | τ/cycle | tokens/s |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        tau, per_cycle = (f"{t:.3f}" if t is not None else "n/a"
                          for t in (r.acceptance_length, r.acceptance_length_cycle_weighted))
        lines.append(f"| {r.dataset} | {r.temperature:g} | {r.requests} | {r.drafts} | {r.accepted} | {tau} | {per_cycle} | "
                     f"{r.tokens_per_s:.1f} |")
    return "\n".join(lines)


def _stop_ids(tokenizer_dir: str, tokenizer: PreTrainedTokenizerBase, given: list[int] | None) -> list[int]:
    # Default: the stop ids `dflash-train eval` decodes with (tokenizer EOS + generation-config EOS).
    if given is not None:
        return given
    try:
        generation = GenerationConfig.from_pretrained(tokenizer_dir)
    except OSError:
        generation = None
    return stop_token_ids(tokenizer, generation)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", required=True, help="server root, e.g. http://127.0.0.1:8000")
    parser.add_argument("--dataset", action="append", help="mt-bench, humaneval, ... or a .jsonl (repeatable)")
    parser.add_argument("--num-prompts", type=int, default=40, help="conversations per set, as eval picks them")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--model", help="served model name (default: the first of /v1/models)")
    parser.add_argument("--tokenizer", help="target tokenizer directory (default: --model)")
    parser.add_argument("--stop-token-ids", type=int, nargs="*", help="default: the target's EOS ids")
    parser.add_argument("--temperature", type=temperatures, default=[0.0],
                        help="one temperature or a comma-separated sweep, e.g. 0,0.7,1 (default 0: greedy)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the first sampled request (default 0)")
    parser.add_argument("--json", type=Path, help="write the figures and every reply here")
    return parser.parse_args(argv)


def temperatures(text: str) -> list[float]:
    """`--temperature`'s value: distinct finite temperatures >= 0, in the order given. (`dflash-train eval`
    parses its own with `commands.data_args.temperature_list`, which this package may not import.)"""
    try:
        values = [float(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a temperature or a comma-separated list of them") from None
    if not all(0.0 <= value < float("inf") for value in values) or len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"{text!r}: temperatures must be finite, >= 0 and distinct")
    return values


def foreign_json(path: Path | None) -> bool:
    """Whether `path` exists and is not a report an earlier run of this command wrote (never overwritten)."""
    if path is None or not path.exists():
        return False
    report = json_object_or_none(path)
    return not (report is not None and {"url", "sets"} <= report.keys())


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    url = args.url.rstrip("/")
    if foreign_json(args.json):
        print(f"error: {args.json} was not written by this command; pick another --json, it is not overwritten",
              file=sys.stderr)
        return 2
    try:
        model = args.model or served_model(url)
        tokenizer_dir = args.tokenizer or model
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        run = Run(url, model, tokenizer, args.max_tokens, _stop_ids(tokenizer_dir, tokenizer, args.stop_token_ids))
        read_counters(url)  # fail before decoding anything on a server without the counters
        sets = [load_prompt_set(name, args.num_prompts) for name in args.dataset or ["mt-bench", "humaneval"]]
        results = [measure_set(replace(run, temperature=temperature, seed=args.seed), prompt_set)
                   for temperature in args.temperature for prompt_set in sets]
    except (ServerError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(table(results))
    if args.json:
        write_json_atomically(args.json, {"url": url, "model": model, "max_tokens": args.max_tokens,
                                          "temperatures": args.temperature, "seed": args.seed,
                                          "stop_token_ids": run.stop_ids, "sets": [asdict(r) for r in results]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
