"""The docs describe the tree as it is: docs/design.md's map of where things live (§11) names every module of
the package, every top-level folder and every package of dflash_train/, and nothing that does not exist."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "dflash_train"
TOP = {"benchmarks", "data", "dflash_train", "docs", "export", "recipes", "tests"}


def where_things_live() -> str:
    design = (ROOT / "docs" / "design.md").read_text()
    return design.split("## §11 Where things live", 1)[1].split("\n## ", 1)[0]


def test_the_design_module_map_names_every_module() -> None:
    listed = set(re.findall(r"^\s+(\w+\.py)\s", where_things_live(), flags=re.MULTILINE))
    modules = {p.name for p in PACKAGE.rglob("*.py") if p.name != "__init__.py"}
    assert modules - listed == set(), "add these modules to the map in docs/design.md §11"


def test_the_design_map_names_every_folder_and_package() -> None:
    folders = set(re.findall(r"^ {4}([\w.]+)/\s", where_things_live(), flags=re.MULTILINE))
    packages = set(re.findall(r"^ {6}(\w+)/\s", where_things_live().split("    dflash_train/", 1)[1],
                              flags=re.MULTILINE))
    real_packages = {p.parent.name for p in PACKAGE.glob("*/__init__.py")}
    assert TOP - folders == set(), "add these folders to the map in docs/design.md §11"
    assert folders - TOP == set(), "docs/design.md §11 names top-level folders that do not exist"
    assert real_packages - packages == set(), "add these packages of dflash_train/ to docs/design.md §11"
    assert packages - real_packages == set(), "docs/design.md §11 names packages that do not exist"
