"""Profile files: round trip, from_table, fingerprints, and the model check."""

from __future__ import annotations

import json

import numpy as np
import pytest
import transformers

from polykv.errors import ProfileError
from polykv.models.geometry import geometry_from_config
from polykv.profiling.budget import Budget
from polykv.profiling.profile import (CandidateConfig, Profile, ProfileProvenance, StatTable, load_profile,
                                      moend_configs)
from polykv.solvers import solve


def geometry(layers=3, kv=2, seed_field=64):
    cfg = transformers.LlamaConfig(num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=kv,
                                   head_dim=16, hidden_size=64, max_position_embeddings=seed_field)
    return geometry_from_config(cfg)


def full_profile() -> Profile:
    rng = np.random.default_rng(0)
    configs = moend_configs("tova") + [CandidateConfig(rule="snapkv", phase="prefill", keep=0.25, k_bits=8,
                                                       v_bits=4, params={"window": 16})]
    stats = {"cosine": StatTable(columns=["tova", "snapkv"], values=rng.random((3, 2)), higher_is_better=True,
                                 phase="prefill", capacity=256, description="mean hidden-state cosine"),
             "entropy": StatTable(columns=["entropy"], values=rng.random((3, 1)) * 5, higher_is_better=False)}
    prov = ProfileProvenance(corpus="4 x 2048 tokens of prose", seed=7, context_tokens=2048,
                             versions={"polykv": "0.1.0"}, created="2026-01-01T00:00:00+00:00")
    p = Profile.from_table(rng.random((3, 55)) / 3, configs, geometry(), provenance=prov, stats=stats)
    return Profile(model=p.model, configs=p.configs, metrics={"l2": p.table(), "kl": rng.random((3, 55))},
                   stats=p.stats, provenance=prov)


def test_round_trip_is_exact(tmp_path):
    p = full_profile()
    path = tmp_path / "p.json"
    p.save(str(path))
    q = load_profile(str(path))
    assert q.model == p.model and q.configs == p.configs and q.provenance == p.provenance
    for name in ("l2", "kl"):
        assert np.array_equal(q.table(name), p.table(name))
    for name, st in p.stats.items():
        got = q.stat(name)
        assert got.columns == st.columns and np.array_equal(got.values, st.values)
        assert (got.higher_is_better, got.phase, got.capacity, got.description) == \
               (st.higher_is_better, st.phase, st.capacity, st.description)
    assert q.to_json() == path.read_text() and q.fingerprint == p.fingerprint
    assert q.default_metric == "l2" and q.source == str(path)


def test_file_is_plain_versioned_json_one_row_per_line(tmp_path):
    path = tmp_path / "p.json"
    full_profile().save(str(path))
    raw = json.loads(path.read_text())
    assert raw["schema_version"] == 1 and raw["format"] == "polykv-profile"
    assert len(raw["configs"]) == 55 and len(raw["metrics"]["l2"]) == 3
    lines = path.read_text().splitlines()
    assert sum(1 for line in lines if line.strip().startswith('{"rule"')) == 55


def test_from_table_accepts_geometry_dict_or_tuple():
    table = np.arange(6, dtype=float).reshape(2, 3)
    configs = [("tova", "both", 0.5, 16, 16), {"rule": "h2o", "keep": 0.25, "k_bits": 8}, ("full", "both", 1, 16, 16)]
    for dims in ((2, 2, 16), {"num_layers": 2, "num_kv_heads": 2, "head_dim": 16}, geometry(layers=2)):
        p = Profile.from_table(table, configs, dims, metric="kl")
        assert p.model.num_layers == 2 and p.default_metric == "kl" and np.array_equal(p.table("kl"), table)
        assert [c.label for c in p.configs] == ["tova@0.5/both/K16V16", "h2o@0.25/both/K8V16",
                                                "full@1/both/K16V16"]
    assert Profile.from_table(table, configs, geometry(layers=2)).model.fingerprint == geometry(layers=2).fingerprint


def test_fingerprint_changes_with_content_not_provenance():
    p = full_profile()
    q = Profile(model=p.model, configs=p.configs, metrics={"l2": p.table("l2") + 1e-9, "kl": p.table("kl")},
                stats=p.stats, provenance=p.provenance)
    r = Profile(model=p.model, configs=p.configs, metrics=p.metrics, stats=p.stats,
                provenance=ProfileProvenance(note="copied"))
    assert p.fingerprint != q.fingerprint and p.fingerprint == r.fingerprint
    assert p.fingerprint.startswith("prof-")


def test_profile_for_another_model_is_a_profile_error():
    p = full_profile()
    p.check_model(geometry())
    with pytest.raises(ProfileError, match=r"field 'model.fingerprint': the profile was measured on model cfg-"):
        p.check_model(geometry(seed_field=128))
    with pytest.raises(ProfileError, match=r"field 'model.num_kv_heads'"):
        p.check_model(geometry(kv=1))
    with pytest.raises(ProfileError, match="model.fingerprint"):
        solve(p, Budget.of_ratio(4, 512), "exact", geometry=geometry(seed_field=128))
    assert solve(p, Budget.of_ratio(4, 512), "exact", geometry=geometry()).model.fingerprint == p.model.fingerprint
