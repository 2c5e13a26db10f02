"""What a calibration measures, on which sequences, and what it hands back.

:class:`CalibrationSettings` (the design space: rules, keeps, widths, prefix, metrics) and the candidate configs
it spans (:func:`candidate_configs`, over :func:`default_rules` unless rules are named, with the parameters a
probe rule needs for a tokenizer, :func:`tokenizer_params`); the calibration sequences drawn from the offline
corpus (:func:`corpus_sequences`); :class:`CalibrationResult`, the profile with the per-model data measured
beside it, and where that data lives beside a profile file (:func:`query_stats_path`, :func:`model_data_for`).
:func:`polykv.profiling.calibrate.calibrate` runs the measurement; every name here is importable from
:mod:`polykv.profiling.calibrate` too.

Candidate configs: keep 1.0 is listed once, as rule ``full``, at every (K, V) width pair; every
other keep is listed per rule, in phase ``settings.phase`` (``prefill``: what is measured).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import attrs
import torch

from polykv.errors import ProfileError
from polykv.contract.model_data import ModelDataNeed, load_side_files, registered_needs, side_file
from polykv.plan import DEFAULT_QUANTIZER
from polykv.profiling.profile import CandidateConfig, Profile, moend_configs
from polykv.profiling.profile_checks import FULL_RULE


QUERY_STATS_SUFFIX = ".qstats.safetensors"
"""The side file of the query statistics a calibrated rule declares (``ModelDataNeed.suffix``), the data
``polykv calibrate --query-stats`` places: ``x.profile.json`` -> ``x.qstats.safetensors``."""


def query_stats_need(needs) -> ModelDataNeed | None:
    """Among ``needs``, the one whose side file holds query statistics (:data:`QUERY_STATS_SUFFIX`), or None."""
    return next((n for n in needs if n.suffix == QUERY_STATS_SUFFIX), None)


@attrs.define(frozen=True, kw_only=True)
class CalibrationSettings:
    """What to measure; the defaults are MoE-nD's design space over every registered rule."""

    rules: tuple[str, ...] | None = attrs.field(default=None, converter=lambda v: None if v is None else tuple(v))
    """Retention rules to profile (None = every registered rule except ``full``)."""
    keeps: tuple[float, ...] = (0.1, 0.25, 0.5, 0.75, 0.9, 1.0)
    """Keep ratios of the prefix."""
    bits: tuple[int, ...] = (16, 8, 4)
    """Widths tried for keys and for values."""
    phase: str = "prefill"
    """Phase recorded in the configs (calibration compresses the prefix, i.e. the prefill)."""
    prefix: int = 512
    """Prefix tokens P that are compressed; the rest of each sequence are follow-up queries."""
    seed: int = 0
    """Seeds the corpus draw, the random rule and the sampled validation configs."""
    stat_capacity: int = 256
    """PolyKV's common calibration capacity for the cosine and delta-PPL statistics."""
    delta_ppl_sequences: int = 0
    """Calibration sequences the delta-PPL statistic runs on (0 = not measured; the whole model per rule)."""
    validate_configs: int = 8
    """Measured KL configs sampled (the same for every layer) into ``stats.kl_sampled`` when held-out sequences
    are given."""
    kl_configs: str = "subset"
    """Which configs the end-to-end ``kl`` metric measures on held-out sequences (:mod:`polykv.profiling.endtoend`):
    ``"subset"`` (every rule x keep at 16/16 bits and ``full`` at every width pair, the rest composed additively)
    or ``"all"``."""
    quantizer: str = DEFAULT_QUANTIZER
    quantizer_params: Mapping[str, Any] = attrs.field(factory=dict, converter=dict)
    rule_params: Mapping[str, Mapping[str, Any]] = attrs.field(
        factory=dict, converter=lambda d: {str(k): dict(v) for k, v in dict(d or {}).items()})
    """Parameters of rules by name (e.g. the token ids a probe rule's prompts need, :func:`tokenizer_params`):
    written into those rules' configs (and so into the solved plans' ops)."""
    ranks: tuple[int | None, ...] = attrs.field(default=(), converter=lambda v: tuple(v or ()))
    """Key and value ranks of the low-rank axis (None = full width); empty: the axis is not measured. Every
    (k_rank, v_rank) pair of them but full x full is measured per layer (:mod:`polykv.profiling.rank_error`, at 16
    bits, keeping everything) and composed additively with every config (:func:`~polykv.profiling.calibrate_axes.rank_configs`)."""
    head_losses: bool = False
    """Also measure every config's ``l2`` per KV head (only that head's query group's output error) into the profile's
    ``head_metrics`` (the ``global`` solver's head shares)."""
    pairs: bool = False
    """Measure the error of sharing every adjacent pair of full-attention layers (:mod:`polykv.profiling.share_error`)
    into the profile's pair table."""
    objectives: tuple[str, ...] = attrs.field(default=("continuation",), converter=tuple)
    """The follow-ups the end-to-end KL is measured on, each its own metric table
    (:mod:`polykv.profiling.objectives`): ``continuation`` (``kl``), ``reconstruction``, ``retrieval``."""
    objective_weights: Mapping[str, float] = attrs.field(factory=dict, converter=dict)
    """Weight of each objective (by objective name; 1.0 unless given) in the routing table ``kl_mix`` of several."""
    reconstruction_chunk: int = 64
    """Prefix tokens per chunk of the reconstruction objective's follow-ups."""


