"""Answers that end in a verbatim loop, cut to two turns of it (`prepare --trim-loops`).

A small target that runs into its token cap often repeats one phrase to the end: in a speedrun's regenerated
answers about a fifth stopped at the 512-token cap inside such a loop, and cutting them removes about a
quarter of all answer text (docs/results.md, 'Many answers end in a loop'). Every repetition costs training
compute and teaches the drafter nothing the first two do not (copying the period), and it crowds
the drafter's supervised positions with the easiest text there is. Only answers the cap stopped (or
regeneration's --stop-loops ended) are cut: an answer the target ended itself is kept whole. The cut answer stays unfinished (no end-of-turn supervised).

A tail loop is the shortest period p <= MAX_PERIOD whose copies, read back from the end, repeat at least
MIN_REPEATS times (a period whose text ends mid-copy is a rotation of itself, so a cap that cut a copy short
still counts); the answer keeps its text up to the end of the loop's KEEP-th copy.
"""

from __future__ import annotations

# A regenerated row's finish_reason when the target did not end the answer itself: the token cap stopped it
# ("length"), or regeneration's --stop-loops ended it inside a verbatim loop ("loop"). Such an answer is
# trained as unfinished (no end of turn supervised) and is what --trim-loops may cut.
UNFINISHED = ("length", "loop")
MAX_PERIOD = 120  # characters: a repeated line or sentence, not a repeated paragraph
MIN_REPEATS = 3
KEEP = 2


def trim_tail_loop(text: str, max_period: int = MAX_PERIOD, min_repeats: int = MIN_REPEATS,
                   keep: int = KEEP) -> str:
    """`text` cut to `keep` copies of the loop it ends in, or `text` itself when it ends in none."""
    for period in range(1, min(max_period, len(text) // min_repeats) + 1):
        start = _loop_start(text, period)
        if (len(text) - start) // period >= min_repeats:
            return text[: start + keep * period]
    return text


def _loop_start(text: str, period: int) -> int:
    """Where the run of whole `period`-long copies that ends `text` begins."""
    end = len(text)
    copy = text[end - period:]
    start = end - period
    while start - period >= 0 and text[start - period:start] == copy:
        start -= period
    return start
