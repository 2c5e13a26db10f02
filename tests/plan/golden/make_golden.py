"""Regenerate the golden plan files in this folder: ``python tests/plan/golden/make_golden.py``.

Valid files are canonical plans (as :meth:`polykv.Plan.save` writes them) for a 2-layer model with
2 KV heads of dimension 16. Each invalid file breaks exactly one rule of the plan format; the dotted
field its error must name (null for JSON syntax errors) and a fragment of the message are written to
``expected-errors.json``. Review the diff before committing regenerated files.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import attrs

from polykv.models.geometry import ModelGeometry
from polykv.plan import OpSpec, Provenance, full_plan, per_layer_plan, uniform_plan

HERE = Path(__file__).resolve().parent
GEOMETRY = ModelGeometry(model_type="llama", num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                         rope_theta=10000.0)
SMALL_GROUPS = {"group_size": 16, "residual": 16}  # KIVI groups must divide head_dim 16


def _named(plan):
    return attrs.evolve(plan, model=attrs.evolve(plan.model, name="tiny-llama"))


def valid_plans() -> dict[str, object]:
    mixed = per_layer_plan(GEOMETRY, [
        dict(prefill=OpSpec(rule="snapkv", capacity=64, params={"window": 16, "pooling": "avg"}),
             decode=OpSpec(rule="streamingllm", capacity=64, params={"n_sink": 4}), k_bits=8, v_bits=8,
             quantizer_params=SMALL_GROUPS),
        dict(prefill=OpSpec(rule="tova", capacity_ratio=0.25),
             decode=OpSpec(rule="h2o", capacity_ratio=0.5, params={"recent_ratio": 0.25}), k_bits=4, v_bits=2,
             quantizer_params=SMALL_GROUPS),
    ], decode_slack=16)
    prov = Provenance(solver="moend-greedy", params={"rule": "snapkv", "metric": "kl"}, budget={"ratio": 8},
                      context_tokens=4096, predicted_loss=0.0375, predicted_bytes=123456,
                      profile_fingerprint="prof-0123456789ab", polykv_version="0.1.0",
                      created="2026-01-02T03:04:05Z", note="hand-checked: gardé à 8× — ✓")
    solved = uniform_plan(GEOMETRY, prefill="key-norm", decode="full", capacity=128, k_bits=8, v_bits=4,
                          quantizer_params=SMALL_GROUPS, provenance=prov)
    no_model = attrs.evolve(uniform_plan(GEOMETRY, prefill="random", decode="random", capacity_ratio=1.0),
                            model=None)
    return {"full-every-layer": _named(full_plan(GEOMETRY)),
            "mixed-rules-bits-and-phases": _named(mixed),
            "solver-provenance-unicode-note": _named(solved),
            "no-model-block": no_model}


def invalid_cases(base_text: str):
    """(name, field, message fragment, text) for each invalid file, all derived from ``base_text``."""
    base = json.loads(base_text)

    def mutated(change):
        d = copy.deepcopy(base)
        change(d)
        return json.dumps(d, indent=2, ensure_ascii=False) + "\n"

    def layer(i, **kv):
        return lambda d: d["layers"][i].update(**kv)

    def op(i, phase, **kv):
        return lambda d: d["layers"][i][phase].update(**kv)

    def extra_layer(d):
        d.update(model=None)
        d["layers"].append(dict(d["layers"][1], layer=2))

    yield ("malformed-json-missing-comma", None, "malformed JSON at line 5, column 3",
           base_text.replace('"trigger": {"decode_slack": 16},', '"trigger": {"decode_slack": 16}', 1))
    yield ("nan-number", None, "NaN is not a number", base_text.replace('"predicted_loss": null', '"predicted_loss": NaN'))
    cases = [
        ("schema-version-3", "schema_version", "unknown schema version 3", lambda d: d.update(schema_version=3)),
        ("unknown-rule", "layers[1].decode.rule", "unknown rule 'h2o-typo'", op(1, "decode", rule="h2o-typo")),
        ("unknown-quantizer", "layers[0].quantizer", "unknown quantizer 'kiwi'", layer(0, quantizer="kiwi")),
        ("layer-count-for-model", "layers", "the plan has 3 layers but the model has 2", extra_layer),
        ("model-num-layers-disagrees-with-entries", "model.num_layers", "lists 2 layers but model.num_layers is 3",
         lambda d: d["model"].update(num_layers=3)),
        ("kv-heads-for-model", "model.num_kv_heads", "made for 4 KV heads but the model has 2",
         lambda d: d["model"].update(num_kv_heads=4)),
        ("head-dim-for-model", "model.head_dim", "head_dim 64", lambda d: d["model"].update(head_dim=64)),
        ("fingerprint-for-model", "model.fingerprint", "made for model cfg-000000000000",
         lambda d: d["model"].update(fingerprint="cfg-000000000000")),
        ("bit-width-3", "layers[0].k_bits", "unsupported bit width 3", layer(0, k_bits=3)),
        ("bits-as-string", "layers[1].v_bits", "expected an integer", layer(1, v_bits="2")),
        ("zero-capacity", "layers[0].prefill.capacity", "capacity must be a positive number", op(0, "prefill", capacity=0)),
        ("negative-capacity", "layers[0].decode.capacity", "got -8", op(0, "decode", capacity=-8)),
        ("ratio-above-one", "layers[1].prefill.capacity_ratio", "must be in (0, 1]", op(1, "prefill", capacity_ratio=1.5)),
        ("ratio-zero", "layers[1].decode.capacity_ratio", "got 0.0", op(1, "decode", capacity_ratio=0)),
        ("capacity-and-ratio", "layers[1].prefill.capacity", "exactly one of", op(1, "prefill", capacity=10)),
        ("no-capacity", "layers[0].decode.capacity", "exactly one of", lambda d: d["layers"][0]["decode"].pop("capacity")),
        ("full-with-capacity", "layers[0].prefill.capacity", "takes no capacity", op(0, "prefill", rule="full")),
        ("unknown-top-level-key", "comment", "unknown key(s) ['comment']", lambda d: d.update(comment="x")),
        ("unknown-layer-key", "layers[0].kbits", "unknown key(s) ['kbits']", layer(0, kbits=4)),
        ("unknown-op-key", "layers[1].prefill.capcity", "unknown key(s) ['capcity']", op(1, "prefill", capcity=3)),
        ("unknown-rule-param", "layers[0].prefill.params", "has no parameter(s) ['windw']",
         lambda d: d["layers"][0]["prefill"]["params"].update(windw=8)),
        ("rule-in-wrong-phase", "layers[1].decode.rule", "does not run in the decode phase",
         layer(1, decode={"rule": "snapkv", "capacity": 32})),
        ("layers-out-of-order", "layers[1].layer", "entry 1 says layer 0", layer(1, layer=0)),
        ("empty-layers", "layers", "non-empty list", lambda d: d.update(layers=[])),
        ("decode-slack-zero", "trigger.decode_slack", "must be >= 1", lambda d: d["trigger"].update(decode_slack=0)),
    ]
    for name, field, message, change in cases:
        yield name, field, message, mutated(change)


def main() -> None:
    for old in HERE.glob("Plan-*.json"):
        old.unlink()
    plans = valid_plans()
    for name, plan in plans.items():
        plan.save(str(HERE / f"Plan-valid-{name}.json"))
    expected = {}
    for name, field, message, text in invalid_cases(plans["mixed-rules-bits-and-phases"].to_json()):
        (HERE / f"Plan-invalid-{name}.json").write_text(text, encoding="utf-8")
        expected[f"Plan-invalid-{name}.json"] = {"field": field, "message": message}
    (HERE / "expected-errors.json").write_text(json.dumps(expected, indent=2, sort_keys=True) + "\n",
                                               encoding="utf-8")
    print(f"wrote {len(plans)} valid and {len(expected)} invalid plan files to {HERE}")


if __name__ == "__main__":
    main()
