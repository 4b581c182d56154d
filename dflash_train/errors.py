"""How every entry point ends on a user error: one line that says what to do, no traceback."""

from __future__ import annotations

import sys
from collections.abc import Callable

from dflash_train.disk import command_output, disk_full_message


def close_progress_bars() -> None:
    """Finish any bar a failed command left open, so that its error starts on a line of its own."""
    from tqdm import tqdm

    for bar in list(getattr(tqdm, "_instances", [])):
        bar.close()


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
