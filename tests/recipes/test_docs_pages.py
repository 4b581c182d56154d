"""The README reads in five minutes and the docs hold together: README.md is at most 150 lines with no sentence
over 40 words (prose only: code blocks, tables and headings are not sentences), and every relative link in
README.md and docs/*.md points at a file that exists, and at a heading of it where the link names one."""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

import pytest

from tests.helpers.paths import REPO

README = REPO / "README.md"
DOCS = [README, *sorted((REPO / "docs").glob("*.md"))]
MAX_LINES = 150
MAX_WORDS = 40
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def prose(text: str) -> str:
    """The text a reader reads as sentences: fenced code blocks, table rows and headings left out."""
    text = re.sub(r"^```.*?^```[^\n]*$", "", text, flags=re.MULTILINE | re.DOTALL)
    kept = [line for line in text.splitlines() if not line.lstrip().startswith(("|", "#"))]
    return "\n".join(kept)


def sentences(text: str) -> list[str]:
    """Sentences of the prose: split after . ! or ? followed by a space or a line end, and at blank lines and
    list items (a list item is a sentence of its own even without a full stop)."""
    flat = re.sub(r"\n\s*\n|\n\s*(?:[-*]|\d+\.)\s+", "\n\n", prose(text))
    parts = []
    for paragraph in flat.split("\n\n"):
        parts += re.split(r"(?<=[.!?])\s+", paragraph.replace("\n", " "))
    return [part.strip() for part in parts if part.strip()]


def words(sentence: str) -> int:
    """Words of a sentence as read: a link counts its text, not its address."""
    return len(re.sub(r"\]\([^)]*\)", "]", sentence).split())


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, markup and punctuation dropped, spaces as hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    kept = "".join(ch for ch in text if ch in " -_" or unicodedata.category(ch)[0] in "LN")
    return kept.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.MULTILINE | re.DOTALL)
    seen: dict[str, int] = {}
    found = set()
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*#*\s*$", text, flags=re.MULTILINE):
        base = slug(heading)
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def test_the_readme_is_short() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= MAX_LINES, f"README.md has {len(lines)} lines; move detail to a page of docs/"


def test_no_readme_sentence_is_over_40_words() -> None:
    long = [f"{words(s)} words: {s}" for s in sentences(README.read_text()) if words(s) > MAX_WORDS]
    assert not long, "\n".join(long)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_relative_link_points_at_a_file_and_heading(doc: Path) -> None:
    text = re.sub(r"^```.*?^```", "", doc.read_text(), flags=re.MULTILINE | re.DOTALL)
    broken = []
    for target in LINK.findall(text):
        if re.match(r"^[a-z]+:", target):
            continue  # http(s), mailto: not checked here
        path, _, anchor = target.partition("#")
        file = (doc.parent / path).resolve() if path else doc
        if not file.exists():
            broken.append(f"{target}: no such file")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(f"{target}: no heading #{anchor} in {file.relative_to(REPO)}")
    assert not broken, "\n".join(broken)


def test_the_code_names_only_docs_pages_that_exist() -> None:
    """A comment, docstring or recipe that sends the reader to docs/<page>.md names a page that exists."""
    sources = [*(REPO / "dflash_train").rglob("*.py"), *(REPO / "benchmarks").glob("*.py"),
               *(REPO / "recipes").rglob("*.*"), *(REPO / "tests").rglob("*.py"), REPO / "Makefile"]
    missing = sorted({f"{path.relative_to(REPO)}: docs/{page}" for path in sources
                      if path.is_file() and path != Path(__file__)
                      for page in re.findall(r"docs/([\w.-]+\.md)", path.read_text(errors="ignore"))
                      if not (REPO / "docs" / page).is_file()})
    assert not missing, "\n".join(missing)


def test_the_checks_see_what_a_reader_sees() -> None:
    text = ("# Title\n\nOne short sentence. Another one! A question?\n- an item\n- [a link](docs/x.md#y) here\n"
            "```bash\nnot. a. sentence.\n```\n| a | table. row |\n")
    assert sentences(text) == ["One short sentence.", "Another one!", "A question?", "an item",
                               "[a link](docs/x.md#y) here"]
    assert words("[a link](docs/x.md#y) here") == 3
    assert slug("§10 Performance yardsticks") == "10-performance-yardsticks"
    assert slug("`train_packing`: packed against padded rows") == "train_packing-packed-against-padded-rows"
    assert slug("Speedrun v4 (2026-12-04, 52584ee)") == "speedrun-v4-2026-12-04-52584ee"
    assert slug("τ against training minutes") == "τ-against-training-minutes"
