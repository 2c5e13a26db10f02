"""A study's hash covers what makes its items, so a results file never resumes into other items."""

from __future__ import annotations

from polykv.registry import get_registry
from polykv.studies.spec import load_spec


def test_changed_task_default_changes_the_hash(tmp_path, spec_writer, monkeypatch):
    spec = load_spec(spec_writer(tmp_path))
    before = spec.hash
    assert load_spec(spec_writer(tmp_path)).hash == before       # deterministic
    task_cls = get_registry().task("passkey")
    monkeypatch.setattr(task_cls, "defaults", {**task_cls.defaults, "filler": "prose"
                                               if task_cls.defaults["filler"] == "code" else "code"})
    assert spec.hash != before

