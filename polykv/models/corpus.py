"""An offline corpus of real prose and code, built from the running Python's standard library.

Studies need filler text for long-context tasks and calibration needs a small, heterogeneous set of
real sequences; neither may download anything. Every CPython installation carries both kinds:

- **prose**: the Python reference-manual topics shipped in ``pydoc_data.topics`` (the text
  ``help("assignment")`` prints: English prose with grammar snippets), plus module, class and function
  docstrings of the standard library of at least ``_MIN_DOCSTRING`` characters, read with :mod:`ast`
  (no module is imported).
- **code**: the source files of the standard library (``sysconfig.get_paths()["stdlib"]``), skipping
  test suites, site-packages, GUI demos and ``pydoc_data`` itself.

Recipe, in full: collect candidates as above, order them by source name, keep those with at least
``min_chars`` characters, and draw ``n`` of them without replacement with ``random.Random(seed)``
(``"mixed"`` draws ``n // 2`` code and the rest prose, then interleaves them, prose first).
Installed third-party packages are never read, so two machines with the same Python version build
the same corpus. :data:`CORPUS_RECIPE` changes whenever this recipe changes; :func:`corpus_id` adds
the Python version, and :func:`corpus_fingerprint` hashes the selected texts for provenance records.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import os
import platform
import random
import sysconfig
import warnings

import attrs

from polykv.errors import StudyError

CORPUS_RECIPE = "stdlib-r1"
KINDS = ("prose", "code", "mixed")
_MIN_DOCSTRING = 400
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "idlelib", "turtledemo",
                        "__pycache__", "pydoc_data", "lib2to3", "ensurepip"})


@attrs.define(frozen=True)
class Document:
    """One corpus text and where it came from."""

    source: str
    """Stable name, e.g. ``"topics:assignment"``, ``"doc:json/__init__.py:JSONDecoder"``, ``"code:json/decoder.py"``."""
    kind: str
    """``"prose"`` or ``"code"``."""
    text: str
    """The text itself."""


def corpus_id() -> str:
    """Identifier of the corpus recipe and the standard library it reads (e.g. ``stdlib-r1/py3.11.7``)."""
    return f"{CORPUS_RECIPE}/py{platform.python_version()}"


def _stdlib_dir() -> str:
    return sysconfig.get_paths()["stdlib"]


def _stdlib_files() -> list[tuple[str, str]]:
    """(relative name, absolute path) of every standard-library source file in the recipe, sorted."""
    root = _stdlib_dir()
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("config-"))
        for f in sorted(filenames):
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                out.append((os.path.relpath(path, root).replace(os.sep, "/"), path))
    return sorted(out)


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as fh:
            return fh.read()
    except (OSError, UnicodeDecodeError):
        return None


@functools.lru_cache(maxsize=1)
def _code_documents() -> tuple[Document, ...]:
    docs = []
    for rel, path in _stdlib_files():
        text = _read(path)
        if text and text.strip():
            docs.append(Document(f"code:{rel}", "code", text))
    return tuple(docs)


def _docstrings(rel: str, source: str) -> list[Document]:
    """Long module, class and function docstrings of one file, named by qualified name."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    out = []

    def visit(node, qualname: str) -> None:
        doc = ast.get_docstring(node, clean=True)
        if doc and len(doc) >= _MIN_DOCSTRING:
            out.append(Document(f"doc:{rel}:{qualname}" if qualname else f"doc:{rel}", "prose", doc))
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(child, f"{qualname}.{child.name}" if qualname else child.name)

    visit(tree, "")
    return out


@functools.lru_cache(maxsize=1)
def _prose_documents() -> tuple[Document, ...]:
    from pydoc_data.topics import topics

    docs = [Document(f"topics:{key}", "prose", topics[key]) for key in sorted(topics)]
    for code in _code_documents():
        docs.extend(_docstrings(code.source[len("code:"):], code.text))
    # A name can repeat only for conditional definitions (if/else branches): keep the first of each.
    seen, unique = set(), []
    for d in sorted(docs, key=lambda d: d.source):
        if d.source not in seen:
            seen.add(d.source)
            unique.append(d)
    return tuple(unique)


def _candidates(kind: str, min_chars: int) -> list[Document]:
    pool = _prose_documents() if kind == "prose" else _code_documents()
    return [d for d in pool if len(d.text) >= min_chars]


def _draw(kind: str, n: int, min_chars: int, rng: random.Random) -> list[Document]:
    cands = _candidates(kind, min_chars)
    if n > len(cands):
        raise StudyError(f"the offline corpus ({corpus_id()}) has only {len(cands)} {kind} texts of at least "
                         f"{min_chars} characters; asked for {n}. Lower n or min_chars.")
    return rng.sample(cands, n)


