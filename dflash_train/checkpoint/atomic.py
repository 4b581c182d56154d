"""Publishing a directory so that readers never see it half-written.

Files are first written to a hidden staging directory next to the destination (same filesystem, so
renames are atomic), then moved into place by renames.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


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
