"""End-to-end KL of one-layer plans through the runtime, reusing one uncompressed prefill per sequence.

For a held-out sequence of T tokens (a prefix of P tokens, then F follow-up tokens) and a config c on
layer l, the *one-layer plan* (:func:`polykv.profiling.validation.config_plan`: everything full except
layer l, whose prefill op runs c) is what is measured, exactly as :func:`polykv.apply` runs it:

1. the prefix is prefilled once per sequence, uncompressed, and kept as a snapshot
   (:func:`polykv.runtime.fork.capture_prefill`): raw K/V of every layer plus the state of every rule
   of the plans restored from it (a rule's probe, :mod:`polykv.contract.probe`, runs in that prefill;
   a layer whose rule reads every attention row attends in the signal pass, so it gets its own prefill);
2. per (layer, config) the plan's cache is restored from the snapshot
   (:func:`~polykv.runtime.fork.restore_prefill`: the layer's rule selects and its stores quantize, as at
   the end of :meth:`polykv.runtime.Session.prefill`), and only the follow-up tokens run through the model;
3. ``KL(p_full || p_plan)`` in nats of the next-token distributions of follow-up positions
   P+1 .. T-1 (the prediction of token P comes from the prefill, before any layer compresses, and is the
   same under every plan), averaged over positions and sequences.

The result equals :func:`~polykv.profiling.validation.plan_logprobs` of the same plan on the same
sequence (the tests check it), at the cost of F - 1 forward tokens per (layer, config, sequence)
instead of T - 1.

**Which configs** (:func:`kl_columns`): ``"all"`` measures every config; ``"subset"`` (the default,
what a 2,048-token calibration of a large menu affords) measures every rule x keep at 16/16 bits and
``full`` at every (K, V) width pair, and composes the rest additively
(:func:`compose_additive`): ``kl(rule@keep, K, V) = kl(rule@keep, 16, 16) + kl(full, K, V)``.

**Whole plans** (:class:`PlanMeter`, what the ``refine`` solver measures): the same KL of a plan that
compresses every layer, on held-out sequences the profile was not calibrated on
(:func:`heldout_sequences`: the offline corpus draw, less every sequence that begins like one the
profile's provenance says it was calibrated on). Each sequence's prefix is prefilled once per
attention signature, with the rule states of every setting of a layer menu recorded, so each plan
costs its F - 1 follow-up tokens.
"""

from __future__ import annotations

import json
import re
from typing import Any, Callable, Mapping, Sequence

import attrs
import numpy as np
import torch

from polykv.errors import PolykvError, ProfileError, RuntimeConfigError
from polykv.profiling.profile import FULL_RULE, CandidateConfig
from polykv.profiling import validation as val

KL_MODES = ("subset", "all")


def kl_columns(configs: Sequence[CandidateConfig], mode: str) -> list[int]:
    """Columns of ``configs`` measured end to end under ``mode`` (module docstring); the identity config
    (keep 1.0 at 16/16 bits, KL 0 by construction) is left out."""
    if mode not in KL_MODES:
        raise ProfileError(f"KL configs mode {mode!r}: use one of {', '.join(KL_MODES)} (--kl-configs)")
    out = []
    for i, c in enumerate(configs):
        if c.keeps_everything and c.k_bits == c.v_bits == 16:
            continue
        if mode == "all" or c.keeps_everything or (c.k_bits == c.v_bits == 16):
            out.append(i)
    return out


def _eviction_key(c: CandidateConfig) -> tuple:
    return (c.rule, c.phase, c.keep, json.dumps(c.params, sort_keys=True))


def compose_additive(configs: Sequence[CandidateConfig], measured: Mapping[int, np.ndarray], layers: int
                     ) -> tuple[np.ndarray, list[int]]:
    """[L, C] KL table from the measured columns (``{column: [L] values}``); every other column is its
    eviction's 16/16 column plus its widths' ``full`` column (0 for 16/16). Returns the table and the
    composed columns. A column whose parts were not measured is an error naming it."""
    evict = {_eviction_key(c): i for i, c in enumerate(configs) if c.k_bits == c.v_bits == 16}
    widths = {(c.k_bits, c.v_bits): i for i, c in enumerate(configs) if c.keeps_everything}
    table = np.zeros((layers, len(configs)))
    composed = []
    for i, c in enumerate(configs):
        if i in measured:
            table[:, i] = measured[i]
            continue
        if c.keeps_everything and c.k_bits == c.v_bits == 16:
            continue  # the identity: KL 0
        parts = [] if c.keeps_everything else [evict.get(_eviction_key(c))]
        if (c.k_bits, c.v_bits) != (16, 16):
            parts.append(widths.get((c.k_bits, c.v_bits)))
        if any(p is None or (p not in measured and not _identity(configs[p])) for p in parts):
            raise ProfileError(f"config {c.label}: its KL cannot be composed: the configs list no measured "
                               f"{c.rule}@{c.keep:g} at 16/16 bits or full at K{c.k_bits}/V{c.v_bits}; measure every "
                               f"config (--kl-configs all) or add those configs")
        table[:, i] = sum(measured[p] for p in parts if p in measured)
        composed.append(i)
    return table, composed


