"""Bad input to the user's-data loaders, the file tasks' shared options, the offline RULER tasks and the CSV
export through the Python API: one clear line each (polykv's own error class, naming the file, line, field or
parameter), and nothing written."""

from __future__ import annotations

import json

import pytest

from polykv.errors import OutputError, StudyError
from polykv.studies.export import write_csv
from polykv.studies.tasks import WhitespaceTokenizer, load_jsonl, load_longbench, load_ruler
from polykv.studies.tasks.words import CommonWordsTask, FrequentWordsTask

USER = {"context": "The code is 4417.", "question": "What is the code?", "answers": ["4417"]}
LB = {"context": "Paris is the capital.", "input": "Capital?", "answers": ["Paris"], "all_classes": None,
      "length": 4, "dataset": "hotpotqa", "_id": "a"}
RL = {"input": "The number is 42.\nWhat is the number?", "outputs": ["42"], "length": 9, "index": 0}


def _file(tmp_path, recs, name="data.jsonl"):
    path = tmp_path / name
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in recs))
    return str(path)


def _one_line(exc, *parts):
    msg = str(exc.value)
    assert "\n" not in msg, msg
    for part in parts:
        assert part in msg, (part, msg)


@pytest.mark.parametrize("recs,kw,parts", [
    ([USER, dict(USER, answers=None)], {}, ["data.jsonl line 2", "'answers'"]),
    ([USER, {k: v for k, v in USER.items() if k != "question"}], {}, ["line 2", "['question']"]),
    ([dict(USER, context=["a"])], {}, ["line 1", "'context'"]),
    ([USER], {"context_field": "passage"}, ["line 1", "['passage']", "context_field"]),
    ([USER, dict(USER, id=True)], {"id_field": "id"}, ["line 1", "['id']"]),
])
def test_load_jsonl_names_the_file_line_and_field(tmp_path, recs, kw, parts):
    with pytest.raises(StudyError) as exc:
        load_jsonl(_file(tmp_path, recs), **kw)
    _one_line(exc, *parts)


@pytest.mark.parametrize("load,recs,kw,param", [
    (load_jsonl, [USER], {"metric": "bleu"}, "metric"),
    (load_jsonl, [USER], {"stop": [3]}, "stop"),
    (load_jsonl, [USER], {"question_template": "{question} {0}"}, "question_template"),
    (load_jsonl, [USER], {"max_new_tokens": 0}, "max_new_tokens"),
    (load_longbench, [LB], {"question_template": "Q: {question}"}, "question_template"),
    (load_longbench, [LB], {"metric": "fidelity"}, "metric"),
    (load_longbench, [LB], {"max_new_tokens": -1}, "max_new_tokens"),
    (load_ruler, [RL], {"stop": "\n"}, "stop"),
    (load_ruler, [RL], {"metric": "bleu"}, "metric"),
])
def test_a_bad_option_is_named_before_the_file_is_read(tmp_path, load, recs, kw, param):
    with pytest.raises(StudyError) as exc:
        load(_file(tmp_path, recs), **kw)
    assert exc.value.param == param
    _one_line(exc, param)


def test_a_users_file_given_to_longbench_points_at_jsonl_file(tmp_path):
    with pytest.raises(StudyError) as exc:
        load_longbench(_file(tmp_path, [USER]))
    _one_line(exc, "line 1", "missing field(s) ['input'", "jsonl_file")


def test_cwe_past_its_word_list_and_fwe_below_five_words_say_what_to_change():
    with pytest.raises(StudyError) as exc:
        CommonWordsTask().make_items(WhitespaceTokenizer(), 1, seed=0, length=100_000)
    _one_line(exc, "word list", "params.length")
    with pytest.raises(StudyError) as exc:
        FrequentWordsTask().make_items(WhitespaceTokenizer(), 1, seed=0, length=200)
    assert exc.value.param == "length"
    _one_line(exc, "params.length")


def test_write_csv_refuses_a_users_file_and_a_missing_results_file_writing_nothing(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "policies.csv").write_text("name,score\nmine,1\n")
    results = _file(tmp_path, [{"format": "polykv-study-results", "kind": "header", "spec": {"name": "x"},
                                "spec_hash": "spec-0", "version": 1}], name="r.jsonl")
    with pytest.raises(OutputError) as exc:
        write_csv(results, str(out))
    _one_line(exc, "policies.csv")
    assert sorted(p.name for p in out.iterdir()) == ["policies.csv"]
    with pytest.raises(StudyError) as exc:
        write_csv(str(tmp_path / "absent.jsonl"), str(tmp_path / "fresh"))
    _one_line(exc, "absent.jsonl")
    assert not (tmp_path / "fresh").exists()
