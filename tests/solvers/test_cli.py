"""``polykv solve``: profile file + budget -> plan file, and clear errors (exit 2) on bad input."""

from __future__ import annotations

import numpy as np
import pytest

from polykv import get_registry, load_plan
from polykv.cli import main
from polykv.profiling.budget import Budget
from polykv.profiling.profile import Profile, ProfileModel, StatTable, moend_configs
from polykv.solvers import solve


@pytest.fixture()
def profile_path(tmp_path):
    rng = np.random.default_rng(0)
    stats = {"cosine": StatTable(columns=["tova", "h2o"], values=rng.random((4, 2)), higher_is_better=True)}
    p = Profile.from_table(rng.random((4, 54)), moend_configs("tova"),
                           {"num_layers": 4, "num_kv_heads": 2, "head_dim": 64, "num_heads": 4}, stats=stats)
    path = tmp_path / "profile.json"
    p.save(str(path))
    return str(path)


@pytest.mark.parametrize("budget,solver,params", [
    ("4x", "exact", []),
    ("1000000", "moend-greedy", ["--param", "rule=tova"]),
    ("400tok", "profile-route", ["--param", "allocation=uniform", "--param", "scope=both"]),
    ("400tok", "random-placement", ["--param", "count=3", "--param", "index=2"]),
    ("400tok", "uniform", ["--param", "mode=1d"]),
])
def test_solve_writes_a_valid_plan(tmp_path, capsys, profile_path, budget, solver, params):
    out = str(tmp_path / "plan.json")
    rc = main(["solve", profile_path, "--budget", budget, "--context", "1024", "--solver", solver, *params, "-o", out])
    stdout = capsys.readouterr().out
    assert rc == 0 and out in stdout and "predicted" in stdout
    plan = load_plan(out, registry=get_registry())
    prov = plan.provenance
    assert prov.solver == solver and prov.context_tokens == 1024 and prov.polykv_version and prov.created
    b = Budget.parse(budget, 1024, basis="resident")  # the CLI's default basis
    assert prov.budget == b.as_dict() and prov.basis == "resident" and prov.cache_dtype == "bfloat16"
    assert prov.predicted_bytes <= b.to_bytes(ProfileModel(num_layers=4, num_kv_heads=2, head_dim=64))
    assert all(op.capacity is None for lp in plan.layers for op in (lp.prefill, lp.decode))  # ratios


def test_cli_plan_equals_python_plan(tmp_path, profile_path):
    from polykv.profiling.profile import load_profile

    out = str(tmp_path / "plan.json")
    assert main(["solve", profile_path, "--budget", "2x", "--context", "700", "-o", out]) == 0
    py = solve(load_profile(profile_path), Budget.parse("2x", 700, basis="resident"), "exact")
    assert load_plan(out).layers == py.layers
    nominal = str(tmp_path / "nominal.json")
    assert main(["solve", profile_path, "--budget", "5x", "--context", "700", "--basis", "nominal", "-o", nominal]) == 0
    assert load_plan(nominal).layers == solve(load_profile(profile_path), Budget.parse("5x", 700), "exact").layers
    assert load_plan(nominal).provenance.basis == "nominal"


def test_capacities_tokens_writes_token_counts(tmp_path, profile_path):
    out = str(tmp_path / "plan.json")
    assert main(["solve", profile_path, "--budget", "4x", "--context", "1000", "--capacities", "tokens",
                 "--solver", "uniform", "--param", "mode=1d", "-o", out]) == 0
    plan = load_plan(out)
    assert all(lp.prefill.capacity is not None and lp.prefill.capacity_ratio is None for lp in plan.layers)
    assert plan.provenance.context_tokens == 1000


@pytest.mark.parametrize("args,pattern", [
    (["--budget", "huge"], "cannot read budget 'huge'"),
    (["--budget", "10"], "minimum feasible budget is"),
    (["--budget", "4x", "--solver", "nope"], "unknown solver 'nope'. Available: exact"),
    (["--budget", "4x", "--param", "rule"], "expected KEY=VALUE"),
    (["--budget", "4x", "--param", "colour=red"], r"no parameter\(s\) \['colour'\]"),
])
def test_bad_input_exits_2_with_a_message(tmp_path, capsys, profile_path, args, pattern):
    import re

    rc = main(["solve", profile_path, "--context", "1024", "-o", str(tmp_path / "p.json"), *args])
    err = capsys.readouterr().err
    assert rc == 2 and re.search(pattern, err) and "Traceback" not in err
    assert not (tmp_path / "p.json").exists()


def test_missing_profile_file(tmp_path, capsys):
    rc = main(["solve", str(tmp_path / "none.json"), "--budget", "4x", "--context", "8", "-o", str(tmp_path / "p")])
    assert rc == 2 and "none.json: no such file" in capsys.readouterr().err


def test_model_check_refuses_a_profile_from_another_model(tmp_path, capsys):
    import transformers

    from polykv.models.geometry import geometry_from_config

    def folder(name, layers):
        cfg = transformers.LlamaConfig(num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                       head_dim=64, hidden_size=256)
        cfg.save_pretrained(str(tmp_path / name))
        return str(tmp_path / name), geometry_from_config(cfg)

    mine, geo = folder("mine", 4)
    other, _ = folder("other", 4)
    (tmp_path / "other" / "config.json").write_text(
        (tmp_path / "other" / "config.json").read_text().replace('"rope_theta": 10000.0', '"rope_theta": 500000.0'))
    path = str(tmp_path / "profile.json")
    Profile.from_table(np.ones((4, 54)), moend_configs("tova"), geo).save(path)
    args = ["solve", path, "--budget", "2x", "--context", "1024", "-o", str(tmp_path / "plan.json")]
    assert main(args + ["--model", mine]) == 0
    capsys.readouterr()
    assert main(args + ["--model", other]) == 2
    assert "field 'model.fingerprint': the profile was measured on model" in capsys.readouterr().err


def test_plan_show_states_the_basis(tmp_path, capsys, profile_path):
    out = str(tmp_path / "plan.json")
    for basis, line in (("resident", "basis    resident bytes (stores + metadata), batch 1, bfloat16 storage, at 1000"),
                        ("nominal", "basis    nominal bytes (MoE-nD: codes only), at 1000 tokens")):
        assert main(["solve", profile_path, "--budget", "4x", "--context", "1000", "--basis", basis, "-o", out]) == 0
        capsys.readouterr()
        assert main(["plan", "show", out]) == 0
        assert line in capsys.readouterr().out
