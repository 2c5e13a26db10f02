"""Offline orthonormal bases per layer and KV head for post-RoPE keys and for values (the low-rank axis).

For every layer l and KV head h, the uncentred second moments (dot products must survive the
projection, so the mean is not removed) of the keys the cache holds (after RoPE) and of the values::

    C_k = E[k k^T]        C_v = E[v v^T]                                           [d, d]

are measured over plain text, and their eigenvectors, sorted by eigenvalue (largest first), are the
bases: a layer stored at rank r keeps ``c = P^T k`` with ``P`` the first r key eigenvectors [d, r]
(values: ``e = U^T v``). Post-RoPE keys depend on their position; the calibration text covers only
its own short range, so ``C_k`` is averaged over the rotations of ``offsets`` positions spread over the
model's position range (a key at position p + o is ``R_o k_p``: ``C_k = mean_o R_o C R_o^T``),
which makes the basis serve any position of a long context.

The bases travel with the model's fingerprint in a safetensors file (``x.kvbases.safetensors``
beside a profile ``x.profile.json``); a plan with ranks names it in its ``model_data`` field under
:data:`KV_BASES_KEY`, and the runtime finds, checks or computes it as it does a rule's per-model data
(:mod:`polykv.contract.model_data`). Design: Loki (arXiv 2406.02542) and Eigen Attention
(arXiv 2408.05646), training-free, per KV head; the runtime side is :mod:`polykv.attention.low_rank`.
"""

from __future__ import annotations

import os
from typing import Any, Iterable

import attrs
import torch

from polykv.atomic import replace_with
from polykv.errors import ProfileError
from polykv.models.geometry import fingerprints_match, geometry_of_model, rope_of_model
from polykv.models.tagged_tensors import read_tagged

FORMAT = "polykv-kv-bases"
FORMAT_VERSION = 1
KV_BASES_KEY = "kv_bases"
"""Key of the bases in a plan's ``model_data`` field and in ``apply(model_data=...)``."""
KV_BASES_SUFFIX = ".kvbases.safetensors"
"""Side file of a profile that keeps the bases: ``x.profile.json`` -> ``x.kvbases.safetensors``."""
DEFAULT_OFFSETS = 16
"""Position offsets the key moments are averaged over (spread over the model's position range)."""
_ARRAYS = ("key", "value", "key_energy", "value_energy")
ORTHONORMAL_TOL = 1e-3
"""Largest ``|B^T B - I|`` entry a loaded basis may have (float32 eigenvectors are orthonormal to ~1e-6)."""


