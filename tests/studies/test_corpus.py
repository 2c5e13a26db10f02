"""The offline corpus: deterministic, versioned, real prose and code from the standard library."""

import ast
import platform

import pytest

from polykv.errors import StudyError
from polykv.models import corpus


def test_corpus_id_names_recipe_and_python():
    assert corpus.corpus_id() == f"{corpus.CORPUS_RECIPE}/py{platform.python_version()}"


def test_selection_is_deterministic_by_seed():
    a = corpus.corpus_documents("mixed", 8, 1000, seed=3)
    assert a == corpus.corpus_documents("mixed", 8, 1000, seed=3)
    assert [d.source for d in a] != [d.source for d in corpus.corpus_documents("mixed", 8, 1000, seed=4)]
    assert corpus.corpus_texts("mixed", 8, 1000, seed=3) == [d.text for d in a]
    assert corpus.corpus_fingerprint([d.text for d in a]) == corpus.corpus_fingerprint(
        corpus.corpus_texts("mixed", 8, 1000, seed=3))


def test_kinds_and_min_chars():
    prose = corpus.corpus_documents("prose", 10, 2000, seed=0)
    code = corpus.corpus_documents("code", 10, 2000, seed=0)
    mixed = corpus.corpus_documents("mixed", 5, 2000, seed=0)
    assert all(d.kind == "prose" and len(d.text) >= 2000 for d in prose)
    assert all(d.kind == "code" and len(d.text) >= 2000 for d in code)
    assert [d.kind for d in mixed] == ["prose", "code", "prose", "code", "prose"]
    assert len({d.source for d in prose}) == 10
    for d in code:
        ast.parse(d.text)  # real Python source
    assert all(d.source.startswith(("topics:", "doc:")) for d in prose)


def test_prose_is_mostly_words():
    text = " ".join(corpus.corpus_texts("prose", 20, 1000, seed=1))
    words = text.split()
    alpha = sum(w.strip(".,;:()\"'").isalpha() for w in words)
    assert alpha / len(words) > 0.6


def test_errors_say_what_to_change():
    with pytest.raises(StudyError, match="unknown corpus kind"):
        corpus.corpus_texts("poetry", 1)
    with pytest.raises(StudyError, match="Lower n or min_chars"):
        corpus.corpus_texts("prose", 5, min_chars=10_000_000)


def test_filler_text_is_long_enough_and_prefix_stable():
    short = corpus.filler_text(5000, seed=2)
    long = corpus.filler_text(20000, seed=2)
    assert len(short) >= 5000 and len(long) >= 20000
    assert long.startswith(short)
    assert corpus.filler_text(5000, seed=3) != short