def _identity(c: CandidateConfig) -> bool:
    return c.keeps_everything and c.k_bits == c.v_bits == 16


class PrefixSnapshots:
    """Uncompressed prefills of prompts ([B, P] token ids each; one per held-out sequence, or the calibration
    sequences' prefixes as one batch), one per prompt and per prefill variant
    (attention signature, probe), captured when first needed. A variant that serves plans on several
    layers (the plain SDPA prefill, a probe) is kept for the whole run; one that serves a single layer
    (its rule attends in the signal pass) is dropped with :meth:`release`."""

    def __init__(self, model, prompts: Sequence[torch.Tensor], plans_by_layer: Mapping[int, list],
                 *, registry, model_data=None):
        from polykv.runtime.fork import capture_groups

        self.model, self.registry, self.model_data = model, registry, model_data
        self.ids = [p.to(next(model.parameters()).device) for p in prompts]
        self.prefix = int(self.ids[0].shape[1])
        self._key_of: dict[tuple, tuple] = {}
        self._plans: dict[tuple, list] = {}
        layers_of: dict[tuple, set] = {}
        for layer, plans in plans_by_layer.items():
            for plan in plans:
                op = plan.layers[layer].prefill
                ident = (layer, op.rule, json.dumps(op.params, sort_keys=True, default=str))
                if ident not in self._key_of:  # the variant depends on the rule, not on its capacity or widths
                    try:
                        groups = capture_groups(model, [plan], registry=registry, model_data=model_data,
                                                input_ids=self.ids[0])
                    except PolykvError as exc:
                        raise ProfileError(f"calibrating rule '{op.rule}' on layer {layer} through the runtime: {exc} "
                                           f"(give the rule's parameters with CalibrationSettings.rule_params, or "
                                           f"leave it out of the rules)") from None
                    self._key_of[ident] = next(iter(groups))
                key = self._key_of[ident]
                self._plans.setdefault(key, []).append(plan)
                layers_of.setdefault(key, set()).add(layer)
        self.shared = {key for key, layers in layers_of.items() if len(layers) > 1}
        self._snaps: dict[tuple, list] = {}

    def key(self, plan, layer: int) -> tuple:
        op = plan.layers[layer].prefill
        return self._key_of[(layer, op.rule, json.dumps(op.params, sort_keys=True, default=str))]

    def get(self, key: tuple) -> list:
        """One snapshot per sequence of the variant ``key``."""
        from polykv.runtime.fork import capture_prefill

        if key not in self._snaps:
            plans = self._plans[key]
            self._snaps[key] = [capture_prefill(self.model, ids, plans, registry=self.registry,
                                                   model_data=self.model_data) for ids in self.ids]
        return self._snaps[key]

    def layer_snapshot(self, plan, layer: int, index: int = 0):
        """The :class:`~polykv.runtime.fork.LayerSnapshot` of ``layer`` in prompt ``index``'s prefill for ``plan``."""
        return self.get(self.key(plan, layer))[index].layers[layer]

    def release(self, layer_keys: set) -> None:
        """Drop the variants among ``layer_keys`` that no other layer needs."""
        for key in layer_keys - self.shared:
            self._snaps.pop(key, None)


@torch.no_grad()
def followup_logprobs(model, plan, snapshot, ids: torch.Tensor, prefix: int, *, model_data=None, registry=None,
                      seed: int = 0, storage_dtype=None) -> torch.Tensor:
    """[F-1, V] float64 log-probabilities of tokens ``prefix+1`` .. T-1 under ``plan``, its cache restored from
    ``snapshot`` (the uncompressed prefill of ``ids[:prefix]``) and the follow-up tokens fed in one forward
    (``storage_dtype``: the cache's, as :func:`polykv.apply` takes it)."""
    from polykv.runtime import apply
    from polykv.runtime.fork import restore_prefill

    ids = ids.view(1, -1).to(next(model.parameters()).device)
    with apply(model, plan, model_data=model_data, seed=seed, registry=registry,
               storage_dtype=storage_dtype) as session:
        cache = restore_prefill(session, snapshot)
        logits = model(input_ids=ids[:, prefix:-1], use_cache=True, **{session.cache_keyword: cache}).logits
    return torch.log_softmax(logits[0].double(), dim=-1)


