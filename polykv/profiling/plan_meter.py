"""Whole plans measured end to end on held-out sequences: next-token KL against the full cache through the
runtime, each sequence prefilled once (:class:`PlanMeter`, what the ``refine`` solver measures with), and the
held-out draw that leaves out every calibration sequence of a profile.

The one-layer tables of calibration live in :mod:`polykv.profiling.endtoend`; both read follow-up tokens through
:func:`~polykv.profiling.endtoend.followup_logprobs`.
"""

from __future__ import annotations

import json
import re
from typing import Any, Callable, Mapping, Sequence

import attrs
import torch

from polykv.errors import ProfileError, RuntimeConfigError
from polykv.models.corpus import corpus_id
from polykv.runtime import apply
from polykv.runtime.fork import PrefillSnapshot, capture_groups, capture_prefill, forward
from polykv.profiling import validation as val
from polykv.profiling.endtoend import followup_logprobs

_DRAW = re.compile(r"^(?P<corpus>\S+) (?P<kind>\w+) seed=(?P<seed>-?\d+): (?P<n>\d+) texts of >= \d+ chars cut to "
                   r"(?P<tokens>\d+) tokens")


@attrs.define(frozen=True, kw_only=True)
class CalibrationDraw:
    """The corpus draw a profile was calibrated on, read from its provenance."""

    corpus: str
    """Corpus identifier (:func:`polykv.models.corpus.corpus_id`) at calibration."""
    kind: str
    """Corpus kind (``mixed``, ``prose``, ``code``)."""
    seed: int
    """Seed of the draw."""
    sequences: int
    """Sequences drawn (calibration and validation ones)."""
    tokens: int
    """Tokens per sequence."""


def calibration_draw(profile) -> CalibrationDraw | None:
    """The corpus draw recorded in ``profile.provenance.corpus``; None when it records none (a table made
    by hand)."""
    m = _DRAW.match(getattr(profile.provenance, "corpus", "") or "")
    if m is None:
        return None
    return CalibrationDraw(corpus=m["corpus"], kind=m["kind"], seed=int(m["seed"]), sequences=int(m["n"]),
                           tokens=int(m["tokens"]))


def heldout_sequences(tokenize: Callable[[str], Sequence[int]], n: int, tokens: int, *, seed: int,
                      profile=None, kind: str = "mixed") -> tuple[list[torch.Tensor], str]:
    """``n`` sequences of ``tokens`` ids from the offline corpus that the profile was not calibrated on,
    and their description.

    The draw is :func:`~polykv.profiling.calibrate.corpus_sequences` with ``seed``; a sequence whose first
    ids equal one of the profile's calibration sequences (redrawn from its provenance with the same
    tokenizer) is dropped. A draw made on another corpus version cannot be redrawn and is an error.
    """
    from polykv.models.corpus import corpus_id
    from polykv.profiling.calibrate_settings import corpus_sequences

    draw = calibration_draw(profile) if profile is not None else None
    excluded: list[torch.Tensor] = []
    if draw is not None:
        if draw.corpus != corpus_id():
            raise ProfileError(f"{profile.source}: calibrated on corpus {draw.corpus}, this Python reads "
                               f"{corpus_id()}; the held-out sequences cannot be told apart from the calibration "
                               "ones: recalibrate the profile on this Python")
        excluded, _ = corpus_sequences(tokenize, draw.sequences, draw.tokens, seed=draw.seed, kind=draw.kind)
    picked, desc = corpus_sequences(tokenize, n + len(excluded), tokens, seed=seed, kind=kind)
    kept = []
    for ids in picked:
        if not any(_same_start(ids, ex) for ex in excluded):
            kept.append(ids)
    dropped = len(picked) - len(kept)
    kept = kept[:n]
    note = (f"{desc}; the first {n} not among the profile's {len(excluded)} calibration sequences "
            f"({dropped} of the draw were)" if draw is not None else
            f"{desc}; the profile records no calibration draw, so none was excluded")
    return kept, note


def _same_start(a: torch.Tensor, b: torch.Tensor) -> bool:
    k = min(a.numel(), b.numel())
    return bool(torch.equal(a[:k], b[:k]))


