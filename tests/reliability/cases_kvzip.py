"""Bad input to KVzip (rules ``kvzip``, ``kvzip-head``) through the CLI: refused before any model runs, naming
the layer or field."""

from __future__ import annotations

from cases import add, model_folder, mutate, plan_dict, write

IDS = {"repeat_ids": [5, 6], "continue_ids": [7], "suffix_ids": [8]}
HEAD = {"rule": "kvzip-head", "capacity_ratio": 0.6}


def _head_plan(**extra) -> dict:
    """Both layers kvzip-head in prefill, in one kvzip-head group."""
    d = mutate(mutate(plan_dict(), "layers.0.prefill", dict(HEAD)), "layers.1.prefill", dict(HEAD))
    d["allocation"] = [{"allocator": "kvzip-head", "layers": [0, 1]}]
    d.update(extra)
    return d


def _foreign_scores(d) -> str:
    """A head-score file of the tiny model's shape, measured on another model."""
    import torch

    from polykv.adapters.rules.kvzip_heads import HeadScores

    path = d / "other.kvzip-heads.safetensors"
    HeadScores(scores=torch.rand(2, 2), fingerprint="cfg-000000000000+s-000000000000", num_tokens=8).save(path)
    return str(path)


HEAD_PLANS = [
    # decode has no prompt: kvzip-head ranks the prompt's heads once, in prefill
    ("kvzip-head-in-decode", mutate(_head_plan(), "layers.1.decode", dict(HEAD)), "layers[1].decode"),
    ("kvzip-head-sink-unknown", mutate(_head_plan(), "layers.0.prefill.params", {"sink": "all"}),
     "layers[0].prefill.params.sink'"),
]
for _id, _plan, _expect in HEAD_PLANS:
    add(f"kvzip-{_id}", "plan", lambda d, p=_plan: ["plan", "validate", write(d, "p.json", p)], _expect)

# a head-score file measured on another model, named by the plan: refused by `plan validate --model`
add("kvzip-head-scores-of-another-model", "plan", lambda d: [
    "plan", "validate", write(d, "p.json", _head_plan(model_data={"kvzip-head": _foreign_scores(d)})),
    "--model", model_folder(d)], "model_data.kvzip-head")

# a probe longer than the model's positions after the prompt: 40 context + (2 + 1 + 30) probe tokens > 64
add("kvzip-probe-past-positions", "plan", lambda d: [
    "plan", "show", write(d, "p.json", mutate(plan_dict(), "layers.0.prefill",
                                              {"rule": "kvzip", "capacity": 16, "params": dict(IDS, chunk_size=30)})),
    "--model", model_folder(d, max_position_embeddings=64), "--context", "40"], "layers[0].prefill")
