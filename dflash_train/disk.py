"""A full disk, however a library reports it, as one line that says what to do.

Every writer here finishes a file under a temporary name and renames it into place (shards, features,
checkpoints, exports), so a write that runs out of space leaves the finished files intact; the message
says so, and that the same command continues (or rewrites) once there is room.
"""

from __future__ import annotations

import errno
import shutil
from pathlib import Path

DISK_FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT}
# Libraries that wrap the OS error (safetensors' Rust writer, say) keep its text.
DISK_FULL_TEXT = ("No space left on device", "Disk quota exceeded")


def is_disk_full(error: BaseException) -> bool:
    if isinstance(error, OSError) and error.errno in DISK_FULL_ERRNOS:
        return True
    return any(text in str(error) for text in DISK_FULL_TEXT)


def free_gib(path: Path) -> float | None:
    """Free space on the disk holding `path` (its nearest existing ancestor), or None if unknown."""
    for folder in (path, *path.parents):
        if folder.exists():
            return shutil.disk_usage(folder).free / 2**30
    return None


def disk_full_message(error: BaseException) -> str | None:
    """The one-line error for a full disk, or None when `error` is something else."""
    if not is_disk_full(error):
        return None
    filename = getattr(error, "filename", None)
    folder = Path(filename).parent if filename else None  # the file itself may be a temporary name
    free = free_gib(folder or Path.cwd())
    room = f" ({free:.1f} GiB free there)" if free is not None else ""
    return (f"disk full writing to {folder or 'the output'}{room}: free space or write to another disk; files "
            "already finished are intact, and the same command continues where it stopped")
