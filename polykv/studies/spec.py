"""Study specs: which model, which policies (plan files, or solvers x budgets), which tasks and items.

A spec is a JSON file (paths inside it are relative to the file's folder)::

    {
      "name": "demo",
      "model": "default",                       # SmolLM2-135M, or {"tiny": {"family": "llama", ...}}
      "dtype": "float32",
      "context_tokens": 2048,                   # T the budgets refer to
      "profile": "../profiles/smollm2.json",   # needed by solver entries
      "storage_dtype": "bfloat16",              # cache storage (default: dtype); budgets count it
      "basis": "resident",                      # budgets in real bytes (default) or MoE-nD "nominal" bytes
      "budgets": ["8x", "4x"],                  # bytes ("3MiB"), ratio ("8x") or tokens per layer ("256tok")
      "baseline": true,                         # also run the full cache ("full")
      "plans": {"mine": "plans/mine.json"},     # plan files, run as they are
      "solvers": [{"name": "2d_hetero", "solver": "moend-greedy", "params": {}},
                  {"name": "random", "solver": "random-placement", "count": 9, "guided": "route"}],
      "tasks": [{"task": "passkey", "params": {"length": 2048}, "samples": 20, "seed": 0}],
      "bos": "auto",                            # BOS before the context: "auto" (as the tokenizer), true, false
      "prompt_format": "plain"                  # or "chat": the tokenizer's chat template, split after the context
    }

Every solver entry runs at every budget as policy ``<name>@<budget>``. A ``random-placement`` entry
with ``count`` N expands into N policies ``<name>#<i>@<budget>`` (index i of N count-matched
placements of the guided route). ``role`` names the entry's place in a study design (MoE-nD's chain:
``full``, ``1d``, ``2d_uniform``, ``2d``, ``2d_hetero``; PolyKV's factorial cells
``homogeneous_uniform`` ...); an entry named like a role takes that role.

:func:`load_spec` checks everything that can be checked without the model (names, parameters, files,
budgets) and raises :class:`~polykv.errors.StudyError` naming the file and field. A teacher-forced
task (``continuation``) needs ``"baseline": true``: its metrics compare every policy with the full cache.
``bos`` and ``prompt_format`` are the prompt rule of :mod:`polykv.studies.prompt`; ``"chat"`` applies to
generated tasks only (a teacher-forced continuation is plain text).
"""

from __future__ import annotations

import hashlib
import json
import os
import unicodedata
from typing import Any, Mapping

import attrs

from polykv.contract.model_data import registered_needs, side_file
from polykv.errors import PolykvError, StudyError
from polykv.models import MODEL_ALIASES, NAMED_MODELS
from polykv.models.kv_bases import KV_BASES_SUFFIX
from polykv.plan import load_plan
from polykv.plan import MAX_CONTEXT_TOKENS  # the largest context a spec (or --context) may name
from polykv.profiling.budget import Budget
from polykv.profiling.profile import load_profile
from polykv.registry import get_registry
from polykv.runtime.prompt import PROMPT_FORMATS
from polykv.strict_json import FieldReader
from polykv.models.corpus import corpus_id
from polykv.studies.tasks.base import GENERATE, TEACHER_FORCED

CHAIN_ROLES = ("full", "1d", "2d_uniform", "2d", "2d_hetero")
FACTORIAL_ROLES = ("homogeneous_uniform", "homogeneous_allocated", "routed_uniform", "routed_allocated")
ROLES = CHAIN_ROLES + FACTORIAL_ROLES + ("placement", "")
FULL_POLICY = "full"
_TOP = {"name", "model", "dtype", "context_tokens", "profile", "budgets", "baseline", "plans", "solvers", "tasks",
        "reuse_prefill", "chunk_size", "bos", "prompt_format", "storage_dtype", "basis"}
_SOLVER = {"name", "solver", "params", "role", "count", "guided"}
_TASK = {"task", "params", "samples", "seed"}
DTYPES = ("float32", "bfloat16", "float16")
LABEL_MAX = 128
"""Longest study or policy name: a label in reports and file names, well inside a file system's name limit."""


