"""The docs match the code: every plan field and every hook is documented, and examples run."""

from __future__ import annotations

import re
from pathlib import Path

import attrs
import pytest

from polykv.contract import hookspecs
from polykv.plan import AllocationGroup, LayerPlan, ModelInfo, OpSpec, Plan, Provenance, TriggerSettings

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"


def _sections(text: str) -> dict[str, str]:
    """``## heading`` -> body up to the next ``##`` heading."""
    parts = re.split(r"^## +(.+)$", text, flags=re.M)
    return {parts[i].strip(): parts[i + 1] for i in range(1, len(parts), 2)}


def _python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.M | re.S)


def _table_fields(body: str) -> set[str]:
    return set(re.findall(r"^\| `([a-z_]+)` \|", body, flags=re.M))


# -- plan format ----------------------------------------------------------------------------------

RECORDS = {"Plan": Plan, "ModelInfo": ModelInfo, "TriggerSettings": TriggerSettings, "Provenance": Provenance,
           "LayerPlan": LayerPlan, "OpSpec": OpSpec, "AllocationGroup": AllocationGroup}


@pytest.mark.parametrize("record", sorted(RECORDS))
def test_every_plan_field_is_documented_and_nothing_else(record):
    sections = _sections((DOCS / "plan-format.md").read_text(encoding="utf-8"))
    (body,) = [b for h, b in sections.items() if f"({record})" in h]
    documented = _table_fields(body)
    real = {f.name for f in attrs.fields(RECORDS[record])}
    assert real - documented == set(), f"fields of {record} missing from docs/plan-format.md"
    assert documented - real == set(), f"docs/plan-format.md documents fields {record} does not have"


def test_plan_format_examples_run():
    blocks = _python_blocks((DOCS / "plan-format.md").read_text(encoding="utf-8"))
    assert blocks
    for block in blocks:
        exec(compile(block, "docs/plan-format.md", "exec"), {"__name__": "docs_example"})


def test_plan_format_json_example_is_a_valid_plan(tmp_path):
    from polykv.plan import load_plan
    from polykv.registry import get_registry

    text = (DOCS / "plan-format.md").read_text(encoding="utf-8")
    (example,) = re.findall(r"^```json\n(.*?)^```", text, flags=re.M | re.S)
    path = tmp_path / "example.json"
    path.write_text(example, encoding="utf-8")
    plan = load_plan(str(path), registry=get_registry())
    plan.save(str(path))
    assert path.read_text(encoding="utf-8") == example, "the example is not in canonical (saved) form"


# -- plugin hooks ---------------------------------------------------------------------------------

HOOKS = sorted(name for name, obj in vars(hookspecs).items()
               if callable(obj) and hasattr(obj, f"{hookspecs.PROJECT}_spec"))


def test_hookspecs_are_found():
    assert "register_operators" in HOOKS and len(HOOKS) >= 4


@pytest.mark.parametrize("hook", HOOKS)
def test_every_hook_is_documented_with_a_running_example(hook):
    sections = _sections((DOCS / "plugins.md").read_text(encoding="utf-8"))
    assert hook in sections, f"hook {hook} (polykv/contract/hookspecs.py) has no '## {hook}' section in docs/plugins.md"
    body = sections[hook]
    assert f"{hook}(register)" in body, "the section must show the hook's signature"
    assert "| `register` |" in body, "the section must describe the hook's parameters"
    blocks = _python_blocks(body)
    assert blocks, f"the {hook} section has no python example"
    for block in blocks:
        assert f"def {hook}(" in block, "the example must implement the hook it documents"
        exec(compile(block, f"docs/plugins.md#{hook}", "exec"), {"__name__": "docs_example"})


def test_every_documented_hook_exists():
    sections = _sections((DOCS / "plugins.md").read_text(encoding="utf-8"))
    documented = {h for h in sections if h.startswith("register_")}
    assert documented == set(HOOKS)


# -- links ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("page", ["README.md", "docs/index.md", "docs/concepts.md", "docs/plan-format.md",
                                  "docs/plugins.md", "docs/cli.md", "docs/results.md",
                                  "CONTRIBUTING.md"])
def test_relative_links_resolve(page):
    path = ROOT / page
    for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", path.read_text(encoding="utf-8")):
        assert (path.parent / target).exists(), f"{page} links to missing {target}"


def test_cli_doc_covers_every_verb():
    from polykv.cli import build_parser

    parser = build_parser()
    (sub,) = [a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction"]
    text = (DOCS / "cli.md").read_text(encoding="utf-8")
    for verb in sub.choices:
        assert f"## polykv {verb}" in text, f"docs/cli.md has no section for `polykv {verb}`"


# -- README tour ----------------------------------------------------------------------------------

@pytest.mark.model
def test_readme_tour_runs_as_shown(tmp_path, monkeypatch, capsys):
    """The README's Python blocks, run in order from a copy of the repository's data folders (as from a fresh
    clone): the shipped exact 8x plan runs with the query statistics its plan names, nothing computed."""
    import shutil
    import warnings

    from polykv.contract.model_data import ModelDataNote

    for folder in ("plans", "profiles"):
        shutil.copytree(ROOT / folder, tmp_path / folder)
    monkeypatch.chdir(tmp_path)
    blocks = _python_blocks((ROOT / "README.md").read_text(encoding="utf-8"))
    assert blocks and 'polykv.load_plan("plans/smollm2-135m-instruct.exact.8x.plan.json")' in blocks[0]
    namespace = {"__name__": "readme_tour"}
    with warnings.catch_warnings():
        warnings.simplefilter("error", ModelDataNote)
        warnings.simplefilter("error", FutureWarning)
        for block in blocks:
            exec(compile(block, "README.md", "exec"), namespace)
            printed = capsys.readouterr().out.strip()
            assert int(printed.rsplit(" ", 1)[1]) > 0                     # the run's resident bytes
    assert "triattention" in namespace["polykv"].load_plan("plans/smollm2-135m-instruct.exact.8x.plan.json").rules_used()
