"""The newcomer path of docs/architecture.md, counted from what really runs.

One layer's plan "SnapKV in prefill, H2O in decode, 16 bits" is saved to a file, then ``polykv.load_plan`` +
``polykv.apply`` + one prefill forward + one decode forward run on a tiny random-weight Llama under
``sys.setprofile``. Every function of ``polykv/`` or ``adapters/`` that is *called* is recorded; module-level code
(imports, plugin registration at import) and whatever it calls is not, and neither is transformers. The path is
run once before it is counted, so that lazy imports and one-time registrations are out of the count. Per file:
the functions called and the lines of those functions (their source span from ``def`` to the last line,
decorators and docstrings included; a nested function's lines counted once). The same for the plan at
K4V4 with the ``kivi`` quantizer: the files it adds.

``python tests/foundation/test_newcomer_path.py`` prints both tables as docs/architecture.md holds them.
"""

from __future__ import annotations

import gc
import inspect
import re
import sys
from pathlib import Path

import torch

import polykv
from polykv.models.geometry import geometry_of_model
from polykv.plan import OpSpec
from polykv.plan.writing import save
from polykv.testing import tiny_model, token_ids

ROOT = Path(__file__).resolve().parents[2]
ARCHITECTURE = ROOT / "docs" / "architecture.md"
COUNTED = (ROOT / "polykv", ROOT / "adapters")
HINT = "recount with `python tests/foundation/test_newcomer_path.py` and paste its tables into docs/architecture.md"


def _plan(geometry, kivi: bool):
    bits = dict(k_bits=4, v_bits=4, quantizer_params={"group_size": 16, "residual": 16}) if kivi else {}
    return polykv.uniform_plan(geometry, prefill=OpSpec(rule="snapkv", capacity=12, params={"window": 4}),
                               decode=OpSpec(rule="h2o", capacity=8), decode_slack=1, **bits)


def _run(model, path: str, ids: torch.Tensor) -> None:
    plan = polykv.load_plan(path)
    with torch.no_grad(), polykv.apply(model, plan, check=False) as session:   # what a user gets by default
        cache = session.new_cache()
        out = model(ids, use_cache=True, **{session.cache_keyword: cache})
        model(out.logits[:, -1:].argmax(-1), use_cache=True, **{session.cache_keyword: cache})


def _called(model, path: str, ids: torch.Tensor) -> set:
    """Code objects of polykv/ and adapters/ called by one run (module-level code and its callees left out)."""
    called, in_module = set(), [0]
    roots = tuple(str(r) + "/" for r in COUNTED)

    def profile(frame, event, arg):
        code = frame.f_code
        if event == "call":
            if code.co_name == "<module>":
                in_module[0] += 1
            elif not in_module[0] and code.co_filename.startswith(roots):
                called.add(code)
        elif event == "return" and code.co_name == "<module>":
            in_module[0] -= 1

    # Garbage from earlier work (a suspended generator in a reference cycle, say) is collected first and the
    # collector paused while the path runs: its finalisers would otherwise be counted at random.
    gc.collect()
    gc.disable()
    sys.setprofile(profile)
    try:
        _run(model, path, ids)
    finally:
        sys.setprofile(None)
        gc.enable()
    return called


def _lines(codes) -> dict[str, tuple[int, int]]:
    """Per file (relative to the repository): (functions called, lines of those functions, each line once)."""
    spans: dict[str, set] = {}
    names: dict[str, set] = {}
    for code in codes:
        rel = Path(code.co_filename).resolve().relative_to(ROOT).as_posix()
        source, first = inspect.getsourcelines(code)
        spans.setdefault(rel, set()).update(range(first, first + len(source)))
        names.setdefault(rel, set()).add((code.co_firstlineno, code.co_qualname))
    # a nested function (a closure, a lambda, a generator expression) is a function of its own, inside another
    return {rel: (len(names[rel]), len(spans[rel])) for rel in sorted(spans)}


def count(tmp: Path) -> tuple[dict, dict]:
    """The 16-bit path and the K4V4 path: per file (functions called, lines of those functions)."""
    torch.manual_seed(0)
    model = tiny_model("llama", layers=1)
    ids = token_ids(1, 24)
    out = []
    for kivi in (False, True):
        path = str(tmp / f"plan-{'kivi' if kivi else '16'}.json")
        save(_plan(geometry_of_model(model), kivi), path)
        _run(model, path, ids)                                    # imports and one-time registrations first
        out.append(_lines(_called(model, path, ids)))
    return out[0], out[1]


def tables(plain: dict, kivi: dict) -> str:
    """The two Markdown tables of the newcomer path (the 16-bit path; the files K4V4 adds)."""
    rows = ["| file | functions called | lines of those functions |", "| --- | --- | --- |"]
    rows += [f"| `{rel}` | {n} | {lines} |" for rel, (n, lines) in plain.items()]
    rows.append(f"| **{len(plain)} files** | **{sum(n for n, _ in plain.values())}** | "
                f"**{sum(x for _, x in plain.values())}** |")
    added = {rel: v for rel, v in kivi.items() if rel not in plain}
    rows += ["", "K4V4 (`k_bits=4, v_bits=4`, quantizer `kivi`) adds:", "",
             "| file | functions called | lines of those functions |", "| --- | --- | --- |"]
    rows += [f"| `{rel}` | {n} | {lines} |" for rel, (n, lines) in added.items()]
    rows.append(f"| **{len(added)} files** | **{sum(n for n, _ in added.values())}** | "
                f"**{sum(x for _, x in added.values())}** |")
    return "\n".join(rows)


def documented() -> str:
    text = ARCHITECTURE.read_text(encoding="utf-8").split("## The newcomer path", 1)[1].split("\n## ", 1)[0]
    found = re.search(r"^\| file \| functions called .*?(?=\n\n(?!K4V4|\| file)[^|\n])", text, flags=re.M | re.S)
    return found.group(0).strip() if found else ""


def test_the_documented_newcomer_path_is_what_runs(tmp_path):
    plain, kivi = count(tmp_path)
    assert documented() == tables(plain, kivi), HINT


def test_the_count_sees_the_rules_and_the_store(tmp_path):
    plain, kivi = count(tmp_path)
    assert {"adapters/rules/snapkv.py", "adapters/rules/h2o.py", "polykv/storage/token_buffer.py"} <= set(plain)
    assert "adapters/quantizers/kivi.py" in kivi and "adapters/quantizers/kivi.py" not in plain
    assert not any(rel.startswith("tests/") for rel in plain)


if __name__ == "__main__":
    import tempfile

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        print(tables(*count(Path(tmp))))
