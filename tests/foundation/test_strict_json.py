"""The strict JSON parser every file reader shares refuses what plain ``json.loads`` lets through."""

import pytest

from polykv.strict_json import MAX_DEPTH, JsonInputError, loads_strict


@pytest.mark.parametrize("text, words", [
    ('{"a": 1, "a": 2}', "appears twice"),
    ('[1, NaN]', "NaN"),
    ('{"x": -Infinity}', "Infinity"),
    ('"\\ud800"', "lone surrogate"),
    ('{"name": ["ok", "\\udfff"]}', "name[1]"),
    ("[" * 100_000 + "]" * 100_000, "nested deeper"),
    ('{"a": [1, 2', "line 1"),
])
def test_refused_with_a_reason(text, words):
    with pytest.raises(JsonInputError, match=None) as info:
        loads_strict(text)
    assert words in str(info.value)


def test_valid_json_reads_as_json_does():
    text = '{"a": [1, 2.5, "x\\u00e9", null, true], "b": {"c": "[{"}}'
    assert loads_strict(text) == {"a": [1, 2.5, "x\u00e9", None, True], "b": {"c": "[{"}}


def test_depth_limit_counts_only_structure_not_brackets_in_strings():
    assert loads_strict("[" * MAX_DEPTH + "]" * MAX_DEPTH)
    assert loads_strict('["' + "[" * 500 + '"]') == ["[" * 500]
    with pytest.raises(JsonInputError):
        loads_strict("[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1))
