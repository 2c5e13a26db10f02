"""The one field reader behind plan, profile and study-spec files: each refusal is the file kind's own
error, names the file and the dotted field (the key itself for an unknown key) and says what to do."""

from __future__ import annotations

import copy
import json

import pytest

from cases import plan_dict, profile_dict
from polykv.errors import PlanError, ProfileError, StudyError
from polykv.plan.io import parse_plan_dict
from polykv.profiling.profile import from_dict
from polykv.strict_json import FieldReader
from polykv.studies.spec import load_spec


def test_each_kind_keeps_its_error_type_and_names_the_unknown_key_itself(tmp_path):
    plan = plan_dict()
    plan["layers"][0]["prefill"]["capcity"] = 3
    with pytest.raises(PlanError, match=r"p\.json, layer 0, field 'layers\[0\]\.prefill\.capcity': unknown key"):
        parse_plan_dict(plan, "p.json")
    prof = profile_dict()
    prof["model"]["colour"] = 1
    with pytest.raises(ProfileError, match=r"q\.json, field 'model\.colour': unknown key.*allowed keys here"):
        from_dict(prof, "q.json")
    (tmp_path / "s.json").write_text(json.dumps({"tasks": [{"task": "passkey", "sampels": 2}]}))
    with pytest.raises(StudyError, match=r"s\.json: field 'tasks\[0\]\.sampels': unknown key"):
        load_spec(str(tmp_path / "s.json"))


def test_a_profile_schema_version_of_true_is_not_version_1():
    prof = copy.deepcopy(profile_dict())
    prof["schema_version"] = True
    with pytest.raises(ProfileError, match=r"field 'schema_version': unknown schema version True"):
        from_dict(prof, "q.json")


def test_malformed_spec_json_names_the_line_and_how_to_find_it(tmp_path):
    (tmp_path / "s.json").write_text('{"tasks": [\n}')
    with pytest.raises(StudyError, match=r"s\.json: malformed JSON at line 2, column 1: .*json\.tool"):
        load_spec(str(tmp_path / "s.json"))


@pytest.mark.parametrize("call, message", [
    (lambda r: r.int_(True, "a.n", minimum=1), r"field 'a\.n': expected an integer, got True"),
    (lambda r: r.int_(0, "a.n", minimum=1), r"field 'a\.n': must be >= 1, got 0"),
    (lambda r: r.float_(1e30, "a.x", maximum=1e9), r"field 'a\.x': must be <= 1e\+09.*fix the number"),
    (lambda r: r.str_("", "a.s", nonempty=True), r"field 'a\.s': expected a non-empty string, got ''"),
    (lambda r: r.bool_(1, "a.b"), r"field 'a\.b': expected true or false, got 1"),
    (lambda r: r.choice(1, "a.c", (True, "auto"), "mode"), r"field 'a\.c': unknown mode 1; use true or \"auto\""),
    (lambda r: r.list_([], "a.l", nonempty=True, what="a non-empty list"), r"field 'a\.l': expected a non-empty list"),
    (lambda r: r.obj({}, "a", ["k"]), r"field 'a\.k': missing required key"),
    (lambda r: r.obj([], "a"), r"field 'a': expected a JSON object, got list"),
])
def test_every_getter_refuses_with_the_dotted_field(call, message):
    with pytest.raises(PlanError, match=r"^f\.json, " + message):
        call(FieldReader("f.json", PlanError))
