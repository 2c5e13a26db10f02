"""Prefill once, restore per plan: exactly the tokens, logits, positions and bytes of a prefill per plan."""

from __future__ import annotations

import attrs
import pytest
import torch

import polykv
from polykv.errors import RuntimeConfigError
from polykv.models.geometry import geometry_of_model
from polykv.plan import OpSpec, per_layer_plan, uniform_plan
from polykv.runtime.fork import capture_prefill, forward, restore_prefill
from polykv.studies.results import read_records
from polykv.studies.runner import prepare, run_study
from polykv.studies.spec import load_spec
from polykv.testing import tiny_model


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", layers=3, heads=4, kv_heads=2, head_dim=32)


def _plans(geo):
    mixed = per_layer_plan(geo, [
        {"prefill": OpSpec(rule="snapkv", capacity=18, params={"window": 6}), "k_bits": 8, "v_bits": 4},
        {"prefill": OpSpec(rule="h2o", capacity=20), "decode": OpSpec(rule="h2o", capacity=22)},
        {"prefill": OpSpec(rule="tova", capacity=14), "decode": OpSpec(rule="tova", capacity=16), "k_bits": 4},
    ], decode_slack=1)
    return [
        uniform_plan(geo, prefill=OpSpec(rule="snapkv", capacity=20, params={"window": 4})),
        uniform_plan(geo, prefill=OpSpec(rule="h2o", capacity=20), decode=OpSpec(rule="h2o", capacity=24),
                     decode_slack=1),
        uniform_plan(geo, prefill=OpSpec(rule="tova", capacity=16), k_bits=4, v_bits=8),
        uniform_plan(geo, prefill=OpSpec(rule="streamingllm", capacity=16)),
        uniform_plan(geo, prefill=OpSpec(rule="random", capacity=16)),
        mixed,
    ]


def _run(model, plan, context, question, snapshot=None):
    with torch.no_grad(), polykv.apply(model, plan) as session:
        if snapshot is None:
            session.prefill(context)
        else:
            restore_prefill(session, snapshot)
        kv = session.resident_bytes()
        positions = [layer.positions.clone() for layer in session.cache.layers]
        out = forward(session, question)
        logits, tokens = [out.logits], []
        for _ in range(6):
            tokens.append(out.logits[:, -1:].argmax(-1))
            out = forward(session, tokens[-1])
            logits.append(out.logits)
        return kv, positions, logits, torch.cat(tokens, 1), session.resident_bytes()


def test_restored_caches_equal_a_prefill_per_plan(model):
    geo = geometry_of_model(model)
    g = torch.Generator().manual_seed(0)
    context, question = torch.randint(1, 128, (1, 64), generator=g), torch.randint(1, 128, (1, 5), generator=g)
    plans = _plans(geo)
    snapshot = capture_prefill(model, context, plans)
    for plan in plans:
        kv_a, pos_a, log_a, tok_a, end_a = _run(model, plan, context, question)
        kv_b, pos_b, log_b, tok_b, end_b = _run(model, plan, context, question, snapshot)
        assert kv_a == kv_b and end_a == end_b
        assert all(torch.equal(a, b) for a, b in zip(pos_a, pos_b))
        assert all(torch.equal(a, b) for a, b in zip(log_a, log_b))  # bit for bit, not just close
        assert torch.equal(tok_a, tok_b)
    # The snapshot is not consumed: restoring the first plan again still matches.
    assert torch.equal(_run(model, plans[0], context, question, snapshot)[3], _run(model, plans[0], context,
                                                                                   question)[3])


def test_a_snapshot_without_the_signals_a_plan_needs_is_refused(model):
    geo = geometry_of_model(model)
    context = torch.randint(1, 128, (1, 40), generator=torch.Generator().manual_seed(1))
    snapshot = capture_prefill(model, context, [uniform_plan(geo, prefill=OpSpec(rule="streamingllm", capacity=8))])
    h2o = uniform_plan(geo, prefill=OpSpec(rule="h2o", capacity=8))
    with polykv.apply(model, h2o) as session, pytest.raises(RuntimeConfigError, match="capture_prefill"):
        restore_prefill(session, snapshot)


def test_study_with_reuse_equals_study_with_a_prefill_per_policy(tmp_path, spec_writer, view, small_study):
    _, _, reference = small_study  # reuse_prefill defaults to true
    spec = load_spec(spec_writer(tmp_path, reuse_prefill=False))
    results = str(tmp_path / "results.jsonl")
    run_study(prepare(spec, results), progress=False)
    records = read_records(results)
    assert not any(r["reused_prefill"] for r in records if r["kind"] == "result")
    assert all(r["reused_prefill"] for r in reference if r["kind"] == "result")
    assert view(records) == view(reference)


def test_a_chunked_capture_equals_a_chunked_prefill(model):
    geo = geometry_of_model(model)
    g = torch.Generator().manual_seed(2)
    context, question = torch.randint(1, 128, (1, 50), generator=g), torch.randint(1, 128, (1, 4), generator=g)
    plan = uniform_plan(geo, prefill=OpSpec(rule="h2o", capacity=20), k_bits=8, v_bits=8)
    snapshot = capture_prefill(model, context, [plan], chunk_size=16)
    with torch.no_grad(), polykv.apply(model, plan) as session:
        session.prefill(context, chunk_size=16)
        want = forward(session, question).logits
        want_bytes = session.resident_bytes().per_layer
    with torch.no_grad(), polykv.apply(model, plan) as session:
        restore_prefill(session, snapshot)
        assert torch.equal(forward(session, question).logits, want)
        assert session.resident_bytes().per_layer == want_bytes


