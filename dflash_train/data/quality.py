"""Counting what a data step kept and dropped, and printing it as one summary table."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any


@dataclass
class DataReport:
    """Rows read, kept, and dropped by reason; plus free-form totals (tokens, truncations, ...)."""

    title: str
    read: int = 0
    kept: int = 0
    dropped: Counter[str] = field(default_factory=Counter)
    totals: Counter[str] = field(default_factory=Counter)

    def drop(self, reason: str) -> None:
        self.dropped[reason] += 1

    def as_dict(self) -> dict[str, Any]:
        return {"read": self.read, "kept": self.kept, "dropped": dict(sorted(self.dropped.items())),
                **dict(sorted(self.totals.items()))}

    def lines(self) -> list[str]:
        rows = [("rows read", self.read), ("rows kept", self.kept)]
        rows += [(f"dropped: {reason}", n) for reason, n in sorted(self.dropped.items())]
        rows += sorted(self.totals.items())
        width = max(len(name) for name, _ in rows)
        return [self.title] + [f"  {name:<{width}}  {value:>12,}" for name, value in rows]

    def print(self) -> None:
        print("\n".join(self.lines()))
