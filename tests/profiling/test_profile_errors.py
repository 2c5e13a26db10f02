"""Every bad profile input is a ProfileError naming the file and the field."""

from __future__ import annotations

import json

import numpy as np
import pytest

from polykv.errors import ProfileError
from polykv.profiling.profile import CandidateConfig, Profile, StatTable, load_profile, moend_configs

CONFIGS = moend_configs("tova", keeps=(0.5, 1.0), k_bits=(16,), v_bits=(16, 4))  # 4 configs


def good() -> dict:
    p = Profile.from_table(np.full((2, 4), 0.5), CONFIGS, (2, 1, 8),
                           stats={"g": StatTable(columns=["tova"], values=[[1.0], [2.0]], higher_is_better=True)})
    return json.loads(p.to_json())


def write(tmp_path, raw, text=None):
    path = tmp_path / "bad.json"
    path.write_text(text if text is not None else json.dumps(raw))
    return str(path)


def edit(fn):
    raw = good()
    fn(raw)
    return raw


SHAPE = r"field 'metrics.l2': expected shape"
CASES = [
    ("empty table", edit(lambda r: r["metrics"].update(l2=[])), r"field 'metrics.l2': the table is empty"),
    ("empty rows", edit(lambda r: r["metrics"].update(l2=[[], []])), r"field 'metrics.l2': the table is empty"),
    ("columns != configs", edit(lambda r: r["configs"].pop()), SHAPE + r" \[2, 3\], got \[2, 4\]"),
    ("rows != layers", edit(lambda r: r["metrics"]["l2"].pop()), SHAPE + r" \[2, 4\], got \[1, 4\]"),
    ("ragged", edit(lambda r: r["metrics"]["l2"][0].pop()), r"field 'metrics.l2': rows have different lengths"),
    ("string value", edit(lambda r: r["metrics"]["l2"][1].__setitem__(2, "x")), r"field 'metrics.l2\[1\]\[2\]'"),
    ("schema", edit(lambda r: r.update(schema_version=2)), r"field 'schema_version': unknown schema version 2"),
    ("no schema", edit(lambda r: r.pop("schema_version")), r"field 'schema_version': missing required key"),
    ("unknown key", edit(lambda r: r.update(extra=1)), r"unknown key\(s\) \['extra'\]"),
    ("no metrics", edit(lambda r: r.update(metrics={})), r"field 'metrics': the profile has no metric table"),
    ("no configs", edit(lambda r: r.update(configs=[])), r"field 'configs': the profile lists no"),
    ("bad phase", edit(lambda r: r["configs"][0].update(phase="later")), r"field 'configs\[0\].phase': unknown phase"),
    ("bad bits", edit(lambda r: r["configs"][1].update(k_bits=3)), r"'configs\[1\].k_bits': unsupported bit width 3"),
    ("bad keep", edit(lambda r: r["configs"][2].update(keep=1.5)), r"field 'configs\[2\].keep': keep ratio must be in"),
    ("full keep", edit(lambda r: r["configs"][0].update(rule="full")), r"'configs\[0\].keep': rule 'full' keeps"),
    ("duplicate", edit(lambda r: r["configs"].__setitem__(1, dict(r["configs"][0]))),
     r"field 'configs\[1\]': duplicate"),
    ("missing keep", edit(lambda r: r["configs"][0].pop("keep")), r"field 'configs\[0\].keep': missing required key"),
    ("layers", edit(lambda r: r["model"].update(num_layers=0)), r"field 'model.num_layers': must be a positive"),
    ("format", edit(lambda r: r.update(format="polykv-plan")), r"field 'format'"),
    ("stat shape", edit(lambda r: r["stats"]["g"].update(columns=["tova", "h2o"])),
     r"field 'stats.g.values': expected shape"),
    ("stat flag", edit(lambda r: r["stats"]["g"].update(higher_is_better="yes")), r"field 'stats.g.higher_is_better'"),
]


@pytest.mark.parametrize("raw,pattern", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_file_names_file_and_field(tmp_path, raw, pattern):
    path = write(tmp_path, raw)
    with pytest.raises(ProfileError, match=pattern) as info:
        load_profile(path)
    assert str(info.value).startswith(path)


@pytest.mark.parametrize("text,pattern", [
    ('{"schema_version": 1,', r"malformed JSON at line 1"),
    (json.dumps(good()).replace("0.5", "NaN", 1), r"NaN is not a number"),
    (json.dumps(good()).replace("0.5", "Infinity", 1), r"Infinity is not a number"),
])
def test_malformed_text(tmp_path, text, pattern):
    with pytest.raises(ProfileError, match=pattern):
        load_profile(write(tmp_path, None, text))


def test_missing_file(tmp_path):
    with pytest.raises(ProfileError, match=r"nope.json: no such file"):
        load_profile(str(tmp_path / "nope.json"))


def test_python_construction_is_checked_too():
    with pytest.raises(ProfileError, match=r"field 'metrics.l2': non-finite value nan at layer 1, column 2"):
        t = np.zeros((2, 4))
        t[1, 2] = np.nan
        Profile.from_table(t, CONFIGS, (2, 1, 8))
    with pytest.raises(ProfileError, match=r"expected shape \[2, 3\], got \[2, 4\]"):
        Profile.from_table(np.zeros((2, 4)), CONFIGS[:3], (2, 1, 8))
    with pytest.raises(ProfileError, match=r"field 'configs': the profile lists no"):
        Profile.from_table(np.zeros((2, 0)), [], (2, 1, 8))
    with pytest.raises(ProfileError, match=r"field 'model.num_layers': must be a positive integer, got 0"):
        Profile.from_table(np.zeros((0, 4)), CONFIGS, (0, 1, 8))
    with pytest.raises(ProfileError, match=r"cannot read model dimensions"):
        Profile.from_table(np.zeros((2, 4)), CONFIGS, "llama")
    with pytest.raises(ProfileError, match=r"field 'metrics.kl': no such metric table"):
        Profile.from_table(np.zeros((2, 4)), CONFIGS, (2, 1, 8)).table("kl")
    with pytest.raises(ProfileError, match=r"field 'configs\[0\].phase'"):
        Profile.from_table(np.zeros((2, 1)), [CandidateConfig(rule="tova", keep=0.5, phase="x")], (2, 1, 8))
