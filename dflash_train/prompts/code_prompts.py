"""Code-writing prompts built from the documented functions of the installed Python code.

Every public function and method with a docstring in the standard library and the installed packages becomes
one request, "Write a Python function `name(args)` that does the following: <the docstring's first sentence>",
in one of a few wordings (chosen from the function's module and name, so the same code always gives the same
prompts). Signatures and sentences are read from the source with ``ast``; nothing is imported. Left out:
private names (a leading underscore), tests, vendored copies, properties and overloads, sentences that do not
say what the code does (aliases, deprecation notes, "see ..."), and the packages of evaluation harnesses and
benchmarks (a top-level name holding "eval" or "bench"), so that no benchmark's text becomes a prompt.

``code-prompts:stub`` asks for the same functions as code to complete instead: the signature and the
sentence as a docstring in a Python block, for a method inside its class (with ``self``), the shape of a
function-completion task.

Parsing every installed package takes tens of seconds, so the prompts are cached under
``$DFLASH_TRAIN_CACHE/code-prompts`` (default ``~/.cache/dflash_train``), keyed by the Python version, this
module's source and the path, size and modification time of every file read: a changed environment, or a
change here, parses again.
"""

from __future__ import annotations

import ast
import copy
import hashlib
import json
import os
import re
import sys
import sysconfig
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SKIPPED_DIRS = frozenset({
    "test", "tests", "testing", "__pycache__", "_vendor", "vendor", "vendored", "site-packages", "dist-packages",
    "idlelib", "lib2to3", "turtledemo", "ensurepip", "examples", "benchmarks",
})
BENCHMARK_MARKERS = ("eval", "bench")
SKIPPED_DECORATORS = frozenset({"property", "cached_property", "setter", "getter", "deleter", "overload"})
NOT_A_DESCRIPTION = ("alias", "deprecated", "see ", "same as", "todo", "copied from", "overrid", "for internal use",
                     "backward", "legacy", "placeholder", "no-op", "dummy", "stub")
MIN_WORDS, MAX_WORDS = 4, 60
MAX_SIGNATURE_CHARS = 100  # a longer signature (long defaults or annotations) is written with its names only
TEMPLATES = (
    "Write {thing} that does the following: {summary}",
    "Implement {thing}. {summary}",
    'Write {thing}. Its docstring begins: "{summary}" Give the code and a short explanation of how it works.',
    "Can you show me {thing}? It should do this: {summary}",
)

# Worded apart from any benchmark's instruction (a shared 13-word run would make `prepare` drop the rows).
STUB_REQUEST = "Complete the {what}, so that it does what its docstring says, and explain the code briefly."
_SENTENCE_END = re.compile(r"(?<=[.!?])\s")
_SPHINX_ROLE = re.compile(r":[\w:]+:`~?([^`]*)`")
_ARGUMENT_DOC = re.compile(r"^\w+ \(|^(args|arguments|parameters|params|returns?|yields?|raises?)\s*:", re.IGNORECASE)


@dataclass(frozen=True)
class Documented:
    module: str
    owner: str | None  # the class of a method
    name: str
    signature: str
    summary: str
    dropped: str | None = None  # a method's first argument (self, cls), left out of `signature`

    @property
    def origin(self) -> str:
        return f"{self.module}:{self.owner + '.' if self.owner else ''}{self.name}"

    def prompt(self) -> str:
        thing = (f"a method `{self.signature}` of a Python class `{self.owner}`" if self.owner
                 else f"a Python function `{self.signature}`")
        template = TEMPLATES[zlib.crc32(self.origin.encode()) % len(TEMPLATES)]
        return template.format(thing=thing, summary=self.summary)

    def stub(self) -> str:
        """The request as code to complete: the signature and the docstring's sentence in a Python block (the
        ``code-prompts:stub`` form, the shape of a function-completion task)."""
        docstring = '"""' + self.summary.replace('"""', "'''") + '"""'
        if self.owner is None:
            code = f"def {self.signature}:\n    {docstring}"
            return f"{STUB_REQUEST.format(what='function')}\n```python\n{code}\n```"
        head = self.signature
        if self.dropped:  # self (or cls) back in its place: the other wordings leave it out
            name, _, rest = head.partition("(")
            head = f"{name}({self.dropped}{'' if rest.startswith(')') else ', '}{rest}"
        code = f"class {self.owner}:\n    def {head}:\n        {docstring}"
        return f"{STUB_REQUEST.format(what=f'method `{self.name}` of this Python class')}\n```python\n{code}\n```"


