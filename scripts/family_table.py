"""Print the family table: every causal-LM family of the installed transformers under polykv.

    python scripts/family_table.py [MODEL_TYPE ...] [--all]

Rows come from :func:`polykv.models.families.check_family`, the same check ``tests/models/test_family_matrix.py``
asserts. Without ``--all`` only served and refused families are listed (encoder-decoder, composite and
unbuildable ones are counted below the table).
"""

from __future__ import annotations

import sys
import time
import warnings


def main(argv: list[str]) -> int:
    import torch
    import transformers

    from polykv.models.families import check_family, family_table, model_types

    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)
    show_all = "--all" in argv
    names = [a for a in argv if not a.startswith("--")] or model_types()
    start = time.perf_counter()
    results = [check_family(name) for name in names]
    shown = [r for r in results if show_all or r.status in ("served", "refused", "error")]
    print(family_table(shown))
    counts = {}
    for r in results:
        counts[r.status] = counts.get(r.status, 0) + 1
    print(f"\n{len(results)} model types in {time.perf_counter() - start:.0f} s: "
          + ", ".join(f"{n} {status}" for status, n in sorted(counts.items())))
    return 0 if counts.get("error", 0) == 0 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
