"""Bad input to the low-rank axis (``k_rank`` / ``v_rank``) through the CLI: refused when the plan is read, naming
the layer and field, before any model runs."""

from __future__ import annotations

from cases import add, model_folder, mutate, plan_dict, write


def _v2(plan: dict) -> dict:
    return mutate(plan, "schema_version", 2)


def _bases_of_another_model(d) -> str:
    """A bases file for the case models' shape (2 layers, 2 KV heads, d = 32) measured on another model."""
    import torch

    from polykv.models.kv_bases import KVBases

    eye = torch.eye(32).expand(2, 2, 32, 32).contiguous()
    energy = torch.linspace(1, 0, 32).expand(2, 2, 32).contiguous()
    KVBases(key=eye, value=eye, key_energy=energy, value_energy=energy,
            fingerprint="cfg-000000000000+s-000000000000").save(d / "other.kvbases.safetensors")
    return "other.kvbases.safetensors"


RANK_PLANS = [
    # a rank above the head dim (32) of the plan's model
    ("above-head-dim", _v2(mutate(plan_dict(), "layers.1.k_rank", 33)), "layers[1].k_rank"),
    ("zero", _v2(mutate(plan_dict(), "layers.0.v_rank", 0)), "layers[0].v_rank"),
    ("string", _v2(mutate(plan_dict(), "layers.0.k_rank", "16")), "layers[0].k_rank"),
    # a rank field in a version-1 file
    ("in-version-1", mutate(plan_dict(), "layers.1.v_rank", 16), "layers[1].v_rank"),
    # KIVI quantizes layer 0's 4-bit values in groups of 32 channels (its default group size): 24 is not a multiple
    ("kivi-group", _v2(mutate(plan_dict(), "layers.0.v_rank", 24)), "layers[0].v_rank"),
]
for _id, _plan, _expect in RANK_PLANS:
    add(f"rank-{_id}", "plan", lambda d, p=_plan: ["plan", "validate", write(d, "p.json", p)], _expect)
    add(f"rank-show-{_id}", "plan", lambda d, p=_plan: ["plan", "show", write(d, "p.json", p)], _expect)

add("rank-bases-of-another-model", "plan", lambda d: ["plan", "validate", write(
    d, "p.json", mutate(_v2(mutate(plan_dict(), "layers.1.k_rank", 16)), "model_data", {
        "kv_bases": _bases_of_another_model(d)})), "--model", model_folder(d)], "model_data.kv_bases")
add("rank-above-model-head-dim", "plan", lambda d: ["plan", "validate", write(
    d, "p.json", mutate(_v2(mutate(plan_dict(), "layers.1.k_rank", 24)), "model", None)), "--model",
    model_folder(d, head_dim=16)], "layers[1].k_rank")