def corpus_documents(kind: str = "mixed", n: int = 20, min_chars: int = 0, seed: int = 0) -> list[Document]:
    """``n`` corpus documents of ``kind`` with at least ``min_chars`` characters, chosen by ``seed``.

    Parameters
    ----------
    kind : {"prose", "code", "mixed"}
        Which texts to draw; ``"mixed"`` is half code (n // 2) and half prose, interleaved.
    n : int
        Number of documents (>= 0).
    min_chars : int
        Minimum length of each document in characters.
    seed : int
        Seed of the deterministic draw; the same seed and corpus id give the same documents.
    """
    if kind not in KINDS:
        raise StudyError(f"unknown corpus kind {kind!r}; choose one of {list(KINDS)}")
    if n < 0 or min_chars < 0:
        raise StudyError(f"corpus n and min_chars must be >= 0; got n={n}, min_chars={min_chars}")
    rng = random.Random(f"{CORPUS_RECIPE}:{kind}:{seed}")
    if kind != "mixed":
        return _draw(kind, n, min_chars, rng)
    code = _draw("code", n // 2, min_chars, rng)
    prose = _draw("prose", n - n // 2, min_chars, rng)
    out = []
    for i in range(max(len(code), len(prose))):
        out.extend(x[i] for x in (prose, code) if i < len(x))
    return out


def corpus_texts(kind: str = "mixed", n: int = 20, min_chars: int = 0, seed: int = 0) -> list[str]:
    """The texts of :func:`corpus_documents` (same arguments, same order)."""
    return [d.text for d in corpus_documents(kind, n, min_chars, seed)]


def corpus_fingerprint(texts) -> str:
    """sha256 (first 16 hex digits) of a list of texts, for provenance records."""
    h = hashlib.sha256()
    for t in texts:
        data = t.encode("utf-8")
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()[:16]


_RESERVED_DIRS = frozenset({"test", "tests", "idle_test", "idlelib", "turtledemo", "lib2to3"})
"""Skipped folders whose docstrings are the reserved prose (:func:`reserved_text`)."""


def _reserved_files() -> list[tuple[str, str]]:
    """(relative name, absolute path) of the source files under the skipped folders of :data:`_RESERVED_DIRS`."""
    root, out = _stdlib_dir(), []
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = os.path.relpath(dirpath, root).replace(os.sep, "/")
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS - _RESERVED_DIRS and not d.startswith("config-"))
        if set(rel_dir.split("/")) & _RESERVED_DIRS:
            out += [(f"{rel_dir}/{f}", os.path.join(dirpath, f)) for f in sorted(filenames) if f.endswith(".py")]
    return sorted(out)


@functools.lru_cache(maxsize=1)
def _corpus_paragraphs() -> frozenset[str]:
    return frozenset().union(*(paragraphs(d.text) for d in _prose_documents() + _code_documents()))


def paragraphs(text: str) -> set[str]:
    """The stripped non-empty paragraphs (blocks between blank lines) of ``text``."""
    return {p.strip() for p in text.split("\n\n") if p.strip()}


def reserved_text(min_chars: int, *, seed: int = 0, separator: str = "\n\n") -> str:
    """At least ``min_chars`` characters of *reserved* prose, text that no corpus document (study filler, calibration
    sequence) contains: the docstrings (of at least ``_MIN_DOCSTRING`` characters) of the standard library's test
    suites, IDLE, the turtle demos and lib2to3, folders the recipe skips, read file by file in a seeded order and
    joined by ``separator``. A docstring copied from the rest of the library (one paragraph in common with any corpus
    document) is left out. For calibration items that must stay apart from the studies (the retrieval objective's
    haystacks, :mod:`polykv.profiling.objectives`)."""
    files = _reserved_files()
    random.Random(f"{CORPUS_RECIPE}:reserved:{seed}").shuffle(files)
    taken = _corpus_paragraphs()
    parts, total = [], 0
    for rel, path in files:
        if total >= min_chars:
            break
        text = _read(path)
        with warnings.catch_warnings():  # test suites hold deliberately odd literals (invalid escapes)
            warnings.simplefilter("ignore", (SyntaxWarning, DeprecationWarning))
            docs = _docstrings(rel, text) if text else []
        for d in docs:
            if not paragraphs(d.text) & taken:
                parts.append(d.text.strip())
                total += len(parts[-1]) + len(separator)
    if total < min_chars:
        raise StudyError(f"this Python's standard library ({corpus_id()}) holds only {total} characters of reserved "
                         f"prose (docstrings of its test suites and IDLE); asked for {min_chars}. Install the "
                         f"standard library's test suite and IDLE, or ask for less text")
    return separator.join(parts)


def filler_text(min_chars: int, *, kind: str = "prose", seed: int = 0, separator: str = "\n\n") -> str:
    """At least ``min_chars`` characters of real text: whole documents of ``kind`` joined by ``separator``.

    Documents are taken in the seeded order of the whole candidate pool, so the result is deterministic
    and never repeats a document; an error says so when the pool is too small.
    """
    if kind not in ("prose", "code"):
        raise StudyError(f"filler kind must be 'prose' or 'code'; got {kind!r}")
    pool = list(_candidates(kind, 1))
    random.Random(f"{CORPUS_RECIPE}:filler:{kind}:{seed}").shuffle(pool)
    parts, total = [], 0
    for d in pool:
        if total >= min_chars:
            break
        parts.append(d.text.strip())
        total += len(parts[-1]) + len(separator)
    if total < min_chars:
        raise StudyError(f"the offline corpus ({corpus_id()}) holds only {total} characters of {kind}; "
                         f"asked for {min_chars}")
    return separator.join(parts)
