"""The throughput file regenerate rewrites after every shard (regen_stats.json), what prepare and a rerun make of
it, and the line a run stopped by SIGTERM or Ctrl-C prints from it. Answers come from a back end that needs no
model; generation itself is tested in tests/regeneration/test_regenerate.py."""

from __future__ import annotations

import json
import os
import signal
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest

from dflash_train.commands.regenerate import Stopped, _claim_out, reporting_stops
from dflash_train.data.chat import ChatTokenizer
from dflash_train.prompts.corpora import CorpusSpec, open_corpus
from dflash_train.regeneration.regenerate import (
    STATS_FILE,
    Completion,
    PromptRow,
    RegenerateConfig,
    latest_stats,
    regenerate,
    stats_path,
)
from dflash_train.shards import regenerated_files
from tests.helpers.regeneration import WORDS
from tests.helpers.tiny_models import make_tiny_tokenizer


class Counting:
    """Answers row ``i`` with ``i + 1`` tokens, cut by the length limit every third row; ``on_call`` runs before
    each unit is answered (the unit's number from 1)."""

    def __init__(self, on_call: Callable[[int], None] | None = None) -> None:
        self.calls, self.on_call = 0, on_call

    def complete(self, rows: list[PromptRow], seed: int) -> list[Completion]:
        self.calls += 1
        if self.on_call is not None:
            self.on_call(self.calls)
        return [Completion("yes", "length" if r.row_id % 3 == 0 else "stop", r.row_id + 1) for r in rows]


class Killed(Exception):
    pass


