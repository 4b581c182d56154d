"""An evaluation run: every prompt set through the target alone and through target + drafter, all in the
same fast loop, in the same process; lossless check, acceptance statistics and speed per set.

Per prompt set, turn by turn (turn k of every conversation is one request; turn k+1 is asked after the
target's own answer to turn k):
1. the target alone, one token per step (block 1, no drafter): the speed baseline; its answers are the turn
   history and the teacher-forced accuracy's text;
2. target + drafter (block B): its cycles give the acceptance lengths, its speed over (1) the speedup;
3. greedy only, unless `lossless_check` is off: the target alone through (2)'s verify pass with every draft
   refused (`DecodeEngine(refuse_drafts=True)`: [batch, B] blocks, one token committed per cycle, the same
   batch size, caches, kernels and compiled graph). (2) must equal (3) token for token (`lossless`), exactly
   in any dtype: both commit argmaxes of rows of the same forward shape (the guarantee is spelled out in
   `dflash_train.runtime.engine`), so a divergence is a bug, never a rounding tie. (1) is not that
   reference: a one-token step runs other kernels, which in bf16 may round a near-tie the other way. (3)
   costs about one more target-only pass and is not timed into any speed figure.
Decode tokens/s exclude prefill; every engine is warmed up (and its CUDA graph captured) before timing.
With `target_cache`, pass (1) of prompts decoded before with the same target and settings is read from disk
(`dflash_train.eval.target_pass_cache`): evaluating many drafters then decodes the target alone once.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, NamedTuple

import torch
from rich.progress import Progress

from dflash_train.data.prompt_ids import prompt_ids, supports_thinking
from dflash_train.eval.console import PassProgress
from dflash_train.eval.metrics import acceptance_metrics, running_tau
from dflash_train.eval.phases import PhaseTimer
from dflash_train.eval.target_pass_cache import TargetPassCache, target_identity
from dflash_train.eval.teacher_forced import TeacherForcedAccuracy
from dflash_train.models import DFlashDraftModel
from dflash_train.prompts.eval_sets import PromptSet
from dflash_train.runtime.engine import DecodeEngine, EngineConfig, RunStats
from dflash_train.runtime.hf_target import HFCacheTarget
from dflash_train.runtime.state import RequestOutput
from dflash_train.runtime.static_target import StaticTarget
from dflash_train.target import TargetModel

logger = logging.getLogger(__name__)
# inductor's autotuned matmul templates and launch configurations: minutes more compiling, a faster step
MAX_AUTOTUNE = (("max_autotune", True), ("coordinate_descent_tuning", True))
MAX_LISTED_MISMATCHES = 10
RETOKENIZE_MARGIN = 8  # an answer decoded to text and tokenised again inside the history may grow a little


@dataclass(frozen=True)
class EvalSettings:
    # How both engines run (batch, block size, new tokens, sampling, stop ids, kernels, graphs, compilation);
    # the baseline's block size and the caches' length are set per engine.
    runtime: EngineConfig
    thinking: bool = False
    lossless_check: bool = True  # greedy: the verify-shaped target-only pass that `lossless` compares against
    target_cache: Path | None = None  # where target-alone passes are kept and reused (None: always decoded)
    teacher_forced: bool = True  # the drafter's top-1 accuracy on the target's own answers (τ̂), after decoding

    @property
    def block_size(self) -> int:
        return self.runtime.block_size

    @property
    def max_new_tokens(self) -> int:
        return self.runtime.max_new_tokens

    @property
    def temperature(self) -> float:
        return self.runtime.temperature

    @property
    def batch_size(self) -> int:
        return self.runtime.batch_size


@dataclass
class Request:
    conversation: int
    turn: int
    messages: list[dict[str, str]]
    ids: list[int]


@dataclass
class PassTotals:
    tokens: int = 0
    decode_s: float = 0.0
    cycles: int = 0

    def add(self, stats: RunStats) -> None:
        self.tokens += stats.new_tokens
        self.decode_s += stats.wall_s - stats.prefill_s
        self.cycles += stats.cycles

    @property
    def tokens_per_s(self) -> float | None:
        return self.tokens / self.decode_s if self.decode_s > 0 else None


class Engines(NamedTuple):
    target_only: DecodeEngine  # one token per step: the speed baseline
    dflash: DecodeEngine
    lossless_check: DecodeEngine | None  # dflash's verify pass with every draft refused; None: no check


class Evaluator:
    def __init__(self, target: TargetModel, draft: DFlashDraftModel, settings: EvalSettings,
                 progress: Progress | None = None, phases: PhaseTimer | None = None) -> None:
        self.target, self.draft, self.settings, self.progress = target, draft, settings, progress
        self.phases = phases if phases is not None else PhaseTimer()
        self.stop_ids = list(settings.runtime.stop_token_ids)
        self.context_limit = int(getattr(target.config.get_text_config(), "max_position_embeddings", 1 << 20))
        self.engines: Engines | None = None
        self._spare_runner: StaticTarget | HFCacheTarget | None = None  # the last engines' runner, for the next
        self.target_cache: TargetPassCache | None = None  # made with the engines: its key names their settings
        self.runner_check: dict[str, float] | None = None
        self.thinking_switch = supports_thinking(target.tokenizer) if target.tokenizer is not None else False
        if settings.thinking and not self.thinking_switch:
            logger.warning("--thinking on has no effect: the target's chat template has no thinking switch")

    def use_temperature(self, temperature: float) -> None:
        """Decode at `temperature` from the next set on. The engines are built again (a CUDA graph holds its
        sampling step), around the same target runner and its caches; the runner check is not repeated."""
        if temperature == self.settings.temperature:
            return
        self.settings = replace(self.settings, runtime=replace(self.settings.runtime, temperature=temperature))
        if self.engines is not None:
            self._spare_runner = self.engines.target_only.runner
        self.engines, self.target_cache = None, None

    def _engine_config(self, block_size: int, max_length: int) -> EngineConfig:
        return replace(self.settings.runtime, block_size=block_size, max_length=max_length)

    def reserve(self, prompt_sets: list[PromptSet]) -> None:
        """Build the engines once, large enough for every request of these sets: the longest conversation
        with each earlier answer at its full length. A later set or turn that outgrew the caches would
        otherwise rebuild them, which on a GPU means compiling and capturing both engines again."""
        with self.phases.phase("prompts/reserve"):  # every conversation rendered once to size the caches
            longest = self._longest_request(prompt_sets)
        if longest is None:
            return
        need, first = longest
        if len(first.ids) + self.settings.max_new_tokens + self.settings.block_size <= self.context_limit:
            self._get_engines(first, need)

    def _longest_request(self, prompt_sets: list[PromptSet]) -> tuple[int, Request] | None:
        """(cache positions the longest conversation needs, its first request), or None for no conversation."""
        budget = self.settings.max_new_tokens + self.settings.block_size
        longest: tuple[int, Request] | None = None
        for prompt_set in prompt_sets:
            for index, conversation in enumerate(prompt_set.conversations):
                if not conversation.turns:
                    continue
                messages = list(conversation.prefix)
                for turn in conversation.turns[:-1]:
                    messages += [{"role": "user", "content": turn}, {"role": "assistant", "content": ""}]
                messages.append({"role": "user", "content": conversation.turns[-1]})
                answers = (len(conversation.turns) - 1) * (self.settings.max_new_tokens + RETOKENIZE_MARGIN)
                need = len(prompt_ids(self.target.tokenizer, messages, self.settings.thinking)) + answers + budget
                need = min(need, self.context_limit)  # longer requests are skipped, not decoded
                if longest is None or need > longest[0]:
                    first = list(conversation.prefix) + [{"role": "user", "content": conversation.turns[0]}]
                    ids = prompt_ids(self.target.tokenizer, first, self.settings.thinking)
                    longest = (need, Request(index, 0, first, ids))
        return longest

    @property
    def checks_lossless(self) -> bool:
        return self.settings.temperature == 0 and self.settings.lossless_check

    def _new_engine(self, draft: DFlashDraftModel | None, config: EngineConfig,
                    runner: StaticTarget | HFCacheTarget | None = None,
                    refuse_drafts: bool = False) -> DecodeEngine:
        return DecodeEngine(self.target, draft, config, runner=runner, refuse_drafts=refuse_drafts)

    def _get_engines(self, first: Request, need: int) -> Engines:
        """Engines whose static caches hold `need` positions; rebuilt (and recaptured) only to grow."""
        if self.engines is not None and self.engines.target_only.runner.max_length >= need:
            return self.engines
        self.engines = None  # free the old caches first
        max_length = -(-need // 256) * 256
        drafted_config = self._engine_config(self.settings.block_size, max_length)
        with self.phases.phase("warm_up/build"):  # static caches and buffers
            # The last engines' runner is taken again when its caches are long enough (another temperature).
            runner, self._spare_runner = self._spare_runner, None
            # its runner is dflash's too: its state rings (hybrid targets) must take back dflash's whole block
            baseline_config = replace(self._engine_config(1, max_length), runner_step_tokens=self.settings.block_size)
            baseline = self._new_engine(None, baseline_config, runner=runner)
            dflash = self._new_engine(self.draft, drafted_config, runner=baseline.runner)
        if self.runner_check is None:
            with self.phases.phase("warm_up/runner_check"):
                self.runner_check = baseline.runner.compare_with_hf(first.ids)
        self._warm_up(baseline, first, "target_only")
        self._warm_up(dflash, first, "dflash")
        check = None
        if self.checks_lossless:
            # Built after dflash has settled its compilation (a compiler failure may have turned it off, or the
            # shared runner's attention to SDPA): the check must run dflash's very forward, at its batch size.
            check = self._new_engine(self.draft, replace(drafted_config, compile=dflash.uses_compile),
                                     runner=baseline.runner, refuse_drafts=True)
            self._warm_up(check, first, "lossless_check")
        self.engines = Engines(baseline, dflash, check)
        if self.settings.target_cache is not None:
            self.target_cache = TargetPassCache(self.settings.target_cache, target_identity(self.target, baseline.config))
        return self.engines

    def _warm_up(self, engine: DecodeEngine, first: Request, name: str) -> None:
        """Untimed by the speed figures: kernel compilation, graph capture (at the engine's batch shape), the
        allocator; timed apart as warm_up/<name>, since compiling may well take longer than the decoding."""
        with self.phases.phase(f"warm_up/{name}"):
            engine.prepare()
            # A whole first request warms what compiles or is captured per shape (GPU: each prefill length's
            # graphs, the allocator). An eager CPU engine has nothing of the kind, and decoding the request
            # there took as long as a tenth of a short eval.
            if engine.device.type == "cuda" or engine.uses_compile:
                engine.generate([first.ids])

    def _requests(self, prompt_set: PromptSet, histories: list[list[dict[str, str]]], alive: list[int],
                  turn: int) -> tuple[list[Request], int]:
        requests, too_long = [], 0
        budget = self.settings.max_new_tokens + self.settings.block_size
        for index in alive:
            turns = prompt_set.conversations[index].turns
            if turn >= len(turns):
                continue
            messages = histories[index] + [{"role": "user", "content": turns[turn]}]
            ids = prompt_ids(self.target.tokenizer, messages, self.settings.thinking)
            if len(ids) + budget > self.context_limit:
                too_long += 1
                continue
            requests.append(Request(index, turn, messages, ids))
        return requests, too_long

    def _pass(self, engine: DecodeEngine, requests: list[Request], label: str,
              phase: str) -> tuple[list[RequestOutput], RunStats]:
        """`phase`: where its wall time goes, prefill and host work included (its RunStats exclude prefill)."""
        progress = PassProgress(self.progress, label, len(requests))
        with self.phases.phase(phase):
            return engine.generate([r.ids for r in requests], on_finish=progress.finished)

    @torch.no_grad()
    def evaluate_set(self, prompt_set: PromptSet, name: str | None = None) -> dict[str, Any]:
        """`name`: the set's key in its phases and progress lines (default: the set's own name)."""
        name = name or prompt_set.name
        histories = [list(c.prefix) for c in prompt_set.conversations]
        alive = list(range(len(prompt_set.conversations)))
        requests_done: list[tuple[Request, RequestOutput | None, RequestOutput]] = []
        answers: list[tuple[list[int], list[int]]] = []  # (prompt, the target's own answer) per request
        totals = {"target": PassTotals(), "dflash": PassTotals(), "lossless_check": PassTotals()}
        too_long, turn, reused = 0, 0, 0
        while alive:
            with self.phases.phase(f"prompts/{name}"):  # chat templates and tokenisation
                requests, skipped = self._requests(prompt_set, histories, alive, turn)
            too_long += skipped
            if not requests:
                break
            need = max(len(r.ids) for r in requests) + self.settings.max_new_tokens + self.settings.block_size
            engines = self._get_engines(requests[0], need)
            label = f"{name}{f' turn {turn + 1}' if turn else ''}"
            alone, stats, was_stored = self._target_only_pass(engines.target_only, requests, label, name)
            totals["target"].add(stats)
            reused += was_stored
            drafted, stats = self._pass(engines.dflash, requests, f"{label} dflash", f"decode/{name}/dflash")
            totals["dflash"].add(stats)
            checked: list[RequestOutput | None] = [None] * len(requests)
            if engines.lossless_check is not None:
                checked, stats = self._pass(engines.lossless_check, requests, f"{label} lossless check",
                                            f"decode/{name}/lossless_check")
                totals["lossless_check"].add(stats)
            for request, own, out, reference in zip(requests, alone, drafted, checked, strict=True):
                answers.append((request.ids, own.tokens))
                answer = self.target.tokenizer.decode(own.tokens, skip_special_tokens=True)
                histories[request.conversation] = request.messages + [{"role": "assistant", "content": answer}]
                requests_done.append((request, reference, out))
            alive, turn = [r.conversation for r in requests], turn + 1
        summary = self._summarise(prompt_set, requests_done, totals, too_long)
        # Every turn's target-alone pass read from the cache: the speedup compares two processes.
        summary["target_only_reused"] = bool(turn) and reused == turn
        return {**summary, **self._teacher_forced(answers, name)}

    def _target_only_pass(self, engine: DecodeEngine, requests: list[Request], label: str,
                          name: str) -> tuple[list[RequestOutput], RunStats, bool]:
        """Pass (1), read from the target cache when it holds these prompts; decoded (and stored) otherwise.
        The third value says whether it was read."""
        prompts = [r.ids for r in requests]
        stored = self.target_cache.load(prompts) if self.target_cache is not None else None
        if stored is not None:
            return *stored, True
        outputs, stats = self._pass(engine, requests, f"{label} target only", f"decode/{name}/target_only")
        if self.target_cache is not None:
            self.target_cache.store(prompts, outputs, stats)
        return outputs, stats, False

    def _teacher_forced(self, answers: list[tuple[list[int], list[int]]], name: str) -> dict[str, Any]:
        """Over every answer at once after the decode passes (it reads none of their state), timed as one phase."""
        if not self.settings.teacher_forced:
            return {"teacher_forced_slot_accuracy": None, "teacher_forced_acceptance_length": None}
        with self.phases.phase(f"teacher_forced/{name}"):
            teacher_forced = TeacherForcedAccuracy(self.target, self.draft, self.settings.block_size)
            for prompt, answer in answers:
                teacher_forced.add(prompt, answer)
            return teacher_forced.result()

    def _summarise(self, prompt_set: PromptSet, done: list[tuple[Request, RequestOutput | None, RequestOutput]],
                   totals: dict[str, PassTotals], too_long: int) -> dict[str, Any]:
        """`done`: (request, output of the lossless check's pass or None, output with the drafter)."""
        if not done:
            raise ValueError(f"no prompt of {prompt_set.name} fits the target's context of {self.context_limit} "
                             f"tokens with --max-new-tokens {self.settings.max_new_tokens}; lower it")
        checked = self.checks_lossless
        mismatches = [_mismatch(request, reference, out) for request, reference, out in done
                      if reference is not None and reference.tokens != out.tokens]
        with_draft, alone = totals["dflash"].tokens_per_s, totals["target"].tokens_per_s
        return {
            "source": prompt_set.source,
            **({"note": prompt_set.note} if prompt_set.note else {}),
            "conversations": len({request.conversation for request, _, _ in done}),
            "requests": len(done),
            "skipped_rows": prompt_set.skipped_rows,
            "skipped_too_long": too_long,
            **acceptance_metrics([out.acceptance_lengths for _, _, out in done], self.settings.block_size),
            "acceptance_length_by_turn": _tau_by_turn(done),
            "acceptance_length_by_category": _tau_by_category(done, prompt_set),
            "acceptance_length_per_request": _tau_per_request(done),
            "lossless": (not mismatches) if checked else None,
            "lossless_requests": len(done) - len(mismatches) if checked else None,
            "mismatches": mismatches[:MAX_LISTED_MISMATCHES],
            "decode_seconds_lossless_check": totals["lossless_check"].decode_s if checked else None,
            "new_tokens_with_draft": totals["dflash"].tokens,
            "new_tokens_target_only": totals["target"].tokens,
            "decode_seconds_with_draft": totals["dflash"].decode_s,
            "decode_seconds_target_only": totals["target"].decode_s,
            "tokens_per_s_with_draft": with_draft,
            "tokens_per_s_target_only": alone,
            "speedup": with_draft / alone if with_draft and alone else None,
            "skipped": _skipped_text(prompt_set.skipped_rows, too_long),
        }


def _tau_by_turn(done: list[tuple[Request, RequestOutput | None, RequestOutput]]) -> list[float | None]:
    """τ of the requests of each turn (first, second, ...): a later turn's context holds the target's own
    earlier answers, which a drafter trained on first turns alone has rarely seen."""
    turns = max(request.turn for request, _, _ in done) + 1
    return [running_tau([out.acceptance_lengths for request, _, out in done if request.turn == turn])
            for turn in range(turns)]


def _tau_per_request(done: list[tuple[Request, RequestOutput | None, RequestOutput]]) -> list[list[Any]]:
    """[conversation, turn, τ] of every request (τ None without a cycle): what a paired comparison of two
    drafters on the same prompts resamples (uncertainty.py)."""
    return [[request.conversation, request.turn, running_tau([out.acceptance_lengths])] for request, _, out in done]


def _tau_by_category(done: list[tuple[Request, RequestOutput | None, RequestOutput]],
                     prompt_set: PromptSet) -> dict[str, float | None] | None:
    """τ of the requests of each category of the set (MT-Bench's eight), in the order they first appear;
    None for a set whose rows name no category."""
    categories = [prompt_set.conversations[request.conversation].category for request, _, _ in done]
    if not any(categories):
        return None
    names = list(dict.fromkeys(name or "uncategorised" for name in categories))
    return {name: running_tau([out.acceptance_lengths for (_, _, out), category in zip(done, categories, strict=True)
                               if (category or "uncategorised") == name]) for name in names}


def _mismatch(request: Request, reference: RequestOutput, drafted: RequestOutput) -> dict[str, int]:
    """Where the drafted output first leaves the lossless check's (an index past the shorter output when
    one is a prefix of the other: a stop or length difference, not a token)."""
    pairs = zip(reference.tokens, drafted.tokens, strict=False)
    first = next((i for i, (a, b) in enumerate(pairs) if a != b), min(len(reference.tokens), len(drafted.tokens)))
    return {"conversation": request.conversation, "turn": request.turn, "first_divergence": first,
            "target_tokens": len(reference.tokens), "dflash_tokens": len(drafted.tokens)}


def _skipped_text(malformed: int, too_long: int) -> str:
    parts = [f"{malformed} malformed rows"] * bool(malformed) + [f"{too_long} prompts longer than the context"] * bool(
        too_long)
    return ", ".join(parts)