@attrs.define(frozen=True, kw_only=True)
class SolverEntry:
    name: str
    """Method name (a line in the score-vs-memory plot)."""
    solver: str
    """Registered solver."""
    params: dict[str, Any] = attrs.field(factory=dict)
    role: str = ""
    """Place in a design (see the module docstring); "" for none."""
    count: int | None = None
    """``random-placement`` only: number of count-matched placements."""
    guided: str | None = None
    """``random-placement`` only: the entry whose route the placements control for."""


@attrs.define(frozen=True, kw_only=True)
class TaskEntry:
    task: str
    params: dict[str, Any] = attrs.field(factory=dict)
    samples: int = 20
    """Items per policy."""
    seed: int = 0


@attrs.define(frozen=True, kw_only=True)
class StudySpec:
    """A checked study spec; see the module docstring for the file format."""

    name: str
    model: Any
    """``"default"`` or ``{"tiny": {...}}`` (keyword arguments of :func:`polykv.testing.tiny_model`)."""
    dtype: str
    context_tokens: int
    profile: str | None
    budgets: tuple[str, ...]
    baseline: bool
    plans: dict[str, str]
    solvers: tuple[SolverEntry, ...]
    tasks: tuple[TaskEntry, ...]
    reuse_prefill: bool = True
    """Run each context through the model once and restore every policy from it (exact)."""
    chunk_size: int | None = None
    bos: Any = "auto"
    """BOS before every context: ``"auto"`` (what the tokenizer does), ``True`` or ``False``."""
    prompt_format: str = "plain"
    """``"plain"`` completion or ``"chat"`` (the tokenizer's chat template, split after the context)."""
    storage_dtype: str | None = None
    """dtype the cache stores unquantized K/V, scales and residuals in (None: ``dtype``)."""
    basis: str = "resident"
    """What solver budgets count: ``"resident"`` bytes (metadata included) or MoE-nD's ``"nominal"`` bytes."""
    source: str = "<spec>"
    digests: dict[str, str] = attrs.field(factory=dict)
    """sha256 of every file the spec reads (plans, profile, task files), keyed by path."""
    side_digests: dict[str, str] = attrs.field(factory=dict)
    """sha256 of every existing file those name or keep beside them, keyed by path: each plan's ``model_data``
    files (query statistics, head scores, key/value bases) and the profile's side files."""

    @property
    def files(self) -> dict[str, str]:
        """sha256 of every file the study reads, side files included, keyed by path (the results header's
        ``files``)."""
        return {**self.digests, **self.side_digests}

    @property
    def cache_dtype(self) -> str:
        """The dtype the cache holds: ``storage_dtype``, else the compute ``dtype``."""
        return self.storage_dtype or self.dtype

    def budget(self, text: str):
        """Budget ``text`` at the spec's context, basis and cache dtype (batch 1)."""
        return Budget.parse(str(text), self.context_tokens, basis=self.basis, cache_dtype=self.cache_dtype)

    def as_dict(self) -> dict[str, Any]:
        """The spec as written (paths resolved), for the results header."""
        d = attrs.asdict(self, recurse=True)
        for key in ("source", "digests", "side_digests"):
            d.pop(key)
        return d

    @property
    def hash(self) -> str:
        """``spec-<16 hex>``: content of the spec, of every file it reads (side files included), and of what
        makes its items.

        Task parameters are hashed with the task's defaults filled in, together with the offline
        corpus recipe, so a changed default or corpus never resumes into results made from other items.
        """
        return self._hash(self.files)

    @property
    def legacy_hash(self) -> str:
        """The hash polykv gave this spec before it covered side files (results files of format version 1):
        equal to :attr:`hash` when the study reads no side file."""
        return self._hash(self.digests)

    def _hash(self, files: dict[str, str]) -> str:
        text = json.dumps({"spec": self.as_dict(), "files": sorted(files.values()),
                           "tasks": [_resolved_task_params(t) for t in self.tasks], "corpus": corpus_id()},
                          sort_keys=True, default=str)
        return "spec-" + hashlib.sha256(text.encode()).hexdigest()[:16]


def _resolved_task_params(entry: TaskEntry) -> dict[str, Any]:
    registry = get_registry()
    defaults = dict(registry.task(entry.task).defaults) if registry.has("task", entry.task) else {}
    return {"task": entry.task, "params": {**defaults, **entry.params}}