class PlanMeter:
    """Measured KL of whole plans on fixed sequences (module docstring), with the prefill reused.

    Parameters
    ----------
    model
        A transformers decoder the runtime serves.
    sequences : sequence of torch.Tensor
        [T] token ids each, all at least ``prefix + 2`` long.
    prefix : int
        Tokens the plan compresses (P); the rest are the follow-up.
    model_data, registry, storage_dtype, seed
        As :func:`polykv.apply` takes them.
    layer_menu : sequence of LayerPlan
        Layer settings the measured plans may use; a snapshot captured for a new attention signature
        records every one's rule states, so later plans of that signature restore from it.
    reuse_prefill : bool
        Restore each plan from a shared prefill (default) rather than prefilling it.
    rows : sequence of sequences of int, optional
        Per sequence, the follow-up prediction rows scored (row r predicts ``ids[prefix + 1 + r]``; an objective's
        :class:`~polykv.profiling.objectives.FollowUp`); None: every row.
    weights : sequence of float, optional
        Per sequence, its weight in :meth:`measure` (an objective mix: the objective's weight over its item count);
        None: the plain mean.
    """

    def __init__(self, model, sequences: Sequence[torch.Tensor], prefix: int, *,
                 model_data: Mapping[str, Any] | None = None, registry=None, storage_dtype=None, seed: int = 0,
                 layer_menu: Sequence[Any] = (), reuse_prefill: bool = True,
                 rows: Sequence[Sequence[int]] | None = None, weights: Sequence[float] | None = None):
        if not sequences:
            raise RuntimeConfigError("a plan meter needs at least one held-out sequence")
        short = [i for i, s in enumerate(sequences) if s.numel() < prefix + 2]
        if prefix < 1 or short:
            raise RuntimeConfigError(f"held-out sequences {short} are shorter than the prefix ({prefix}) + 2 tokens; "
                                     "use longer sequences or a shorter prefix")
        self.model, self.prefix, self.seed = model, int(prefix), int(seed)
        self.model_data, self.registry, self.storage_dtype = dict(model_data or {}), registry, storage_dtype
        self.reuse_prefill = bool(reuse_prefill)
        device = next(model.parameters()).device
        self.sequences = [s.view(1, -1).to(device) for s in sequences]
        self.rows = None if rows is None else [list(r) for r in rows]
        self.weights = [1.0 / len(self.sequences)] * len(self.sequences) if weights is None else \
            [float(w) for w in weights]
        if len(self.weights) != len(self.sequences) or (self.rows is not None and len(self.rows) != len(self.sequences)):
            raise RuntimeConfigError("a plan meter needs one weight and one list of scored rows per sequence")
        self.references = [val.reference_logprobs(model, s, self.prefix)[1:] for s in self.sequences]  # (F-1, V)
        if self.rows is not None:
            self.references = [ref[r] for ref, r in zip(self.references, self.rows)]
        self.layer_menu = self._distinct(layer_menu)
        prompts: dict[bytes, int] = {}
        self._prompt_of = [prompts.setdefault(s[0, :self.prefix].cpu().numpy().tobytes(), len(prompts))
                           for s in self.sequences]
        """Per sequence, the index of its prefix among the distinct ones (each prefilled once per signature)."""
        self._snapshots: list[dict] = [{} for _ in prompts]  # per distinct prefix: variant key -> layers
        self._menu_signature: dict | None = None
        self.prefills = 0
        """Prefills run so far (one per sequence and attention signature with reuse)."""

    @staticmethod
    def _distinct(menu) -> list:
        seen, out = set(), []
        for lp in menu:
            key = tuple((op.rule, json.dumps(op.params, sort_keys=True, default=str)) for op in (lp.prefill, lp.decode))
            if key not in seen:
                seen.add(key)
                out.append(lp)
        return out

    def measure(self, plan) -> float:
        """Measured KL(full || plan) of the sequences' (scored) follow-up predictions, in nats, mean over positions
        and weighted over sequences (the plain mean without ``weights``)."""
        total = 0.0
        for i, ids in enumerate(self.sequences):
            logprobs = self._logprobs(plan, i, ids)
            total += self.weights[i] * val.kl_divergence(self.references[i], logprobs if self.rows is None else
                                                         logprobs[self.rows[i]])
        return total

    @torch.no_grad()
    def _logprobs(self, plan, i: int, ids: torch.Tensor) -> torch.Tensor:
        """[F-1, V] float64 log-probabilities of the follow-up predictions under ``plan``."""
        prompt = ids[:, :self.prefix]
        if not self.reuse_prefill:
            with apply(self.model, plan, model_data=self.model_data, registry=self.registry, seed=self.seed,
                       storage_dtype=self.storage_dtype) as session:
                session.prefill(prompt)
                self.prefills += 1
                return torch.log_softmax(forward(session, ids[:, self.prefix:-1]).logits[0].double(), dim=-1)
        kw = dict(model_data=self.model_data, registry=self.registry, seed=self.seed, storage_dtype=self.storage_dtype)
        i = self._prompt_of[i]
        if self._snapshots[i]:
            try:
                return followup_logprobs(self.model, plan, PrefillSnapshot(variants=self._snapshots[i],
                                                                           input_ids=prompt), ids, self.prefix, **kw)
            except RuntimeConfigError:  # a new attention signature (or rule state): prefill once for it below
                pass
        snap = capture_prefill(self.model, prompt, [plan] + self._companions(plan, prompt), registry=self.registry,
                               model_data=self.model_data)
        self.prefills += len(snap.variants)
        self._snapshots[i].update(snap.variants)
        return followup_logprobs(self.model, plan, PrefillSnapshot(variants=self._snapshots[i], input_ids=prompt),
                                 ids, self.prefix, **kw)

    def _companions(self, plan, prompt: torch.Tensor) -> list:
        """Plans of ``plan``'s attention signature that, between them, run every menu setting on some layer,
        so that one capture records the rule states of every plan of that signature."""
        if self._menu_signature is None:  # per menu setting: (does it attend in the signal pass, probe key)
            self._menu_signature = {}
            for j, lp in enumerate(self.layer_menu):
                uniform = attrs.evolve(plan, layers=tuple(attrs.evolve(lp, layer=x.layer) for x in plan.layers),
                                       allocation=())
                groups = capture_groups(self.model, [uniform], registry=self.registry, input_ids=prompt,
                                        model_data=self.model_data)
                (sig, probe, _), = groups.keys()
                self._menu_signature[j] = (sig[0], probe)
        (own, _, ranks), = capture_groups(self.model, [plan], registry=self.registry,
                                          model_data=self.model_data).keys()
        out = []
        for j, lp in enumerate(self.layer_menu):
            attends, probe = self._menu_signature[j]
            layers = [l for l, s in enumerate(own) if s == attends]
            if probe is not None or not layers or plan.allocation or ranks is not None:
                continue
            out.append(attrs.evolve(plan, layers=tuple(
                attrs.evolve(x, prefill=lp.prefill, decode=lp.decode) if x.layer in layers else x
                for x in plan.layers)))
        return out
