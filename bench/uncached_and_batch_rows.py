"""Two results on the default model, each against vanilla or a single row measured in the same run.

1. ``generate(use_cache=False)`` under the keep-everything plan gives vanilla's uncached tokens, and a
   compressing plan refuses it in one line.
2. D2O decode in a batch of two equal-length rows gives each row the tokens and logits it gets alone.

    python bench/uncached_and_batch_rows.py
"""

from __future__ import annotations

import torch

import polykv
from polykv.models import load_default_model
from polykv.models.geometry import geometry_of_model


def main() -> None:
    model, tok = load_default_model()
    geo = geometry_of_model(model)
    ids = tok("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        vanilla = model.generate(ids, max_new_tokens=8, do_sample=False, use_cache=False)
        with polykv.apply(model, polykv.full_plan(geo)):
            full = model.generate(ids, max_new_tokens=8, do_sample=False, use_cache=False)
        print("use_cache=False, vanilla:           ", repr(tok.decode(vanilla[0, ids.shape[1]:])))
        print("use_cache=False, keep-everything:   ", repr(tok.decode(full[0, ids.shape[1]:])),
              "same tokens:", torch.equal(vanilla, full))
        plan = polykv.uniform_plan(geo, prefill="snapkv", decode="full", capacity=8)
        try:
            with polykv.apply(model, plan):
                model.generate(ids, max_new_tokens=8, do_sample=False, use_cache=False)
            print("use_cache=False, compressing plan:   NOT refused")
        except polykv.errors.PolykvError as exc:
            print("use_cache=False, compressing plan:   refused:", exc)

        texts = ["The quick brown fox jumps over the lazy dog. " * 6,
                 "Paris is the capital and largest city of France. " * 5]
        rows = [tok(t, return_tensors="pt").input_ids[:, :48] for t in texts]
        d2o = polykv.uniform_plan(geo, prefill="full", decode="d2o", capacity=24)
        kw = dict(max_new_tokens=12, do_sample=False, output_scores=True, return_dict_in_generate=True)
        with polykv.apply(model, d2o):
            batch = model.generate(torch.cat(rows), attention_mask=torch.ones(2, 48, dtype=torch.long), **kw)
        for i, row in enumerate(rows):
            with polykv.apply(model, d2o):
                alone = model.generate(row, **kw)
            diff = max((a[0] - b[i]).abs().max().item() for a, b in zip(alone.scores, batch.scores))
            print(f"d2o, batch row {i} vs alone: same tokens {torch.equal(alone.sequences[0], batch.sequences[i])}, "
                  f"largest logit difference {diff:.2e}")


if __name__ == "__main__":
    main()