def study_error(message: str, *, source: str, field: str | None = None, layer: int | None = None,
                hint: str | None = None) -> StudyError:
    """A :class:`StudyError` naming the spec file, the field and what to do."""
    where = f"{source}: field '{field}'" if field else source
    return StudyError(f"{where}: {message}" + (f" ({hint})" if hint else ""))


def _digest(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def check_label(value: Any, r: FieldReader, field: str, what: str, hint: str | None = None) -> str:
    """``value`` when it is a name polykv may print and use in one file name: a non-empty string of at most
    :data:`LABEL_MAX` characters on one line, never a path (no ``/`` or ``\\``, not ``.`` or ``..``); else the
    spec's StudyError naming ``field``."""
    if not isinstance(value, str) or not value.strip():
        r.fail(f"expected a non-empty {what}, got {value!r}", field=field, hint=hint)
    control = next((c for c in value if unicodedata.category(c) in ("Cc", "Zl", "Zp")), None)
    if control is not None:
        r.fail(f"{what} {value!r} holds the control character {control!r}; a name is one line of printable text",
               field=field, hint=hint)
    if "/" in value or "\\" in value or value in (".", ".."):
        r.fail(f"{what} {value!r} is a path; a name is a label, never a path (no '/', '\\', '.' or '..')",
               field=field, hint=hint)
    if len(value) > LABEL_MAX:
        r.fail(f"{what} of {len(value)} characters; a name has at most {LABEL_MAX}", field=field, hint=hint)
    return value


def _side_digests(paths, out: dict[str, str], r: FieldReader, field: str) -> None:
    """Add the sha256 of each of ``paths`` that is a file to ``out`` (a side file that is absent is read from
    elsewhere or computed; one that appears later changes the study's hash all the same)."""
    for path in paths:
        if os.path.isfile(path):
            try:
                out[path] = _digest(path)
            except OSError as exc:
                r.fail(f"cannot read {path} ({exc.strerror})", field=field, hint="make the file readable")


def _path(base: str, value: Any, r: FieldReader, field: str) -> str:
    if not isinstance(value, str) or not value:
        r.fail(f"expected a file path, got {value!r}", field=field)
    path = value if os.path.isabs(value) else os.path.normpath(os.path.join(base, value))
    if not os.path.isfile(path):
        r.fail(f"no such file: {path}", field=field, hint="fix the path (relative to the spec's folder)")
    return path


def parse_spec(raw: Any, *, base: str = ".", source: str = "<spec>", registry=None) -> StudySpec:
    """Check a spec dict (as read from JSON) and return a :class:`StudySpec`; never loads a model."""
    if registry is None:
        registry = get_registry()
    r = FieldReader(source, study_error)
    raw = r.obj(raw, "", optional=_TOP)
    digests: dict[str, str] = {}
    side: dict[str, str] = {}
    if "name" in raw:
        name = check_label(raw["name"], r, "name", "study name",
                           hint="use a plain name; --results chooses where the results go")
    else:
        name = check_label(os.path.splitext(os.path.basename(source))[0] or "study", r, "name",
                           "study name (the spec file's name)", hint="add a \"name\" to the spec")
    model = raw.get("model", "default")
    if not (model == "default" or (isinstance(model, str) and (model in NAMED_MODELS or model in MODEL_ALIASES))
            or (isinstance(model, Mapping) and set(model) == {"tiny"} and isinstance(model["tiny"], Mapping))):
        r.fail(f"expected \"default\", a model name ({', '.join(sorted(NAMED_MODELS))}) or "
               f"{{\"tiny\": {{...}}}}, got {model!r}", field="model")
    dtype = r.choice(raw.get("dtype", "float32"), "dtype", DTYPES, "dtype")
    T = r.int_(raw.get("context_tokens", 2048), "context_tokens", minimum=1)
    if T > MAX_CONTEXT_TOKENS:
        r.fail(f"{T} tokens is more than any model reads", field="context_tokens",
               hint=f"use at most {MAX_CONTEXT_TOKENS}")
    storage_dtype = raw.get("storage_dtype")
    if storage_dtype is not None:
        r.choice(storage_dtype, "storage_dtype", DTYPES, "dtype", hint="or leave it out to store in \"dtype\"")
    basis = r.choice(raw.get("basis", "resident"), "basis", ("resident", "nominal"), "budget basis")
    budgets = raw.get("budgets", [])
    if not isinstance(budgets, list) or not all(isinstance(b, (str, int)) for b in budgets):
        r.fail(f"expected a list of budgets like [\"8x\", \"3MiB\"], got {budgets!r}", field="budgets")
    for i, b in enumerate(budgets):
        try:
            Budget.parse(str(b), T)
        except PolykvError as exc:
            raise r.error(str(exc), field=f"budgets[{i}]") from None
    budgets = tuple(str(b) for b in budgets)
    if len(set(budgets)) != len(budgets):
        r.fail(f"duplicate budgets in {list(budgets)}", field="budgets")
    plans = dict(r.dict_(raw.get("plans", {}), "plans"))
    for pname, value in list(plans.items()):
        check_label(pname, r, "plans", "plan name")
        path = _path(base, value, r, f"plans.{pname}")
        try:
            plan = load_plan(path, registry=registry)
        except PolykvError as exc:
            raise r.error(str(exc), field=f"plans.{pname}") from None
        plans[pname], digests[path] = path, _digest(path)
        _side_digests(plan.model_data.values(), side, r, f"plans.{pname}")
    solvers = _solver_entries(raw.get("solvers", []), r, registry)
    profile = raw.get("profile")
    if profile is not None:
        profile = _path(base, profile, r, "profile")
        digests[profile] = _digest(profile)
        try:
            load_profile(profile)
        except PolykvError as exc:
            raise r.error(str(exc), field="profile") from None
        suffixes = {need.suffix for need in registered_needs(registry)} | {KV_BASES_SUFFIX}
        _side_digests([side_file(profile, suffix) for suffix in sorted(suffixes)], side, r, "profile")
    if solvers and profile is None:
        r.fail("solver entries need a profile file", field="profile", hint="add \"profile\": \"path.json\"")
    if solvers and not budgets:
        r.fail("solver entries need at least one budget", field="budgets", hint="add \"budgets\": [\"8x\"]")
    tasks = _task_entries(raw.get("tasks"), base, r, registry, digests)
    baseline = r.bool_(raw.get("baseline", True), "baseline")
    reuse = r.bool_(raw.get("reuse_prefill", True), "reuse_prefill")
    if not baseline:
        forced = [t.task for t in tasks if registry.task(t.task).mode == TEACHER_FORCED]
        if forced:
            r.fail(f"task '{forced[0]}' is teacher_forced: its KL and top-1 agreement compare every policy with "
                   "the full cache, so the study needs the full baseline", field="baseline",
                   hint="set \"baseline\": true")
    bos, prompt_format = _prompt_rule(raw, tasks, r, registry)
    names = set(plans) | {s.name for s in solvers} | ({FULL_POLICY} if baseline else set())
    if len(names) != len(plans) + len(solvers) + int(baseline):
        r.fail("policy names must be unique across plans, solvers and 'full'", field="solvers")
    if not (plans or solvers or baseline):
        r.fail("the spec names no policy", field="plans", hint="add plans, solvers or \"baseline\": true")
    return StudySpec(name=name, model=model, dtype=dtype, context_tokens=T, profile=profile, budgets=budgets,
                     baseline=baseline, plans=plans, solvers=solvers, tasks=tasks, reuse_prefill=reuse,
                     chunk_size=r.int_(raw.get("chunk_size"), "chunk_size", minimum=1, optional=True), bos=bos,
                     prompt_format=prompt_format, source=source, digests=digests, side_digests=side,
                     storage_dtype=storage_dtype, basis=basis)


def _prompt_rule(raw: Mapping, tasks, r: FieldReader, registry) -> tuple[Any, str]:
    bos = raw.get("bos", "auto")
    if not (bos == "auto" or isinstance(bos, bool)):
        r.fail(f"expected \"auto\", true or false, got {bos!r}", field="bos",
               hint="auto: a BOS exactly where the model's tokenizer adds one")
    fmt = raw.get("prompt_format", "plain")
    if fmt not in PROMPT_FORMATS:
        r.fail(f"expected one of {', '.join(PROMPT_FORMATS)}, got {fmt!r}", field="prompt_format")
    if fmt == "chat":
        forced = [t.task for t in tasks if registry.task(t.task).mode == TEACHER_FORCED]
        if forced:
            r.fail(f"task '{forced[0]}' is teacher_forced: it continues plain text, which has no chat turn",
                   field="prompt_format", hint="use \"plain\", or run that task in another study")
    return bos, fmt


def _solver_entries(raw: Any, r: FieldReader, registry) -> tuple[SolverEntry, ...]:
    r.list_(raw, "solvers", what="a list of solver entries")
    out = []
    for i, e in enumerate(raw):
        f = f"solvers[{i}]"
        e = r.obj(e, f, optional=_SOLVER)
        check_label(e.get("name"), r, f + ".name", "solver entry name")
        if any(c in e["name"] for c in "@#"):
            r.fail(f"expected a name without '@' or '#', got {e.get('name')!r}", field=f + ".name")
        try:
            cls = registry.solver(e.get("solver"))
        except PolykvError as exc:
            raise r.error(str(exc), field=f + ".solver") from None
        params = e.get("params", {})
        try:
            cls(registry=registry).params(params)
        except PolykvError as exc:
            raise r.error(str(exc), field=f + ".params") from None
        role = e.get("role", e["name"] if e["name"] in ROLES else "")
        if role not in ROLES:
            r.fail(f"unknown role {role!r}", field=f + ".role", hint=f"use one of {', '.join(x for x in ROLES if x)}")
        count = guided = None
        if e["solver"] == "random-placement":
            count = r.int_(e.get("count", 1), f + ".count", minimum=1)
            guided = e.get("guided")
            role = role or "placement"
        elif "count" in e or "guided" in e:
            r.fail("only random-placement entries take 'count' and 'guided'", field=f + ".count")
        out.append(SolverEntry(name=e["name"], solver=e["solver"], params=dict(params), role=role, count=count,
                               guided=guided))
    names = {s.name for s in out}
    for i, s in enumerate(out):
        if s.guided is not None and s.guided not in names:
            r.fail(f"no solver entry named {s.guided!r}", field=f"solvers[{i}].guided")
    return tuple(out)


def _task_entries(raw: Any, base: str, r: FieldReader, registry, digests: dict) -> tuple[TaskEntry, ...]:
    r.list_(raw, "tasks", nonempty=True, what="a non-empty list of tasks",
            hint="e.g. [{\"task\": \"passkey\", \"samples\": 20}]")
    out = []
    for i, e in enumerate(raw):
        f = f"tasks[{i}]"
        e = r.obj(e, f, optional=_TASK)
        try:
            cls = registry.task(e.get("task"))
        except PolykvError as exc:
            raise r.error(str(exc), field=f + ".task") from None
        if cls.mode not in (GENERATE, TEACHER_FORCED):
            r.fail(f"task '{cls.name}' has mode {cls.mode!r}; the study runner runs '{GENERATE}' and "
                   f"'{TEACHER_FORCED}' tasks", field=f + ".task", hint="fix the task class's 'mode'")
        params = dict(r.obj(e.get("params", {}), f + ".params", optional=cls.defaults))
        samples = r.int_(e.get("samples", 20), f + ".samples", minimum=1)
        seed = r.int_(e.get("seed", 0), f + ".seed", minimum=0)
        try:
            cls().params(**params)
        except PolykvError as exc:
            raise r.error(str(exc), field=f + ".params" + (f".{exc.param}" if getattr(exc, "param", None) else "")) \
                from None
        if "path" in cls.defaults:  # a file task: read and check the file now, before any model loads
            params["path"] = _path(base, params.get("path"), r, f + ".params.path")
            digests[params["path"]] = _digest(params["path"])
            try:
                cls().make_items(None, samples, seed, **params)
            except PolykvError as exc:
                raise r.error(str(exc), field=f + ".params.path") from None
        out.append(TaskEntry(task=cls.name, params=params, samples=samples, seed=seed))
    if len(set(t.task for t in out)) != len(out):
        r.fail("each task may appear once (results are keyed by task name)", field="tasks")
    return tuple(out)


def load_spec(path: str, *, registry=None) -> StudySpec:
    """Read and check a spec file (see the module docstring); nothing here loads a model."""
    raw = FieldReader(path, study_error).read("study spec file", missing_hint="check the path to the study spec",
                                              text_hint="a study spec is a UTF-8 JSON file")
    return parse_spec(raw, base=os.path.dirname(os.path.abspath(path)), source=path, registry=registry)
