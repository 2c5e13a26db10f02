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

import inspect
import json
from typing import Any, Callable, Mapping, Sequence

import attrs
import numpy as np
import torch

from polykv.errors import PolykvError, ProfileError, RuntimeConfigError
from polykv.models.geometry import geometry_of_model
from polykv.plan import full_plan
from polykv.runtime import apply
from polykv.runtime import session as runtime_session
from polykv.runtime.fork import (attention_signature, capture_prefill, plan_ranks, plan_states, probe_key,
                                 restore_prefill, session_probe)
from polykv.runtime.checks import attention_modules
from polykv.plan import Plan
from polykv.profiling.profile import CandidateConfig
from polykv.profiling.profile_checks import FULL_RULE
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
        self.model, self.registry, self.model_data = model, registry, model_data
        self.ids = [p.to(next(model.parameters()).device) for p in prompts]
        self.prefix = int(self.ids[0].shape[1])
        # The variant and the states a prefill records for a one-layer plan depend on its layer, rule and
        # parameters, not on its capacity or widths; and a layer's states depend on that layer's op alone. So the
        # plans of one (rule, params) on every layer are opened as ONE session (``merged``), which gives each
        # layer's variant key and, restored into, the same prefill as the one-layer plans would.
        # A plan with low-rank or shared layers prefills differently from the full plan below its layer: never merged.
        by_rule: dict[tuple, dict[int, Plan]] = {}
        for layer, plans in plans_by_layer.items():
            for plan in plans:
                op = plan.layers[layer].prefill
                alone = None if _mergeable(plan) else layer
                by_rule.setdefault((op.rule, _params_key(op.params), alone), {}).setdefault(layer, plan)
        self._key_of: dict[tuple, tuple] = {}
        members: dict[tuple, dict[tuple, dict[int, Plan]]] = {}
        for group, per_layer in by_rule.items():
            rule, params = group[:2]
            for layer, key in self._variant_keys(rule, per_layer).items():
                self._key_of[(layer, rule, params)] = key
                members.setdefault(key, {}).setdefault(group, {})[layer] = per_layer[layer]
        self._plans = {key: [_merge(per_layer) for per_layer in groups.values()] for key, groups in members.items()}
        """Per variant, the merged plans its prefill is captured for (one per (rule, params))."""
        self.shared = {key for key, groups in members.items() if len({l for g in groups.values() for l in g}) > 1}
        self._snaps: dict[tuple, list] = {}

    def _variant_keys(self, rule: str, per_layer: Mapping[int, Plan]) -> dict[int, tuple]:
        """``{layer: (attention signature, probe key, ranks)}`` of each one-layer plan of one (rule, params), read from one
        session of their merged plan: a layer attends in the signal pass exactly when its own states ask for it."""
        layers = sorted(per_layer)
        try:
            session = runtime_session.apply(self.model, _merge(per_layer), registry=self.registry,
                                            model_data=self.model_data)
            states = plan_states(session)
            probe = probe_key(session_probe(session, self.ids[0]))
        except PolykvError as exc:
            where = f"layer {layers[0]}" if len(layers) == 1 else f"layers {layers[0]}..{layers[-1]}"
            raise ProfileError(f"calibrating rule '{rule}' on {where} through the runtime: {exc} (give the rule's "
                               f"parameters with CalibrationSettings.rule_params, or leave it out of the "
                               f"rules)") from None
        return {layer: (attention_signature([states[i] if i == layer else [] for i in range(len(states))]), probe,
                        plan_ranks(per_layer[layer])) for layer in layers}

    def key(self, plan, layer: int) -> tuple:
        op = plan.layers[layer].prefill
        return self._key_of[(layer, op.rule, _params_key(op.params))]

    def get(self, key: tuple) -> list:
        """One snapshot per sequence of the variant ``key``."""
        if key not in self._snaps:
            plans = self._plans[key]
            self._snaps[key] = [capture_prefill(self.model, ids, plans, registry=self.registry,
                                                   model_data=self.model_data) for ids in self.ids]
        return self._snaps[key]

    def plain(self) -> list:
        """One snapshot per sequence of the plain prefill (every layer in SDPA, no probe), the full plan's: the
        plans' own variant when one is plain, else captured for the full plan."""
        layers = geometry_of_model(self.model).num_layers
        key = ((False,) * layers, None, None)
        if key not in self._plans:
            self._plans[key] = [full_plan(geometry_of_model(self.model))]
        self.shared.add(key)
        return self.get(key)

    def layer_snapshot(self, plan, layer: int, index: int = 0):
        """The :class:`~polykv.runtime.fork.LayerSnapshot` of ``layer`` in prompt ``index``'s prefill for ``plan``."""
        return self.get(self.key(plan, layer))[index].layers[layer]

    def release(self, layer_keys: set) -> None:
        """Drop the variants among ``layer_keys`` that no other layer needs."""
        for key in layer_keys - self.shared:
            self._snaps.pop(key, None)


