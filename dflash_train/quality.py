"""Counting what a data step kept and dropped, and printing it as one summary table: shared by every stage
that reads records (`pack`, `regenerate`, `self-prompt`, `prepare`)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

SHOWN_LOCATIONS = 3  # per drop reason, in the summary
EXCLUDED_SOURCE = "excluded_source"  # the drop reason of records whose source prepare --exclude-source names
OVER_SOURCE_CAP = "over_source_cap"  # records of a source past the count prepare --cap-source allows it
CHOSEN_DROPS = (EXCLUDED_SOURCE, OVER_SOURCE_CAP)  # drops a flag asked for: counted, never warned about
WARN_DROPPED_SHARE = 0.05  # a reason that drops more of the rows read gets a warning line in the summary

# What to do about a reason that drops many rows (the summary's warning line says it).
DROP_HINTS = {
    "template_not_prefix_stable": "the chat template never renders their answers after the prompt the model "
                                  "answered; check the target's chat template (`prepare --show 3` shows rows)",
    "template_rejected": "the chat template refused them (system message or role order it does not accept)",
    "too_few_supervised_tokens": "their answers are shorter than 2 x --block-size tokens; a smaller --block-size "
                                 "keeps them",
    "too_long": "their prompt alone fills --max-length; raise it",
    "special_token_text": "their text contains the tokenizer's special tokens",
    "missing_mapped_column": "they lack a column --columns names; check the mapping against the data's columns",
}


@dataclass
class DataReport:
    """Rows read, kept, and dropped by reason; plus free-form totals (tokens, truncations, ...)."""

    title: str
    read: int = 0
    kept: int = 0
    dropped: Counter[str] = field(default_factory=Counter)
    totals: Counter[str] = field(default_factory=Counter)

    # where the first few rows of each drop reason came from, e.g. "chats.jsonl line 7", so they can be found
    dropped_at: dict[str, list[str]] = field(default_factory=dict)
    # per source label: "kept" and each drop reason, so a mix shows which of its sources it loses rows of
    by_source: dict[str, Counter[str]] = field(default_factory=dict)
    # warnings found outside the counts (a flag naming a source no record has), in the summary's warning lines
    notes: list[str] = field(default_factory=list)

    def note_unmatched_sources(self, flag: str, names: Iterable[str]) -> None:
        """A warning for each of `names` (sources `flag` names) that labels no record read: a typo there
        excludes or caps nothing."""
        seen = ", ".join(sorted(self.by_source)) or "none"
        for name in sorted(set(names) - set(self.by_source)):
            self.notes.append(f"WARNING: {flag} {name} names no source of the data (its sources: {seen}); it "
                              "changed nothing")

    def count_source(self, source: str, outcome: str) -> None:
        """One record of `source` kept (`outcome` "kept") or dropped for the reason `outcome`."""
        self.by_source.setdefault(source, Counter())[outcome] += 1

    def drop(self, reason: str, where: str | None = None) -> None:
        self.dropped[reason] += 1
        shown = self.dropped_at.setdefault(reason, [])
        if where is not None and len(shown) < SHOWN_LOCATIONS:
            shown.append(where)

    def as_dict(self) -> dict[str, Any]:
        counted = {"read": self.read, "kept": self.kept, "dropped": dict(sorted(self.dropped.items())),
                   **dict(sorted(self.totals.items()))}
        if len(self.by_source) > 1:
            counted["by_source"] = {name: dict(sorted(c.items())) for name, c in sorted(self.by_source.items())}
        return counted

    def lines(self) -> list[str]:
        rows = [("rows read", self.read), ("rows kept", self.kept)]
        rows += [(f"dropped: {reason}", n) for reason, n in sorted(self.dropped.items())]
        rows += sorted(self.totals.items())
        width = max(len(name) for name, _ in rows)
        table = [f"  {name:<{width}}  {value:>12,}{self._where(name)}" for name, value in rows]
        return [self.title, *table, *self._source_lines(), *self.warnings()]

    def _source_lines(self) -> list[str]:
        """With two sources or more: per source, rows kept and the share each drop reason took."""
        if len(self.by_source) < 2:
            return []
        lines = ["  by source:"]
        width = max(len(name) for name in self.by_source)
        for name, counts in sorted(self.by_source.items()):
            total = sum(counts.values())
            drops = ", ".join(f"{reason} {n:,} ({n / total:.0%})" for reason, n in sorted(counts.items())
                              if reason != "kept")
            lines.append(f"    {name:<{width}}  kept {counts['kept']:,} of {total:,}" + (f"; {drops}" if drops else ""))
        return lines

    def warnings(self) -> list[str]:
        """A line for each drop reason that took more than ``WARN_DROPPED_SHARE`` of the rows read: a data or
        template problem is easy to miss in the table's counts."""
        lines = list(self.notes)
        for reason, n in sorted(self.dropped.items()):
            if reason in CHOSEN_DROPS:  # the user asked for these: no warning
                continue
            if self.read and n > WARN_DROPPED_SHARE * self.read:
                hint = f": {DROP_HINTS[reason]}" if reason in DROP_HINTS else ""
                lines.append(f"WARNING: {n:,} of {self.read:,} rows ({n / self.read:.0%}) dropped as {reason}{hint}")
        return lines

    def nothing_kept(self, what: str, sources: list[str]) -> str:
        """The one-line error of a step that kept no row: that the data was empty, or why every row was dropped,
        where the first ones were and what to do about it (the summary table is never printed then)."""
        where = ", ".join(sources)
        if not self.read:
            return f"no {what} in {where}: it holds no records (an empty file or folder); check --data"
        reasons = []
        for reason, n in sorted(self.dropped.items(), key=lambda item: -item[1]):
            found = self._where(f"dropped: {reason}").strip()
            hint = f": {DROP_HINTS[reason]}" if reason in DROP_HINTS else ""
            reasons.append(f"{reason} {n:,}" + (f" {found}" if found else "") + hint)
        return f"no usable {what} in {where}: all {self.read:,} read were dropped ({'; '.join(reasons)})"

    def _where(self, row: str) -> str:
        """`  (chats.jsonl line 3, 4, 5, ...)` after a drop reason's count: where its first rows were."""
        reason = row.removeprefix("dropped: ")
        shown = self.dropped_at.get(reason) if row.startswith("dropped: ") else None
        if not shown:
            return ""
        parts, previous = [], None
        for where in shown:
            prefix, _, number = where.rpartition(" ")
            parts.append(number if prefix and prefix == previous else where)
            previous = prefix
        more = ", ..." if self.dropped[reason] > len(shown) else ""
        return f"  ({', '.join(parts)}{more})"

    def print(self) -> None:
        print("\n".join(self.lines()))
