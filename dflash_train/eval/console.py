"""Console output of an evaluation: a progress bar per pass with running τ and tokens/s, and one summary
table."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from dflash_train.eval.metrics import running_tau
from dflash_train.eval.phases import timing_line
from dflash_train.eval.uncertainty import format_interval
from dflash_train.runtime.state import RequestOutput

PLAIN_LINES_PER_PASS = 10  # a line every 10 % of a pass's requests ...
PLAIN_LINE_MAX_REQUESTS = 20  # ... or every 20 requests, whichever comes first


class PassProgress:
    """Progress of one pass (a dataset round through one engine), updated as requests finish: a live bar on a
    terminal; where output goes to a file (rich draws nothing there until the run ends), plain lines: one as
    the pass starts and one every 10 % of its requests (at most 20 apart) with τ and tokens/s so far."""

    def __init__(self, progress: Progress | None, label: str, total: int) -> None:
        self.progress, self.label, self.total, self.lengths, self.tokens = progress, label, total, [], 0
        self.started = time.perf_counter()
        self.task = progress.add_task(label, total=total, tau="", rate="") if progress else None
        self.plain = progress is not None and not progress.console.is_terminal
        self.every = max(1, min(PLAIN_LINE_MAX_REQUESTS, -(-total // PLAIN_LINES_PER_PASS)))
        if self.plain:
            print(f"eval {label}: {total} requests", flush=True)

    def finished(self, _index: int, output: RequestOutput) -> None:
        self.lengths.append(output.acceptance_lengths)
        self.tokens += len(output.tokens)
        if self.progress is None:
            return
        tau = running_tau(self.lengths)
        seconds = max(time.perf_counter() - self.started, 1e-9)
        rate = self.tokens / seconds
        self.progress.update(self.task, advance=1, tau=f"τ {tau:.2f}" if tau else "", rate=f"{rate:,.0f} tok/s")
        done = len(self.lengths)
        if self.plain and (done % self.every == 0 or done == self.total):
            running = f", τ {tau:.2f}" if tau else ""
            print(f"eval {self.label}: {done}/{self.total} requests, {rate:,.0f} tok/s{running} ({seconds:.0f} s)",
                  flush=True)


@contextmanager
def progress_bars(enabled: bool = True) -> Iterator[Progress | None]:
    if not enabled:
        yield None
        return
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[tau]}"),
               TextColumn("{task.fields[rate]}"), TimeElapsedColumn())
    with Progress(*columns, transient=False) as progress:
        yield progress


def _fmt(value: Any, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def summary_table(report: dict[str, Any]) -> Table:
    settings = report["settings"]
    # A sweep's main table is its lowest temperature's (the report's own figures).
    at = f", temperature {settings['temperature']:g}" if "temperature_sweep" in report else ""
    table = Table(title=f"DFlash eval: {report['target']} + {report['draft']} (block {settings['block_size']}{at})")
    table.add_column("dataset", no_wrap=True)
    for column in ("reqs", "τ", "τ 95% CI", "τ/cycle", "τ̂ teacher-forced", "lossless", "tok/s draft", "tok/s target",
                   "speedup"):
        table.add_column(column, justify="right", no_wrap=True)
    for name, row in report["datasets"].items():
        mark = lossless_mark(row)
        table.add_row(name, str(row["requests"]), _fmt(row["acceptance_length"], ".2f"),
                      format_interval(row.get("acceptance_length_ci95")), _fmt(row["acceptance_length_cycle_weighted"], ".2f"),
                      _fmt(row.get("teacher_forced_acceptance_length"), ".2f"), mark,
                      _fmt(row["tokens_per_s_with_draft"], ",.1f"), _fmt(row["tokens_per_s_target_only"], ",.1f"),
                      _fmt(row["speedup"], ".2f") + "×")
    return table


def sweep_table(report: dict[str, Any]) -> Table | None:
    """τ, its interval, its share of the greedy τ and the speedup of every prompt set at every temperature of a
    sweep; None for a report of one temperature."""
    sweep = report.get("temperature_sweep")
    if not sweep:
        return None
    table = Table(title="τ against temperature")
    table.add_column("dataset", no_wrap=True)
    for column in ("temperature", "τ", "τ 95% CI", "τ / greedy τ", "lossless", "speedup"):
        table.add_column(column, justify="right", no_wrap=True)
    for name, summary in sweep["summary"].items():
        fractions = summary["fraction_of_greedy"] or [None] * len(sweep["temperatures"])
        for i, temperature in enumerate(sweep["temperatures"]):
            row = sweep["runs"][i]["datasets"][name]
            table.add_row(name if i == 0 else "", f"{temperature:g}", _fmt(summary["acceptance_length"][i], ".2f"),
                          format_interval(summary["acceptance_length_ci95"][i]), _fmt(fractions[i], ".0%"),
                          lossless_mark(row), _fmt(summary["speedup"][i], ".2f") + "×")
    return table


def wide_console() -> Console:
    """A terminal's own width; 200 columns where output goes to a file or pipe (rich would assume 80 and cut
    table cells short, leaving a job log without its numbers)."""
    console = Console()
    return console if console.is_terminal else Console(width=200)


def print_summary(report: dict[str, Any], paths: list[str]) -> None:
    console = wide_console()
    console.print(summary_table(report))
    sweep = sweep_table(report)
    if sweep is not None:
        console.print(sweep)
    for name, row in report["datasets"].items():
        if row.get("skipped"):
            console.print(f"{name}: skipped {row['skipped']}")
    timing = timing_line(report)
    if timing is not None:  # older reports have no phase times
        console.print(timing, highlight=False)
    console.print("written: " + ", ".join(paths))


def lossless_mark(row: dict[str, Any]) -> str:
    """yes; NO (m/n): only m of n requests kept the target's output; n/a: sampled, or no check was run;
    ties (k): an older report's k divergences at bf16 near-ties (`lossless_failed`)."""
    if row["lossless"] is None:
        return "n/a"
    if row["lossless"]:
        return "yes"
    if not lossless_failed(row):
        return f"ties ({row['divergences_at_ties']})"
    return f"NO ({row['lossless_requests']}/{row['requests']})"


def lossless_failed(row: dict[str, Any]) -> bool:
    """Whether the check ran and some output diverged. Reports written before the check was exact compared
    against one-token decoding and excused divergences at bf16 near-ties (`lossless_up_to_ties`); recipe
    summaries and a resumed demo still read them."""
    return row["lossless"] is False and not row.get("lossless_up_to_ties")