@attrs.define(frozen=True, kw_only=True, eq=False)
class KVBases:
    """Eigenvectors of the key and value second moments per layer and KV head (CPU float32)."""

    key: torch.Tensor
    """[L, Hkv, d, d] key eigenvectors as columns, largest eigenvalue first (orthonormal)."""
    value: torch.Tensor
    """[L, Hkv, d, d] value eigenvectors as columns, largest eigenvalue first."""
    key_energy: torch.Tensor
    """[L, Hkv, d] eigenvalues of ``E[k k^T]`` (descending): the energy each key channel keeps."""
    value_energy: torch.Tensor
    """[L, Hkv, d] eigenvalues of ``E[v v^T]`` (descending)."""
    fingerprint: str | None = None
    """Fingerprint of the model measured (:func:`polykv.models.geometry.geometry_of_model`)."""
    num_tokens: int = 0
    """Tokens averaged over."""
    positions: int = 0
    """Positions the key moments were averaged over (0: only the calibration text's own)."""

    def __attrs_post_init__(self) -> None:
        shape = tuple(self.key.shape)
        if len(shape) != 4 or shape[2] != shape[3] or tuple(self.value.shape) != shape \
                or tuple(self.key_energy.shape) != shape[:3] or tuple(self.value_energy.shape) != shape[:3]:
            raise ProfileError(f"key/value bases: key and value must be [L, Hkv, d, d] and the energies [L, Hkv, d], "
                               f"got {tuple(self.key.shape)}, {tuple(self.value.shape)}, "
                               f"{tuple(self.key_energy.shape)}, {tuple(self.value_energy.shape)}")

    @property
    def num_layers(self) -> int:
        return self.key.shape[0]

    @property
    def num_kv_heads(self) -> int:
        return self.key.shape[1]

    @property
    def head_dim(self) -> int:
        return self.key.shape[2]

    def basis(self, stream: str, layer: int, rank: int) -> torch.Tensor:
        """[Hkv, d, rank] the first ``rank`` eigenvectors of ``stream`` ("key" or "value") at ``layer``."""
        if not 0 <= layer < self.num_layers or not 1 <= rank <= self.head_dim:
            raise ProfileError(f"key/value bases cover layers 0..{self.num_layers - 1} and ranks 1..{self.head_dim}, "
                               f"not layer {layer} rank {rank}; recompute them on this model")
        return (self.key if stream == "key" else self.value)[layer, :, :, :rank].contiguous()

    def energy_kept(self, stream: str, layer: int, rank: int) -> torch.Tensor:
        """[Hkv] share of the stream's second moment the first ``rank`` channels keep."""
        e = (self.key_energy if stream == "key" else self.value_energy)[layer].clamp_min(0)
        return e[:, :rank].sum(-1) / e.sum(-1).clamp_min(1e-30)

    def check_model(self, model: Any) -> None:
        """Raise unless ``model`` has this shape and (when both are known) this fingerprint."""
        self.check_geometry(geometry_of_model(model))

    def check_geometry(self, geo: Any) -> None:
        if (geo.num_layers, geo.num_kv_heads, geo.head_dim) != (self.num_layers, self.num_kv_heads, self.head_dim):
            raise ProfileError(f"key/value bases are for L={self.num_layers}, Hkv={self.num_kv_heads}, "
                               f"d={self.head_dim}; the model has L={geo.num_layers}, Hkv={geo.num_kv_heads}, "
                               f"d={geo.head_dim}: recompute them on this model")
        if not fingerprints_match(self.fingerprint, geo.fingerprint):
            raise ProfileError(f"key/value bases belong to model {self.fingerprint}, not {geo.fingerprint}: recompute "
                               f"them on this model with polykv.models.kv_bases.compute_kv_bases")

    def resident_bytes(self, ranks: Iterable[tuple[int | None, int | None]], dtype_bytes: int) -> int:
        """Bytes of the basis slices a run holds for per-layer ``(k_rank, v_rank)`` (None: no basis):
        ``Hkv * d * rank`` elements per projected stream and layer."""
        return bytes_of_bases(ranks, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, dtype_bytes=dtype_bytes)

    # -- files ---------------------------------------------------------------------------------
    def save(self, path: str | os.PathLike) -> None:
        """Write a ``.safetensors`` file atomically."""
        from safetensors.torch import save_file

        path = os.fspath(path)
        if not path.endswith(".safetensors"):
            raise ProfileError(f"{path}: key/value bases files end in .safetensors")
        # each tensor in its own contiguous memory (safetensors refuses views and shared storage)
        arrays = {n: getattr(self, n).detach().to("cpu", torch.float32).contiguous().clone() for n in _ARRAYS}
        meta = {"format": FORMAT, "format_version": str(FORMAT_VERSION), "fingerprint": self.fingerprint or "",
                "num_tokens": str(int(self.num_tokens)), "positions": str(int(self.positions))}
        replace_with(path, lambda tmp: save_file(arrays, tmp, metadata=meta))

    @classmethod
    def load(cls, path: str | os.PathLike) -> "KVBases":
        """Read a file written by :meth:`save`."""
        path = os.fspath(path)
        if not os.path.isfile(path):
            raise ProfileError(f"{path}: no such key/value bases file; create it with "
                               f"polykv.models.kv_bases.compute_kv_bases(model, batches).save(path)")
        arrays, meta = read_tagged(path, _ARRAYS, fmt=FORMAT, version=FORMAT_VERSION, what="key/value bases",
                                   fix="recompute the bases")
        bases = cls(**arrays, fingerprint=meta.get("fingerprint") or None, num_tokens=int(meta.get("num_tokens", 0)),
                    positions=int(meta.get("positions", 0)))
        bases.check_orthonormal(path)
        return bases

    def check_orthonormal(self, source: str) -> None:
        """Each layer's and head's key and value basis is orthonormal to :data:`ORTHONORMAL_TOL` (``B^T B = I``),
        else one line naming the stream, layer, head and the largest deviation."""
        for stream in ("key", "value"):
            b = getattr(self, stream)
            eye = torch.eye(b.shape[-1], dtype=b.dtype)
            dev = (b.transpose(-1, -2) @ b - eye).abs().amax(dim=(-1, -2))     # [L, Hkv]
            if b.numel() and float(dev.max()) > ORTHONORMAL_TOL:
                layer, head = divmod(int(dev.argmax()), dev.shape[1])
                raise ProfileError(f"{source}: the {stream} basis of layer {layer}, KV head {head} is not "
                                   f"orthonormal (|B^T B - I| up to {float(dev.max()):.3g}, tolerance "
                                   f"{ORTHONORMAL_TOL}); recompute the bases")


def bytes_of_bases(ranks: Iterable[tuple[int | None, int | None]], *, num_kv_heads: int, head_dim: int,
                   dtype_bytes: int) -> int:
    """Bytes of the basis slices for per-layer ``(k_rank, v_rank)``: ``Hkv * d * r * dtype_bytes`` per
    projected stream and layer (counted once per model, apart from the cache)."""
    return sum(num_kv_heads * head_dim * int(r) * dtype_bytes for pair in ranks for r in pair if r is not None)


