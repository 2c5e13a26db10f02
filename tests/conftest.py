"""Shared test set-up.

Tests import polykv as installed (editable or wheel), never through the checkout's root folder:
``python -m pytest`` puts the current folder first on ``sys.path``, which would make the repository's
``adapters/`` folder importable as a bare top-level ``adapters`` module (a name that belongs to an
unrelated PyPI library). The built-in adapters are only ever ``polykv.adapters``.
"""

from __future__ import annotations

import gc
import os
import sys
from pathlib import Path

import pytest

# No garbage collection while torch, transformers and the test modules are imported: the import of a large
# library triggers full collections over an ever larger heap, which on 2 busy cores cost seconds per process
# (per pytest-xdist worker). pytest_runtestloop below collects once, freezes what the imports left (modules,
# classes, functions: they live as long as the process) out of later collections, and turns collection back on.
gc.disable()

REPO_ROOT = Path(__file__).resolve().parent.parent


def _is_repo_root(entry: str) -> bool:
    try:
        return Path(entry or os.getcwd()).resolve() == REPO_ROOT
    except OSError:
        return False


sys.path[:] = [p for p in sys.path if not _is_repo_root(p)]

# One intra-op thread unless the caller chose: tests run on small 2-core machines, often beside other
# work, where OpenMP threads spinning for a busy core make a 16-token generation ten times slower.
# Set POLYKV_TEST_THREADS (or OMP_NUM_THREADS) to override.
_threads = os.environ.get("POLYKV_TEST_THREADS") or os.environ.get("OMP_NUM_THREADS")
if _threads is None or _threads.isdigit():
    import torch

    torch.set_num_threads(int(_threads or 1))

# Every plugin output is checked in full during tests (polykv.runtime.plugin_results: the expensive checks too),
# so a built-in or test plugin that breaks its contract fails with one line naming it.
os.environ.setdefault("POLYKV_CHECK", "1")

# Without a GPU, Triton kernels run in Triton's CPU interpreter. Triton reads TRITON_INTERPRET when it is
# first imported, and a model forward imports it (through transformers), so it is set before any test.
import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

try:  # imported now so that the slow-marker guard below can watch interpreter launches from the first test
    import triton.runtime.interpreter  # noqa: E402,F401
except ImportError:  # Triton is the kernels extra
    pass

try:
    from hypothesis import settings
except ImportError:  # hypothesis is a test extra; tests that need it import it themselves
    pass
else:
    # No deadlines: timing on a shared 2-core machine is not a property of the code under test.
    settings.register_profile("polykv", deadline=None, database=None, print_blob=True)
    settings.load_profile("polykv")


_FROZE = pytest.StashKey[bool]()


@pytest.hookimpl(tryfirst=True)
def pytest_runtestloop(session):
    if not gc.get_freeze_count():  # not a session nested in a test (tests/foundation/test_slow_marker.py)
        gc.collect()
        gc.freeze()
        session.stash[_FROZE] = True
    gc.enable()


def pytest_sessionfinish(session):
    gc.enable()  # also after a session that stopped before its test loop
    if session.stash.get(_FROZE, False):
        gc.unfreeze()  # what the test loop froze is collected at exit again (nanobind reports the rest as leaks)


@pytest.fixture(autouse=True)
def _fresh_model_data_cache(monkeypatch, tmp_path_factory, request):
    """Each test starts with an empty cache of computed per-model data (polykv.contract.model_data.cache_dir), so
    that data one test computed never satisfies another and no test writes under the user's cache."""
    import polykv.contract.model_data

    root = tmp_path_factory.getbasetemp() / "model-data-cache"
    folder = str(root / f"{abs(hash(request.node.nodeid)):x}")
    monkeypatch.setattr(polykv.contract.model_data, "cache_dir", lambda: folder)


@pytest.fixture(scope="session")
def default_model():
    """(model, tokenizer) of SmolLM2-135M-Instruct in float32, loaded once per session.

    The first load on a machine converts the GGUF and caches a copy (``$POLYKV_CACHE`` or
    ``~/.cache/polykv``); later sessions load the copy in about a second.
    """
    from polykv.models import load_default_model

    return load_default_model()


