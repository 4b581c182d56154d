"""Writing files and folders so that readers never see them half-written.

Everything is first written under a hidden temporary name beside its destination (same filesystem, so the
final rename is atomic), then renamed into place: a name that exists is complete, and an interrupted
write leaves at most a hidden temporary, which no reader looks at.

    write_atomically(path, write)       one file: ``write(tmp)``, then rename
    write_json_atomically(path, obj)    one JSON file
    staging_dir(out_dir)                a folder: fill the staging folder, then
    replace_dir(staged, out_dir)          publish it whole (replacing an earlier one), or
    update_files(staged, out_dir, ...)    move its files into an existing folder, one rename each
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

PUBLISHED_FILE_MODE = 0o644  # what a written file gets: the private 0600 of a temporary file must not survive


def write_atomically(path: Path, write: Callable[[Path], None]) -> None:
    """Call ``write(tmp)`` on a temporary sibling of ``path``, then rename it to ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        write(tmp)
        os.chmod(tmp, PUBLISHED_FILE_MODE)  # mkstemp's private 0600 would survive the rename
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_json_atomically(path: Path, payload: dict[str, Any]) -> None:
    write_atomically(path, lambda tmp: tmp.write_text(json.dumps(payload, indent=2) + "\n"))


@contextmanager
def staging_dir(out_dir: Path) -> Iterator[Path]:
    """A fresh hidden directory beside `out_dir`, removed on exit (whatever was not moved out of it)."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    tmp.chmod(0o755)  # mkdtemp's private 0700 would survive the rename and lock other users out
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def replace_dir(staged: Path, out_dir: Path) -> None:
    """Make `staged` become `out_dir`, replacing any previous `out_dir` as a whole."""
    if not out_dir.exists():
        os.replace(staged, out_dir)
        return
    # The old folder is moved aside first (a rename cannot replace a non-empty folder), then removed.
    old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
    os.replace(out_dir, old / out_dir.name)
    os.replace(staged, out_dir)
    shutil.rmtree(old, ignore_errors=True)


def update_files(staged: Path, out_dir: Path, stale: list[str], last: str) -> None:
    """Move every file of `staged` into the existing `out_dir` (file by file, `last` at the end), then
    delete the `stale` names that the new files do not replace. Other files in `out_dir` are kept."""
    names = sorted((p.name for p in staged.iterdir()), key=lambda name: name == last)
    for name in names:
        os.replace(staged / name, out_dir / name)
    for name in set(stale) - set(names):
        (out_dir / name).unlink(missing_ok=True)