def layer_kl(model, geometry, layer: int, configs: Sequence[CandidateConfig], columns: Sequence[int],
             sequences: Sequence[torch.Tensor], references: Sequence[torch.Tensor], snapshots: PrefixSnapshots,
             *, quantizer: str, quantizer_params: Mapping[str, Any], model_data=None, registry=None, seed: int = 0,
             tick: Callable[[], None] | None = None) -> np.ndarray:
    """KL of each config in ``columns`` on ``layer`` (module docstring), one value per column; ``references``
    are :func:`~polykv.profiling.validation.reference_logprobs` of each sequence (all F positions)."""
    out = np.zeros(len(columns))
    used = set()
    for j, col in enumerate(columns):
        plan = val.config_plan(geometry, layer, configs[col], quantizer=quantizer, quantizer_params=quantizer_params)
        key = snapshots.key(plan, layer)
        used.add(key)
        for s, ref, snap in zip(sequences, references, snapshots.get(key)):
            lp = followup_logprobs(model, plan, snap, s, snapshots.prefix, model_data=model_data, registry=registry,
                                   seed=seed)
            out[j] += val.kl_divergence(ref[1:], lp) / len(sequences)
        if tick is not None:
            tick()
    snapshots.release(used)
    return out


def one_layer_plans(geometry, layers: Sequence[int], configs: Sequence[CandidateConfig], columns: Sequence[int], *,
                    quantizer: str, quantizer_params: Mapping[str, Any]) -> dict[int, list]:
    """``{layer: [one-layer plan of each column]}``, the plans :class:`PrefixSnapshots` captures for."""
    return {layer: [val.config_plan(geometry, layer, configs[c], quantizer=quantizer,
                                    quantizer_params=quantizer_params) for c in columns] for layer in layers}


def describe(configs: Sequence[CandidateConfig], columns: Sequence[int], composed: Sequence[int], sequences: int,
             followup: int) -> str:
    """The provenance note of a ``kl`` table."""
    text = (f"metric kl: KL(full || one-layer plan) of the next-token distributions of {followup - 1} follow-up "
            f"positions, mean over {sequences} held-out sequences, measured through the runtime (prefix prefilled "
            f"once per sequence, each (layer, config) restored from it) for {len(columns)} configs per layer")
    if composed:
        text += (f"; the other {len(composed)} are composed additively: kl(rule@keep, K, V) = kl(rule@keep, 16, 16) "
                 f"+ kl({FULL_RULE}, K, V)")
    return text


# -- whole plans on held-out sequences ------------------------------------------------------------------

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
    from polykv.profiling.calibrate import corpus_sequences

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
    """

    def __init__(self, model, sequences: Sequence[torch.Tensor], prefix: int, *,
                 model_data: Mapping[str, Any] | None = None, registry=None, storage_dtype=None, seed: int = 0,
                 layer_menu: Sequence[Any] = (), reuse_prefill: bool = True):
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
        self.references = [val.reference_logprobs(model, s, self.prefix)[1:] for s in self.sequences]  # (F-1, V)
        self.layer_menu = self._distinct(layer_menu)
        self._snapshots: list[dict] = [{} for _ in self.sequences]  # per sequence: variant key -> layers
        self._menu_signature: dict | None = None
        self.prefills = 0
        """Prefills run so far (one per sequence and attention signature with reuse)."""

    @staticmethod
    def _distinct(menu) -> list:
        seen, out = set(), []
        for lp in menu:
            key = tuple((op.rule, tuple(sorted(op.params.items(), key=str))) for op in (lp.prefill, lp.decode))
            if key not in seen:
                seen.add(key)
                out.append(lp)
        return out

    def measure(self, plan) -> float:
        """Mean measured KL(full || plan) over the sequences' follow-up predictions, in nats."""
        total = 0.0
        for i, ids in enumerate(self.sequences):
            total += val.kl_divergence(self.references[i], self._logprobs(plan, i, ids))
        return total / len(self.sequences)

    @torch.no_grad()
    def _logprobs(self, plan, i: int, ids: torch.Tensor) -> torch.Tensor:
        """[F-1, V] float64 log-probabilities of the follow-up predictions under ``plan``."""
        from polykv.runtime import apply
        from polykv.runtime.fork import PrefillSnapshot, capture_prefill, forward

        prompt = ids[:, :self.prefix]
        if not self.reuse_prefill:
            with apply(self.model, plan, model_data=self.model_data, registry=self.registry, seed=self.seed,
                       storage_dtype=self.storage_dtype) as session:
                session.prefill(prompt)
                self.prefills += 1
                return torch.log_softmax(forward(session, ids[:, self.prefix:-1]).logits[0].double(), dim=-1)
        kw = dict(model_data=self.model_data, registry=self.registry, seed=self.seed, storage_dtype=self.storage_dtype)
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
        from polykv.runtime.fork import capture_groups

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