@pytest.fixture(scope="session")
def default_geometry(default_model):
    """ModelGeometry (with weights fingerprint) of the default model."""
    from polykv.models.geometry import geometry_of_model

    return geometry_of_model(default_model[0])


@pytest.fixture(scope="session")
def saved_tiny_model(tmp_path_factory):
    """``saved_tiny_model(head_dim)``: a folder holding a 2-layer tiny random-weight Llama (4 query heads,
    2 KV heads) and a 320-token byte-level BPE tokenizer trained on the offline corpus, as
    ``polykv calibrate MODEL`` reads it; built once per head_dim and session."""
    made: dict[int, str] = {}

    def make(head_dim: int) -> str:
        if head_dim not in made:
            from tokenizers import Tokenizer, models, pre_tokenizers, trainers
            from transformers import PreTrainedTokenizerFast

            from polykv.models.corpus import corpus_texts
            from polykv.testing import tiny_model

            tok = Tokenizer(models.BPE())
            tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
            trainer = trainers.BpeTrainer(vocab_size=320, show_progress=False,
                                          initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
            tok.train_from_iterator(corpus_texts("prose", 10, min_chars=500, seed=0), trainer=trainer)
            tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok)
            folder = tmp_path_factory.mktemp(f"tiny-model-d{head_dim}")
            tiny_model("llama", layers=2, heads=4, kv_heads=2, head_dim=head_dim,
                       vocab=len(tokenizer)).save_pretrained(folder)
            tokenizer.save_pretrained(folder)
            made[head_dim] = str(folder)
        return made[head_dim]

    return make


# ---- The slow marker -------------------------------------------------------------------------------
# ``pytest -m "not slow"`` runs the rest of the suite in about a minute. A test is slow when it loads a
# real model, starts a process (Ray included) or runs a Triton kernel in Triton's CPU interpreter. Tests
# marked ``model`` are slow by this rule; the others say ``@pytest.mark.slow`` (or a module's
# ``pytestmark``). The guards below fail a test that does one of these things without the mark, naming
# what it did, so the quick subset cannot grow slow unnoticed.

REAL_MODEL_FIXTURES = ("default_model", "default_geometry")
"""Session fixtures that load the real default model."""

ONE_WORKER_FIXTURES = ("local_ray",)
"""Session fixtures that must exist once per run, not once per pytest-xdist worker: two local Rays started by
two workers would compete for the same ports and session folder. Under ``--dist loadgroup`` (scripts/test.sh)
every test using one of them runs on a single worker (see "Parallel runs" below)."""


def _is_slow(item) -> bool:
    return item.get_closest_marker("slow") is not None


def pytest_sessionstart(session):
    """Build (or load) the compiled CPU decode kernel of the KIVI stores once, before any test: any test that
    decodes a quantized layer on the CPU uses it, and its first build starts the C compiler (a process)."""
    from polykv.adapters.quantizers import kivi_cpu

    if kivi_cpu.enabled():
        kivi_cpu.library()


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    # tryfirst: before ``-m`` deselects, so the added marks count, and before pytest-xdist reads the groups.
    one_worker = []
    for item in items:
        if item.get_closest_marker("model") is not None:
            item.add_marker(pytest.mark.slow)
        fixtures = getattr(item, "fixturenames", ())
        if any(name in fixtures for name in ONE_WORKER_FIXTURES):
            one_worker.append(item.nodeid)
        for name in REAL_MODEL_FIXTURES:
            if name in fixtures and item.get_closest_marker("model") is None:
                raise pytest.UsageError(f"{item.nodeid} uses the real-model fixture {name!r} but is not "
                                        "marked: add @pytest.mark.model (it makes the test slow)")
    folder = getattr(config, "workerinput", {}).get(ONE_WORKER_KEY)
    if folder:  # a pytest-xdist worker: tell the controller's scheduler which tests share one worker
        _write_atomically(Path(folder) / config.workerinput["workerid"], "".join(f"{n}\n" for n in one_worker))


