"""Synthetic study tasks: lengths, needles, determinism, scoring, registration."""

import re

import pytest

from polykv.errors import StudyError
from polykv.registry import Registry
from polykv.studies import builtin_tasks
from polykv.studies.tasks import TEACHER_FORCED, WhitespaceTokenizer, count_tokens
from polykv.studies.tasks.continuation import ContinuationTask
from polykv.studies.tasks.niah import NeedleMultiKeyTask, NeedleMultiValueTask, NeedleSingleTask
from polykv.studies.tasks.passkey import PasskeyTask
from polykv.studies.tasks.variable_tracking import VariableTrackingTask


def prompt_tokens(tok, item):
    return count_tokens(tok, item.context) + count_tokens(tok, item.question)


@pytest.mark.parametrize("length", [512, 2048])
def test_passkey_key_once_and_length_within_5_percent(tokenizer, length):
    items = PasskeyTask().make_items(tokenizer, 3, seed=0, length=length)
    for item in items:
        key = item.answers[0]
        assert re.fullmatch(r"[1-9]\d{4}", key)
        assert item.context.count(key) == 1
        assert key not in item.question
        assert abs(prompt_tokens(tokenizer, item) - length) <= 0.05 * length
        assert item.question.endswith("The pass key is")


def test_passkey_depth_places_the_needle():
    tok = WhitespaceTokenizer()
    early = PasskeyTask().make_items(tok, 1, seed=0, depth=0.0)[0]
    late = PasskeyTask().make_items(tok, 1, seed=0, depth=1.0)[0]
    mid = PasskeyTask().make_items(tok, 1, seed=0, depth=0.5)[0]
    where = lambda it: it.context.index(f"The pass key is {it.answers[0]}") / len(it.context)  # noqa: E731
    assert where(early) < 0.1 and where(late) > 0.9 and 0.35 < where(mid) < 0.65
    assert mid.meta["depth"] == 0.5


def test_passkey_is_deterministic_and_item_i_ignores_n():
    tok = WhitespaceTokenizer()
    a = PasskeyTask().make_items(tok, 3, seed=4, length=600)
    b = PasskeyTask().make_items(tok, 5, seed=4, length=600)
    c = PasskeyTask().make_items(tok, 3, seed=5, length=600)
    assert a == b[:3]
    assert [i.answers for i in a] != [i.answers for i in c]
    assert len({i.answers[0] for i in b}) == 5


def test_passkey_scoring():
    task = PasskeyTask()
    item = task.make_items(WhitespaceTokenizer(), 1, seed=0, length=400)[0]
    key = item.answers[0]
    assert task.score(item, f" {key}. Remember it.") == 1.0
    assert task.score(item, " 12345") == (1.0 if key == "12345" else 0.0)
    assert task.score(item, f" unknown, maybe 1{key}") == 0.0
    assert task.score(item, " I do not know") == 0.0


def test_needle_variants(tokenizer):
    single = NeedleSingleTask().make_items(tokenizer, 2, seed=1, length=1024)
    multikey = NeedleMultiKeyTask().make_items(tokenizer, 2, seed=1, length=1024)
    multivalue = NeedleMultiValueTask().make_items(tokenizer, 2, seed=1, length=1024)
    for items, n_needles, n_answers in ((single, 1, 1), (multikey, 4, 1), (multivalue, 4, 4)):
        for item in items:
            assert item.context.count("One of the special magic numbers for") == n_needles
            assert len(item.answers) == n_answers
            for value in item.answers:
                assert item.context.count(value) == 1
            assert item.meta["queries"][0] in item.question
            assert item.meta["queries"][0] not in item.meta["keys"][1:]
            assert abs(prompt_tokens(tokenizer, item) - 1024) <= 0.05 * 1024


