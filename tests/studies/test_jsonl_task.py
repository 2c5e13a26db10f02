"""The user's own JSONL data as a task, and the options every file task shares (metric, max_new_tokens, stop,
question_template): honest answer-span scoring, one-line errors naming the file, line and field."""

import json

import pytest

from polykv.errors import StudyError
from polykv.registry import get_registry
from polykv.studies.tasks import load_jsonl, load_longbench, load_ruler
from polykv.studies.tasks.base import answer_span
from polykv.studies.tasks.files import LongBenchFileTask, RulerFileTask
from polykv.studies.tasks.jsonl import JSONL_METRICS, JsonlFileTask


def write_jsonl(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return str(path)


def line(i, **kw):
    rec = {"context": f"Note {i}. The meeting moved to room {100 + i}.", "question": f"Which room for note {i}?",
           "answers": [f"room {100 + i}", f"{100 + i}"]}
    rec.update(kw)
    return rec


def test_items_keep_context_apart_and_put_the_question_in_the_template(tmp_path):
    path = write_jsonl(tmp_path / "mine.jsonl", [line(0), line(1, answers="room 101")])
    a, b = load_jsonl(path)
    assert a.context == "Note 0. The meeting moved to room 100." and "room 100" not in a.question
    assert a.question == "\n\nQuestion: Which room for note 0?\nAnswer:"
    assert a.answers == ("room 100", "100") and b.answers == ("room 101",)   # a string is one answer
    assert (a.id, b.id) == ("line-1", "line-2") and a.metric == "string_match_part" and a.max_new_tokens == 32
    assert get_registry().task("jsonl_file") is JsonlFileTask


def test_field_names_id_field_template_and_options_are_parameters(tmp_path):
    recs = [{"passage": "The code is 4417.", "ask": "What is the code?", "gold": "4417", "uid": "q7"}]
    path = write_jsonl(tmp_path / "renamed.jsonl", recs)
    (item,) = JsonlFileTask().make_items(None, 1, 0, path=path, context_field="passage", question_field="ask",
                                         answers_field="gold", id_field="uid", question_template=" Q: {question} A:",
                                         metric="exact_match", max_new_tokens=5, stop=["."])
    assert (item.id, item.question, item.max_new_tokens, item.meta["stop"]) == ("q7", " Q: What is the code? A:", 5,
                                                                                (".",))
    task = JsonlFileTask()
    assert task.score(item, " 4417. The code is 4417.") == 1.0
    assert task.score(item, " The code is 4417.") == 0.0                      # exact match of the span


def test_default_scoring_reads_the_answer_span_only(tmp_path):
    path = write_jsonl(tmp_path / "mine.jsonl", [line(0)])
    (item,) = load_jsonl(path)
    task = JsonlFileTask()
    assert task.score(item, " Room 100, on the first floor.\nMore text") == 1.0
    # A generation that answers wrongly, then repeats the context, earns nothing for the repeat:
    assert task.score(item, " I do not know.\nNote 0. The meeting moved to room 100.") == 0.0
    assert task.score(item, "\n\n room 100") == 1.0                         # leading blank lines are skipped
    (whole,) = load_jsonl(path, stop=())
    assert task.score(whole, " I do not know.\nNote 0. The meeting moved to room 100.") == 1.0
    assert answer_span("  a. b\nc", (".", "\n")) == "a" and answer_span("abc", ()) == "abc"


def test_every_listed_metric_scores_a_span(tmp_path):
    path = write_jsonl(tmp_path / "mine.jsonl", [line(0)])
    for metric in JSONL_METRICS:
        (item,) = load_jsonl(path, metric=metric)
        assert 0.0 <= JsonlFileTask().score(item, " room 100") <= 1.0
        assert JsonlFileTask().score(item, " room 100") > 0.0, metric


@pytest.mark.parametrize("recs,params,match", [
    ([line(0), {"context": "x", "question": "y"}], {}, r"mine\.jsonl line 2: missing field\(s\) \['answers'\]"),
    ([line(0, answers=[1])], {}, r"line 1: field 'answers' must be a non-empty string or a non-empty list"),
    ([line(0, context="")], {}, r"line 1: field 'context' is empty"),
    ([line(0, question=" ")], {}, r"line 1: field 'question' is empty"),
    ([line(0), "{bad"], {}, r"line 2: not valid JSON"),
    ([line(0, uid=1), line(1, uid=1)], {"id_field": "uid"}, r"line 2: field 'uid' is '1', the id of line 1"),
    ([line(0, uid=[1])], {"id_field": "uid"}, r"line 1: field 'uid' must be a non-empty string or an integer"),
    ([line(0)], {"answers_field": "gold"}, r"missing field\(s\) \['gold'\].*set context_field"),
    ([line(0)], {"metric": "classification"}, r"params.metric|parameter 'metric'"),
    ([line(0)], {"stop": "\n"}, r"params.stop must be a list of non-empty strings"),
    ([line(0)], {"question_template": "{question} {x}"}, r"params.question_template .* no other \(found"),
    ([line(0)], {"question_template": "{question"}, r"not a valid format string"),
])
def test_bad_lines_and_options_name_the_file_line_and_field(tmp_path, recs, params, match):
    path = write_jsonl(tmp_path / "mine.jsonl", recs)
    with pytest.raises(StudyError, match=match) as err:
        JsonlFileTask().make_items(None, None, 0, path=path, **params)
    assert "\n" not in str(err.value)


def test_a_bad_option_carries_the_parameter_it_names(tmp_path):
    with pytest.raises(StudyError) as err:
        JsonlFileTask().params(metric="bleu")
    assert err.value.param == "metric"
    with pytest.raises(StudyError) as err:
        LongBenchFileTask().params(stop=[""])
    assert err.value.param == "stop"


def test_longbench_takes_max_new_tokens_and_stop_and_scores_unknown_datasets_on_the_first_line(tmp_path):
    rec = {"context": "Paris is the capital of France.", "input": "Capital of France?", "answers": ["Paris"],
           "all_classes": None, "length": 9, "dataset": "my_qa", "_id": "a"}
    path = write_jsonl(tmp_path / "lb.jsonl", [rec, dict(rec, _id="b", dataset="hotpotqa")])
    mine, hotpot = load_longbench(path, metric="string_match_part")
    assert mine.max_new_tokens == 32 and mine.meta["stop"] == ("\n",)       # not 128 tokens searched anywhere
    assert hotpot.max_new_tokens == 32 and "stop" not in hotpot.meta         # LongBench's own protocol
    task = LongBenchFileTask()
    assert task.score(mine, " I am not sure.\nParis is the capital of France.") == 0.0
    assert task.score(mine, " Paris.") == 1.0
    custom, _ = task.make_items(None, None, 0, path=path, metric="string_match_part", max_new_tokens=7, stop=["."])
    assert custom.max_new_tokens == 7 and custom.meta["stop"] == (".",)


def test_longbench_refuses_a_users_file_and_points_at_jsonl_file(tmp_path):
    path = write_jsonl(tmp_path / "mine.jsonl", [line(0)])
    with pytest.raises(StudyError, match=r"missing field\(s\) \['input'.*use the task 'jsonl_file'"):
        load_longbench(path)


def test_ruler_takes_stop_strings(tmp_path):
    rec = {"input": "The number is 42.\nWhat is the number?", "outputs": ["42"], "length": 9, "index": 0}
    path = write_jsonl(tmp_path / "r.jsonl", [rec])
    (whole,) = load_ruler(path)
    (cut,) = RulerFileTask().make_items(None, None, 0, path=path, stop=["\n"])
    assert "stop" not in whole.meta and cut.meta["stop"] == ("\n",)
    assert RulerFileTask().score(whole, "no.\n42") == 1.0 and RulerFileTask().score(cut, "no.\n42") == 0.0