def _params_key(params) -> str:
    return json.dumps(params, sort_keys=True, default=str)


def _mergeable(plan: Plan) -> bool:
    return not plan.low_rank and all(lp.share is None for lp in plan.layers)


def _merge(per_layer: Mapping[int, Plan]) -> Plan:
    """One plan whose layer ``l`` is ``per_layer[l]``'s (its one compressed layer), every other layer's as in the
    first plan (full)."""
    first = per_layer[min(per_layer)]
    layers = list(first.layers)
    for layer, plan in per_layer.items():
        layers[layer] = plan.layers[layer]
    return attrs.evolve(first, layers=tuple(layers))


def decoder_layers(model) -> list[torch.nn.Module]:
    """The decoder layer (block) of every layer, in order: the module list whose i-th entry holds layer i's attention
    module (:func:`polykv.runtime.session.apply` finds those)."""
    attn = attention_modules(model, geometry_of_model(model).num_layers)
    for _, blocks in model.named_modules():
        if isinstance(blocks, torch.nn.ModuleList) and len(blocks) == len(attn) and all(
                any(m is a for m in block.modules()) for block, a in zip(blocks, attn)):
            return list(blocks)
    raise RuntimeConfigError(f"{type(model).__name__}: no module list holds one decoder layer per attention module; "
                             f"the kl metric cannot skip the layers below the compressed one on this model")


class LayerOutputs:
    """What each decoder layer outputs during the follow-up forward of the full plan (every layer uncompressed),
    restored from an uncompressed prefill: in a one-layer plan on layer l, layers 0..l-1 keep every token at 16
    bits, so they compute exactly this; the plan's follow-up forward starts from layer l-1's output and runs only
    layers l..L-1 (:func:`followup_logprobs`).

    With ``logits=True`` the same forward keeps the full plan's follow-up logits (:attr:`logits`), the reference
    every one-layer plan's KL is taken against (:meth:`KLReference.of_logits`): the full model's predictions at the
    follow-up positions from the prefill already captured, instead of a forward over the whole sequence per item."""

    def __init__(self, model, snapshot, ids: torch.Tensor, prefix: int, *, layers: Sequence[int], registry=None,
                 logits: bool = False):
        want = {layer - 1 for layer in layers if layer > 0}
        blocks = decoder_layers(model)
        self.outputs: dict[int, Any] = {}
        """Layer index -> its output (what the next layer takes), for the layers below a measured one."""
        self.logits: torch.Tensor | None = None
        """[F-1, V] the full plan's follow-up logits (predicting tokens ``prefix+1`` .. T-1) with ``logits=True``."""
        hooks = [blocks[i].register_forward_hook(lambda _m, _a, out, i=i: self.outputs.__setitem__(i, _detached(out)))
                 for i in sorted(want)]
        ids = ids.view(1, -1).to(next(model.parameters()).device)
        try:
            with torch.no_grad(), apply(model, full_plan(geometry_of_model(model)), registry=registry) as session:
                cache = restore_prefill(session, snapshot)
                keep = {"logits_to_keep": 1} if not logits and \
                    "logits_to_keep" in inspect.signature(type(model).forward).parameters else {}
                out = model(input_ids=ids[:, prefix:-1], use_cache=True, **{session.cache_keyword: cache}, **keep)
                if logits:
                    self.logits = out.logits[0]
        finally:
            for hook in hooks:
                hook.remove()

    def entering(self, layer: int):
        """What layer ``layer`` takes (None for layer 0: the whole stack runs)."""
        return None if layer == 0 else self.outputs[layer - 1]


