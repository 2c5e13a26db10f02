"""Bad input to KVzap (rule and allocator ``kvzap``, ``polykv model-data ... kvzap``) through the CLI: refused before
any model runs, naming the layer, field, file or option."""

from __future__ import annotations

from cases import add, model_folder, mutate, plan_dict, write

KVZAP = {"rule": "kvzap", "capacity": 16}


def _plan(params: dict | None = None, **extra) -> dict:
    """Layer 0 runs kvzap in prefill (with ``params``)."""
    d = mutate(plan_dict(), "layers.0.prefill", dict(KVZAP, params=params or {}))
    d.update(extra)
    return d


def _surrogate(d, *, fingerprint="cfg-000000000000+s-000000000000", layers=2, version=None) -> str:
    """A surrogate file of the tiny model's shape (2 layers of hidden size 128, 2 KV heads); ``version`` 1: the
    format whose regressors read the stored keys and values (per KV head, 3d/2 = 48 features)."""
    import torch
    from safetensors.torch import save_file

    from polykv.adapters.rules.kvzap_model import FORMAT, KVzapSurrogate

    L, H, D, h = layers, 2, 128, 4
    path = d / "other.kvzap.safetensors"
    if version == 1:
        Fd = 48
        arrays = dict(feat_mean=torch.zeros(L, H, Fd), feat_std=torch.ones(L, H, Fd), lin_w=torch.zeros(L, H, Fd),
                      lin_b=torch.zeros(L, H), mlp_w1=torch.zeros(L, H, Fd, h), mlp_b1=torch.zeros(L, H, h),
                      mlp_w2=torch.zeros(L, H, h), mlp_b2=torch.zeros(L, H))
        save_file(arrays, str(path), metadata={"format": FORMAT, "format_version": "1", "fingerprint": fingerprint})
        return str(path)
    KVzapSurrogate(feat_mean=torch.zeros(L, D), feat_std=torch.ones(L, D), lin_w=torch.zeros(L, D, H),
                   lin_b=torch.zeros(L, H), mlp_w1=torch.zeros(L, D, h), mlp_b1=torch.zeros(L, h),
                   mlp_w2=torch.zeros(L, h, H), mlp_b2=torch.zeros(L, H), fingerprint=fingerprint).save(path)
    return str(path)


def _damaged(d) -> str:
    path = d / "bad.kvzap.safetensors"
    path.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{not json")
    return str(path)


PLANS = [
    ("surrogate-unknown", _plan({"surrogate": "cubic"}), "layers[0].prefill.params.surrogate"),
    ("threshold-text", _plan({"threshold": "high"}), "layers[0].prefill.params.threshold"),
    ("threshold-nan", _plan({"threshold": float("nan")}), "p.json"),          # strict JSON: no NaN
    ("threshold-infinite", _plan({"threshold": float("inf")}), "p.json"),
    ("n-sink-negative", _plan({"n_sink": -1}), "layers[0].prefill.params.n_sink"),
    ("window-negative", _plan({"window": -4}), "layers[0].prefill.params.window"),
    ("window-fraction", _plan({"window": 2.5}), "layers[0].prefill.params.window"),
    ("unknown-param", _plan({"tau": -4}), "layers[0].prefill.params"),
    # the protected tokens alone fill the capacity: the scores would never decide anything
    ("sinks-and-window-over-capacity", _plan({"n_sink": 4, "window": 16}), "layers[0].prefill"),
    ("threshold-window-over-capacity", _plan({"threshold": -4.0}), "layers[0].prefill"),
]
for _id, _plan_d, _expect in PLANS:
    add(f"kvzap-{_id}", "plan", lambda d, p=_plan_d: ["plan", "validate", write(d, "p.json", p)], _expect)

# a surrogate trained on another model, named by the plan: refused by `plan validate --model`
add("kvzap-surrogate-of-another-model", "plan", lambda d: [
    "plan", "validate", write(d, "p.json", _plan(model_data={"kvzap": _surrogate(d)})),
    "--model", model_folder(d)], "model_data.kvzap")
add("kvzap-surrogate-damaged", "plan", lambda d: [
    "plan", "validate", write(d, "p.json", _plan(model_data={"kvzap": _damaged(d)})),
    "--model", model_folder(d)], "bad.kvzap.safetensors")
add("kvzap-surrogate-too-few-layers", "plan", lambda d: [
    "plan", "validate", write(d, "p.json", _plan(model_data={"kvzap": _surrogate(d, fingerprint="", layers=1)})),
    "--model", model_folder(d)], "model_data.kvzap")
# a surrogate of the first format (its regressors read the stored keys and values): refused, saying to retrain
add("kvzap-surrogate-old-format", "plan", lambda d: [
    "plan", "validate", write(d, "p.json", _plan(model_data={"kvzap": _surrogate(d, fingerprint="", version=1)})),
    "--model", model_folder(d)], "retrain it with `polykv model-data MODEL kvzap")
# the kvzap allocator over a layer whose prefill rule is another one: nothing to rank
add("kvzap-allocator-over-another-rule", "plan", lambda d: [
    "plan", "validate", write(d, "p.json", _plan(allocation=[{"allocator": "kvzap", "layers": [0, 1]}]))],
    "allocation")

# polykv model-data: the corpus options, checked before the model loads
for _id, _argv, _expect in [
    ("texts-zero", ["--texts", "0"], "--texts"),
    ("texts-huge", ["--texts", "100000"], "--texts"),
    ("tokens-tiny", ["--tokens", "3"], "--tokens"),
    ("texts-more-than-the-corpus", ["--texts", "9000", "--tokens", "100000"], "--texts"),
]:
    add(f"kvzap-model-data-{_id}", "cli", lambda d, a=_argv: [
        "model-data", model_folder(d), "kvzap", "-o", str(d / "out.kvzap.safetensors"), *a], _expect,
        outputs=("out.kvzap.safetensors",))
# -o names a file that is not a surrogate: never overwritten
add("kvzap-model-data-output-not-a-surrogate", "cli", lambda d: [
    "model-data", model_folder(d), "kvzap", "-o", write(d, "notes.txt", "my notes")], "notes.txt")
