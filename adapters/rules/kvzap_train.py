"""Training KVzap's surrogate (:mod:`polykv.adapters.rules.kvzap_model`) against the ``kvzip`` rule's own scores.

For each text (a LongTensor [1, T] of plain text, e.g. an offline-corpus text) the ``kvzip`` rule's
reconstruction probe runs through the runtime (the ``run_probe`` the runtime hands in:
polykv.runtime.session.run_probe; the rule's defaults: the first 4 tokens are sinks, one chunk per 2048 tokens),
which gives every layer's scores [Hkv, T]; forward pre-hooks on the same pass read the hidden states entering each
layer's attention module in the prompt's (full-cache) forward. Up to ``positions`` random tokens per text (after
the sinks) become samples: attention input [D] -> ``log max(score, 1e-9)`` in each KV head [Hkv]. Then, per
layer, 5% of the samples are held out and

* ``linear``: ridge regression (alpha 1, float64 normal equations) on standardised inputs, D -> Hkv, as the
  reference's linear KVzap;
* ``mlp``: D -> h -> GELU -> Hkv, MSE, AdamW (lr 5e-3), ``epochs`` epochs of batches of 512, cosine schedule,
  gradient norm clipped at 1.0 per layer (``kvzap/train.py``); h = D / 8 by default (the released models).

Per-text samples can be kept in a ``checkpoint`` folder so an interrupted run resumes where it stopped.
"""

from __future__ import annotations

import hashlib
import math
import os
import time
import warnings
from typing import Any, Callable

import torch
import torch.nn.functional as F

from polykv.adapters.rules.kvzap_model import KVzapSurrogate
from polykv.adapters.rules.kvzip import prompt_params
from polykv.contract import model_data

SINK = 4
"""Leading tokens of every text that are attention sinks (the ``kvzip`` rule's ``n_sink``): never samples."""
LOG_FLOOR = 1e-9
"""Scores below this are taken as this before the log (a softmax maximum that underflowed)."""
VALIDATION = 0.05


def _attention_modules(model: Any) -> list:
    mods = [m for m in model.modules() if hasattr(m, "k_proj") and isinstance(getattr(m, "layer_idx", None), int)]
    if not mods:
        raise model_data.ModelDataError("found no attention modules (modules with k_proj and layer_idx) in the model")
    return sorted(mods, key=lambda m: m.layer_idx)


def _attention_input(layer_idx: int, args: tuple, kwargs: dict) -> torch.Tensor:
    """The hidden states [B, q, D] an attention module's forward was called with."""
    hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else (args[0] if args else None)
    if not isinstance(hidden, torch.Tensor) or hidden.dim() != 3:
        raise model_data.ModelDataError(f"layer {layer_idx}: the attention module was called without a [batch, "
                                        f"tokens, hidden] 'hidden_states' input; kvzap cannot be trained on this model")
    return hidden.detach()


@torch.no_grad()
def text_samples(model: Any, ids: torch.Tensor, prompt: dict, *, positions: int, seed: int,
                 run_probe: Callable) -> tuple:
    """Samples of one text ``ids`` [1, T]: (attention inputs [L, P, D] float16, targets [L, Hkv, P] float32);
    ``run_probe``: the runtime's probe runner (:data:`polykv.contract.probe.ProbeRunner`)."""
    Hkv = model_data.model_geometry(model).num_kv_heads
    attn = _attention_modules(model)
    caught: list[list] = [[] for _ in attn]
    handles = [m.register_forward_pre_hook(lambda _m, args, kwargs, i=i: caught[i].append(
        _attention_input(attn[i].layer_idx, args, kwargs)), with_kwargs=True) for i, m in enumerate(attn)]
    try:
        states = run_probe(model, "kvzip", dict(prompt), ids)
    finally:
        for h in handles:
            h.remove()
    T = ids.shape[1]
    gen = torch.Generator().manual_seed(seed)
    pick = (torch.randperm(T - SINK, generator=gen)[:positions] + SINK).sort().values
    xs, ys = [], []
    for (first, *_probe), state in zip(caught, states):   # the prompt's forward comes first, then the probe's
        xs.append(first[0, pick.to(first.device)].cpu().half())                                     # (P, D)
        if state.scores.shape[-1] != T:  # a window-bounded layer (Gemma 3's sliding ones) kept only its window: it
            ys.append(torch.zeros(Hkv, len(pick)))  # never evicts by score, and its regressors learn "keep" (log 1)
            continue
        ys.append(state.scores[0, :, pick.to(state.scores.device)].float().clamp_min(LOG_FLOOR).log().cpu())
    return torch.stack(xs), torch.stack(ys)