def test_needle_direct_question_keeps_needles_and_asks_in_passkey_style(tokenizer):
    ruler = NeedleSingleTask().make_items(tokenizer, 2, seed=3, length=1024)
    direct = NeedleSingleTask().make_items(tokenizer, 2, seed=3, length=1024, question="direct")
    for a, b in zip(ruler, direct):
        query = b.meta["queries"][0]
        assert b.answers == a.answers and b.meta["keys"] == a.meta["keys"]
        assert b.question.endswith(f"The special magic number for {query} is")
        assert "mentioned in the provided text" in a.question and "mentioned" not in b.question
        assert abs(prompt_tokens(tokenizer, b) - 1024) <= 0.05 * 1024
    several = NeedleMultiValueTask().make_items(tokenizer, 1, seed=3, length=1024, question="direct")[0]
    assert several.question.endswith("are") and len(several.answers) == 4
    with pytest.raises(StudyError, match="question"):
        NeedleSingleTask().make_items(tokenizer, 1, seed=3, length=1024, question="chat")


def test_needle_string_match_all_is_a_fraction():
    task = NeedleMultiValueTask()
    item = task.make_items(WhitespaceTokenizer(), 1, seed=0, length=800)[0]
    v = item.answers
    assert task.score(item, f" {v[0]}, {v[1]}, {v[2]} and {v[3]}.") == 1.0
    assert task.score(item, f" {v[2]} and {v[0]}") == 0.5
    assert task.score(item, " none") == 0.0


def test_variable_tracking_chain_in_order_and_scored(tokenizer):
    task = VariableTrackingTask()
    item = task.make_items(tokenizer, 1, seed=2, length=1024, num_chains=2, num_hops=3)[0]
    chain, value = item.meta["chains"][0], item.meta["values"][0]
    statements = [f"VAR {chain[0]} = {value}."] + [f"VAR {b} = VAR {a}." for a, b in zip(chain, chain[1:])]
    positions = [item.context.index(s) for s in statements]
    assert positions == sorted(positions)
    assert item.context.count(f"VAR {chain[-1]} ") == 1
    assert item.answers == tuple(chain) and len(chain) == 4
    assert value in item.question and "4 variables" in item.question
    assert task.score(item, " " + " ".join(chain)) == 1.0
    assert task.score(item, " " + " ".join(item.meta["chains"][1])) == 0.0
    assert abs(prompt_tokens(tokenizer, item) - 1024) <= 0.05 * 1024


def test_variable_tracking_answer_prefix_ends_the_question(tokenizer):
    plain = VariableTrackingTask().make_items(tokenizer, 1, seed=2, length=1024, num_hops=1)[0]
    primed = VariableTrackingTask().make_items(tokenizer, 1, seed=2, length=1024, num_hops=1, answer_prefix="VAR")[0]
    assert primed.question == plain.question + " VAR" and primed.answers == plain.answers
    assert plain.question.endswith("they are:")


def test_continuation_items_split_one_text(tokenizer):
    task = ContinuationTask()
    item = task.make_items(tokenizer, 1, seed=0, context_tokens=800, continuation_tokens=100)[0]
    assert task.mode == TEACHER_FORCED and item.question == "" and item.max_new_tokens == 0
    assert abs(count_tokens(tokenizer, item.context) - 800) <= 40
    assert abs(count_tokens(tokenizer, item.answers[0]) - 100) <= 16
    from polykv.models.corpus import filler_text
    # The continuation is the text that follows the context in the same corpus stream.
    stream = item.context + item.answers[0]
    assert filler_text(len(stream) + 1, kind="prose", seed=item.meta["filler_seed"]).startswith(stream)
    assert item.context[-1].isspace() and not item.answers[0][0].isspace()
    with pytest.raises(StudyError, match="teacher-forced"):
        task.score(item, "anything")


def test_parameter_and_length_errors():
    tok = WhitespaceTokenizer()
    with pytest.raises(StudyError, match="task 'passkey' has no parameter"):
        PasskeyTask().make_items(tok, 1, lenght=100)
    with pytest.raises(StudyError, match="raise the length"):
        PasskeyTask().make_items(tok, 1, length=10)
    with pytest.raises(StudyError, match="num_queries"):
        NeedleSingleTask().make_items(tok, 1, num_queries=2)


def test_builtin_tasks_register_through_the_hook():
    reg = Registry(load_entry_points=False)
    assert set(reg.names("task")) == {t.name for t in builtin_tasks.TASKS}
    assert reg.task("passkey") is PasskeyTask
    assert reg.entry("task", "niah_multikey").plugin == "polykv.studies.builtin_tasks"
    for task in builtin_tasks.TASKS:
        assert task.name and task.description and isinstance(task.defaults, dict)
