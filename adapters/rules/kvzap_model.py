"""KVzap's surrogate: per layer, a small regressor that predicts the log of KVzip's score of a token, in each KV
head, from the hidden state entering the layer's attention (the normed input its q/k/v projections read), and the
safetensors file that carries it (fingerprinted to the model).

Input (per token, float32): its attention input ``x`` [D] (the model's hidden size), standardised with the training
set's mean and deviation. Output: Hkv predicted log-scores, one per KV head. Two regressors per layer, both in one
file: ``linear`` (``W x + b``, ridge-fitted, alpha 1, as the reference's linear KVzap) and ``mlp``
(``W2 gelu(W1 x + b1) + b2``, hidden width ``h``).

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
FORMAT_VERSION = 2
"""2: the regressors read the attention input; 1 (refused): they read the stored keys and values."""
KVZAP_SUFFIX = ".kvzap.safetensors"
"""Side file of a profile that keeps the surrogate: ``x.profile.json`` -> ``x.kvzap.safetensors``."""
SURROGATES = ("mlp", "linear")
_TENSORS = ("feat_mean", "feat_std", "lin_w", "lin_b", "mlp_w1", "mlp_b1", "mlp_w2", "mlp_b2")
RETRAIN = ("train it on this model with `polykv model-data MODEL kvzap -o FILE` (or remove the file to train one "
           "from the offline corpus)")


@attrs.define(frozen=True, kw_only=True, eq=False)
class KVzapSurrogate:
    """Both regressors of every layer (CPU float32 tensors). L layers, D hidden size (inputs), Hkv KV heads
    (outputs), h hidden units."""

    feat_mean: torch.Tensor
    """[L, D] input means of the training set."""
    feat_std: torch.Tensor
    """[L, D] input deviations (floored at 1e-6)."""
    lin_w: torch.Tensor
    """[L, D, Hkv] linear weights (on standardised inputs)."""
    lin_b: torch.Tensor
    """[L, Hkv] linear biases."""
    mlp_w1: torch.Tensor
    """[L, D, h] first MLP layer."""
    mlp_b1: torch.Tensor
    """[L, h]."""
    mlp_w2: torch.Tensor
    """[L, h, Hkv] second MLP layer (one output per KV head)."""
    mlp_b2: torch.Tensor
    """[L, Hkv]."""
    fingerprint: str | None = None
    """Fingerprint of the model it was trained on."""
    info: dict = attrs.field(factory=dict)
    """Training facts kept in the file's metadata (samples, texts, validation loss and correlation per regressor)."""
    path: str | None = attrs.field(default=None)
    """The file it was read from (for messages), or None."""

    def __attrs_post_init__(self) -> None:
        if self.feat_mean.dim() != 2 or self.lin_b.dim() != 2 or self.mlp_w1.dim() != 3:
            raise ProfileError(f"{self.path or 'kvzap surrogate'}: tensors 'feat_mean' {tuple(self.feat_mean.shape)}, "
                               f"'lin_b' {tuple(self.lin_b.shape)}, 'mlp_w1' {tuple(self.mlp_w1.shape)} are not "
                               f"[L, D], [L, Hkv], [L, D, h]; {RETRAIN}")
        (L, D), H, h = self.feat_mean.shape, self.lin_b.shape[1], self.mlp_w1.shape[-1]
        want = {"feat_std": (L, D), "lin_w": (L, D, H), "lin_b": (L, H), "mlp_w1": (L, D, h), "mlp_b1": (L, h),
                "mlp_w2": (L, h, H), "mlp_b2": (L, H)}
        for name, shape in want.items():
            if tuple(getattr(self, name).shape) != shape:
                got = tuple(getattr(self, name).shape)
                raise ProfileError(f"{self.path or 'kvzap surrogate'}: tensor '{name}' is {got}, expected {shape} "
                                   f"(from feat_mean {(L, D)} and lin_b {(L, H)}); {RETRAIN}")
        if not bool((self.feat_std > 0).all()):
            raise ProfileError(f"{self.path or 'kvzap surrogate'}: tensor 'feat_std' holds a deviation <= 0 (inputs "
                               f"are divided by it); {RETRAIN}")

    @property
    def num_layers(self) -> int:
        return int(self.feat_mean.shape[0])

    @property
    def hidden_size(self) -> int:
        """D: the width of the attention input the regressors read."""
        return int(self.feat_mean.shape[1])

    @property
    def num_kv_heads(self) -> int:
        return int(self.lin_b.shape[1])

    @property
    def hidden(self) -> int:
        return int(self.mlp_w1.shape[-1])

    def check_layer(self, layer_idx: int, kv_heads: int, hidden_size: int) -> None:
        """Raise a ValueError (one line) unless this surrogate covers layer ``layer_idx`` with that shape."""
        if not 0 <= layer_idx < self.num_layers or (kv_heads, hidden_size) != (self.num_kv_heads, self.hidden_size):
            where = f"{self.path}: " if self.path else ""
            raise ValueError(f"{where}the kvzap surrogate covers {self.num_layers} layers of hidden size "
                             f"{self.hidden_size} x {self.num_kv_heads} KV heads, not layer {layer_idx} with hidden "
                             f"size {hidden_size} x {kv_heads} KV heads: it was trained on another model; {RETRAIN}")

    def predict(self, layer_idx: int, hidden: torch.Tensor, *, surrogate: str = "mlp",
                kv_heads: int | None = None) -> torch.Tensor:
        """Predicted log KVzip scores of tokens from their attention inputs ``hidden`` [B, q, D] of layer
        ``layer_idx``: [B, Hkv, q] float32 (``kv_heads``: the layer's, checked when given)."""
        self.check_layer(layer_idx, self.num_kv_heads if kv_heads is None else kv_heads, hidden.shape[-1])

        def held(name: str) -> torch.Tensor:           # this layer's tensor, on the input's device
            return getattr(self, name)[layer_idx].to(hidden.device)

        x = (hidden.float() - held("feat_mean")) / held("feat_std")                                  # (B, q, D)
        if surrogate == "linear":
            out = x @ held("lin_w") + held("lin_b")                                                  # (B, q, Hkv)
        elif surrogate == "mlp":
            out = F.gelu(x @ held("mlp_w1") + held("mlp_b1")) @ held("mlp_w2") + held("mlp_b2")
        else:
            raise ValueError(f"surrogate must be one of {list(SURROGATES)}, got {surrogate!r}")
        return out.transpose(1, 2)                                                                   # (B, Hkv, q)

    def check_model(self, model: Any) -> None:
        """Raise unless ``model`` has these layers, KV heads and head size and (when both are known) this
        fingerprint."""
        geo = model_data.model_geometry(model)
        where = f"{self.path}: " if self.path else ""
        if not model_data.fingerprints_match(self.fingerprint, geo.fingerprint):
            raise ProfileError(f"{where}the kvzap surrogate was trained on model {self.fingerprint}, this model is "
                               f"{geo.fingerprint}; {RETRAIN}")
        width = hidden_size_of(model)
        if (geo.num_layers, geo.num_kv_heads, width) != (self.num_layers, self.num_kv_heads, self.hidden_size):
            raise ProfileError(f"{where}the kvzap surrogate covers {self.num_layers} layers of hidden size "
                               f"{self.hidden_size} x {self.num_kv_heads} KV heads, this model has "
                               f"{geo.num_layers} of hidden size {width} x {geo.num_kv_heads}; {RETRAIN}")

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
        if file_format(path) == (FORMAT, "1"):
            raise ProfileError(f"{path}: a kvzap surrogate of format version 1, whose regressors read the stored keys "
                               f"and values; kvzap now reads the hidden states entering attention (version "
                               f"{FORMAT_VERSION}): retrain it with `polykv model-data MODEL kvzap -o {path}`")
        arrays, meta = model_data.read_tagged(path, _TENSORS, fmt=FORMAT, version=FORMAT_VERSION,
                                              what="kvzap surrogate", fix=RETRAIN, nonnegative=("feat_std",))
        info = {k: v for k, v in meta.items() if k not in ("format", "format_version", "fingerprint")}
        return cls(**arrays, fingerprint=meta.get("fingerprint") or None, info=info, path=path)


def hidden_size_of(model: Any) -> int:
    """The width D of the hidden states entering ``model``'s attention modules (its text config's hidden size)."""
    config = getattr(model.config, "get_text_config", lambda: model.config)()
    return int(config.hidden_size)


def file_format(path: str) -> tuple[str | None, str | None]:
    """(format, format_version) of a safetensors file's metadata, read without loading tensors; (None, None) when
    unreadable."""
    try:
        from safetensors import safe_open

        with safe_open(path, framework="pt") as fh:
            meta = fh.metadata() or {}
        return meta.get("format"), meta.get("format_version")
    except Exception:  # noqa: BLE001 - any unreadable file is not ours
        return None, None


def is_kvzap_file(path: str) -> bool:
    """True when ``path`` is a kvzap surrogate file polykv wrote (its format tag), read without loading tensors."""
    return file_format(path)[0] == FORMAT