def _digest(ids: torch.Tensor) -> str:
    return hashlib.sha1(ids.detach().cpu().long().numpy().tobytes()).hexdigest()[:16]


def _cached_samples(path: str, meta: dict):
    """The samples a checkpoint file holds when it was written for ``meta`` (model, text, positions, seed), else
    None."""
    if not os.path.isfile(path):
        return None
    try:
        from safetensors import safe_open

        with safe_open(path, framework="pt") as fh:
            got = dict(fh.metadata() or {})
            if all(got.get(k) == v for k, v in meta.items()):
                return fh.get_tensor("x"), fh.get_tensor("y")
    except Exception:  # noqa: BLE001 - a damaged checkpoint file is recomputed (said below)
        pass
    warnings.warn(f"{path}: checkpoint of another model, text or setting, or damaged; recomputing that text",
                  UserWarning, stacklevel=3)
    return None


def collect(model: Any, token_batches: list, prompt: dict, *, positions: int, seed: int,
            checkpoint: str | None, progress: Callable[[str], None] | None,
            run_probe: Callable) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Samples of every text, resuming from ``checkpoint``: (attention inputs [L, N, D] float16, targets
    [L, Hkv, N], tokens read)."""
    fp = model_data.model_geometry(model).fingerprint
    device = next(model.parameters()).device
    if checkpoint:
        os.makedirs(checkpoint, exist_ok=True)
    xs, ys, tokens, start, computed = [], [], 0, time.perf_counter(), 0
    n = len(token_batches)
    for i, batch in enumerate(token_batches):
        ids = torch.as_tensor(batch).long()
        if ids.dim() > 2 or (ids.dim() == 2 and ids.shape[0] != 1):
            raise model_data.ModelDataError(f"text {i} is a {list(ids.shape)} tensor; give one text per batch, [1, T] "
                                            f"or [T] ids")
        ids = ids.reshape(1, -1)
        if ids.shape[1] <= SINK + 1:
            raise model_data.ModelDataError(f"text {i} has {ids.shape[1]} tokens; kvzap training needs more than "
                                            f"{SINK + 1} per text")
        meta = {"fingerprint": fp, "text": _digest(ids), "positions": str(positions), "seed": str(seed + i),
                "inputs": "attention input"}
        path = os.path.join(checkpoint, f"text-{i:05d}.safetensors") if checkpoint else None
        got = _cached_samples(path, meta) if path else None
        resumed = got is not None
        if got is None:
            got = text_samples(model, ids.to(device), prompt, positions=positions, seed=seed + i,
                               run_probe=run_probe)
            computed += 1
            if path:
                from safetensors.torch import save_file

                x, y = got
                model_data.write_atomically(path, lambda tmp: save_file({"x": x.contiguous(), "y": y.contiguous()},
                                                                        tmp, metadata=meta))
        xs.append(got[0])
        ys.append(got[1])
        tokens += int(ids.shape[1])
        if progress is not None:
            spent = time.perf_counter() - start
            eta = spent / computed * (n - i - 1) if computed else 0.0
            progress(f"kvzap: kvzip scores of text {i + 1}/{n} ({ids.shape[1]} tokens"
                     f"{', from the checkpoint' if resumed else ''}); {spent:.0f} s so far, about {eta:.0f} s left")
    return torch.cat(xs, dim=1), torch.cat(ys, dim=2), tokens


def fit_linear(x: torch.Tensor, y: torch.Tensor, alpha: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Ridge per regressor on standardised inputs x [G, N, F] (float), targets y [G, N, O] (O outputs each, fitted
    alike): (w [G, F, O], b [G, O])."""
    G, N, Fd = x.shape
    xtx = torch.zeros(G, Fd, Fd, dtype=torch.float64)
    xty = torch.zeros(G, Fd, y.shape[-1], dtype=torch.float64)
    ybar = y.double().mean(dim=1)                                                    # (G, O)
    for a in range(0, N, 4096):
        xc = x[:, a:a + 4096].double()
        xtx += xc.transpose(1, 2) @ xc
        xty += xc.transpose(1, 2) @ (y[:, a:a + 4096].double() - ybar[:, None])
    w = torch.linalg.solve(xtx + alpha * torch.eye(Fd, dtype=torch.float64), xty)
    return w.float(), ybar.float()


