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
    assert "register_rules" in HOOKS and len(HOOKS) >= 4


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
                                  "docs/plugins.md", "docs/cli.md", "docs/results.md", "docs/architecture.md",
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


# -- architecture map -----------------------------------------------------------------------------

ARCHITECTURE = DOCS / "architecture.md"
_MODULE_PATH = re.compile(r"\b((?:polykv|adapters)/[\w/]*\w\.py)\b")


def _architecture_paths() -> set[str]:
    return set(_MODULE_PATH.findall(ARCHITECTURE.read_text(encoding="utf-8")))


def test_every_module_path_in_the_architecture_page_exists():
    missing = sorted(p for p in _architecture_paths() if not (ROOT / p).is_file())
    assert not missing, f"docs/architecture.md names modules that do not exist: {missing}"


def test_the_architecture_file_map_names_every_module():
    real = {p.relative_to(ROOT).as_posix() for base in ("polykv", "adapters") for p in (ROOT / base).rglob("*.py")}
    unmapped = sorted(real - _architecture_paths())
    assert not unmapped, f"add a line for each to the file map of docs/architecture.md: {unmapped}"


def test_the_path_check_catches_a_missing_module(tmp_path, monkeypatch):
    page = tmp_path / "architecture.md"
    page.write_text("| `polykv/runtime/session.py` | ... `polykv/runtime/no_such_module.py` |\n", encoding="utf-8")
    monkeypatch.setitem(globals(), "ARCHITECTURE", page)
    with pytest.raises(AssertionError, match="no_such_module"):
        test_every_module_path_in_the_architecture_page_exists()


def newcomer_path() -> list[tuple[str, int, int]]:
    """(file, lines, code lines) of the newcomer-path table of docs/architecture.md, counted now: code
    lines hold a token other than a comment, docstrings excluded."""
    import ast
    import io
    import tokenize

    text = ARCHITECTURE.read_text(encoding="utf-8").split("## The newcomer path", 1)[1].split("\n## ", 1)[0]
    out = []
    for path in re.findall(r"^\| `([\w/]+\.py)` \|", text, flags=re.M):
        source = (ROOT / path).read_text(encoding="utf-8")
        docs = set()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
                docs |= set(range(node.lineno, node.end_lineno + 1))
        code = set()
        for tok in tokenize.generate_tokens(io.StringIO(source).readline):
            if tok.type not in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
                                tokenize.ENDMARKER):
                code |= set(range(tok.start[0], tok.end[0] + 1))
        out.append((path, len(source.splitlines()), len(code - docs)))
    return out


def test_the_newcomer_path_table_lists_files():
    rows = newcomer_path()
    assert len(rows) >= 10 and all(lines >= code > 0 for _, lines, code in rows)


if __name__ == "__main__":   # the counts the newcomer-path table of docs/architecture.md quotes
    rows = newcomer_path()
    for path, lines, code in rows:
        print(f"{path:40s} {lines:6d} {code:6d}")
    print(f"{len(rows)} files, {sum(r[1] for r in rows)} lines, {sum(r[2] for r in rows)} code lines")