def check_head_losses(head_losses: bool, ranks) -> None:
    """Per-KV-head losses are measured for the token and bit configs only: refused with a rank axis."""
    if head_losses and ranks:
        raise ProfileError("--head-losses measures the token and bit configs per KV head, and --ranks adds rank configs "
                           "it does not measure per head; calibrate the ranks in another run (or leave one out)")


@attrs.define(frozen=True, kw_only=True, eq=False)
class CalibrationResult:
    profile: Profile | None
    """The profile; None for a run restricted to some layers (``calibrate(..., layers=)``), whose ``arrays`` hold them."""
    model_data: dict[str, Any] = attrs.field(factory=dict)
    """Per-model data the calibrated rules declared, by key, measured on the calibration sequences."""
    needs: tuple[ModelDataNeed, ...] = ()
    """The declarations behind ``model_data`` (their side files go beside the profile)."""
    seconds: float
    """Wall time of the run (resumed layers excluded)."""
    arrays: dict[int, dict[str, Any]] = attrs.field(factory=dict)
    """Per layer computed by a run restricted to some layers, its table rows (what a checkpoint holds)."""

    @property
    def query_stats(self) -> Any:
        """The query statistics among ``model_data``: the data of the need whose side file is
        :data:`QUERY_STATS_SUFFIX` (None when no calibrated rule needs query statistics)."""
        need = query_stats_need(self.needs)
        return None if need is None else self.model_data[need.key]

    def side_files(self, profile_path: str, *, query_stats_path: str | None = None) -> dict[str, Any]:
        """``{path: data}`` to save beside ``profile_path`` (``query_stats_path`` overrides where query
        statistics go)."""
        out = {}
        for need in self.needs:
            path = side_file(profile_path, need.suffix)
            if query_stats_path and need.suffix == QUERY_STATS_SUFFIX:
                path = query_stats_path
            out[path] = self.model_data[need.key]
        return out


def query_stats_path(profile_path: str) -> str:
    """Where the query statistics of a profile live: ``x.profile.json`` -> ``x.qstats.safetensors``."""
    return side_file(profile_path, QUERY_STATS_SUFFIX)


def model_data_for(profile_path: str, *, registry=None, model=None) -> dict[str, Any]:
    """``model_data`` for :func:`polykv.apply` from the side files of a profile: ``{need.key: data}`` for
    every registered rule's declared need whose side file exists (checked against ``model`` if given).

    >>> with polykv.apply(model, plan, model_data=model_data_for("profiles/x.profile.json")):  # doctest: +SKIP
    ...     ...
    """
    if registry is None:
        from polykv.registry import get_registry

        registry = get_registry()
    return load_side_files(profile_path, registered_needs(registry), model=model)