def _detached(out):
    return out.detach().clone() if isinstance(out, torch.Tensor) else out


class _SkipBelow:
    """Within the block, decoder layers 0..l-1 return ``output`` (what layer l-1 output in the full plan's run)
    without computing anything; the layers from l on run as usual."""

    def __init__(self, model, layer: int, output):
        self.blocks = decoder_layers(model)[:layer] if output is not None else []
        self.output = output
        self.saved: list = []

    def __enter__(self):
        out = self.output
        for block in self.blocks:
            self.saved.append(block.__dict__.get("forward", _NONE))
            block.forward = lambda *_a, **_k: out
        return self

    def __exit__(self, *exc):
        for block, saved in zip(self.blocks, self.saved):
            if saved is _NONE:
                del block.forward
            else:
                block.forward = saved


_NONE = object()


@torch.no_grad()
def followup_logits(model, plan, snapshot, ids: torch.Tensor, prefix: int, *, model_data=None, registry=None,
                    seed: int = 0, layer: int = 0, entering=None, storage_dtype=None) -> torch.Tensor:
    """[F-1, V] logits (compute dtype) predicting tokens ``prefix+1`` .. T-1 under ``plan``, its cache restored from
    ``snapshot`` (the uncompressed prefill of ``ids[:prefix]``) and the follow-up tokens fed in one forward
    (``storage_dtype``: the cache's, as :func:`polykv.apply` takes it).

    With ``entering`` (:meth:`LayerOutputs.entering` of ``layer``, the plan's only compressed layer), layers below
    ``layer`` are not run: they would compute exactly ``entering``; the forward runs layers ``layer`` .. L-1, the
    compressed one served by the runtime's layer cache as in any session."""
    ids = ids.view(1, -1).to(next(model.parameters()).device)
    with apply(model, plan, model_data=model_data, seed=seed, registry=registry,
               storage_dtype=storage_dtype) as session:
        cache = restore_prefill(session, snapshot)
        with _SkipBelow(model, layer, entering):
            logits = model(input_ids=ids[:, prefix:-1], use_cache=True, **{session.cache_keyword: cache}).logits
    return logits[0]


def followup_logprobs(model, plan, snapshot, ids: torch.Tensor, prefix: int, **kwargs) -> torch.Tensor:
    """[F-1, V] float64 log-probabilities of :func:`followup_logits` (same arguments)."""
    return torch.log_softmax(followup_logits(model, plan, snapshot, ids, prefix, **kwargs).double(), dim=-1)


