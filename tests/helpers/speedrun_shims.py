"""The speedrun script run without its commands: a stand-in `python3` first on PATH records each call's
arguments and answers the one query the script makes, a run's final drafter: there is one once this call has
trained the run, or for every run when FINISHED is set (a run trained before). A stand-in `timeout` records the
seconds a regeneration is given and runs it."""

from __future__ import annotations

import os
import pathlib
import subprocess

from tests.helpers.paths import REPO

SHIM = """#!/usr/bin/env bash
printf '%s\\n' "$*" >> "$CALLS"
if [[ "$1" == "-c" ]] && { [[ -n "${FINISHED:-}" ]] || grep -qF "training.output_dir=$3 " "$CALLS"; }; then
  echo "$DRAFT"
fi
exit 0
"""


TIMEOUT_SHIM = """#!/usr/bin/env bash
[[ "$1" == --foreground ]] && shift
printf "timeout %s\\n" "$1" >> "$CALLS"
shift
exec "$@"
"""


def run_stage(stage: str, tmp_path: pathlib.Path, shim: str = SHIM, **settings: str) -> list[str]:
    bin_dir, calls = tmp_path / "bin", tmp_path / "calls.txt"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "python3").write_text(shim)
    (bin_dir / "python3").chmod(0o755)
    calls.write_text("")
    if stage in ("regenerate", "data"):  # the prompts stage's file, which these two refuse to run without
        (tmp_path / "run").mkdir(exist_ok=True)
        (tmp_path / "run" / "prompts.jsonl").touch()
    env = {**os.environ, **settings, "OUT": str(tmp_path / "run"), "CALLS": str(calls),
           "DRAFT": str(tmp_path / "draft"), "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    done = subprocess.run(["bash", str(REPO / "recipes/smollm2-135m-speedrun.sh"), stage], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    return calls.read_text().splitlines()


def timeout_recorded(tmp_path: pathlib.Path) -> None:
    """Puts the stand-in `timeout` on the PATH `run_stage` makes: regenerations' budgets land in the calls."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "timeout").write_text(TIMEOUT_SHIM)
    (bin_dir / "timeout").chmod(0o755)
