"""KVzap's surrogate: per layer and KV head, a small regressor that predicts the log of KVzip's score of a token
from that token alone, and the safetensors file that carries it (fingerprinted to the model).

Input (per token, per KV head, float32): the token's own stored key and value in that head,
``phi = [|k_f| for f < d/2] ++ v`` with ``|k_f| = sqrt(k[f]^2 + k[f + d/2]^2) / s`` (RoPE's "half" pairing; the
magnitudes are the same before and after RoPE, so the stored post-RoPE keys give them exactly, whatever position the
token sits at; ``s`` the RoPE attention scaling), standardised with the training set's mean and deviation. The paper
feeds the attention input hidden state instead (the layer's input after its norm): the plugin contract hands a rule
the stored keys and values, which are the layer's own projections of that hidden state.

Two regressors per (layer, head), both in one file: ``linear`` (``w . phi + b``, ridge-fitted, alpha 1, as the
reference's linear KVzap) and ``mlp`` (``w2 . gelu(W1 phi + b1) + b2``, hidden size ``h``).

Reference: Jégou & Jeblick, "KVzap" (arXiv:2601.07891); kvpress ``KVzapPress`` (kvzap_press.py), ``kvzap/train.py``.
"""

from __future__ import annotations

import os
from typing import Any

import attrs
import torch
import torch.nn.functional as F

from polykv.contract import model_data
from polykv.errors import ProfileError

FORMAT = "polykv-kvzap-surrogate"
FORMAT_VERSION = 1
KVZAP_SUFFIX = ".kvzap.safetensors"
"""Side file of a profile that keeps the surrogate: ``x.profile.json`` -> ``x.kvzap.safetensors``."""
SURROGATES = ("mlp", "linear")
_TENSORS = ("feat_mean", "feat_std", "lin_w", "lin_b", "mlp_w1", "mlp_b1", "mlp_w2", "mlp_b2")
RETRAIN = ("train it on this model with `polykv model-data MODEL kvzap -o FILE` (or remove the file to train one "
           "from the offline corpus)")


def features(keys: torch.Tensor, values: torch.Tensor, rope_scaling: float = 1.0) -> torch.Tensor:
    """``[|k_f| ++ v]`` per token and head: keys, values [B, Hkv, T, d] -> [B, Hkv, T, 3d/2] float32."""
    k = keys.float()
    half = k.shape[-1] // 2
    mag = torch.sqrt(k[..., :half] ** 2 + k[..., half:2 * half] ** 2) / float(rope_scaling)   # (B, Hkv, T, d/2)
    return torch.cat([mag, values.float()], dim=-1)                                          # (B, Hkv, T, 3d/2)


