"""Rule parameters that come from the model's tokenizer, filled and checked by :func:`polykv.apply`.

A rule declares them in ``tokenizer_params`` and builds them in ``params_for_tokenizer(tokenizer)``
(:class:`~polykv.contract.rules.RetentionRule`; KVzip's prompt token ids). :func:`fill_tokenizer_params` gives
every op of a plan that leaves one unset (null) the values built from the tokenizer ``apply`` was given, else the
one saved beside a model loaded from a local folder; :func:`check_token_ids` refuses token ids (parameters whose
spec says ``token_ids``) outside the model's vocabulary.
"""

from __future__ import annotations

import os
from typing import Any

import attrs

from polykv.contract.model_data import tokenizer_of
from polykv.contract.params import ParamError, check_params, token_id_params
from polykv.errors import PlanError, RuntimeConfigError
from polykv.plan import Plan

PHASES = ("prefill", "decode")


def check_tokenizer(tokenizer: Any) -> None:
    """``apply(tokenizer=...)`` takes a tokenizer object: a name or path is refused, never downloaded."""
    if isinstance(tokenizer, (str, bytes, os.PathLike)) or not callable(getattr(tokenizer, "encode", None)):
        raise RuntimeConfigError(
            f"apply(tokenizer=...) expects a tokenizer object with an encode() method, got the "
            f"{type(tokenizer).__name__} {tokenizer!r}; load it first, e.g. "
            f"transformers.AutoTokenizer.from_pretrained(folder) for a local folder (polykv loads none by name)")


def fill_tokenizer_params(plan: Plan, registry, model, tokenizer: Any = None) -> Plan:
    """``plan`` with every op's unset tokenizer parameters built from ``tokenizer`` (else the one saved beside
    ``model``); unchanged when no op leaves one unset. Raises RuntimeConfigError when a value is needed and no
    tokenizer is known, or the tokenizer builds values the rule refuses."""
    built: dict[str, dict[str, Any]] = {}
    layers = list(plan.layers)
    for i, lp in enumerate(layers):
        for phase in PHASES:
            op = getattr(lp, phase)
            cls = registry.rule(op.rule)
            missing = [n for n in getattr(cls, "tokenizer_params", ()) if op.params.get(n) is None]
            if not missing:
                continue
            where = f"layer {lp.layer} ({phase}): rule '{op.rule}'"
            if op.rule not in built:
                if tokenizer is None:
                    tokenizer = tokenizer_of(model)
                if tokenizer is None:
                    raise RuntimeConfigError(
                        f"{where} builds its parameters {missing} from the model's tokenizer, and none is known (the "
                        f"model was not loaded from a local folder holding one): pass polykv.apply(model, plan, "
                        f"tokenizer=tok), or set them in the plan")
                values = dict(cls.params_for_tokenizer(tokenizer))
                try:
                    check_params(cls.param_specs, values, owner=f"rule '{op.rule}'")
                except ParamError as exc:
                    raise RuntimeConfigError(f"{where}: the tokenizer given built a value it refuses: {exc}") from None
                built[op.rule] = values
            params = {**op.params, **{n: built[op.rule][n] for n in missing}}
            lp = attrs.evolve(lp, **{phase: attrs.evolve(op, params=params)})
        layers[i] = lp
    return plan if layers == list(plan.layers) else attrs.evolve(plan, layers=tuple(layers))


def check_token_ids(plan: Plan, registry, model) -> None:
    """Every token id a rule parameter holds (spec ``token_ids``) is below the model's ``vocab_size``."""
    config = getattr(model, "config", None)
    vocab = getattr(config, "vocab_size", None)
    if vocab is None and hasattr(config, "get_text_config"):
        vocab = getattr(config.get_text_config(), "vocab_size", None)
    if vocab is None:
        return
    for lp in plan.layers:
        for phase in PHASES:
            op = getattr(lp, phase)
            cls = registry.rule(op.rule)
            for name in token_id_params(getattr(cls, "param_specs", {})):
                ids = op.params.get(name)
                bad = [t for t in ids or [] if isinstance(t, int) and t >= int(vocab)]
                if bad:
                    raise PlanError(f"rule '{op.rule}': parameter '{name}' holds token id {bad[0]}, outside the "
                                    f"model's vocabulary [0, {int(vocab)}): the ids were made for another tokenizer",
                                    layer=lp.layer, field=f"layers[{lp.layer}].{phase}.params.{name}",
                                    hint="leave them null to build them from this model's tokenizer "
                                         "(polykv.apply(model, plan, tokenizer=tok))")