def _eig_desc(moment: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(eigenvalues [..., d] descending, eigenvectors [..., d, d] as columns) of symmetric ``moment``."""
    vals, vecs = torch.linalg.eigh(0.5 * (moment + moment.transpose(-1, -2)))
    return vals.flip(-1), vecs.flip(-1)


def rope_rotations(inv_freq: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """[n, d, d] float64 RoPE rotations by ``offsets`` [n] positions in the "half" layout (pairs f, f + d/2)."""
    half = inv_freq.numel()
    ang = offsets.double()[:, None] * inv_freq.double()[None, :]                  # (n, d/2)
    cos, sin = torch.cos(ang), torch.sin(ang)
    R = torch.zeros(offsets.numel(), 2 * half, 2 * half, dtype=torch.float64)
    f = torch.arange(half)
    R[:, f, f], R[:, f, f + half] = cos, -sin
    R[:, f + half, f], R[:, f + half, f + half] = sin, cos
    return R


def position_averaged(moment: torch.Tensor, inv_freq: torch.Tensor | None, positions: int, tokens: int,
                      offsets: int = DEFAULT_OFFSETS) -> torch.Tensor:
    """``mean_o R_o C R_o^T`` over ``offsets`` offsets spread over [0, positions - tokens] (``moment`` [..., d, d])."""
    if inv_freq is None or positions <= tokens or offsets < 2 or 2 * inv_freq.numel() != moment.shape[-1]:
        return moment
    R = rope_rotations(inv_freq, torch.linspace(0, positions - tokens, offsets).round())   # (n, d, d)
    return torch.einsum("nij,...jk,nlk->...il", R, moment, R) / R.shape[0]


@torch.no_grad()
def compute_kv_bases(model: Any, token_batches: Iterable[torch.Tensor], *, positions: int | None = None,
                     offsets: int = DEFAULT_OFFSETS) -> KVBases:
    """Measure the key and value bases with one cached forward per batch over plain text.

    Parameters
    ----------
    model : transformers causal LM
        Keys and values are read from the cache the forward fills (keys after RoPE).
    token_batches : iterable of LongTensor
        Token ids [B, T] or [T] without padding.
    positions : int, optional
        Position range the key moments are averaged over (default: the model's position limit, at most
        32768); 0 keeps the calibration text's own positions.
    offsets : int
        Offsets sampled over that range.
    """
    geo = geometry_of_model(model)
    L, Hkv, d = geo.num_layers, geo.num_kv_heads, geo.head_dim
    ck = torch.zeros(L, Hkv, d, d, dtype=torch.float64)
    cv = torch.zeros_like(ck)
    counts = torch.zeros(L, 2, dtype=torch.float64)
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    longest = 0
    try:
        for batch in token_batches:
            ids = torch.as_tensor(batch)
            ids = ids.unsqueeze(0) if ids.dim() == 1 else ids
            if ids.dim() != 2 or ids.numel() == 0:
                raise ProfileError(f"token batches must be non-empty [B, T] or [T] id tensors, got {tuple(ids.shape)}")
            longest = max(longest, int(ids.shape[1]))
            out = model(input_ids=ids.to(device), use_cache=True)
            cache = out["cache"] if "cache" in out else out.past_key_values  # the name depends on transformers
            for i, layer in enumerate(cache.layers):
                k = layer.keys.detach().to("cpu", torch.float64)                  # (B, Hkv, T, d)
                v = layer.values.detach().to("cpu", torch.float64)
                ck[i] += torch.einsum("bhti,bhtj->hij", k, k)
                cv[i] += torch.einsum("bhti,bhtj->hij", v, v)
                counts[i, 0] += k.shape[0] * k.shape[2]
                counts[i, 1] += v.shape[0] * v.shape[2]
    finally:
        model.train(was_training)
    if not bool((counts > 0).all()):
        raise ProfileError("compute_kv_bases got no tokens; pass at least one batch of plain-text token ids")
    ck, cv = ck / counts[:, 0, None, None, None], cv / counts[:, 1, None, None, None]
    inv_freq, _ = rope_of_model(model)
    if positions is None:
        positions = min(int(geo.max_positions or longest), 32768)
    ck = position_averaged(ck, None if inv_freq is None else inv_freq.cpu(), positions, longest, offsets)
    ke, kb = _eig_desc(ck)
    ve, vb = _eig_desc(cv)
    return KVBases(key=kb.float(), value=vb.float(), key_energy=ke.float(), value_energy=ve.float(),
                   fingerprint=geo.fingerprint, num_tokens=int(counts[0, 0]),
                   positions=positions if positions > longest else 0)


def check_bases_of(data: Any, model: Any) -> None:
    """Raise ValueError when ``data`` (:class:`KVBases`) was measured on another model than ``model`` (the check a
    per-model data need runs); TypeError when it is not bases at all."""
    if not isinstance(data, KVBases):
        raise TypeError(f"expected polykv.models.kv_bases.KVBases, got {type(data).__name__}")
    try:
        data.check_model(model)
    except ProfileError as exc:  # the model-data contract's check raises ValueError on data of another model
        raise ValueError(str(exc)) from None
