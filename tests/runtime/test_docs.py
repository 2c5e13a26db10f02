"""The examples in docs/runtime.md run as written (on a tiny model)."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from polykv.adapters.rules.query_stats import compute_query_stats
from polykv.studies.runner import CharTokenizer
from polykv.testing import tiny_model

DOC = Path(__file__).resolve().parents[2] / "docs" / "runtime.md"


def test_docs_examples_run(prompt):
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    assert len(blocks) == 3
    model = tiny_model("llama", layers=2, heads=4, kv_heads=2, head_dim=32)
    ns = {"model": model, "input_ids": prompt(1, 20), "context_ids": prompt(1, 30, seed=1),
          "question_ids": prompt(1, 4, seed=2), "stats": compute_query_stats(model, [prompt(1, 32, seed=3)]),
          "tokenizer": CharTokenizer(model.config.vocab_size)}
    with torch.no_grad():
        for block in blocks:
            exec(compile(block, str(DOC), "exec"), ns)
    assert ns["out"].logits.shape[:2] == (1, 30)
    assert len(ns["answers"].texts) == 2 and ns["answers"].context_tokens > 512  # the plan's capacity compressed it
    assert ns["answers"].context_bytes.total < ns["geo"].full_cache_bytes(ns["answers"].context_tokens, dtype_bytes=4)
    assert model.config._attn_implementation == "sdpa"
