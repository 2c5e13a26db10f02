"""Bad optional plan sections through the CLI: ``allocation``, ``model_data``, ``share``, ranks and the
provenance's budget, time and basis are read and checked whenever a file gives them (also given as ``false``, ``0``, ``""`` or ``[]``), never skipped because they
look empty; a plan or model config path that is a folder is refused in one line naming it."""

from __future__ import annotations

import os

from cases import add, model_folder, mutate, plan_dict, write


def _v2(d: dict) -> dict:
    return mutate(d, "schema_version", 2)


def _group(layers: list, **extra) -> dict:
    return mutate(plan_dict(), "allocation", [dict({"allocator": "cake", "layers": layers}, **extra)])


def _shared() -> dict:
    """A version-2 plan whose layer 1 shares with layer 0 (both keep everything at 16 bits)."""
    d = _v2(plan_dict())
    for i in (0, 1):
        d["layers"][i].update(prefill={"rule": "full"}, decode={"rule": "full"}, k_bits=16, v_bits=16)
    d["layers"][1]["share"] = 0
    return d


PLANS = [
    # falsy but present: each is read (and refused) like any other value of the wrong kind
    ("allocation-false", mutate(plan_dict(), "allocation", False), "'allocation'"),
    ("allocation-zero", mutate(plan_dict(), "allocation", 0), "'allocation'"),
    ("allocation-empty-string", mutate(plan_dict(), "allocation", ""), "'allocation'"),
    ("allocation-object", mutate(plan_dict(), "allocation", {}), "'allocation'"),
    ("model-data-false", mutate(plan_dict(), "model_data", False), "'model_data'"),
    ("model-data-list", mutate(plan_dict(), "model_data", []), "'model_data'"),
    ("model-data-empty-path", mutate(plan_dict(), "model_data", {"triattention": ""}), "model_data.triattention"),
    ("provenance-budget-false", mutate(plan_dict(), "provenance.budget", False), "provenance.budget"),
    ("provenance-budget-empty", mutate(plan_dict(), "provenance.budget", {}), "provenance.budget"),
    ("provenance-created-empty", mutate(plan_dict(), "provenance.created", ""), "provenance.created"),
    ("provenance-basis-empty", mutate(plan_dict(), "provenance.basis", ""), "provenance.basis"),
    ("provenance-cache-dtype-zero", mutate(plan_dict(), "provenance.cache_dtype", 0), "provenance.cache_dtype"),
    # groups: checked when present
    ("group-empty-entry", mutate(plan_dict(), "allocation", [{}]), "allocation[0].allocator"),
    ("group-layer-out-of-range", _group([0, 5]), "allocation[0].layers"),
    ("group-full-prefill-layer", _group([0, 1]), "layers[1].prefill.rule"),
    # pairs: a share or share_params anywhere turns the checks on
    ("share-params-in-version-1", mutate(plan_dict(), "layers.1.share_params", {"interpolation": 0.5}),
     "layers[1].share'"),
    ("share-null-with-params", mutate(mutate(_shared(), "layers.1.share", None), "layers.1.share_params",
                                      {"interpolation": 0.5}), "layers[1].share_params'"),
    ("share-on-evicting-layer-0", mutate(mutate(plan_dict(), "schema_version", 2), "layers.1.share", 0),
     "layers[0].prefill.rule"),
    # ranks: checked when some layer has one
    ("rank-null", mutate(_v2(plan_dict()), "layers.0.k_rank", None), "layers[0].k_rank"),
    ("rank-version-1-second-layer", mutate(plan_dict(), "layers.1.k_rank", 8), "layers[1].k_rank"),
    ("rank-above-head-dim-v", mutate(_v2(plan_dict()), "layers.1.v_rank", 64), "layers[1].v_rank"),
]
for _id, _plan, _expect in PLANS:
    add(f"planpath-{_id}", "plan", lambda d, p=_plan: ["plan", "validate", write(d, "p.json", p)], _expect)


def _folder(d, name: str) -> str:
    os.mkdir(d / name)
    return str(d / name)


add("planpath-plan-is-folder", "plan", lambda d: ["plan", "validate", _folder(d, "p.json")], "p.json")
add("planpath-plan-show-is-folder", "plan", lambda d: ["plan", "show", _folder(d, "p.json")], "p.json")


def _config_folder(d) -> list[str]:
    folder = model_folder(d)
    os.remove(os.path.join(folder, "config.json"))
    os.mkdir(os.path.join(folder, "config.json"))
    return ["plan", "validate", write(d, "p.json", plan_dict()), "--model", folder]


add("planpath-model-config-is-folder", "plan", _config_folder, "config.json")
