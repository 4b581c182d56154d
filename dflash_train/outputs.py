"""Output folders: where a command may write, and what `--overwrite` may remove. The same rules for every
command that writes a folder (prepare, regenerate, extract, export, train, and the demo's stages):

- an output folder is never deleted as a whole: it may hold the user's own files, or be (or hold) an input;
- a folder that is, or holds, one of the command's inputs is refused, with or without --overwrite;
- an absent or empty folder is used; so is the command's own output made from the same inputs (replaced
  if finished, resumed if the command resumes);
- any other non-empty folder is refused with one line that suggests --overwrite, which then removes only
  the files the command writes (the names in its `OutputKind`) and keeps every other file. Files with
  those names in a folder without the command's marker are not its own: such a folder is refused.
- resumable commands (regenerate, extract) remove an earlier run under --overwrite only when it was made
  with other settings, so that every rank of one run may pass the flag.

Light on imports: the demo reads this module before torch may be loaded.
"""

from __future__ import annotations

import fnmatch
import os
import shutil
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from dflash_train.disk import note_output

if TYPE_CHECKING:
    from dflash_train.training.config import TrainConfig


@dataclass(frozen=True)
class OutputKind:
    """What one command writes into its output folder."""

    command: str
    what: str  # "a prepared dataset": for messages
    # A name only this command writes (the last one, where it publishes a finished output): without it,
    # files with the command's names are not its own (a user's saved dataset also has state.json).
    marker: str
    patterns: tuple[str, ...]  # every top-level file or folder the command writes, temporary ones included
    also_marks: tuple[str, ...] = ()  # other names that show the folder is the command's (whichever comes first)

    def owns(self, name: str) -> bool:
        return any(fnmatch.fnmatchcase(name, pattern) for pattern in self.patterns)


# The names are those of the writers (data/prepared.py, shards.py, features/store.py, checkpoint/,
# training/); tests check that they agree.
PREPARED = OutputKind("prepare", "a prepared dataset", "dflash_data.json",
                      ("dflash_data.json", "data-*-of-*.arrow", "dataset_info.json", "state.json"))
REGENERATED = OutputKind("regenerate", "regenerated responses", "regenerate.json",
                         ("regenerate.json", "part-*.jsonl", ".part-*.tmp", ".regenerate.json.*.tmp", "turns",
                          "regen_stats*.json", ".regen_stats*.tmp"),
                         also_marks=("turns",))  # a multi-turn run writes <out>/regenerate.json at its last turn
FEATURES = OutputKind("extract", "a feature store", "manifest.json",
                      ("manifest.json", "features-*.safetensors", ".features-*.tmp", ".manifest.json.*.tmp"))
EXPORTED = OutputKind("export", "an exported drafter", "dflash.py",
                      ("config.json", "model.safetensors", "model-*-of-*.safetensors", "model.safetensors.index.json",
                       "dflash.py", "README.md"))
TRAINING = OutputKind("train", "a training run", "checkpoints",
                      ("checkpoints", "metrics.jsonl", "training_curves.png", "wandb"), also_marks=("metrics.jsonl",))
EVALUATION = OutputKind("eval", "an evaluation report", "report.json",
                        ("report.json", "report.png", ".report.json.*.tmp"))


def entries(out: Path) -> list[Path]:
    return sorted(out.iterdir()) if out.is_dir() else []


def foreign_entries(out: Path, kind: OutputKind) -> list[Path]:
    """What in `out` the command did not write."""
    return [path for path in entries(out) if not kind.owns(path.name)]


def holds_output(out: Path, kind: OutputKind) -> bool:
    return any((out / name).exists() for name in (kind.marker, *kind.also_marks))


def refuse_inputs_inside(out: Path, inputs: Iterable[str | Path | None], flag: str = "--out") -> None:
    """Refuse an output folder that is one of the inputs or holds one: writing or replacing the command's
    files there could destroy what it reads. Inputs that are not on disk (Hub ids, aliases) are skipped."""
    target = out.expanduser().resolve()
    for item in inputs:
        if item is None or not Path(item).expanduser().exists():
            continue
        source = Path(item).expanduser().resolve()
        if source == target or target in source.parents:
            relation = "is" if source == target else "holds"
            raise ValueError(f"{flag} {out} {relation} the input {item}; write to a folder of its own (a new path "
                             f"outside the inputs)")


