"""The docs describe the tree as it is: docs/design.md's module map names every module of the package, and the
README's layout block names every top-level folder and every package of dflash_train/."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "dflash_train"


def test_the_design_module_map_names_every_module() -> None:
    design = (ROOT / "docs" / "design.md").read_text()
    listed = set(re.findall(r"^\s+(\w+\.py)\s", design, flags=re.MULTILINE))
    modules = {p.name for p in PACKAGE.rglob("*.py") if p.name != "__init__.py"}
    assert modules - listed == set(), "add these modules to the module map in docs/design.md"


def test_the_readme_layout_names_every_folder_and_package() -> None:
    readme = (ROOT / "README.md").read_text()
    layout = readme.split("## Layout", 1)[1].split("```")[1]
    named = set(re.findall(r"^\s*([\w.]+)/", layout, flags=re.MULTILINE))
    packages = {p.parent.name for p in PACKAGE.glob("*/__init__.py")}
    top = {"benchmarks", "data", "dflash_train", "docs", "export", "recipes", "tests"}
    assert (packages | top) - named == set(), "add these folders to the README's Layout section"
    assert named - packages - top - {".ci"} == set(), "the README's Layout names folders that do not exist"