@attrs.define(frozen=True, kw_only=True, eq=False)
class KVzapSurrogate:
    """Both regressors of every layer and KV head (CPU float32 tensors). L layers, Hkv KV heads, F = 3d/2
    features, h hidden units."""

    feat_mean: torch.Tensor
    """[L, Hkv, F] feature means of the training set."""
    feat_std: torch.Tensor
    """[L, Hkv, F] feature deviations (floored at 1e-6)."""
    lin_w: torch.Tensor
    """[L, Hkv, F] linear weights (on standardised features)."""
    lin_b: torch.Tensor
    """[L, Hkv] linear biases."""
    mlp_w1: torch.Tensor
    """[L, Hkv, F, h] first MLP layer."""
    mlp_b1: torch.Tensor
    """[L, Hkv, h]."""
    mlp_w2: torch.Tensor
    """[L, Hkv, h] second MLP layer (one output)."""
    mlp_b2: torch.Tensor
    """[L, Hkv]."""
    fingerprint: str | None = None
    """Fingerprint of the model it was trained on."""
    info: dict = attrs.field(factory=dict)
    """Training facts kept in the file's metadata (samples, texts, validation loss and correlation per regressor)."""
    path: str | None = attrs.field(default=None)
    """The file it was read from (for messages), or None."""

    def __attrs_post_init__(self) -> None:
        L, H, Fd = self.feat_mean.shape
        h = self.mlp_w1.shape[-1] if self.mlp_w1.dim() == 4 else -1
        want = {"feat_std": (L, H, Fd), "lin_w": (L, H, Fd), "lin_b": (L, H), "mlp_w1": (L, H, Fd, h),
                "mlp_b1": (L, H, h), "mlp_w2": (L, H, h), "mlp_b2": (L, H)}
        for name, shape in want.items():
            if tuple(getattr(self, name).shape) != shape:
                got = tuple(getattr(self, name).shape)
                raise ProfileError(f"{self.path or 'kvzap surrogate'}: tensor '{name}' is {got}, expected {shape} "
                                   f"(from feat_mean {tuple(self.feat_mean.shape)}); {RETRAIN}")
        if not bool((self.feat_std > 0).all()):
            raise ProfileError(f"{self.path or 'kvzap surrogate'}: tensor 'feat_std' holds a deviation <= 0 (features "
                               f"are divided by it); {RETRAIN}")
        if Fd % 3:
            raise ProfileError(f"{self.path or 'kvzap surrogate'}: {Fd} features per head is not 3d/2 for a head "
                               f"size d; {RETRAIN}")

    @property
    def num_layers(self) -> int:
        return int(self.feat_mean.shape[0])

    @property
    def num_kv_heads(self) -> int:
        return int(self.feat_mean.shape[1])

    @property
    def head_dim(self) -> int:
        return int(self.feat_mean.shape[2]) * 2 // 3

    @property
    def hidden(self) -> int:
        return int(self.mlp_w1.shape[-1])

    def check_layer(self, layer_idx: int, kv_heads: int, head_dim: int) -> None:
        """Raise a ValueError (one line) unless this surrogate covers layer ``layer_idx`` with that shape."""
        if not 0 <= layer_idx < self.num_layers or (kv_heads, head_dim) != (self.num_kv_heads, self.head_dim):
            where = f"{self.path}: " if self.path else ""
            raise ValueError(f"{where}the kvzap surrogate covers {self.num_layers} layers x {self.num_kv_heads} KV "
                             f"heads of size {self.head_dim}, not layer {layer_idx} with {kv_heads} KV heads of size "
                             f"{head_dim}: it was trained on another model; {RETRAIN}")

    def predict_features(self, layer_idx: int, phi: torch.Tensor, surrogate: str = "mlp") -> torch.Tensor:
        """Predicted log-scores from features ``phi`` [B, Hkv, T, F] of one layer: [B, Hkv, T] float32."""
        def held(name: str) -> torch.Tensor:           # this layer's tensor, heads first, on the features' device
            return getattr(self, name)[layer_idx].to(phi.device)

        x = (phi.float() - held("feat_mean")[None, :, None]) / held("feat_std")[None, :, None]    # (B, Hkv, T, F)
        if surrogate == "linear":
            return torch.einsum("bhtf,hf->bht", x, held("lin_w")) + held("lin_b")[None, :, None]
        if surrogate != "mlp":
            raise ValueError(f"surrogate must be one of {list(SURROGATES)}, got {surrogate!r}")
        hid = torch.einsum("bhtf,hfk->bhtk", x, held("mlp_w1")) + held("mlp_b1")[None, :, None]   # (B, Hkv, T, h)
        return torch.einsum("bhtk,hk->bht", F.gelu(hid), held("mlp_w2")) + held("mlp_b2")[None, :, None]

    def predict(self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor, *, rope_scaling: float = 1.0,
                surrogate: str = "mlp") -> torch.Tensor:
        """Predicted log KVzip scores of stored tokens: keys, values [B, Hkv, T, d] -> [B, Hkv, T] float32."""
        self.check_layer(layer_idx, keys.shape[1], keys.shape[-1])
        return self.predict_features(layer_idx, features(keys, values, rope_scaling), surrogate)

    def check_model(self, model: Any) -> None:
        """Raise unless ``model`` has these layers, KV heads and head size and (when both are known) this
        fingerprint."""
        geo = model_data.model_geometry(model)
        where = f"{self.path}: " if self.path else ""
        if not model_data.fingerprints_match(self.fingerprint, geo.fingerprint):
            raise ProfileError(f"{where}the kvzap surrogate was trained on model {self.fingerprint}, this model is "
                               f"{geo.fingerprint}; {RETRAIN}")
        if (geo.num_layers, geo.num_kv_heads, geo.head_dim) != (self.num_layers, self.num_kv_heads, self.head_dim):
            raise ProfileError(f"{where}the kvzap surrogate covers {self.num_layers} layers x {self.num_kv_heads} KV "
                               f"heads of size {self.head_dim}, this model has {geo.num_layers} x {geo.num_kv_heads} "
                               f"of size {geo.head_dim}; {RETRAIN}")

    # -- files ---------------------------------------------------------------------------------
    def save(self, path: str | os.PathLike) -> None:
        """Write a ``.safetensors`` file atomically (a temp file renamed over ``path``)."""
        from safetensors.torch import save_file

        meta = {"format": FORMAT, "format_version": str(FORMAT_VERSION), "fingerprint": self.fingerprint or "",
                **{k: str(v) for k, v in self.info.items()}}
        arrays = {n: getattr(self, n).detach().to("cpu", torch.float32).contiguous() for n in _TENSORS}
        model_data.write_atomically(os.fspath(path), lambda tmp: save_file(arrays, tmp, metadata=meta))

    @classmethod
    def load(cls, path: str | os.PathLike) -> "KVzapSurrogate":
        """Read a file written by :meth:`save`."""
        path = os.fspath(path)
        arrays, meta = model_data.read_tagged(path, _TENSORS, fmt=FORMAT, version=FORMAT_VERSION,
                                              what="kvzap surrogate", fix=RETRAIN, nonnegative=("feat_std",))
        info = {k: v for k, v in meta.items() if k not in ("format", "format_version", "fingerprint")}
        return cls(**arrays, fingerprint=meta.get("fingerprint") or None, info=info, path=path)


def is_kvzap_file(path: str) -> bool:
    """True when ``path`` is a kvzap surrogate file polykv wrote (its format tag), read without loading tensors."""
    try:
        from safetensors import safe_open

        with safe_open(path, framework="pt") as fh:
            return (fh.metadata() or {}).get("format") == FORMAT
    except Exception:  # noqa: BLE001 - any unreadable file is not ours
        return False
