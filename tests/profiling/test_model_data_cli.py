"""``polykv model-data``: per-model data computed on purpose, through the code the runtime computes it with."""

from __future__ import annotations

import pytest
import torch

from polykv.cli import main


def test_list_names_every_kind_and_its_readers(capsys):
    assert main(["model-data", "--list"]) == 0
    out = capsys.readouterr().out
    assert "kvzip-head" in out and "rule 'kvzip-head'" in out
    assert "triattention" in out and "kv_bases" in out and "k_rank" in out


def test_query_statistics_equal_what_the_runtime_computes(saved_tiny_model, tmp_path, capsys):
    import transformers

    from polykv.contract.model_data import corpus_batches
    from polykv.adapters.rules.query_stats import QueryStats, compute_query_stats

    folder = saved_tiny_model(16)
    out = tmp_path / "tiny.qstats.safetensors"
    assert main(["model-data", folder, "triattention", "-o", str(out)]) == 0
    assert "offline corpus" in capsys.readouterr().out
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                              attn_implementation="sdpa").eval()
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    expected = compute_query_stats(model, corpus_batches(tok, "cpu"))
    got = QueryStats.load(str(out))
    assert got.fingerprint == expected.fingerprint and got.num_tokens == expected.num_tokens > 0
    for name in ("mu_real", "mu_imag", "mean_abs", "inv_freq"):
        torch.testing.assert_close(getattr(got, name), getattr(expected, name))


@pytest.mark.parametrize("argv,match", [
    (["model-data", "default", "no-such-data", "-o", "x.safetensors"], "unknown key 'no-such-data'"),
    (["model-data", "default"], "give MODEL KEY -o FILE"),
])
def test_bad_arguments_say_what_to_do(argv, match, capsys):
    assert main(argv) == 2
    assert match in capsys.readouterr().err


def test_a_file_that_is_not_the_data_is_never_overwritten(saved_tiny_model, tmp_path, capsys):
    mine = tmp_path / "notes.safetensors"
    mine.write_text("my notes")
    assert main(["model-data", saved_tiny_model(16), "kv_bases", "-o", str(mine)]) == 2
    assert "notes.safetensors" in capsys.readouterr().err and mine.read_text() == "my notes"
