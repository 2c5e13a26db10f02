"""``polykv plan show --model`` marks window-bounded layers and counts them at their window."""

from __future__ import annotations

import transformers

import polykv
from polykv.cli import main
from polykv.models.geometry import FULL, SLIDING, geometry_from_config
from polykv.plan import OpSpec


def test_plan_show_marks_sliding_layers(tmp_path, capsys):
    cfg = transformers.Gemma3TextConfig(
        num_hidden_layers=3, hidden_size=64, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, vocab_size=128, sliding_window=64, layer_types=[SLIDING, SLIDING, FULL])
    cfg.save_pretrained(tmp_path / "model")
    geo = geometry_from_config(cfg)
    plan = polykv.uniform_plan(geo, prefill=OpSpec(rule="snapkv", capacity=100))
    plan.save(str(tmp_path / "p.json"))
    assert main(["plan", "show", str(tmp_path / "p.json"), "--model", str(tmp_path / "model"),
                 "--context", "1000"]) == 0
    out = capsys.readouterr().out
    assert "ATTENTION" in out and out.count("sliding<=63") == 2 and "full" in out
    assert "2 window-bounded layers keep at most their model's window" in out
    rows = [r for r in (line.split() for line in out.splitlines()) if r[:1] in (["0w"], ["1w"], ["2"]) and len(r) >= 9 and r[1] != "window-bounded"]
    assert [r[7] for r in rows] == ["63", "63", "100"]          # kept tokens: the window bounds the sliding layers
    assert [line.split()[0] for line in out.splitlines()].count("0w") == 1   # each layer is listed once
    assert "w = window-bounded layer (2 of 3)" in out
