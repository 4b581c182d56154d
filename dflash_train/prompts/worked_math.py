"""Generated math problems rewritten to ask for a worked solution (the ``:steps`` option of the generated sources).

reasoning-gym's generators phrase most problems for answer checking: "Give only the result as your final
answer.", "Only reply with the final value.", "Answer with a number." A target asked that answers in a
few tokens: on one speedrun 42 % of its math answers were too short to train on (docs/results.md), and the rest
taught the drafter a style that math prompts asking for reasoning never see (held-out τ̂ 5.48 on its own
math, τ 2.75 decoding step-by-step math it never trained on). Here such answer-format sentences are dropped
and the problem asks for steps and a boxed result instead, so the target writes the kind of solution a
user asks for.

The request is worded differently from the one the project's math eval set appends, so that no training
prompt shares a 13-word sequence with an eval prompt (`prepare` would drop it as contaminated).
"""

from __future__ import annotations

import re

STEPS_REQUEST = "Solve it step by step, then give the final answer in \\boxed{}."

# A sentence that only says how to format the answer: it mentions "only", a final answer/value or units,
# or asks for a bare number, and holds no digit (sentences with digits carry the problem's data, e.g.
# "Return your final answer correct to 3 significant figures.", and are kept).
_FORMAT_ONLY = re.compile(
    r"\b(only|final answer|final value|units|answer with a number|as your answer)\b", re.IGNORECASE)
# Where a sentence ends inside a line: after . ? ! and before a space or a capital ("...degrees)?Return only").
_SENTENCE_END = re.compile(r"(?<=[.?!])\s+|(?<=[.?!])(?=[A-Z])")


def worked_solution_prompt(problem: str) -> str:
    """``problem`` without its answer-format sentences, followed by the request for a worked solution."""
    lines = []
    for line in problem.strip().splitlines():
        sentences = [s for s in _SENTENCE_END.split(line.strip()) if s and not _format_only(s)]
        if sentences or not line.strip():  # keep the problem's paragraph breaks, drop emptied lines
            lines.append(" ".join(sentences))
    text = re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()
    return f"{text}\n\n{STEPS_REQUEST}"


def _format_only(sentence: str) -> bool:
    return not any(c.isdigit() for c in sentence) and bool(_FORMAT_ONLY.search(sentence))
