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


def found_in_chain(error: BaseException, kinds: tuple[type[BaseException], ...]) -> BaseException | None:
    """The first exception of ``kinds`` in ``error`` or the exceptions it was raised from or while handling
    (``__cause__``, ``__context__``), or None. Compilers wrap whatever interrupts them (Triton's
    CompilationError, torch.compile's BackendCompilerFailed), so a Ctrl-C or a signal raised as an exception
    can reach a command as another error's cause; a suppressed context (``raise ... from None``) still counts,
    as it is still what happened."""
    seen: set[int] = set()
    pending: list[BaseException] = [error]
    while pending:
        current = pending.pop()
        if id(current) in seen:  # chains can loop (an error re-raised while handling its own cause)
            continue
        seen.add(id(current))
        if isinstance(current, kinds):
            return current
        # The cause goes on top, so that it is looked at before the context.
        pending.extend(link for link in (current.__context__, current.__cause__) if link is not None)
    return None


def os_error_message(error: OSError) -> str | None:
    """A file the user named or a folder the command writes that cannot be used (missing, not allowed, a folder
    where a file was expected): one line naming it. None for OS errors without a path (those are bugs)."""
    if not error.filename:
        return None
    reason = error.strerror or type(error).__name__
    return f"{reason}: {error.filename}; check the path and its permissions"


def run_with_one_line_errors(prog: str, call: Callable[[], int]) -> int:
    """`call()`, with bad input (ValueError), a full disk and an unusable path as `<prog>: error: ...` (one line,
    whatever the message held) and exit status 2."""
    with command_output():  # the output folder the command notes, for a full disk's free space
        try:
            return call()
        except ValueError as error:
            message: str | None = str(error)
        except OSError as error:
            message = disk_full_message(error) or os_error_message(error)
            if message is None:
                raise
        except Exception as error:
            message = disk_full_message(error)
            if message is None:
                raise
    close_progress_bars()
    # A library's message can run over several lines; the error stays one line.
    print(f"{prog}: error: {' '.join(message.split())}", file=sys.stderr)
    return 2
