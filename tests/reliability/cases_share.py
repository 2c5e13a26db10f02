"""Bad shared layer pairs (``share``) through the CLI: refused when the plan is read, naming the layer and field."""

from __future__ import annotations

from cases import add, model_folder, mutate, write


def shared_dict(layers: int = 2) -> dict:
    """A version-2 plan whose layer 1 shares with layer 0; every layer keeps everything at 16 bits."""
    return {
        "schema_version": 2,
        "model": {"num_layers": layers, "num_kv_heads": 2, "head_dim": 32, "name": "tiny", "fingerprint": None},
        "layers": [dict({"layer": i, "prefill": {"rule": "full"}, "decode": {"rule": "full"}},
                        **({"share": 0} if i == 1 else {})) for i in range(layers)],
    }


def _chained() -> dict:
    d = shared_dict(3)
    d["layers"][2]["share"] = 1
    return d


SHARE_PLANS = [
    ("not-adjacent", mutate(shared_dict(), "layers.1.share", 1), "layers[1].share'"),
    ("layer-0", mutate(shared_dict(), "layers.0.share", 0), "layers[0].share'"),
    ("string", mutate(shared_dict(), "layers.1.share", "0"), "layers[1].share'"),
    ("negative", mutate(shared_dict(), "layers.1.share", -1), "layers[1].share'"),
    ("version-1", mutate(shared_dict(), "schema_version", 1), "layers[1].share'"),
    ("chained", _chained(), "layers[2].share'"),
    ("evicting-lower", mutate(shared_dict(), "layers.0.prefill", {"rule": "snapkv", "capacity": 8}),
     "layers[0].prefill.rule'"),
    ("evicting-upper", mutate(shared_dict(), "layers.1.decode", {"rule": "h2o", "capacity": 8}),
     "layers[1].decode.rule'"),
    ("quantized", mutate(shared_dict(), "layers.1.k_bits", 8), "layers[1].k_bits'"),
    ("param-unknown", mutate(shared_dict(), "layers.1.share_params", {"t": 0.5}), "layers[1].share_params.t'"),
    ("param-range", mutate(shared_dict(), "layers.1.share_params", {"retention_ratio": 1.5}),
     "layers[1].share_params.retention_ratio'"),
    ("param-bool", mutate(shared_dict(), "layers.1.share_params", {"interpolation": True}),
     "layers[1].share_params.interpolation'"),
    ("params-without-share", mutate(mutate(shared_dict(), "layers.1.share", None, delete=True), "layers.1.share_params",
                                    {"interpolation": 0.5}), "layers[1].share_params'"),
]
for _id, _plan, _expect in SHARE_PLANS:
    add(f"share-{_id}", "plan", lambda d, p=_plan: ["plan", "validate", write(d, "p.json", p)], _expect)

# a pair of a sliding-window layer and a full-attention layer (Qwen2 with its first layer full, the second sliding)
add("share-sliding-and-full", "plan", lambda d: ["plan", "validate", write(d, "p.json", shared_dict()), "--model",
                                                 model_folder(d, family="qwen2", use_sliding_window=True,
                                                              sliding_window=8, max_window_layers=1)],
    "layers[1].share'")