def _refuse(item, what: str):
    pytest.fail(f"{item.nodeid} {what} but is not marked slow: add @pytest.mark.slow (pytest -m 'not slow' "
                "must stay quick; see CONTRIBUTING.md)", pytrace=False)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Outside slow tests (their fixtures included), starting a process or a Triton interpreter launch fails."""
    if _is_slow(item):
        yield
        return
    import subprocess

    patched = [(subprocess.Popen, "_execute_child", subprocess.Popen._execute_child)]

    def no_process(self, args, *rest, **kwargs):
        command = " ".join(map(str, args)) if isinstance(args, (list, tuple)) else str(args)
        _refuse(item, f"starts a process ({' '.join(command.split())[:60]})")

    subprocess.Popen._execute_child = no_process
    interpreter = sys.modules.get("triton.runtime.interpreter")
    if interpreter is not None and hasattr(interpreter, "InterpretedFunction"):
        patched.append((interpreter.InterpretedFunction, "run", interpreter.InterpretedFunction.run))

        def no_interpreter(self, *args, **kwargs):
            _refuse(item, f"runs a Triton kernel in Triton's CPU interpreter ({getattr(self, '__name__', self)})")

        interpreter.InterpretedFunction.run = no_interpreter
    try:
        yield
    finally:
        for owner, name, original in patched:
            setattr(owner, name, original)


@pytest.fixture(scope="session")
def local_ray():
    """A local Ray with 2 CPUs for the whole test session (started on first use, shut down after): the
    distributed study and calibration tests share it (Ray starts once per process)."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    yield ray
    ray.shutdown()


# ---- Parallel runs (pytest-xdist) ------------------------------------------------------------------
# scripts/test.sh runs ``-n auto --dist loadgroup``. Each worker collects the tests and writes the node ids that
# use a ONE_WORKER_FIXTURES fixture into a folder the controller made; the controller's scheduler gives those
# tests one group, hence one worker, and sends that group out first. (pytest-xdist's own ``xdist_group`` route
# renames node ids, which pytest 9.2 no longer lets it do: the mark would be ignored without a word.)

ONE_WORKER_KEY = "polykv_one_worker_dir"
ONE_WORKER_GROUP = "one-worker"


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def _distributes(config) -> bool:
    return not hasattr(config, "workerinput") and getattr(config.option, "dist", "no") == "loadgroup" \
        and bool(getattr(config.option, "numprocesses", None) or getattr(config.option, "tx", None))


def pytest_configure(config):
    if _distributes(config):
        import tempfile

        config.stash[_ONE_WORKER_DIR] = tempfile.mkdtemp(prefix="polykv-one-worker-")


def pytest_unconfigure(config):
    folder = config.stash.get(_ONE_WORKER_DIR, None)
    if folder:
        import shutil

        shutil.rmtree(folder, ignore_errors=True)


_ONE_WORKER_DIR = pytest.StashKey[str]()


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    folder = node.config.stash.get(_ONE_WORKER_DIR, None)
    if folder:
        node.workerinput[ONE_WORKER_KEY] = folder


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    folder = config.stash.get(_ONE_WORKER_DIR, None)
    if not folder:
        return None
    from xdist.scheduler import LoadGroupScheduling

    class OneWorkerGroups(LoadGroupScheduling):
        """loadgroup, with the tests the workers listed in ``folder`` as one more group, sent out first: it is the
        run's longest piece of work (one worker runs it from start to end), so the other workers' tests fill the
        time around it instead of waiting for it at the end."""

        def _split_scope(self, nodeid: str) -> str:
            if not hasattr(self, "_one_worker"):
                self._one_worker = {line for f in Path(folder).iterdir() if not f.name.startswith(".")
                                    for line in f.read_text(encoding="utf-8").splitlines()}
            return ONE_WORKER_GROUP if nodeid in self._one_worker else super()._split_scope(nodeid)

        def _assign_work_unit(self, node) -> None:
            if ONE_WORKER_GROUP in self.workqueue:
                self.workqueue.move_to_end(ONE_WORKER_GROUP, last=False)
            super()._assign_work_unit(node)

    return OneWorkerGroups(config, log)
