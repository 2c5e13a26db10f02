"""The synthetic RULER suite made offline: every task builds a 4k-token item in under a second of CPU, the same
item for the same seed, and each item's answers can be read back from its own context."""

import collections
import re
import time

import pytest

from polykv.errors import StudyError
from polykv.registry import get_registry
from polykv.studies.tasks import CharTokenizer, prompt_length
from polykv.studies.tasks.niah import NEEDLE
from polykv.studies.tasks.words import CWE_INSTRUCTION, FWE_INSTRUCTION, NOISE, CommonWordsTask, cwe_vocabulary, zeta

RULER_TASKS = ("niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery", "variable_tracking", "cwe",
               "fwe")


def make(name, tokenizer, n=2, seed=0, **params):
    return get_registry().task(name)().make_items(tokenizer, n, seed=seed, **params)


def check_answers(item):
    """The item's answers, recomputed from its context alone."""
    ctx = item.context
    if item.task.startswith("niah"):
        for key in item.meta["queries"]:
            found = re.findall(re.escape(NEEDLE.format(key=key, value="@")).replace("@", r"(\d+)"), ctx)
            assert found, key
        queried = [v for key in item.meta["queries"]
                   for v in re.findall(re.escape(NEEDLE.format(key=key, value="@")).replace("@", r"(\d+)"), ctx)]
        assert sorted(queried) == sorted(item.answers)
        for key in item.meta["queries"]:
            assert key in item.question
    elif item.task == "variable_tracking":
        chain = list(item.answers)
        value = item.meta["values"][0]
        assert f"VAR {chain[0]} = {value}." in ctx and value in item.question
        positions = [ctx.index(f"VAR {b} = VAR {a}.") for a, b in zip(chain, chain[1:])]
        assert positions == sorted(positions) and positions[0] > ctx.index(f"VAR {chain[0]} = {value}.")
    elif item.task == "cwe":
        listed = re.findall(r"\d+\. (\w+)", ctx.rsplit(CWE_INSTRUCTION, 1)[1])
        counts = collections.Counter(listed)
        n = len(item.answers)
        top = counts.most_common()
        assert {w for w, _ in top[:n]} == set(item.answers)
        assert top[n - 1][1] > top[n][1]                       # the answer is the top n without ties
    elif item.task == "fwe":
        words = ctx.split(FWE_INSTRUCTION, 1)[1].split()
        counts = collections.Counter(w for w in words if w != NOISE)
        top = counts.most_common(4)
        assert tuple(w for w, _ in top[:3]) == item.answers
        assert top[0][1] > top[1][1] > top[2][1] > top[3][1]
        assert collections.Counter(words).most_common(1)[0][0] == NOISE   # the noise outnumbers every word
    else:
        raise AssertionError(item.task)


@pytest.mark.parametrize("name", RULER_TASKS)
def test_each_items_answers_are_read_back_from_its_context(name, tokenizer):
    length = 12000 if isinstance(tokenizer, CharTokenizer) else 1500    # one token per character
    for item in make(name, tokenizer, n=2, seed=3, length=length):
        assert item.metric == "string_match_all" and item.answers
        check_answers(item)
        assert abs(prompt_length(tokenizer, item.context, item.question) - length) <= 0.05 * length
        assert not set(item.answers) & set(re.findall(r"\w+", item.question)) or item.task.startswith("niah")


@pytest.mark.parametrize("name", RULER_TASKS)
def test_an_item_at_4k_tokens_takes_under_a_second_and_is_the_same_for_the_same_seed(name, bpe_tokenizer):
    make(name, bpe_tokenizer, n=1, seed=9, length=2048)                # corpus and word lists loaded once
    start = time.process_time()
    items = make(name, bpe_tokenizer, n=2, seed=0, length=4096)
    per_item = (time.process_time() - start) / 2
    assert per_item < 1.0, f"{name}: {per_item:.2f} s of CPU per item"
    for item in items:
        check_answers(item)
        assert abs(item.meta["tokens"] - 4096) <= 0.05 * 4096
    again = make(name, bpe_tokenizer, n=2, seed=0, length=4096)
    assert [(i.context, i.question, i.answers) for i in items] == [(i.context, i.question, i.answers) for i in again]
    other = make(name, bpe_tokenizer, n=1, seed=1, length=4096)[0]
    assert (other.context, other.answers) != (items[0].context, items[0].answers)


def test_templates_and_scoring_follow_ruler():
    from polykv.studies.tasks import WhitespaceTokenizer

    tok = WhitespaceTokenizer()
    mq = make("niah_multiquery", tok, n=1, length=800)[0]
    a, b, c, d = mq.meta["queries"]
    assert f"for {a}, {b}, {c}, and {d} mentioned in the provided text are" in mq.question
    cwe = make("cwe", tok, n=1, length=800)[0]
    assert cwe.question == ("\nQuestion: What are the 10 most common words in the above list? Answer: The top 10 "
                            "words that appear most often in the list are:") and cwe.max_new_tokens == 120
    assert cwe.context.count(CWE_INSTRUCTION) == 2            # the worked example, then the list
    fwe = make("fwe", tok, n=1, length=800)[0]
    assert fwe.question.endswith("the three most frequently appeared words are:") and fwe.max_new_tokens == 50
    task = get_registry().task("cwe")()
    assert task.score(cwe, " " + " ".join(f"{i + 1}. {w}" for i, w in enumerate(cwe.answers[:5]))) == 0.5
    assert abs(zeta(2.0) - 3.141592653589793 ** 2 / 6) < 1e-9


def test_short_budgets_use_rulers_short_cwe_and_words_run_out_clearly():
    short = {"length": 3975, "max_new_tokens": 120, "freq_cw": None, "freq_ucw": None}
    assert CommonWordsTask.repeats(short)[:2] == (6, 1)                  # RULER's 4k counts generated tokens too
    assert CommonWordsTask.repeats(dict(short, length=3976))[:2] == (30, 3)
    assert len(set(cwe_vocabulary())) == len(cwe_vocabulary()) > 2000
    from polykv.studies.tasks import WhitespaceTokenizer

    with pytest.raises(StudyError, match=r"shipped word list .* lower params.length"):
        make("cwe", WhitespaceTokenizer(), n=1, length=200_000)
    with pytest.raises(StudyError, match="freq_cw"):
        make("cwe", WhitespaceTokenizer(), n=1, freq_cw=2, freq_ucw=2)
