"""Offline pre-RoPE query statistics per layer and query head (the TriAttention signal).

One forward over plain text; for every layer and query head the pre-RoPE queries are paired per
RoPE frequency in the "half" layout, ``q_f = q[f] + i q[f + d/2]`` (the pairing of transformers'
``rotate_half``), and two statistics are kept per frequency f:

- ``mu_f = mean_t q_f`` (complex), stored as ``mu_real`` / ``mu_imag``, [L, H, d/2];
- ``a_f = mean_t |q_f|``, stored as ``mean_abs``, [L, H, d/2].

The model's RoPE inverse frequencies (``inv_freq`` [d/2]) and attention scaling travel with the
statistics, with the model's fingerprint, so a scorer can check it is used on the model it was
measured on. Files are safetensors (``.safetensors``) or numpy (``.npz``), chosen by extension.

Reference: Mao et al., "TriAttention: Efficient Long Reasoning with Trigonometric KV Compression",
arXiv:2604.04921 (2026); code https://github.com/WeianMao/triattention. Scoring: adapters/rules/triattention.py.
"""

from __future__ import annotations

import json
import os
from typing import Any, Iterable

import attrs
import numpy as np
import torch

from polykv.contract import model_data
from polykv.errors import ProfileError

FORMAT = "polykv-query-stats"
QUERY_STATS_SUFFIX = ".qstats.safetensors"
"""Side file of a profile that keeps its query statistics: ``x.profile.json`` -> ``x.qstats.safetensors``."""
FORMAT_VERSION = 1
PAIRING = "half"
_ARRAYS = ("mu_real", "mu_imag", "mean_abs", "inv_freq")


