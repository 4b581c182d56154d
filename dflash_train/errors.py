"""How every entry point ends on a user error: one line that says what to do, no traceback."""

from __future__ import annotations

import sys
from collections.abc import Callable

from tqdm import tqdm

from dflash_train.disk import command_output, disk_full_message


def close_progress_bars() -> None:
    """Finish any bar a failed command left open, so that its error starts on a line of its own."""
    for bar in list(getattr(tqdm, "_instances", [])):
        bar.close()


def first_line(error: BaseException) -> str:
    """The first line of an error's message (library errors can run to pages), or its type when empty."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def run_with_one_line_errors(prog: str, call: Callable[[], int]) -> int:
    """`call()`, with bad input (ValueError) and a full disk as `<prog>: error: ...` and exit status 2."""
    with command_output():  # the output folder the command notes, for a full disk's free space
        try:
            return call()
        except ValueError as error:
            message: str | None = str(error)
        except Exception as error:
            message = disk_full_message(error)
            if message is None:
                raise
    close_progress_bars()
    print(f"{prog}: error: {message}", file=sys.stderr)
    return 2
