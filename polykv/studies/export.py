"""CSV exports of a study for spreadsheets and plotting tools: ``policies.csv`` and ``items.csv``.

``policies.csv`` has one row per (task, policy) with the numbers report.md shows, computed by the same
functions (:func:`polykv.studies.report.policy_rows`, :func:`polykv.studies.designs.paired_vs`): items, mean
score, the Wilson 95% interval of accuracy (binary scores only), mean measured bytes the cache held after
compressing the context (K/V stores plus metadata), the ratio of a 16-bit full cache of the same contexts to
them, and the paired bootstrap difference to the full cache with its 95% interval. ``items.csv`` has one row
per result record: policy, task, item, score, bytes, and the generated text where the results record it.

Cells are written by :mod:`csv` (a name or a prediction holding commas, quotes or newlines is quoted), floats
in full precision, an absent value as an empty cell. Each file is written atomically, and only over a file
that is absent or an earlier export (its header line is recognised).
"""

from __future__ import annotations

import csv
import io
import math
import os
from typing import Any, Sequence

from polykv.atomic import check_output, write_text_atomic
from polykv.studies import designs
from polykv.studies.combine import combine_results
from polykv.studies.report import policy_rows
from polykv.studies.results import Results

POLICY_COLUMNS = ("task", "policy", "method", "budget", "role", "n_items", "mean_score", "accuracy_low",
                  "accuracy_high", "held_bytes", "ratio_vs_full16", "diff_vs_full", "diff_low", "diff_high")
ITEM_COLUMNS = ("policy", "task", "item", "score", "kv_bytes", "metadata_bytes", "prediction")
FILES = {"policies.csv": POLICY_COLUMNS, "items.csv": ITEM_COLUMNS}


def _cell(value: Any) -> Any:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return ""
    return value


def _csv(columns: Sequence[str], rows: list[dict[str, Any]]) -> str:
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(columns)
    for row in rows:
        writer.writerow([_cell(row.get(c)) for c in columns])
    return buf.getvalue()


def policy_table(res: Results) -> list[dict[str, Any]]:
    """The rows of ``policies.csv``."""
    out = []
    for task in res.tasks:
        part = res.for_task(task)
        for row in policy_rows(part, task):
            name = row["policy"]
            wilson = row["wilson"]
            diff = designs.paired_vs(part, task, name, "full") if name != "full" and "full" in part.policies \
                else None
            out.append({"task": task, "policy": name, "method": row["method"], "budget": row["budget"],
                        "role": row["role"], "n_items": row["n"], "mean_score": row["mean"],
                        "accuracy_low": wilson.low if wilson else None,
                        "accuracy_high": wilson.high if wilson else None, "held_bytes": row["bytes"],
                        "ratio_vs_full16": row["ratio"], "diff_vs_full": diff.estimate if diff else None,
                        "diff_low": diff.low if diff else None, "diff_high": diff.high if diff else None})
    return out


def item_table(res: Results) -> list[dict[str, Any]]:
    """The rows of ``items.csv``, in the results' order."""
    return [{"policy": r["policy"], "task": r["task"], "item": r["item"], "score": r["score"],
             "kv_bytes": r["kv_bytes"], "metadata_bytes": r.get("metadata_bytes"), "prediction": r.get("generated")}
            for r in res.results]


def is_export(columns: Sequence[str]):
    """``recognise`` for :func:`~polykv.atomic.check_output`: a file starting with this export's header line."""
    head = (",".join(columns) + "\n").encode()

    def recognise(path: str) -> bool:
        with open(path, "rb") as fh:
            return fh.read(len(head)) == head
    return recognise


def check_csv_outputs(out_dir: str, option: str, inputs: Sequence[str] = ()) -> None:
    """Refuse before anything is written when ``policies.csv`` or ``items.csv`` in ``out_dir`` is not ours."""
    for name, columns in FILES.items():
        check_output(os.path.join(out_dir, name), what=f"CSV export {name}", option=option,
                     inputs=[p for p in inputs if p], recognise=is_export(columns))


def csv_texts(results_paths: str | Sequence[str]) -> dict[str, str]:
    """File name -> CSV text of the study in ``results_paths`` (parts of one experiment are combined)."""
    paths = [results_paths] if isinstance(results_paths, str) else list(results_paths)
    res = combine_results(paths)
    return {"policies.csv": _csv(POLICY_COLUMNS, policy_table(res)),
            "items.csv": _csv(ITEM_COLUMNS, item_table(res))}


def write_csv(results_paths: str | Sequence[str], out_dir: str, *, option: str = "CSV folder",
              texts: dict[str, str] | None = None) -> list[str]:
    """Write ``policies.csv`` and ``items.csv`` into ``out_dir``; return their paths.

    Both outputs are checked before either is written; ``texts`` (from :func:`csv_texts`) skips reading the
    results again.
    """
    paths = [results_paths] if isinstance(results_paths, str) else list(results_paths)
    check_output(out_dir, what="CSV folder", option=option, inputs=paths, folder=True)
    check_csv_outputs(out_dir, option, paths)
    texts = texts if texts is not None else csv_texts(paths)
    os.makedirs(out_dir, exist_ok=True)
    written = []
    for name, text in texts.items():
        path = os.path.join(out_dir, name)
        write_text_atomic(path, text)
        written.append(path)
    return written
