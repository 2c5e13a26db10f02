"""LongBench and RULER JSONL loaders, and the scoring functions they use."""

import json

import pytest

from polykv.errors import StudyError
from polykv.studies.tasks import load_longbench, load_ruler
from polykv.studies.tasks import metrics as M
from polykv.studies.tasks.files import LongBenchFileTask, RulerFileTask


def write_jsonl(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return str(path)


def lb(i, dataset="hotpotqa", **kw):
    rec = {"context": f"Passage {i}. Paris is the capital of France.", "input": f"Question {i}?",
           "answers": ["Paris"], "all_classes": None, "length": 10 + i, "dataset": dataset, "_id": f"id{i}"}
    rec.update(kw)
    return rec


RULER_INPUT = ("Some special magic numbers are hidden within the following text. Make sure to memorize it.\n"
               "filler. One of the special magic numbers for wise-chord is: 1234567. more filler.\n"
               "What are all the special magic numbers for wise-chord mentioned in the provided text?")


def test_longbench_items_split_context_and_question(tmp_path):
    path = write_jsonl(tmp_path / "hotpotqa.jsonl", [lb(0), lb(1)])
    items = load_longbench(path)
    assert [i.id for i in items] == ["id0", "id1"]
    assert items[0].context == "Passage 0. Paris is the capital of France."
    assert items[0].question == "\n\nQuestion: Question 0?\nAnswer:"
    assert items[0].answers == ("Paris",) and items[0].metric == "qa_f1" and items[0].max_new_tokens == 32
    assert items[0].meta["line"] == 1 and items[0].task == "longbench_file"
    task = LongBenchFileTask()
    assert task.score(items[0], " Paris") == 1.0


def test_longbench_metric_per_dataset_and_first_line_rule(tmp_path):
    trec = lb(0, dataset="trec", answers=["Location"], all_classes=["Location", "Entity", "Human"])
    lcc = lb(1, dataset="lcc_e", answers=["return x + 1"])
    path = write_jsonl(tmp_path / "mixed.jsonl", [trec, lcc])
    t, c = load_longbench(path)
    assert (t.metric, c.metric) == ("classification", "code_sim")
    task = LongBenchFileTask()
    assert task.score(t, "Location\nHuman") == 1.0          # LongBench scores trec on the first line only
    assert task.score(t, "Human or Location") == 0.5
    assert task.score(c, "return x + 1\n") == 1.0


def test_longbench_format_errors_name_file_line_and_field(tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", [lb(0), "{not json"])
    with pytest.raises(StudyError, match=r"bad\.jsonl line 2: not valid JSON"):
        load_longbench(path)
    rec = lb(0)
    del rec["answers"]
    path = write_jsonl(tmp_path / "missing.jsonl", [lb(0), lb(1), rec])
    with pytest.raises(StudyError, match=r"missing\.jsonl line 3: missing field\(s\) \['answers'\]"):
        load_longbench(path)
    path = write_jsonl(tmp_path / "zh.jsonl", [lb(0, dataset="dureader")])
    with pytest.raises(StudyError, match="line 1: no built-in LongBench metric for dataset 'dureader'"):
        load_longbench(path)
    assert load_longbench(path, metric="string_match_part")[0].metric == "string_match_part"
    ruler_line = {"input": RULER_INPUT, "outputs": ["1234567"], "length": 50, "index": 0}
    path = write_jsonl(tmp_path / "ruler_as_lb.jsonl", [ruler_line])
    with pytest.raises(StudyError, match="Is this a LongBench file"):
        load_longbench(path)


def test_ruler_question_split_and_answer_prefix(tmp_path):
    recs = [{"input": RULER_INPUT, "outputs": ["1234567"], "length": 50, "index": 7},
            {"input": RULER_INPUT, "outputs": ["1234567"], "length": 50, "index": 8,
             "answer_prefix": " The special magic numbers for wise-chord mentioned in the provided text are"}]
    a, b = load_ruler(write_jsonl(tmp_path / "validation.jsonl", recs))
    assert a.context + a.question == RULER_INPUT
    assert a.question == "\nWhat are all the special magic numbers for wise-chord mentioned in the provided text?"
    assert "1234567" in a.context and a.id == "7"
    assert b.question.endswith("provided text are")
    assert RulerFileTask().score(a, " 1234567.") == 1.0


def test_ruler_errors(tmp_path):
    path = write_jsonl(tmp_path / "v.jsonl", [{"input": "no newline at all", "outputs": ["x"], "length": 1,
                                               "index": 0}])
    with pytest.raises(StudyError, match=r"v\.jsonl line 1: field 'input' has no '\\n'"):
        load_ruler(path)
    path = write_jsonl(tmp_path / "w.jsonl", [{"input": RULER_INPUT, "outputs": "1234567", "length": 1,
                                               "index": 0}])
    with pytest.raises(StudyError, match=r"w\.jsonl line 1: field 'outputs' must be a non-empty list"):
        load_ruler(path)
    with pytest.raises(StudyError, match="needs path="):
        RulerFileTask().make_items(None, 1)
    with pytest.raises(StudyError, match="no such RULER JSONL file"):
        load_ruler(str(tmp_path / "absent.jsonl"))


def test_file_tasks_draw_n_items_by_seed_in_file_order(tmp_path):
    path = write_jsonl(tmp_path / "hotpotqa.jsonl", [lb(i) for i in range(10)])
    task = LongBenchFileTask()
    a = task.make_items(None, 4, seed=1, path=path)
    assert a == task.make_items(None, 4, seed=1, path=path)
    assert [int(i.id[2:]) for i in a] == sorted(int(i.id[2:]) for i in a)
    assert [i.id for i in task.make_items(None, None, path=path)] == [f"id{i}" for i in range(10)]
    with pytest.raises(StudyError, match="holds 10"):
        task.make_items(None, 11, path=path)


# -- metrics, against hand-worked values ------------------------------------------------------------
def test_metrics_by_hand():
    # "The cat sat." -> [cat, sat]; "cat sat on the mat" -> [cat, sat, on, mat]: P = 1, R = 1/2, F1 = 2/3.
    assert M.qa_f1("The cat sat.", ["cat sat on the mat"]) == pytest.approx(2 / 3)
    assert M.qa_f1("dog", ["cat", "dog"]) == 1.0
    assert M.string_match_all("A1 and b2", ["a1", "B2", "c3", "d4"]) == 0.5
    assert M.string_match_part("nothing", ["a1", "b2"]) == 0.0
    assert M.first_number("key 00123 then 5", ["00123"]) == 1.0
    assert M.retrieval("Paragraph 3, maybe 4", ["Paragraph 3"]) == 0.5
    assert M.count("7 or 8 or 7", ["7"]) == pytest.approx(2 / 3)
    # LCS of [a, b, c, d] and [a, c, d, e] is [a, c, d]: P = R = 3/4.
    assert M.rouge_l("a b c d", ["a c d e"]) == pytest.approx(0.75)
    assert M.code_sim("```\nabcd", ["abce"]) == pytest.approx(0.75)