@attrs.define(frozen=True, kw_only=True, eq=False)
class QueryStats:
    """Per-layer, per-query-head statistics of pre-RoPE queries (CPU float32 tensors)."""

    mu_real: torch.Tensor
    """[L, H, d/2] real part of the mean complex query per frequency."""
    mu_imag: torch.Tensor
    """[L, H, d/2] imaginary part of the mean complex query per frequency."""
    mean_abs: torch.Tensor
    """[L, H, d/2] mean magnitude |q_f| per frequency."""
    inv_freq: torch.Tensor
    """[d/2] RoPE inverse frequencies omega_f of the model the statistics were measured on."""
    attention_scaling: float = 1.0
    """RoPE attention scaling s_f of that model (1.0 for plain RoPE)."""
    fingerprint: str | None = None
    """Model fingerprint (:func:`polykv.models.geometry.geometry_of_model`)."""
    num_tokens: int = 0
    """Tokens averaged over."""
    pairing: str = PAIRING
    """Dimension pairing: only ``"half"`` (q[f], q[f + d/2])."""

    def __attrs_post_init__(self) -> None:
        shape = tuple(self.mu_real.shape)
        if len(shape) != 3 or tuple(self.mu_imag.shape) != shape or tuple(self.mean_abs.shape) != shape:
            raise ProfileError(
                f"query statistics: mu_real, mu_imag and mean_abs must share one [L, H, d/2] shape, got "
                f"{tuple(self.mu_real.shape)}, {tuple(self.mu_imag.shape)}, {tuple(self.mean_abs.shape)}"
            )
        if tuple(self.inv_freq.shape) != (shape[2],):
            raise ProfileError(
                f"query statistics: inv_freq must be [d/2] = [{shape[2]}], got {tuple(self.inv_freq.shape)}"
            )
        if self.pairing != PAIRING:
            raise ProfileError(f"query statistics: pairing {self.pairing!r} is not supported; only 'half'")

    @property
    def num_layers(self) -> int:
        return self.mu_real.shape[0]

    @property
    def num_heads(self) -> int:
        return self.mu_real.shape[1]

    @property
    def head_dim(self) -> int:
        return 2 * self.mu_real.shape[2]

    @property
    def mu(self) -> torch.Tensor:
        """[L, H, d/2] complex64 mean query per frequency."""
        return torch.complex(self.mu_real, self.mu_imag)

    def layer(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(mu [H, d/2] complex64, mean_abs [H, d/2] float32) of one layer."""
        if not 0 <= layer_idx < self.num_layers:
            raise ProfileError(
                f"query statistics cover layers 0..{self.num_layers - 1}, not layer {layer_idx}; "
                f"recompute them on this model with polykv.adapters.rules.query_stats.compute_query_stats"
            )
        return torch.complex(self.mu_real[layer_idx], self.mu_imag[layer_idx]), self.mean_abs[layer_idx]

    def check_inv_freq(self, inv_freq: torch.Tensor, *, where: str = "model", name: str | None = None) -> None:
        """Raise unless ``inv_freq`` [d/2] equals the statistics' RoPE frequencies, up to the rounding of the dtype
        either is held in (a model cast with ``model.to(torch.bfloat16)`` holds them rounded to bfloat16).
        ``name``: the buffer's dotted name, for the message."""
        theirs = inv_freq.detach().to("cpu", torch.float64).reshape(-1)
        ours = self.inv_freq.to(torch.float64)
        buffer = f"{where}'s RoPE frequencies" + (f" ({name}, {str(inv_freq.dtype).removeprefix('torch.')})"
                                                  if name else "")
        if theirs.shape != ours.shape:
            raise ProfileError(f"query statistics hold {ours.numel()} RoPE frequencies, the {buffer} are "
                               f"{theirs.numel()} (another head size); recompute them on this model with "
                               "polykv.adapters.rules.query_stats.compute_query_stats")
        held = [inv_freq.dtype, _held_dtype(inv_freq.detach()), _held_dtype(self.inv_freq)]  # float() keeps rounding
        coarse = max((_rounding(d) for d in held), key=lambda r: r[0])
        rtol, atol = max(coarse[0], 1e-5), coarse[1]
        if torch.allclose(theirs, ours, rtol=rtol, atol=atol):
            return
        gap = (theirs - ours).abs() / ours.abs().clamp_min(atol or 1e-30)
        i = int(gap.argmax())
        fix = "recompute them on this model with polykv.adapters.rules.query_stats.compute_query_stats"
        if inv_freq.dtype != torch.float32:
            fix = (f"if the model was cast after loading (model.to({inv_freq.dtype})), load it in that dtype instead "
                   f"(polykv.models.load_default_model(dtype={inv_freq.dtype}) or from_pretrained(..., "
                   f"dtype={inv_freq.dtype})), or {fix}")
        raise ProfileError(f"query statistics were measured with other RoPE frequencies than the {buffer}: frequency "
                           f"{i} is {float(ours[i]):.6g} vs {float(theirs[i]):.6g} ({float(gap[i]):.2g} relative, "
                           f"more than the rounding {rtol:.2g}, e.g. another rope_theta or rope scaling); {fix}")

    def check_model(self, model: Any) -> None:
        """Raise unless ``model`` has this shape, these RoPE frequencies and (when known) this fingerprint."""
        geo = model_data.model_geometry(model)
        if (geo.num_layers, geo.num_heads, geo.head_dim) != (self.num_layers, self.num_heads, self.head_dim):
            raise ProfileError(
                f"query statistics are for L={self.num_layers}, H={self.num_heads}, d={self.head_dim}; the model "
                f"has L={geo.num_layers}, H={geo.num_heads}, d={geo.head_dim}: recompute them on this model"
            )
        if not model_data.fingerprints_match(self.fingerprint, geo.fingerprint):
            raise ProfileError(
                f"query statistics belong to model {self.fingerprint}, not {geo.fingerprint}: recompute them "
                f"on this model with polykv.adapters.rules.query_stats.compute_query_stats"
            )
        inv_freq, _ = _rope_of(model)
        self.check_inv_freq(inv_freq, name=_rope_name(model))

    # -- files ---------------------------------------------------------------------------------
    def _metadata(self) -> dict[str, str]:
        return {"format": FORMAT, "format_version": str(FORMAT_VERSION), "pairing": self.pairing,
                "attention_scaling": repr(float(self.attention_scaling)),
                "fingerprint": self.fingerprint or "", "num_tokens": str(int(self.num_tokens))}

    def save(self, path: str | os.PathLike) -> None:
        """Write a ``.safetensors`` or ``.npz`` file (atomically: a temp file renamed over ``path``)."""
        path = os.fspath(path)
        kind = _kind_of(path)
        arrays = {n: getattr(self, n).detach().to("cpu", torch.float32).contiguous() for n in _ARRAYS}
        def write(tmp: str) -> None:
            if kind == "safetensors":
                from safetensors.torch import save_file

                save_file(arrays, tmp, metadata=self._metadata())
            else:
                with open(tmp, "wb") as fh:
                    np.savez(fh, **{n: a.numpy() for n, a in arrays.items()},
                             metadata=np.array(json.dumps(self._metadata())))

        model_data.write_atomically(path, write)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "QueryStats":
        """Read a file written by :meth:`save`."""
        path = os.fspath(path)
        kind = _kind_of(path)
        if not os.path.exists(path):
            raise ProfileError(f"{path}: no such query statistics file; create it with "
                               f"polykv.adapters.rules.query_stats.compute_query_stats(model, batches).save(path)")
        if not os.path.isfile(path):
            raise ProfileError(f"{path}: not a regular file (a FIFO, device or folder); name a query statistics file")
        try:
            if kind == "safetensors":
                from safetensors import safe_open

                with safe_open(path, framework="pt") as fh:
                    meta = dict(fh.metadata() or {})
                    arrays = {n: fh.get_tensor(n) for n in _ARRAYS}
            else:
                with np.load(path, allow_pickle=False) as fh:
                    meta = json.loads(str(fh["metadata"]))
                    arrays = {n: torch.from_numpy(fh[n].copy()) for n in _ARRAYS}
        except (KeyError, OSError, ValueError) as exc:
            raise ProfileError(f"{path}: not a readable query statistics file ({exc}); recompute it") from exc
        if meta.get("format") != FORMAT or meta.get("format_version") != str(FORMAT_VERSION):
            raise ProfileError(f"{path}: format {meta.get('format')!r} version {meta.get('format_version')!r} "
                               f"is not {FORMAT!r} version {FORMAT_VERSION}; recompute the statistics")
        model_data.check_tensors(path, arrays, fix="recompute the statistics", nonnegative=("mean_abs", "inv_freq"))
        return cls(**{n: a.float() for n, a in arrays.items()}, attention_scaling=float(meta["attention_scaling"]),
                   fingerprint=meta.get("fingerprint") or None, num_tokens=int(meta["num_tokens"]),
                   pairing=meta["pairing"])


def _kind_of(path: str) -> str:
    if path.endswith(".safetensors"):
        return "safetensors"
    if path.endswith(".npz"):
        return "npz"
    raise ProfileError(f"{path}: query statistics files end in .safetensors or .npz")


def _rope_of(model: Any) -> tuple[torch.Tensor, float]:
    """(inv_freq [d/2], attention_scaling) of the model's single rotary embedding."""
    found = [(m.inv_freq, float(getattr(m, "attention_scaling", 1.0)))
             for m in model.modules() if isinstance(getattr(m, "inv_freq", None), torch.Tensor)]
    if not found:
        raise ProfileError("the model has no rotary embedding (no module with an 'inv_freq' buffer); "
                           "TriAttention statistics need a RoPE model")
    first, scale = found[0]
    for other, other_scale in found[1:]:
        if other.shape != first.shape or not torch.equal(other, first) or other_scale != scale:
            raise ProfileError("the model has several different rotary embeddings (per-layer-type RoPE); "
                               "TriAttention statistics support one RoPE per model only")
    return first.detach(), scale


def _rope_name(model: Any) -> str:
    """Dotted name of the model's (first) RoPE frequency buffer, as users reach it (``model.model.rotary_emb.inv_freq``)."""
    for name, m in model.named_modules():
        if isinstance(getattr(m, "inv_freq", None), torch.Tensor):
            return ".".join(["model", *filter(None, [name]), "inv_freq"])
    return "inv_freq"


def _rounding(dtype: torch.dtype) -> tuple[float, float]:
    """(relative, absolute) rounding of a value held in ``dtype``: its epsilon, and its subnormal step."""
    info = torch.finfo(dtype)
    return float(info.eps), float(info.smallest_normal * info.eps)


def _held_dtype(values: torch.Tensor) -> torch.dtype:
    """The coarsest of bfloat16, float16 and float32 that holds ``values`` exactly: statistics measured on a model
    cast to bfloat16 carry its rounded frequencies, which a float32 model's must then match only to that rounding."""
    values = values.to("cpu", torch.float32)
    for dtype in (torch.bfloat16, torch.float16):
        if torch.equal(values.to(dtype).float(), values):
            return dtype
    return torch.float32


def _attention_modules(model: Any) -> list[Any]:
    mods = [m for m in model.modules() if hasattr(m, "q_proj") and isinstance(getattr(m, "layer_idx", None), int)]
    if not mods:
        raise ProfileError("found no attention modules (modules with q_proj and layer_idx) in the model")
    return sorted(mods, key=lambda m: m.layer_idx)


@torch.no_grad()
def compute_query_stats(model: Any, token_batches: Iterable[torch.Tensor]) -> QueryStats:
    """Measure pre-RoPE query statistics with one forward per batch over plain text.

    Parameters
    ----------
    model : transformers causal LM
        A RoPE decoder (Llama, Qwen2, Qwen3, Mistral, ...). Queries are read after ``q_proj``
        (after ``q_norm`` where the model has one), i.e. right before RoPE.
    token_batches : iterable of LongTensor
        Token ids, [B, T] or [T], without padding (every position counts).

    Returns
    -------
    QueryStats
        ``mu`` and ``mean_abs`` [L, H, d/2] averaged over every token of every batch.
    """
    geo = model_data.model_geometry(model)
    inv_freq, scaling = _rope_of(model)
    H, d = geo.num_heads, geo.head_dim
    if d % 2 or inv_freq.numel() != d // 2:
        raise ProfileError(f"RoPE covers {2 * inv_freq.numel()} of {d} head dimensions; "
                           f"TriAttention statistics need full-dimension 'half' RoPE")
    F_ = d // 2
    attn = _attention_modules(model)
    L = len(attn)
    sums = torch.zeros(3, L, H, F_, dtype=torch.float64)  # real, imag, |q_f|
    count = [0]
    handles = []

    def hook_for(i: int):
        def hook(_module, _inputs, out):
            q = out.detach().reshape(out.shape[0], out.shape[1], H, d).double()  # (B, T, H, d)
            re, im = q[..., :F_], q[..., F_:]                                      # (B, T, H, d/2)
            sums[0, i] += re.sum(dim=(0, 1)).cpu()
            sums[1, i] += im.sum(dim=(0, 1)).cpu()
            sums[2, i] += torch.sqrt(re * re + im * im).sum(dim=(0, 1)).cpu()
        return hook

    for i, m in enumerate(attn):
        target = m.q_norm if isinstance(getattr(m, "q_norm", None), torch.nn.Module) else m.q_proj
        handles.append(target.register_forward_hook(hook_for(i)))
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()  # dropout would perturb the queries being averaged
    try:
        for batch in token_batches:
            ids = torch.as_tensor(batch)
            ids = ids.unsqueeze(0) if ids.dim() == 1 else ids
            if ids.dim() != 2 or ids.numel() == 0:
                raise ProfileError(f"token batches must be non-empty [B, T] or [T] id tensors, got {tuple(ids.shape)}")
            model(input_ids=ids.to(device), use_cache=False)
            count[0] += ids.numel()
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    if count[0] == 0:
        raise ProfileError("compute_query_stats got no tokens; pass at least one batch of plain-text token ids")
    mean = (sums / count[0]).float()
    return QueryStats(mu_real=mean[0], mu_imag=mean[1], mean_abs=mean[2], inv_freq=inv_freq.to("cpu", torch.float32),
                      attention_scaling=scaling, fingerprint=geo.fingerprint, num_tokens=count[0])


def is_query_stats_file(path: str) -> bool:
    """True when ``path`` is a query statistics file polykv wrote (its metadata carries ``num_tokens``)."""
    if path.endswith(".safetensors"):
        import struct

        with open(path, "rb") as fh:
            head = fh.read(8)
            if len(head) != 8:
                return False
            (n,) = struct.unpack("<Q", head)
            if n > 1 << 24:
                return False
            meta = json.loads(fh.read(n)).get("__metadata__") or {}
        return "num_tokens" in meta and "attention_scaling" in meta
    if path.endswith(".npz"):
        import zipfile

        with zipfile.ZipFile(path) as zf:
            return "metadata.npy" in zf.namelist() and "inv_freq.npy" in zf.namelist()
    return False
