"""KVzip's context-independent head scores (the reference's ``--level head``): one number per layer and KV head.

``s[l, h] = max_j S[l, h, j]``, the largest reconstruction probability any context token of one calibration
context receives from head (l, h) (:func:`polykv.adapters.rules.kvzip_head.compute_head_scores` runs it through
the runtime's probe path). At run time rule ``kvzip-head`` gives every context token of head (l, h) the
score s[l, h] and allocator ``kvzip-head`` keeps or drops each head's whole context by one threshold over
layers x heads. Files are safetensors with the model's fingerprint in the metadata, so a file measured on
another model is refused before the model runs.

Reference: Kim et al., arXiv:2505.23416; https://github.com/snu-mllab/KVzip (``load_score``, ``--level head``).
"""

from __future__ import annotations

import os
from typing import Any

import attrs
import torch

from polykv.contract import model_data
from polykv.errors import ProfileError

FORMAT = "polykv-kvzip-head-scores"
FORMAT_VERSION = 1
HEAD_SCORES_SUFFIX = ".kvzip-heads.safetensors"
"""Side file of a profile that keeps the head scores: ``x.profile.json`` -> ``x.kvzip-heads.safetensors``."""
RECOMPUTE = ("remove the file to recompute the scores from the offline corpus, or write them with "
             "polykv.adapters.rules.kvzip_head.compute_head_scores(model, batches, tokenizer=..., "
             "run_probe=polykv.runtime.session.run_probe).save(path)")


@attrs.define(frozen=True, kw_only=True, eq=False)
class HeadScores:
    """Per layer and KV head, the largest reconstruction probability over one calibration context."""

    scores: torch.Tensor
    """[L, Hkv] float32 head scores s[l, h]."""
    fingerprint: str | None = None
    """Fingerprint of the model they were measured on (``polykv.contract.model_data.model_geometry``)."""
    num_tokens: int = 0
    """Context tokens of the calibration context."""
    path: str | None = attrs.field(default=None, eq=False)
    """The file they were read from (for messages), or None."""

    def __attrs_post_init__(self) -> None:
        if self.scores.dim() != 2 or not self.scores.is_floating_point():
            raise ProfileError(f"kvzip head scores must be a float [layers, kv_heads] tensor, got "
                               f"{self.scores.dtype} {tuple(self.scores.shape)}")
        if not bool(torch.isfinite(self.scores).all()):
            raise ProfileError("kvzip head scores hold NaN or infinite values; recompute them")

    @property
    def num_layers(self) -> int:
        return int(self.scores.shape[0])

    @property
    def num_kv_heads(self) -> int:
        return int(self.scores.shape[1])

    def layer(self, layer_idx: int, kv_heads: int) -> torch.Tensor:
        """[Hkv] scores of one layer, checked against the layer's shape."""
        if not 0 <= layer_idx < self.num_layers or kv_heads != self.num_kv_heads:
            raise ProfileError(f"kvzip head scores cover {self.num_layers} layers x {self.num_kv_heads} KV heads, not "
                               f"layer {layer_idx} with {kv_heads} KV heads: they were measured on another model; "
                               f"{RECOMPUTE}")
        return self.scores[layer_idx]

    @classmethod
    def measured(cls, scores: torch.Tensor, model: Any, *, num_tokens: int) -> "HeadScores":
        """Scores [L, Hkv] measured on ``model`` (its fingerprint recorded)."""
        return cls(scores=scores, fingerprint=model_data.model_geometry(model).fingerprint, num_tokens=num_tokens)

    def check_model(self, model: Any) -> None:
        """Raise unless ``model`` has these layers and KV heads and (when both are known) this fingerprint."""
        geo = model_data.model_geometry(model)
        where = f"{self.path}: " if self.path else ""
        if not model_data.fingerprints_match(self.fingerprint, geo.fingerprint):
            raise ProfileError(f"{where}kvzip head scores were measured on model {self.fingerprint}, this model is "
                               f"{geo.fingerprint}; {RECOMPUTE}")
        if (geo.num_layers, geo.num_kv_heads) != (self.num_layers, self.num_kv_heads):
            raise ProfileError(f"{where}kvzip head scores cover {self.num_layers} layers x {self.num_kv_heads} KV "
                               f"heads, this model has {geo.num_layers} x {geo.num_kv_heads}; {RECOMPUTE}")

    def save(self, path: str | os.PathLike) -> None:
        """Write a ``.safetensors`` file atomically (a temp file renamed over ``path``)."""
        from safetensors.torch import save_file

        meta = {"format": FORMAT, "format_version": str(FORMAT_VERSION), "fingerprint": self.fingerprint or "",
                "num_tokens": str(int(self.num_tokens))}
        scores = self.scores.detach().to("cpu", torch.float32).contiguous()
        model_data.write_atomically(os.fspath(path), lambda tmp: save_file({"scores": scores}, tmp, metadata=meta))

    @classmethod
    def load(cls, path: str | os.PathLike) -> "HeadScores":
        """Read a file written by :meth:`save`."""
        path = os.fspath(path)
        arrays, meta = model_data.read_tagged(path, ("scores",), fmt=FORMAT, version=FORMAT_VERSION,
                                   what="kvzip head-score", fix=RECOMPUTE)
        scores = arrays["scores"]
        return cls(scores=scores.float(), fingerprint=meta.get("fingerprint") or None,
                   num_tokens=int(meta.get("num_tokens", "0")), path=path)
