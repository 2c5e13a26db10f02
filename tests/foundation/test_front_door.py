"""The package's front door: ``import polykv`` loads no runtime (the runtime loads torch and transformers), and
``polykv.apply`` / ``polykv.answer`` are the runtime's own functions once first used, not wrappers that forward."""

from __future__ import annotations

import subprocess
import sys

import pytest

import polykv
from polykv.runtime import answer, session


@pytest.mark.parametrize("name,module", [("apply", session), ("answer", answer)])
def test_apply_and_answer_are_bound_to_the_runtimes_own_functions_on_first_use(monkeypatch, name, module):
    monkeypatch.delitem(vars(polykv), name, raising=False)            # as before its first use
    assert name in dir(polykv) and name in polykv.__all__
    assert getattr(polykv, name) is getattr(module, name)
    assert vars(polykv)[name] is getattr(module, name)                # later calls go straight to it


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'aply'"):
        polykv.aply


@pytest.mark.slow
def test_import_polykv_loads_no_runtime():
    code = "import sys, polykv\nprint('polykv.runtime.session' in sys.modules, 'torch' in sys.modules)\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.split()[0] == "False", out.stderr