def mlp_forward(p: dict, x: torch.Tensor) -> torch.Tensor:
    """G MLPs ``p`` (as :func:`fit_mlp` returns them) on x [G, N, F]: [G, N, O]."""
    return torch.baddbmm(p["b2"][:, None], F.gelu(torch.baddbmm(p["b1"][:, None], x, p["w1"])), p["w2"])


def fit_mlp(x: torch.Tensor, y: torch.Tensor, *, hidden: int, epochs: int, batch_size: int = 512, lr: float = 5e-3,
            seed: int = 0, progress: Callable[[str], None] | None = None, xv=None, yv=None) -> dict:
    """G independent MLPs F -> hidden -> GELU -> O on standardised inputs x [G, N, F] (any float dtype), targets
    y [G, N, O]: ``{"w1" [G, F, h], "b1" [G, h], "w2" [G, h, O], "b2" [G, O]}``. Every MLP sees the same batches;
    each one's loss is its MSE over its outputs, the summed loss gives each its own gradient, and each one's
    gradient norm is clipped to 1.0 on its own. Targets are standardised per output while training (the returned
    second layer undoes it)."""
    G, N, Fd = x.shape
    O = y.shape[-1]
    gen = torch.Generator().manual_seed(seed)
    y_mean, y_std = y.float().mean(dim=1), y.float().std(dim=1, unbiased=False).clamp_min(1e-6)   # (G, O)
    y = (y.float() - y_mean[:, None]) / y_std[:, None]                  # trained on standardised targets

    def uniform(*shape, fan_in):
        return ((torch.rand(*shape, generator=gen) * 2 - 1) / math.sqrt(fan_in)).requires_grad_()
    p = {"w1": uniform(G, Fd, hidden, fan_in=Fd), "b1": uniform(G, hidden, fan_in=Fd),
         "w2": uniform(G, hidden, O, fan_in=hidden), "b2": uniform(G, O, fan_in=hidden)}
    opt = torch.optim.AdamW(list(p.values()), lr=lr)
    steps = max(1, epochs * math.ceil(N / batch_size))
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)

    def forward(xb):
        return mlp_forward(p, xb.float())

    for epoch in range(epochs):
        order = torch.randperm(N, generator=gen)
        for a in range(0, N, batch_size):
            idx = order[a:a + batch_size]
            loss = ((forward(x[:, idx]) - y[:, idx]) ** 2).mean(dim=(1, 2)).sum()
            opt.zero_grad()
            loss.backward()
            with torch.no_grad():
                norm = torch.sqrt(sum(t.grad.reshape(G, -1).pow(2).sum(1) for t in p.values()))     # (G,)
                scale = (1.0 / (norm + 1e-6)).clamp(max=1.0)
                for t in p.values():
                    t.grad.mul_(scale.view(G, *([1] * (t.dim() - 1))))
            opt.step()
            sched.step()
        if progress is not None and xv is not None:
            with torch.no_grad():
                val = ((forward(xv) * y_std[:, None] + y_mean[:, None] - yv) ** 2).mean().item()
            progress(f"kvzap: MLP epoch {epoch + 1}/{epochs}, validation MSE {val:.4g}")
    out = {k: t.detach() for k, t in p.items()}
    out["w2"], out["b2"] = out["w2"] * y_std[:, None], out["b2"] * y_std + y_mean     # back to the targets' scale
    return out


def _pearson(a: torch.Tensor, b: torch.Tensor) -> float:
    """Mean over regressors and outputs of the correlation of a and b [G, N, O] over the N samples."""
    a, b = a.transpose(1, 2).flatten(0, 1), b.transpose(1, 2).flatten(0, 1)                  # (G * O, N)
    a, b = a - a.mean(1, keepdim=True), b - b.mean(1, keepdim=True)
    return float(((a * b).sum(1) / (a.norm(dim=1) * b.norm(dim=1)).clamp_min(1e-12)).mean())


