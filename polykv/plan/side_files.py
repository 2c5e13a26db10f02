"""A plan's per-model data (its optional ``model_data`` section): data key -> side file, read and checked only when
the plan has it.

In a file the paths are relative to the plan file's folder (:func:`parse_model_data`, :func:`resolve_model_data`);
every key is data some rule of the plan reads (:func:`check_model_data_keys`); ``plan validate`` and
``study --check`` open every side file and check it (:func:`check_side_files`), and a plan with ranks checks its
key/value bases against the model (:func:`check_bases_file`). Every error is a :class:`polykv.errors.PlanError`
naming the file and the field.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import attrs

from polykv.contract.model_data import ModelDataNote, needs_of_rules, side_file_problem
from polykv.errors import PlanError, PolykvError, ProfileError
from polykv.models.kv_bases import KV_BASES_KEY, KVBases
from polykv.plan.bases_need import KV_BASES_NEED
from polykv.plan.records import Plan
from polykv.strict_json import FieldReader


def parse_model_data(r: FieldReader, raw: Any) -> dict[str, str]:
    """``model_data``: data key -> file (a non-empty path, relative to the plan file's folder)."""
    r.dict_(raw, "model_data")
    for key, path in raw.items():
        if not key:
            r.fail("the data key is empty", field="model_data", hint="name the data a rule reads, e.g. \"triattention\"")
        if not isinstance(path, str) or not path:
            r.fail(f"expected a non-empty file path, got {path!r}", field=f"model_data.{key}",
                   hint="e.g. \"triattention\": \"../profiles/x.qstats.safetensors\" (relative to the plan file)")
    return dict(raw)


def resolve_model_data(plan: Plan, source: str) -> Plan:
    """A loaded plan with its ``model_data`` paths resolved against the plan file's folder."""
    folder = os.path.dirname(os.path.abspath(source))
    return attrs.evolve(plan, model_data={k: os.path.normpath(os.path.join(folder, v))
                                          for k, v in plan.model_data.items()})


def check_model_data_keys(plan: Plan, registry, source: str) -> None:
    """Every ``model_data`` key is data some rule of the plan reads (a misspelt key would go unused)."""
    read = sorted(n.key for n in needs_of_rules(registry, sorted(plan.rules_used())))
    if plan.low_rank:
        read = sorted(read + [KV_BASES_KEY])
    for key in sorted(plan.model_data):
        if key not in read:
            raise PlanError(f"no rule of this plan reads per-model data '{key}' (they read {read or 'none'})",
                            source=source, field=f"model_data.{key}",
                            hint="remove the entry or correct its key")


def check_bases_file(plan: Plan, geometry, source: str) -> None:
    """The key/value bases file a plan with ranks names (when it exists) was measured on this model."""
    path = plan.model_data.get(KV_BASES_KEY)
    if not plan.low_rank or not path or not os.path.isfile(path):
        return
    try:
        KVBases.load(path).check_geometry(geometry)
    except ProfileError as exc:
        raise PlanError(str(exc), source=source, field=f"model_data.{KV_BASES_KEY}") from None


def check_side_files(plan: Plan, registry, source: str) -> None:
    """Open and check every side file ``plan.model_data`` names (what ``plan validate`` and ``study --check`` run):
    a regular file (checked with ``stat`` before it is opened), readable as the data its key names (each loader
    checks dtypes, finite and non-negative values, orthonormal bases), of the plan's layers (and KV heads and head
    dim when the plan names its model). A file outside the plan's folder, or one without a model fingerprint, gets
    a one-line note."""
    needs = {n.key: n for n in needs_of_rules(registry, sorted(plan.rules_used()))}
    if plan.low_rank:
        needs[KV_BASES_NEED.key] = KV_BASES_NEED
    folder = os.path.dirname(os.path.abspath(source)) if os.path.isfile(source) else None
    for key, path in sorted(plan.model_data.items()):
        field = f"model_data.{key}"
        need = needs.get(key)
        if need is None:
            continue  # refused by check_model_data_keys
        if not os.path.isfile(path):
            raise PlanError(f"{path} {side_file_problem(path)}", source=source, field=field,
                            hint=f"name a {need.description or key} file (paths are relative to the plan file)")
        if os.stat(path).st_size == 0:   # also what /proc and /sys files report: never opened
            raise PlanError(f"{path} is empty, not a {need.description or key} file", source=source, field=field,
                            hint=f"name a {need.description or key} file (paths are relative to the plan file)")
        try:
            data = need.load(path)
        except (PolykvError, ValueError, OSError) as exc:
            raise PlanError(f"{path} is not a usable {need.description or key} file: {exc}", source=source,
                            field=field) from None
        _check_side_shape(plan, data, path, field, source)
        # noted once the file passed its checks (a refused file gets its one error line only)
        if folder is not None and os.path.commonpath([folder, os.path.abspath(path)]) != folder:
            warnings.warn(f"{source}: field {field}: {path} is outside the plan's folder {folder}", ModelDataNote,
                          stacklevel=2)
        if not getattr(data, "fingerprint", None):
            warnings.warn(f"{source}: field {field}: {path} carries no model fingerprint, so it cannot be matched to "
                          "a model", ModelDataNote, stacklevel=2)


def _check_side_shape(plan: Plan, data, path: str, field: str, source: str) -> None:
    """The side file's layers (and KV heads, head dim when the plan names its model) are the plan's."""
    want = {"num_layers": plan.num_layers}
    if plan.model is not None:
        want.update(num_kv_heads=plan.model.num_kv_heads, head_dim=plan.model.head_dim)
    for name, expected in want.items():
        got = getattr(data, name, None)
        if isinstance(got, int) and got != expected:
            raise PlanError(f"{path} holds data for {name} {got} but the plan has {expected}", source=source,
                            field=field, hint="use the side file measured on the plan's model")