class KLReference:
    """The full model's next-token distributions at the follow-up positions P+1 .. T-1 of one sequence, ready to
    take ``KL(p_full || softmax(z))`` of many plans' logits ``z``:
    ``sum_v p (log p - z) + logsumexp(z) sum_v p`` per position, in float64, a block of positions at a time.
    Equal to :func:`~polykv.profiling.validation.kl_divergence` of the log-probabilities up to float64 rounding,
    without a [F-1, V] float64 log-softmax and difference per plan (at 1,535 positions x 49,152 tokens those took
    9 s of a 7 s forward)."""

    ROWS = 128
    """Positions per block."""

    def __init__(self, logprobs: torch.Tensor):
        """``logprobs``: [F-1, V] float64 log-probabilities of the full model (``reference_logprobs(...)[1:]``)."""
        self.probs = logprobs.exp()
        self.mass = self.probs.sum(-1)                                 # [F-1], 1 up to rounding
        self.neg_entropy = (self.probs * logprobs).sum(-1)              # [F-1]

    @classmethod
    def of(cls, reference: torch.Tensor, rows: Sequence[int] | None = None) -> "KLReference":
        """From :func:`~polykv.profiling.validation.reference_logprobs` (all F positions; the first, predicted by
        the prefill before any layer compresses, is left out), at follow-up prediction ``rows`` only (None: all)."""
        return cls(reference[1:] if rows is None else reference[1:][list(rows)])

    @classmethod
    def of_logits(cls, logits: torch.Tensor, rows: Sequence[int] | None = None) -> "KLReference":
        """From the full plan's [F-1, V] follow-up logits (:attr:`LayerOutputs.logits`), at follow-up prediction
        ``rows`` only (None: all)."""
        z = logits if rows is None else logits[list(rows)]
        return cls(torch.log_softmax(z.double(), dim=-1))

    def kl(self, logits: torch.Tensor) -> float:
        """Mean over positions of KL(p_full || softmax(``logits``)); ``logits`` [F-1, V]."""
        if logits.shape != self.probs.shape:
            raise ValueError(f"logits {list(logits.shape)} do not match the reference {list(self.probs.shape)}")
        total = 0.0
        for start in range(0, logits.shape[0], self.ROWS):
            rows = slice(start, start + self.ROWS)
            z = logits[rows].to(self.probs.device, torch.float64)
            cross = (self.probs[rows] * z).sum(-1)
            total += float((self.neg_entropy[rows] - cross + torch.logsumexp(z, -1) * self.mass[rows]).sum())
        return total / logits.shape[0]


def layer_kl(model, geometry, layer: int, configs: Sequence[CandidateConfig], columns: Sequence[int],
             sequences: Sequence[torch.Tensor], references: Sequence[torch.Tensor], snapshots: PrefixSnapshots,
             *, quantizer: str, quantizer_params: Mapping[str, Any], model_data=None, registry=None, seed: int = 0,
             tick: Callable[[], None] | None = None, below: Sequence[LayerOutputs] | None = None,
             rows: Sequence[Sequence[int]] | None = None, prompts: Sequence[int] | None = None,
             per_sequence: bool = False) -> np.ndarray:
    """KL of each config in ``columns`` on ``layer`` (module docstring), one value per column; ``references``
    are a :class:`KLReference` of each sequence (or its :func:`~polykv.profiling.validation.reference_logprobs`, all F
    positions). With ``below`` (one :class:`LayerOutputs` per sequence) the follow-up forwards run only layers
    ``layer`` .. L-1.

    A sequence may be any prefix + follow-up (:mod:`polykv.profiling.objectives`): ``rows`` gives, per sequence, the
    follow-up prediction rows scored (its reference built on them: ``KLReference.of(reference, rows)``; None: every
    row) and ``prompts`` the index of its prefix among the snapshots' prompts (None: the sequence's own index).
    ``per_sequence`` returns [sequences, columns] instead of the mean over sequences."""
    references = [r if isinstance(r, KLReference) else KLReference.of(r, None if rows is None else rows[i])
                  for i, r in enumerate(references)]
    out = np.zeros((len(sequences), len(columns)))
    used = set()
    for j, col in enumerate(columns):
        plan = val.config_plan(geometry, layer, configs[col], quantizer=quantizer, quantizer_params=quantizer_params)
        key = snapshots.key(plan, layer)
        used.add(key)
        snaps = snapshots.get(key)
        for i, (s, ref) in enumerate(zip(sequences, references)):
            entering = None if below is None else below[i].entering(layer)
            snap = snaps[i if prompts is None else prompts[i]]
            logits = followup_logits(model, plan, snap, s, snapshots.prefix, model_data=model_data, registry=registry,
                                     seed=seed, layer=layer, entering=entering)
            out[i, j] = ref.kl(logits if rows is None else logits[list(rows[i])])
        if tick is not None:
            tick()
    snapshots.release(used)
    return out if per_sequence else out.mean(axis=0)


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