def train_kvzap(model: Any, token_batches, tokenizer: Any = None, *, positions: int = 500, hidden: int | None = None,
                epochs: int = 15, batch_size: int = 512, seed: int = 0, checkpoint: str | None = None,
                progress: Callable[[str], None] | None = None, prompt: dict | None = None,
                run_probe: Callable | None = None) -> KVzapSurrogate:
    """Train both regressors of every layer and KV head of ``model`` on ``token_batches`` (one text each, LongTensor
    [1, T]) against the ``kvzip`` rule's scores; ``tokenizer`` builds the reconstruction prompts (:func:`prompt_params`;
    ``prompt`` gives their ids directly; default: the tokenizer saved beside the model); ``run_probe``: the runtime's
    probe runner (``polykv.runtime.session.run_probe``), which the runtime and ``polykv model-data`` hand in."""
    if run_probe is None:
        raise model_data.ModelDataError("training the kvzap surrogate runs KVzip's probe through the runtime: pass "
                                        "run_probe=polykv.runtime.session.run_probe")
    for name, value, low in (("positions", positions, 1), ("epochs", epochs, 0), ("batch_size", batch_size, 1),
                             ("hidden", 1 if hidden is None else hidden, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise model_data.ModelDataError(f"train_kvzap: {name} must be an integer >= {low}, got {value!r}")
    if prompt is None:
        tokenizer = tokenizer if tokenizer is not None else model_data.tokenizer_of(model)
        if tokenizer is None:
            raise model_data.ModelDataError("training the kvzap surrogate needs the model's tokenizer for KVzip's "
                                            "reconstruction prompts; pass tokenizer=...")
        prompt = prompt_params(tokenizer)
    batches = list(token_batches)
    if not batches:
        raise model_data.ModelDataError("training the kvzap surrogate needs at least one text")
    was_training = model.training
    model.eval()
    try:
        x, y, tokens = collect(model, batches, prompt, positions=int(positions), seed=seed, checkpoint=checkpoint,
                               progress=progress, run_probe=run_probe)
    finally:
        model.train(was_training)
    L, N, D = x.shape
    y = y.transpose(1, 2)                                                               # (L, N, Hkv)
    order = torch.randperm(N, generator=torch.Generator().manual_seed(seed))
    n_val = max(1, int(round(N * VALIDATION))) if N >= 20 else 0
    val, tr = order[:n_val], order[n_val:]
    xt = x[:, tr].float()
    mean, std = xt.mean(dim=1), xt.std(dim=1, unbiased=False).clamp_min(1e-6)             # (L, D)
    xt = (xt - mean[:, None]) / std[:, None]
    yt = y[:, tr]
    lin_w, lin_b = fit_linear(xt, yt)
    h = int(hidden) if hidden is not None else max(8, D // 8)
    xv = ((x[:, val].float() - mean[:, None]) / std[:, None]) if n_val else None
    yv = y[:, val] if n_val else None
    mlp = fit_mlp(xt, yt, hidden=h, epochs=int(epochs), batch_size=int(batch_size), seed=seed, progress=progress,
                  xv=xv, yv=yv)
    info = {"texts": len(batches), "tokens": tokens, "samples": N - n_val, "validation_samples": n_val,
            "positions_per_text": int(positions), "hidden": h, "epochs": int(epochs), "activation": "gelu",
            "target": "log kvzip score", "features": "attention input"}
    if n_val:
        lin = torch.baddbmm(lin_b[:, None], xv, lin_w)
        mlp_pred = mlp_forward(mlp, xv)
        info.update(linear_mse=f"{float(((lin - yv) ** 2).mean()):.4g}", linear_corr=f"{_pearson(lin, yv):.3g}",
                    mlp_mse=f"{float(((mlp_pred - yv) ** 2).mean()):.4g}", mlp_corr=f"{_pearson(mlp_pred, yv):.3g}",
                    target_var=f"{float(yv.var(dim=1).mean()):.4g}")
    return KVzapSurrogate(feat_mean=mean, feat_std=std, lin_w=lin_w, lin_b=lin_b, mlp_w1=mlp["w1"],
                          mlp_b1=mlp["b1"], mlp_w2=mlp["w2"], mlp_b2=mlp["b2"],
                          fingerprint=model_data.model_geometry(model).fingerprint, info=info)