def write_prompts(path: Path, n: int = 10) -> Path:
    rows = [{"prompt": " ".join(WORDS[(i * 3 + k) % len(WORDS)] for k in range(1 + i % 5)) + " ?"} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def config(source: Path, started: float | None = None) -> RegenerateConfig:
    extra = {} if started is None else {"started": started}
    return RegenerateConfig([CorpusSpec(str(source))], batch_size=3, settings={"target": "tiny"}, **extra)


def run(source: Path, out: Path, backend: Counting | None = None,
        progress: Callable[[int, int, float], None] | None = None, started: float | None = None) -> dict:
    return regenerate(backend or Counting(), ChatTokenizer(make_tiny_tokenizer()), config(source, started), out,
                      progress=progress)


def shard_rows(out: Path) -> list[dict]:
    return [json.loads(line) for path in regenerated_files(out) for line in path.read_text().splitlines()]


def read_stats(out: Path) -> dict:
    return json.loads((out / STATS_FILE).read_text())


def test_the_stats_count_every_shard_and_are_rewritten_after_each(tmp_path: Path) -> None:
    source, out, seen = write_prompts(tmp_path / "prompts.jsonl"), tmp_path / "out", []

    def progress(done: int, total: int, rate: float) -> None:
        seen.append(read_stats(out)["this_run"]["units"])

    started = time.time() - 5.0  # five seconds of start-up before decoding
    assert run(source, out, progress=progress, started=started)["complete"]
    assert seen == [0, 1, 2, 3, 4]  # written at the start, then after every shard
    stats, rows = read_stats(out), shard_rows(out)
    for tally in (stats["this_run"], stats["all_shards"]):
        assert tally["units"] == 4 and tally["rows"] == 10
        assert tally["answer_tokens"] == sum(r["completion_tokens"] for r in rows) == sum(range(1, 11))
        assert tally["prompt_tokens"] == sum(r["prompt_tokens"] for r in rows)
        assert tally["finish_reasons"] == dict(Counter(r["finish_reason"] for r in rows)) == {"length": 4, "stop": 6}
    assert stats["num_units"] == 4 and stats["command_seconds"] >= stats["decoding_seconds"] + 5.0
    assert stats["answer_tokens_per_second_overall"] < stats["answer_tokens_per_second_decoding"]
    assert stats_path(out, 1, 2).name == "regen_stats.rank1.json"  # several ranks: one file each
    run(source, out)  # finished already: nothing decoded, the figures of the run that did are kept
    assert read_stats(out) == stats


def test_prepare_and_a_rerun_ignore_the_stats_file(tmp_path: Path) -> None:
    source, out = write_prompts(tmp_path / "prompts.jsonl"), tmp_path / "out"
    run(source, out)
    assert (out / STATS_FILE).is_file() and open_corpus(CorpusSpec(str(out))).size == 10
    chat = ChatTokenizer(make_tiny_tokenizer())
    _claim_out(out, chat, config(source), overwrite=False)  # resumed: the folder is still regenerate's own
    other = RegenerateConfig([CorpusSpec(str(source))], batch_size=2, settings={"target": "tiny"})
    _claim_out(out, chat, other, overwrite=True)  # other settings: the old run is removed, its figures with it
    assert not regenerated_files(out) and not (out / STATS_FILE).exists()
    regenerate(Counting(), chat, other, out)
    assert read_stats(out)["all_shards"]["units"] == 5  # rewritten by the new run


def test_a_resumed_run_rates_its_own_units_and_totals_all_shards(tmp_path: Path) -> None:
    source, out = write_prompts(tmp_path / "prompts.jsonl"), tmp_path / "out"

    def kill(done: int, total: int, rate: float) -> None:
        if done == 2:
            raise Killed

    with pytest.raises(Killed):
        run(source, out, progress=kill)
    before = sum(r["completion_tokens"] for r in shard_rows(out))
    assert read_stats(out)["this_run"]["answer_tokens"] == before  # the figures of the last shard survive
    run(source, out)
    stats, rows = read_stats(out), shard_rows(out)
    assert stats["this_run"]["units"] == 2 and stats["all_shards"]["units"] == 4
    assert stats["this_run"]["answer_tokens"] == sum(r["completion_tokens"] for r in rows) - before
    assert stats["all_shards"]["answer_tokens"] == sum(r["completion_tokens"] for r in rows)
    assert stats["all_shards"]["rows"] == 10 and stats["this_run"]["rows"] == len(rows) - 6


@pytest.mark.parametrize(("signum", "code"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_stopped_run_prints_its_totals_and_keeps_its_shards(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                               signum: int, code: int) -> None:
    source, out, started = write_prompts(tmp_path / "prompts.jsonl"), tmp_path / "out", time.time()

    def stop_at_second_unit(call: int) -> None:
        if call == 2:
            os.kill(os.getpid(), signum)

    def work() -> int:
        run(source, out, Counting(stop_at_second_unit), started=started)
        return 0

    before = signal.getsignal(signal.SIGTERM)
    # Ctrl-C reaches a command through Python's own SIGINT handler; a library loaded by an earlier test in this
    # process may have replaced it (the command's run then ended with 0), so the test sets it as a fresh
    # process has it.
    interrupt = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        assert reporting_stops(work, out, 0, 1, started) == code
    finally:
        signal.signal(signal.SIGINT, interrupt)
    assert signal.getsignal(signal.SIGTERM) == before  # the command's handler is gone afterwards
    line = capsys.readouterr().out.strip().splitlines()[-1]
    tokens = sum(r["completion_tokens"] for r in shard_rows(out))
    assert line.startswith(f"regenerate: stopped after 1 of 4 units: {tokens} answer tokens in ")
    assert line.endswith("while decoding); the finished shards are kept — prepare them with --allow-unfinished")
    assert len(regenerated_files(out)) == 1
    assert open_corpus(CorpusSpec(str(out), allow_unfinished=True)).size == 3
    assert latest_stats(out, 0, 1, started + 1.0) is None  # another command's file is not this one's


class CompilationError(Exception):
    """Stands for a compiler's error (Triton's CompilationError, torch.compile's BackendCompilerFailed), which
    wraps whatever was raised while it compiled, a signal's Stopped or a Ctrl-C included."""


def raise_wrapped(inner: BaseException, how: str) -> None:
    """Raise ``inner`` wrapped as a compiler wraps it: as the cause (``raise ... from``), as the context (raised
    while handling it), or two wrappers deep."""
    try:
        raise inner
    except BaseException as caught:
        if how == "cause":
            raise CompilationError("at 12:4: compilation failed") from caught
        if how == "context":
            raise CompilationError("at 12:4: compilation failed")  # noqa: B904 -- the implicit chain is the case
        try:
            raise CompilationError("at 12:4: compilation failed") from caught
        except CompilationError:
            raise RuntimeError("backend compiler failed")  # noqa: B904 -- the implicit chain is the case


@pytest.mark.parametrize("how", ["cause", "context", "nested"])
@pytest.mark.parametrize(("stop", "code"), [(lambda: Stopped(int(signal.SIGTERM)), 143), (KeyboardInterrupt, 130)],
                         ids=["sigterm", "ctrl-c"])
def test_a_stop_wrapped_by_a_compiler_is_reported_as_a_stop(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], how: str, stop: Callable[[], BaseException], code: int
) -> None:
    """A SIGTERM (or Ctrl-C) that arrives while Triton or torch.compile compiles reaches the command inside the
    compiler's error: the run ends with the stopped line and 128 + the signal, not a traceback."""
    def work() -> int:
        raise_wrapped(stop(), how)
        return 0

    before = signal.getsignal(signal.SIGTERM)
    assert reporting_stops(work, tmp_path / "out", 0, 1, time.time()) == code
    assert signal.getsignal(signal.SIGTERM) == before
    assert capsys.readouterr().out.strip() == (
        "regenerate: stopped before any shard was written by this run; "
        "the finished shards are kept — prepare them with --allow-unfinished")


def test_an_unrelated_wrapped_error_is_raised_unchanged(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A compiler's error with no stop in its chain is a real failure: it propagates as it was raised, and a
    chain that loops back on itself is looked through once."""
    raised: list[BaseException] = []

    def work() -> int:
        try:
            raise_wrapped(ValueError("bad block size"), "nested")
        except RuntimeError as error:
            wrapper = error.__context__
            assert wrapper is not None
            wrapper.__context__ = error  # a cycle: the chain leads back to where it starts
            raised.append(error)
            raise
        return 0

    with pytest.raises(RuntimeError) as caught:
        reporting_stops(work, tmp_path / "out", 0, 1, time.time())
    assert caught.value is raised[0]
    assert capsys.readouterr().out == ""


class WindowedBackend:
    """Three units in flight; each takes one second of a fake clock once waited for, answering 10 tokens a row."""

    window = 3

    def __init__(self, clock: list[float]) -> None:
        self.clock = clock

    def start(self, rows: list[PromptRow], seed: int) -> Callable[[], list[Completion]]:
        def wait() -> list[Completion]:
            self.clock[0] += 1.0
            return [Completion("a b", "stop", 10) for _ in rows]
        return wait


def test_the_progress_rate_is_each_units_own_time_not_its_wait_in_the_window(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Units finish one a second, 40 tokens each: every rate the bar shows is 40 tokens/s, though the later
    units were submitted up to three seconds before they finished."""
    from dflash_train.regeneration import regenerate as module

    clock = [100.0]
    monkeypatch.setattr(module.time, "perf_counter", lambda: clock[0])
    rows = [PromptRow(i, [{"role": "user", "content": "q"}], [1, 2], "src", i) for i in range(24)]
    rates: list[float] = []
    module.run_units(WindowedBackend(clock), rows, [list(range(k, k + 4)) for k in range(0, 24, 4)], tmp_path,
                     0, 1, seed=0, progress=lambda done, total, rate: rates.append(rate) if done else None)
    assert rates == [40.0] * 6