def default_rules(registry) -> tuple[str, ...]:
    """Every registered retention rule except ``full``, by name; the rules that run a probe (a model pass after
    the prompt, :mod:`polykv.contract.probe`) included: calibration runs it in the runtime's prefill."""
    return tuple(sorted(n for n in registry.names("rule") if n != FULL_RULE))


def tokenizer_params(registry, rules: Sequence[str], tokenizer) -> dict[str, dict]:
    """``{rule: params}`` for the rules among ``rules`` that declare ``tokenizer_params``: the parameters (token
    ids of a probe's prompts) the rule builds for this tokenizer (``params_for_tokenizer``)."""
    out = {}
    for rule in rules:
        cls = registry.rule(rule)
        if getattr(cls, "tokenizer_params", ()):
            out[rule] = dict(cls.params_for_tokenizer(tokenizer))
    return out


def candidate_configs(rules: Sequence[str], settings: CalibrationSettings, registry) -> list[CandidateConfig]:
    """keep 1.0 once as ``full`` x (K, V) widths, then each rule at every other keep x (K, V) widths."""
    keeps = sorted(set(float(k) for k in settings.keeps))
    if not keeps or keeps[0] <= 0 or keeps[-1] > 1:
        raise ProfileError(f"keep ratios must lie in (0, 1], got {list(settings.keeps)} (--keeps)")
    bits = list(dict.fromkeys(int(b) for b in settings.bits))
    out = []
    if keeps[-1] == 1.0:
        out += moend_configs(FULL_RULE, "both", keeps=[1.0], k_bits=bits, v_bits=bits)
    for rule in rules:
        cls = registry.rule(rule)
        if settings.phase not in cls.phases and settings.phase != "both":
            raise ProfileError(f"rule '{rule}' does not run in phase '{settings.phase}' (it supports "
                               f"{sorted(cls.phases)}); leave it out with --rules")
        params = settings.rule_params.get(rule, {})
        out += [attrs.evolve(c, params=params) for c in
                moend_configs(rule, settings.phase, keeps=[k for k in keeps if k < 1.0], k_bits=bits, v_bits=bits)]
    return out


def corpus_sequences(tokenize: Callable[[str], Sequence[int]], n: int, tokens: int, *, seed: int = 0,
                     kind: str = "mixed") -> tuple[list[torch.Tensor], str]:
    """``n`` sequences of exactly ``tokens`` token ids from the offline corpus, and their description.

    Texts come from :func:`polykv.models.corpus.corpus_texts` (``kind``, ``seed``), at least
    ``4 * tokens`` characters long; each is tokenized and cut to its first ``tokens`` ids; texts that
    tokenize shorter are skipped, in the corpus order, so the result depends only on the arguments.
    """
    from polykv.models.corpus import corpus_fingerprint, corpus_id, corpus_texts

    if n < 1 or tokens < 2:
        raise ProfileError(f"need at least one sequence of at least 2 tokens, got n={n}, tokens={tokens}")
    for draw in (n, 2 * n, 4 * n, 8 * n):
        texts = corpus_texts(kind, draw, min_chars=4 * tokens, seed=seed)
        picked = []
        for text in texts:
            ids = list(tokenize(text))
            if len(ids) >= tokens:
                picked.append((text, torch.tensor(ids[:tokens], dtype=torch.long)))
            if len(picked) == n:
                break
        if len(picked) == n or len(texts) < draw:
            break
    if len(picked) < n:
        raise ProfileError(f"the offline corpus ({corpus_id()}, kind {kind!r}) has only {len(picked)} texts of at "
                           f"least {tokens} tokens; ask for fewer sequences or shorter ones (--sequences, --tokens)")
    desc = (f"{corpus_id()} {kind} seed={seed}: {n} texts of >= {4 * tokens} chars cut to {tokens} tokens, "
            f"texts sha256 {corpus_fingerprint([t for t, _ in picked])}")
    return [ids for _, ids in picked], desc
