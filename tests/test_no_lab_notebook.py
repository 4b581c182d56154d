"""Code and recipes say why, not when: no dates, commit hashes or measured timings in their prose.

The figures that decided a choice live in docs/benchmarks.md and docs/results.md; a comment or docstring
states the reason in words and points there. This test scans every .py file under dflash_train/,
benchmarks/ and export/ and every file under recipes/, and names file:line for:

- a date (YYYY-MM-DD) anywhere in a file;
- a commit hash (7-12 lowercase hex characters, at least one digit and one letter) in a comment, a
  docstring or a string literal other than those in DATA_STRINGS;
- a timing figure (a number followed by µs, us or ms) in a comment or docstring.

Python comments and docstrings are found with `tokenize` and `ast`; in recipes (YAML, shell) a comment is a
`#` at the start of a line or after a space, outside quotes.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PYTHON_TREES = ("dflash_train", "benchmarks", "export")
RECIPES = "recipes"

DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")
HASH = re.compile(r"\b(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,12}\b")
TIMING = re.compile(r"\d(?:[\d,.]*\d)?\s*(?:µs|us|ms)\b")

# String literals that are data, not prose: (path, literal) -> why it is data. Only a literal that is data may be
# listed (a fixture's digest, a pinned revision), each with its reason; a hash in any other string is taken for
# a note on when something was run. None is needed today.
DATA_STRINGS: dict[tuple[str, str], str] = {}


def _docstring_nodes(tree: ast.AST) -> set[int]:
    """Line numbers of the docstring constants of a module, its classes and functions (their first line)."""
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                    and isinstance(body[0].value.value, str):
                lines.add(body[0].value.lineno)
    return lines


def _spans(text: str, start_line: int) -> list[tuple[int, str]]:
    return [(start_line + offset, line) for offset, line in enumerate(text.splitlines() or [""])]


def python_prose(source: str) -> tuple[list[tuple[int, str]], list[tuple[int, str]]]:
    """(comment and docstring lines, other string literal lines) of a Python source, each as (line, text)."""
    docstrings = _docstring_nodes(ast.parse(source))
    prose, strings = [], []
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            prose.append((token.start[0], token.string))
        elif token.type == tokenize.STRING or token.type == getattr(tokenize, "FSTRING_MIDDLE", -1):
            (prose if token.start[0] in docstrings and token.type == tokenize.STRING else strings).extend(
                _spans(token.string, token.start[0]))
    return prose, strings


def _comment_of(line: str) -> str | None:
    """The comment of a YAML or shell line: from a `#` at its start or after a space, outside quotes."""
    quote = None
    for index, char in enumerate(line):
        if quote:
            if char == quote:
                quote = None
        elif char in "'\"":
            quote = char
        elif char == "#" and (index == 0 or line[index - 1] in " \t"):
            return line[index:]
    return None


def recipe_prose(source: str) -> list[tuple[int, str]]:
    """The comment lines of a YAML file or shell script, each as (line, text)."""
    return [(number, comment) for number, line in enumerate(source.splitlines(), 1)
            if (comment := _comment_of(line)) is not None]


def scan(relative: str, source: str) -> list[str]:
    """`relative:line: what` for each date, commit hash or timing figure in one file's prose."""
    found = []
    for number, line in enumerate(source.splitlines(), 1):
        if DATE.search(line):
            found.append(f"{relative}:{number}: a date ({DATE.search(line).group()})")
    if relative.endswith(".py"):
        prose, strings = python_prose(source)
        strings = [(number, text) for number, text in strings
                   if not any(path == relative and literal in text for path, literal in DATA_STRINGS)]
    else:
        prose, strings = recipe_prose(source), []
    for number, text in prose + strings:
        if match := HASH.search(text):
            found.append(f"{relative}:{number}: a commit hash ({match.group()})")
    for number, text in prose:
        if match := TIMING.search(text):
            found.append(f"{relative}:{number}: a timing figure ({match.group()})")
    return sorted(set(found), key=lambda entry: (entry.split(":")[0], int(entry.split(":")[1]), entry))


def scanned_files() -> list[Path]:
    files = [path for tree in PYTHON_TREES for path in (ROOT / tree).rglob("*.py")]
    files += [path for path in (ROOT / RECIPES).rglob("*") if path.is_file()]
    return sorted(path for path in files if "__pycache__" not in path.parts)


def test_code_and_recipes_keep_no_lab_notebook() -> None:
    found = [entry for path in scanned_files()
             for entry in scan(path.relative_to(ROOT).as_posix(), path.read_text(encoding="utf-8"))]
    assert not found, ("dates, commit hashes or timings in code or recipe prose (say why in words and point "
                       "to docs/benchmarks.md):\n" + "\n".join(found))


def test_the_scanner_finds_planted_notes() -> None:
    planted = '''"""Module docstring, run 2026-12-02."""
x = 1  # measured 4.2 µs at 8bf8361
LABEL = "tiling"


def f():
    """The fused step took 3.1 ms (was 4 ms at a1b2c3d)."""
    return "see 0123abc"
'''
    found = scan("pkg/mod.py", planted)
    assert "pkg/mod.py:1: a date (2026-12-02)" in found
    assert "pkg/mod.py:2: a commit hash (8bf8361)" in found
    assert "pkg/mod.py:2: a timing figure (4.2 µs)" in found
    assert "pkg/mod.py:7: a timing figure (3.1 ms)" in found
    assert "pkg/mod.py:7: a commit hash (a1b2c3d)" in found
    assert "pkg/mod.py:8: a commit hash (0123abc)" in found
    assert not [entry for entry in found if ":3:" in entry]
    recipe = "steps: 100  # 12 ms a step on 2a82239\nname: 'a#b 5 ms'\n# 2026-11-30: tuned\n"
    assert scan("recipes/r.yaml", recipe) == [
        "recipes/r.yaml:1: a commit hash (2a82239)", "recipes/r.yaml:1: a timing figure (12 ms)",
        "recipes/r.yaml:3: a date (2026-11-30)"]


def test_the_scanner_passes_plain_prose_and_code() -> None:
    clean = '''"""cuBLAS is faster above 16 rows (docs/benchmarks.md, 'Skinny products')."""
import re
PATTERN = re.compile(r"deadbeef")  # words of hex letters alone are no hash
timeout_ms = 250  # milliseconds, a setting, not a measurement
bf16 = "bf16"


def g(ms):
    return f"{ms:.1f} ms"
'''
    assert scan("pkg/clean.py", clean) == []


def test_a_listed_data_string_is_not_prose(monkeypatch) -> None:
    source = 'REVISION = "3f2a9c1"  # the pinned upstream revision\n'
    assert scan("pkg/pin.py", source) == ["pkg/pin.py:1: a commit hash (3f2a9c1)"]
    monkeypatch.setitem(DATA_STRINGS, ("pkg/pin.py", "3f2a9c1"), "a pinned revision the code downloads")
    assert scan("pkg/pin.py", source) == []