def _reusable_rules():
    """Every registered prefill rule that needs neither per-model data nor a probe (those have their own reuse
    tests: tests/runtime/test_probe.py, tests/runtime/test_rank_runtime.py): a study restores each of them from one prefill per item."""
    from polykv.contract.model_data import need_of
    from polykv.registry import get_registry

    registry = get_registry()
    out = []
    for name in registry.names("rule"):
        cls = registry.get("rule", name)
        if name != "full" and "prefill" in cls.phases and need_of(cls) is None and not cls.declares_probe():
            out.append(name)
    return out


@pytest.mark.parametrize("rule", _reusable_rules())
def test_every_prefill_rule_restores_from_a_snapshot_as_its_own_prefill(model, rule):
    geo = geometry_of_model(model)
    g = torch.Generator().manual_seed(1)
    context, question = torch.randint(1, 128, (1, 48), generator=g), torch.randint(1, 128, (1, 4), generator=g)
    decode = OpSpec(rule=rule, capacity=22) if "decode" in polykv.get_registry().get("rule", rule).phases \
        else OpSpec(rule="full")
    plan = uniform_plan(geo, prefill=OpSpec(rule=rule, capacity=18), decode=decode, decode_slack=1)
    snapshot = capture_prefill(model, context, [plan])
    kv_a, pos_a, log_a, tok_a, end_a = _run(model, plan, context, question)
    kv_b, pos_b, log_b, tok_b, end_b = _run(model, plan, context, question, snapshot)
    assert kv_a == kv_b and end_a == end_b
    assert all(torch.equal(a, b) for a, b in zip(pos_a, pos_b))
    assert all(torch.equal(a, b) for a, b in zip(log_a, log_b))
    assert torch.equal(tok_a, tok_b)


def test_a_study_gives_its_prefill_capture_the_model_data_it_found(tmp_path, spec_writer, profile_path, monkeypatch):
    """A study reads the profile's side file for a TriAttention plan; its shared prefill must be captured with
    that same data, not with statistics computed (and cached) again from the corpus."""
    import shutil
    import warnings

    from polykv.contract.model_data import ModelDataNote
    from polykv.adapters.rules.query_stats import compute_query_stats
    from tests.studies.runner.conftest import TINY

    monkeypatch.setenv("POLYKV_CACHE", str(tmp_path / "empty-cache"))  # nothing cached: a lookup would compute
    tiny = tiny_model(**TINY)
    profile = tmp_path / "tiny-profile.json"
    shutil.copy(profile_path, profile)
    batches = [torch.randint(1, TINY["vocab"], (1, 64), generator=torch.Generator().manual_seed(s)) for s in (0, 1)]
    compute_query_stats(tiny, batches).save(str(tmp_path / "tiny-profile.qstats.safetensors"))
    plan = uniform_plan(geometry_of_model(tiny), prefill=OpSpec(rule="triattention", capacity_ratio=0.5))
    plan.save(str(tmp_path / "tri.plan.json"))
    spec = spec_writer(tmp_path, profile=str(profile), solvers=[], plans={"tri": str(tmp_path / "tri.plan.json")})
    results = str(tmp_path / "results.jsonl")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run_study(prepare(load_spec(spec), results), progress=False)
    assert not [w for w in caught if issubclass(w.category, ModelDataNote)], [str(w.message) for w in caught]
    records = [r for r in read_records(results) if r["kind"] == "result"]
    assert {r["policy"] for r in records} == {"full", "tri"} and all(r["reused_prefill"] for r in records)


def test_plans_naming_different_model_data_each_read_their_own(tmp_path, spec_writer, profile_path):
    """Two TriAttention plans whose model_data fields name the query statistics of two profiles: each policy runs
    with the file its own plan names (one shared lookup gave both the first file found), and a study of the two
    scores each as a study of it alone."""
    from polykv.adapters.rules.query_stats import QueryStats, compute_query_stats
    from polykv.studies.runner import LoadedStudy
    from tests.studies.runner.conftest import TINY

    tiny = tiny_model(**TINY)
    geo = geometry_of_model(tiny)
    files = {}
    for name, seed in (("a", 0), ("b", 7)):
        batches = [torch.randint(1, TINY["vocab"], (1, 64), generator=torch.Generator().manual_seed(seed))]
        files[name] = str(tmp_path / f"{name}.qstats.safetensors")
        compute_query_stats(tiny, batches).save(files[name])
        plan = uniform_plan(geo, prefill=OpSpec(rule="triattention", capacity_ratio=0.25))
        plan = attrs.evolve(plan, model_data={"triattention": files[name]})
        plan.save(str(tmp_path / f"{name}.plan.json"))
    plans = {n: str(tmp_path / f"{n}.plan.json") for n in files}
    spec = load_spec(spec_writer(tmp_path, solvers=[], plans=plans))
    loaded = LoadedStudy.load(prepare(spec, str(tmp_path / "r.jsonl")))
    for name, path in files.items():
        got, want = loaded.model_data[name]["triattention"], QueryStats.load(path)
        assert all(torch.equal(x, y) for x, y in zip(got.layer(0), want.layer(0))), name
    assert not torch.equal(loaded.model_data["a"]["triattention"].layer(0)[1],
                           loaded.model_data["b"]["triattention"].layer(0)[1])

    def generated(folder, chosen):
        folder.mkdir()
        path = spec_writer(folder, solvers=[], plans={n: plans[n] for n in chosen})
        run_study(prepare(load_spec(path), str(folder / "r.jsonl")), progress=False)
        return {(r["policy"], r["item"]): (r["generated"], r["kv_bytes"]) for r in read_records(str(folder / "r.jsonl"))
                if r["kind"] == "result" and r["policy"] != "full"}

    both = generated(tmp_path / "both", ["a", "b"])
    alone = {**generated(tmp_path / "a-only", ["a"]), **generated(tmp_path / "b-only", ["b"])}
    assert both == alone
