"""Per adjacent layer pair of the default model, the error of sharing it (MiniCache) and how aligned its keys are.

python bench/share_pairs.py   # SmolLM2-135M-Instruct, 512 tokens of the offline corpus, prefix 384

Prints, per pair (l - 1, l): the relative L2 error of each layer's follow-up attention output when the pair's
prefix is merged (polykv.profiling.share_error), and the mean cosine of the two layers' keys and values.
"""

from __future__ import annotations

import torch

from polykv.models import load_default_model
from polykv.models.corpus import corpus_texts
from polykv.profiling.capture import capture_sequence
from polykv.profiling.share_error import pair_errors
from polykv.storage.layer_share import shared_directions

TOKENS, PREFIX = 512, 384


def main() -> None:
    model, tok = load_default_model()
    text = "\n\n".join(corpus_texts("mixed", n=8, min_chars=2000, seed=0))
    ids = tok(text, return_tensors="pt").input_ids[:, :TOKENS]
    caps = capture_sequence(model, ids)
    print(f"{TOKENS} tokens, prefix {PREFIX}, t=0.6, retention 0.05")
    print("pair   lower_err  upper_err  cos_k   cos_v")
    for e in pair_errors(caps, PREFIX):
        lo, hi = caps[e.lower], caps[e.upper]
        cos = [float(torch.cos(shared_directions(a[:, :, :PREFIX], b[:, :, :PREFIX])[3]).mean())
               for a, b in ((lo.key, hi.key), (lo.value, hi.value))]
        print(f"{e.lower:2d}-{e.upper:<3d} {e.lower_error:9.4f}  {e.upper_error:9.4f}  {cos[0]:6.3f}  {cos[1]:6.3f}")


if __name__ == "__main__":
    main()
