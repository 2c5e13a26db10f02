"""``polykv model-data MODEL kvzap``: the surrogate trained through the verb, with its progress, its checkpoint and a
resumed run giving the same file."""

from __future__ import annotations

import os

import torch

from polykv.adapters.rules.kvzap_model import KVzapSurrogate
from polykv.cli import main
from polykv.runtime.session import run_probe


def test_the_verb_trains_reports_progress_and_resumes_from_its_checkpoint(saved_tiny_model, tmp_path, capsys):
    folder = saved_tiny_model(16)
    out = tmp_path / "tiny.kvzap.safetensors"
    argv = ["model-data", folder, "kvzap", "--texts", "3", "--tokens", "40", "-o", str(out)]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert "text 3/3" in captured.err and "left" in captured.err and "MLP epoch 15/15" in captured.err
    assert "('kvzap')" in captured.out and not os.path.exists(str(out) + ".partial")
    first = KVzapSurrogate.load(str(out))
    assert first.num_layers == 2 and first.info["texts"] == "3" and first.info["tokens"] == "120"

    # an interrupted run left two texts in the checkpoint: the same command resumes from them
    from polykv.adapters.rules.kvzap_train import collect
    from polykv.adapters.rules.kvzip import prompt_params
    from polykv.models.corpus import corpus_texts
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                              attn_implementation="sdpa").eval()
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    texts = corpus_texts("mixed", 3, min_chars=160, seed=0)[:2]
    batches = [torch.tensor([tok.encode(t, add_special_tokens=False)[:40]]) for t in texts]
    collect(model, batches, prompt_params(tok), positions=500, seed=0, checkpoint=str(out) + ".partial",
            progress=None, run_probe=run_probe)
    out.unlink()
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "resuming from" in err and err.count("from the checkpoint") == 2
    again = KVzapSurrogate.load(str(out))
    assert torch.equal(again.mlp_w1, first.mlp_w1) and torch.equal(again.lin_w, first.lin_w)