def check_output_file(out: Path, flag: str = "--out") -> None:
    """Refuse a file path that a command could write only at its end (an eval report, a self-prompt file): a
    folder at `out`, a file where one of its folders would be, or a folder this user cannot write in would
    otherwise fail only after the work that the file was to hold."""
    if out.is_dir():
        raise ValueError(f"{flag} {out} is a folder; give the path of the file to write")
    folder = next(parent for parent in out.absolute().parents if parent.exists())  # `/` at the latest
    if not folder.is_dir():
        raise ValueError(f"{flag} {out}: {folder} is a file, not a folder; pick another {flag}")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {out}: cannot write in {folder}; check its permissions or pick another {flag}")


def claim(out: Path, kind: OutputKind, *, inputs: Iterable[str | Path | None], overwrite: bool, reusable: bool,
          flag: str = "--out", why: str | None = None, clear: bool = True) -> None:
    """Check that `out` may be written (see the module's rules); with `overwrite`, remove what `kind` wrote
    there earlier. `reusable`: `out` holds this command's own output from the same inputs. `why` says what
    is wrong with a folder that is refused (default: what it holds). `clear=False` leaves the earlier
    output in place for `publish` to replace once the new one is complete (nothing is lost if it fails)."""
    refuse_inputs_inside(out, inputs, flag)
    note_output(out)  # a full disk is then reported with this folder's free space
    if out.exists() and not out.is_dir():
        raise ValueError(f"{flag} {out} is a file, not a folder; pick another {flag}")
    if reusable or not entries(out):
        return
    clashes = [] if holds_output(out, kind) else \
        [path.name for path in entries(out) if kind.owns(path.name) and not path.name.startswith(".")]
    if clashes:  # the command would replace them, but they are not its own
        raise ValueError(f"{out} holds {', '.join(clashes[:3])} without {kind.marker}: files {kind.command} would "
                         f"replace but did not write; move them away or pick another {flag}")
    if not overwrite:
        raise ValueError(f"{out} is not empty and {why or _describe(out, kind)}; pass --overwrite to replace the "
                         f"files {kind.command} writes there (other files are kept), or pick another {flag}")
    if clear:
        remove_owned(out, kind)


def _describe(out: Path, kind: OutputKind) -> str:
    if holds_output(out, kind):
        return f"holds {kind.what} made from other inputs or settings"
    names = [path.name for path in foreign_entries(out, kind) or entries(out)]
    shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
    return f"holds files {kind.command} did not write ({shown})"


def remove_owned(out: Path, kind: OutputKind) -> list[str]:
    """Remove the files and folders `kind` writes from `out` (the marker first, so that a removal cut short
    never leaves a folder that reads as finished); every other file stays, and so does everything in a folder
    without the marker. Returns the names removed."""
    if not holds_output(out, kind):
        return []
    owned = [path for path in entries(out) if kind.owns(path.name)]
    owned.sort(key=lambda path: path.name not in (kind.marker, *kind.also_marks))
    for path in owned:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)  # a folder of the command's own (regeneration turns, checkpoints)
        else:
            path.unlink()
    return [path.name for path in owned]


def publish(staged: Path, out: Path, kind: OutputKind) -> None:
    """Move a finished output from the folder `staged` into `out`: a new folder appears whole (one rename);
    into an existing one the earlier output's files are removed, then the new ones moved in, the marker
    last, so that an interrupted move never reads as finished. Other files in `out` stay."""
    if not out.exists():
        os.replace(staged, out)
        return
    remove_owned(out, kind)
    names = sorted((path.name for path in staged.iterdir()), key=lambda name: name == kind.marker)
    for name in names:
        os.replace(staged / name, out / name)


def claim_training_dir(config: TrainConfig, overwrite: bool) -> None:
    """training.output_dir: a run there is resumed (training.resume auto or a path); with training.resume=none
    it would be trained over, so it is refused unless --overwrite, which removes only the run's files."""
    out = Path(config.training.output_dir)
    inputs = [config.data.prepared, config.data.features, config.model.init_from, config.model.target]
    has_run = holds_output(out, TRAINING)
    reusable = has_run and config.training.resume != "none"
    if overwrite and has_run and int(os.environ.get("RANK", "0")) != 0:
        reusable = True  # only the first process removes the earlier run; the others would race it
    why = "holds a training run, which training.resume=none would train over" if has_run else None
    claim(out, TRAINING, inputs=inputs, overwrite=overwrite, reusable=reusable, flag="training.output_dir", why=why)