def code_prompts(roots: list[Path] | None = None, cache_dir: Path | None = None) -> list[dict[str, Any]]:
    """The prompts (``{"prompt", "origin"}``, distinct, in file order) of the code under ``roots`` (default: the
    standard library and the installed packages), from the cache when the files are unchanged."""
    files = [(root, path) for root in (roots or source_roots()) for path in python_files(root)]
    cache = (cache_dir or default_cache_dir()) / f"{_fingerprint([path for _, path in files])}.json"
    try:
        return json.loads(cache.read_text())
    except (OSError, ValueError):
        pass
    records = _build(files)
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_name(f".{cache.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(records, ensure_ascii=False))
    tmp.replace(cache)  # complete or absent: a killed run leaves no half cache
    return records


def default_cache_dir() -> Path:
    return Path(os.environ.get("DFLASH_TRAIN_CACHE") or "~/.cache/dflash_train").expanduser() / "code-prompts"


def source_roots() -> list[Path]:
    paths = sysconfig.get_paths()
    sites = sorted({Path(paths["purelib"]), Path(paths["platlib"])})
    return [Path(paths["stdlib"]), *(site for site in sites if site.is_dir())]


def python_files(root: Path) -> list[Path]:
    """The ``.py`` files under ``root`` in sorted order, without tests, vendored code, package metadata and the
    packages of evaluation harnesses and benchmarks."""
    found = []
    for directory, subdirs, names in os.walk(root):
        top = directory == str(root)
        subdirs[:] = sorted(d for d in subdirs if _kept(d, top) and not d.endswith((".dist-info", ".egg-info")))
        found += [Path(directory) / n for n in sorted(names) if n.endswith(".py") and (not top or _kept(n, top))]
    return found


def _kept(name: str, top: bool) -> bool:
    if name in SKIPPED_DIRS or name.startswith("."):
        return False
    return not (top and any(marker in name.lower() for marker in BENCHMARK_MARKERS))


def _fingerprint(files: list[Path]) -> str:
    digest = hashlib.sha256(f"{sys.version}\n".encode() + Path(__file__).read_bytes())
    for path in files:
        stat = path.stat()
        digest.update(f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:32]


def _build(files: list[tuple[Path, Path]]) -> list[dict[str, Any]]:
    # One prompt per name and sentence: a method copied into many classes (a model family's `forward`, say)
    # would otherwise give as many near-identical prompts.
    records, seen = [], set()
    for root, path in files:
        for item in documented(path, module_name(root, path)):
            key = (item.name, item.summary.lower())
            if key not in seen:
                seen.add(key)
                records.append({"prompt": item.prompt(), "stub": item.stub(), "origin": item.origin})
    return records


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts) or path.stem


def documented(path: Path, module: str) -> Iterator[Documented]:
    """The public, documented functions of a module and methods of its public classes."""
    try:
        tree = ast.parse(path.read_bytes(), str(path))
    except (SyntaxError, ValueError, OSError):  # another Python's syntax, a damaged or unreadable file
        return
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
            for member in node.body:
                item = _describe(member, module, node.name)
                if item is not None:
                    yield item
        else:
            item = _describe(node, module, None)
            if item is not None:
                yield item


def _describe(node: ast.stmt, module: str, owner: str | None) -> Documented | None:
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name.startswith(("_", "test")):
        return None
    decorators = {_decorator_name(d) for d in node.decorator_list}
    if decorators & SKIPPED_DECORATORS:
        return None
    summary = summary_sentence(ast.get_docstring(node) or "")
    if summary is None:
        return None
    bound = owner is not None and "staticmethod" not in decorators
    positional = [*node.args.posonlyargs, *node.args.args]
    dropped = positional[0].arg if bound and positional else None
    return Documented(module, owner, node.name, signature(node, drop_first=bound), summary, dropped)


def _decorator_name(node: ast.expr) -> str:
    node = node.func if isinstance(node, ast.Call) else node
    return node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", "")


def summary_sentence(docstring: str) -> str | None:
    """The first sentence of a docstring's first paragraph, when it says what the code does, else None."""
    paragraph = " ".join(docstring.strip().split("\n\n")[0].split())
    sentence = _SPHINX_ROLE.sub(r"`\1`", _SENTENCE_END.split(paragraph, maxsplit=1)[0]).strip()
    if not sentence[:1].isalpha() or ">>>" in sentence or sentence.lower().startswith(NOT_A_DESCRIPTION):
        return None
    if _ARGUMENT_DOC.match(sentence):  # a docstring that starts with its arguments says nothing of what it does
        return None
    if not MIN_WORDS <= len(sentence.split()) <= MAX_WORDS:
        return None
    sentence = sentence[0].upper() + sentence[1:]
    return sentence if sentence.endswith((".", "!", "?")) else sentence.rstrip(":;,") + "."


def signature(node: ast.FunctionDef | ast.AsyncFunctionDef, drop_first: bool = False) -> str:
    """``name(args) -> returns`` as written in the source, without ``self``/``cls`` for a method; with the
    argument names only when that is too long to read in a prompt."""
    args = copy.copy(node.args)
    if drop_first and args.posonlyargs:
        args.posonlyargs = args.posonlyargs[1:]
    elif drop_first and args.args:
        args.args = args.args[1:]
    positional = len(args.posonlyargs) + len(args.args)  # defaults belong to the last positional arguments
    args.defaults = args.defaults[max(0, len(args.defaults) - positional):]
    returns = f" -> {ast.unparse(node.returns)}" if node.returns is not None else ""
    text = f"{node.name}({ast.unparse(args)}){returns}"
    if len(text) <= MAX_SIGNATURE_CHARS:
        return text
    names = [a.arg for a in (*args.posonlyargs, *args.args)]
    names += [f"*{args.vararg.arg}"] if args.vararg else (["*"] if args.kwonlyargs else [])
    names += [a.arg for a in args.kwonlyargs] + ([f"**{args.kwarg.arg}"] if args.kwarg else [])
    return f"{node.name}({', '.join(names)})"
