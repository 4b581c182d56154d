"""A full disk, however a library reports it, as one line that says what to do.

Every writer here finishes a file under a temporary name and renames it into place (shards, features,
checkpoints, exports), so a write that runs out of space leaves the finished files intact; the message
says so, and that the same command continues (or rewrites) once there is room.
"""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

DISK_FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT}
# Libraries that wrap the OS error (safetensors' Rust writer, say) keep its text.
DISK_FULL_TEXT = ("No space left on device", "Disk quota exceeded")


def is_disk_full(error: BaseException) -> bool:
    if isinstance(error, OSError) and error.errno in DISK_FULL_ERRNOS:
        return True
    return any(text in str(error) for text in DISK_FULL_TEXT)


# The running command's output folder, while a command runs (see `command_output`); None otherwise.
_command: dict[str, Path | None] | None = None


@contextmanager
def command_output() -> Iterator[None]:
    """While a command runs: the output folder it notes (`note_output`) is the one a full disk is reported
    for, and it is forgotten when the command ends, so that nothing else run in this process later (another
    command, a library call) is reported with it."""
    global _command
    outer, _command = _command, {"folder": None}
    try:
        yield
    finally:
        _command = outer


def note_output(folder: str | Path | None) -> None:
    """Record the folder the running command writes its output to. A full disk reported without a file
    name (safetensors' and torch's writers say only "No space left on device") is then reported with the
    free space of that folder's disk, which need not be the working directory's. Outside a command
    (`command_output`) nothing is recorded."""
    if _command is not None:
        _command["folder"] = Path(folder) if folder is not None else None


def noted_output() -> Path | None:
    return _command["folder"] if _command is not None else None


def free_gib(path: Path) -> float | None:
    """Free space on the filesystem that holds `path`, from its nearest existing ancestor (an output folder
    that is not created yet lives on its parent's disk), or None if unknown."""
    path = Path(os.path.abspath(path.expanduser()))  # a relative path's parents end at the working directory
    for folder in (path, *path.parents):
        if folder.exists():
            try:
                return shutil.disk_usage(folder).free / 2**30
            except OSError:
                return None
    return None


def disk_full_message(error: BaseException) -> str | None:
    """The one-line error for a full disk, or None when `error` is something else."""
    if not is_disk_full(error):
        return None
    filename = getattr(error, "filename", None)
    # The file itself may be a temporary name: its folder is what the user knows. Without a file name the
    # command's own output folder is the disk that filled up.
    folder = Path(filename).parent if filename else noted_output()
    free = free_gib(folder) if folder is not None else None
    room = f" ({free:.1f} GiB free there)" if free is not None else ""
    return (f"disk full writing to {folder or 'the output'}{room}: free space or write to another disk; files "
            "already finished are intact, and the same command continues where it stopped")
