"""Report figures (matplotlib, Agg backend): score vs measured memory, the placement control's distribution, route
strips, sensitivity heatmap."""

from __future__ import annotations

import functools
import os
import struct
import zlib
from typing import Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.ticker  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from polykv.atomic import replace_with  # noqa: E402
from polykv.plan import FULL_RULE  # noqa: E402
from polykv.profiling import stats  # noqa: E402
from polykv.registry import get_registry  # noqa: E402

PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22",
           "#7f7f7f", "#aec7e8", "#ffbb78", "#98df8a", "#ff9896", "#c5b0d5", "#c49c94", "#f7b6d2", "#9edae5")
"""Rule colours, handed out by rule name order (see :func:`rule_colour`)."""
FULL_COLOUR = "#bbbbbb"
"""The keep-everything op's colour."""


def _plain_text(draw):
    """Draw with every text taken literally: a name from a results file that holds ``$`` is no mathtext (an
    unparsable one, ``$\\frac$``, would stop the report)."""
    @functools.wraps(draw)
    def wrapper(*args, **kwargs):
        with matplotlib.rc_context({"text.parse_math": False}):
            return draw(*args, **kwargs)
    return wrapper


def rule_colour(rule: str, registry=None) -> str:
    """A stable colour per rule: grey for the keep-everything op; otherwise the palette entry at the rule's
    place among the registered rule names in sorted order (a name no plugin registers: a palette entry picked
    by a checksum of the name), so a rule keeps its colour across figures and no plugin is named here."""
    if rule == FULL_RULE:
        return FULL_COLOUR
    if registry is None:
        registry = get_registry()
    names = [n for n in registry.names("rule") if n != FULL_RULE]
    index = names.index(rule) if rule in names else zlib.crc32(rule.encode())
    return PALETTE[index % len(PALETTE)]


def budget_ratio(budget) -> float | None:
    """The compression of a budget written ``8x`` (or ``8``), else None (a byte or token budget has no one ratio)."""
    text = str(budget).strip().lower().removesuffix("x")
    try:
        value = float(text)
    except ValueError:
        return None
    return value if value > 0 else None


@_plain_text
def score_vs_memory(points: Sequence[dict], path: str, *, title: str, full: dict | None = None) -> str:
    """One line per plan: accuracy (Wilson 95% bars) against mean measured KV bytes.

    Parameters
    ----------
    points : sequence of dict
        ``method`` (the line a point belongs to: one legend entry each), ``budget``, ``bytes`` (mean measured
        bytes held), ``full_bytes`` (a 16-bit full cache of the same contexts: where the budget's tick goes),
        ``k`` correct, ``n`` items.
    full : dict, optional
        The full-cache point (``bytes``, ``k``, ``n``), drawn as a star and a dashed accuracy line.
    """
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    methods = list(dict.fromkeys(p["method"] for p in points))
    markers = "osD^vP*X<>"
    for i, m in enumerate(methods):
        pts = sorted((p for p in points if p["method"] == m), key=lambda p: p["bytes"])
        x = np.array([p["bytes"] for p in pts]) / 2 ** 20
        iv = [stats.wilson_interval(p["k"], p["n"]) for p in pts]
        y = np.array([v.estimate for v in iv])
        err = np.array([[v.estimate - v.low for v in iv], [v.high - v.estimate for v in iv]])
        err = np.clip(err, 0.0, None)  # at 0/n or n/n a bound equals the estimate up to rounding
        ax.errorbar(x, y, yerr=err, marker=markers[i % len(markers)], capsize=3, label=m, linewidth=1.4)
    if full is not None:
        fiv = stats.wilson_interval(full["k"], full["n"])
        ax.axhline(fiv.estimate, color="black", linestyle="--", linewidth=0.8)
        ax.plot([full["bytes"] / 2 ** 20], [fiv.estimate], marker="*", markersize=13, color="black",
                linestyle="none", label="full cache")
    ax.set_xscale("log")
    plain = matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}")
    ax.xaxis.set_major_formatter(plain)
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ticks = {}
    for p in points:
        ratio = budget_ratio(p["budget"])
        if ratio and p.get("full_bytes"):
            ticks.setdefault(f"{ratio:g}x", p["full_bytes"] / ratio / 2 ** 20)
    if ticks:
        top = ax.secondary_xaxis("top")
        top.set_xticks(list(ticks.values()), labels=list(ticks))
        top.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        top.set_xlabel("budget (compression of a 16-bit full cache)", fontsize=8)
    ax.set_xlabel("measured bytes held after compressing the context (MiB, log scale)")
    ax.set_ylabel("accuracy (Wilson 95% interval)")
    ax.set_ylim(-0.03, 1.03)
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    return _save(fig, path)


@_plain_text
def placement_distribution(random_scores: Sequence[float], guided: float, path: str, *, title: str,
                           metric: str, higher_is_better: bool = True) -> str:
    """Histogram of the random placements' scores with the guided route's score marked.

    Parameters
    ----------
    random_scores : sequence of float
        Score of each count-matched random placement on ``metric``.
    guided : float
        The guided route's score, drawn as a vertical line.
    metric : str
        What the scores are (axis label), e.g. ``top-1 accuracy`` or ``mean KL (lower is better)``.
    """
    fig, ax = plt.subplots(figsize=(6.5, 4.0))
    values = np.asarray(random_scores, float)
    bins = min(30, max(5, int(np.sqrt(values.size)) * 2))
    ax.hist(values, bins=bins, color="#9ecae1", edgecolor="#3182bd", label=f"{values.size} random placements")
    ax.axvline(guided, color="#d62728", linewidth=2.0, label=f"guided route ({guided:.3g})")
    ax.set_xlabel(f"{metric} ({'higher' if higher_is_better else 'lower'} is better)")
    ax.set_ylabel("placements")
    ax.yaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    return _save(fig, path)


@_plain_text
def route_strip(rows: Sequence[dict], path: str, *, context_tokens: int, title: str) -> str:
    """Per-layer route strips, one row per policy: rule colour, capacity bar, K/V bits.

    Parameters
    ----------
    rows : sequence of dict
        ``name`` and ``layers``: per layer a dict with ``rule`` (the prefill rule, else the decode rule),
        ``kept`` (tokens kept after the context) and ``k_bits``/``v_bits``.
    context_tokens : int
        T, the full height of a bar.
    """
    n = len(rows)
    L = max(len(r["layers"]) for r in rows)
    fig, axes = plt.subplots(n, 1, figsize=(max(7.0, 0.33 * L + 2.5), 1.05 * n + 0.9), squeeze=False)
    rules = []
    for ax, row in zip(axes[:, 0], rows):
        for i, lay in enumerate(row["layers"]):
            frac = min(1.0, lay["kept"] / max(context_tokens, 1))
            ax.bar(i, frac, width=0.85, color=rule_colour(lay["rule"]), edgecolor="black", linewidth=0.3)
            ax.bar(i, 1.0 - frac, bottom=frac, width=0.85, color="none", edgecolor="#dddddd", linewidth=0.3)
            if lay["k_bits"] != 16 or lay["v_bits"] != 16:
                ax.text(i, 0.5, f"{lay['k_bits']}/{lay['v_bits']}", ha="center", va="center", fontsize=5.5,
                        rotation=90)
            rules.append(lay["rule"])
        ax.set_xlim(-0.6, L - 0.4)
        ax.set_ylim(0, 1)
        ax.set_yticks([0, 0.5, 1], labels=["0", "T/2", "T"], fontsize=6)
        ax.set_ylabel(row["name"], rotation=0, ha="right", va="center", fontsize=8)
        ax.set_xticks(range(L))
        ax.tick_params(axis="x", labelsize=6)
    axes[-1, 0].set_xlabel("layer (bar height = tokens kept of the context T; text = K/V bits where quantized; "
                           "an allocator plan: the tokens it kept, from the measured bytes)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=rule_colour(r)) for r in dict.fromkeys(rules)]
    fig.legend(handles, list(dict.fromkeys(rules)), loc="upper right", fontsize=7, ncol=min(6, len(handles)))
    fig.suptitle(title, fontsize=10, x=0.02, ha="left")
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    return _save(fig, path)


@_plain_text
def sensitivity_heatmap(table: np.ndarray, labels: Sequence[str], path: str, *, title: str,
                        stat: tuple[np.ndarray, Sequence[str], str] | None = None) -> str:
    """Heatmap of a profile's metric table [L, C] (log10), and optionally a statistic table [L, R]."""
    ncols = 2 if stat is not None else 1
    main_w = min(14.0, max(6.0, 0.13 * len(labels)))
    widths = [main_w, 2.2] if stat is not None else [main_w]
    fig, axes = plt.subplots(1, ncols, figsize=(sum(widths) + 1.5, 0.2 * table.shape[0] + 2.6),
                             gridspec_kw={"width_ratios": widths}, squeeze=False)
    ax = axes[0, 0]
    positive = table[table > 0]
    floor = float(positive.min()) / 10 if positive.size else 1e-8  # zero losses (full configs) sit just below
    data = np.log10(np.clip(table, floor, None))
    im = ax.imshow(data, aspect="auto", cmap="viridis", interpolation="nearest")
    ax.set_ylabel("layer")
    if len(labels) <= 80:
        ax.set_xticks(range(len(labels)))
        ax.set_xticklabels(labels, rotation=90, fontsize=4.5)
    else:  # too many configs to name one by one: mark where each rule's block starts
        starts = [i for i, lab in enumerate(labels) if i == 0 or lab.split("@")[0] != labels[i - 1].split("@")[0]]
        ax.set_xticks(starts)
        ax.set_xticklabels([labels[i].split("@")[0] for i in starts], rotation=90, fontsize=7)
        ax.set_xlabel(f"{len(labels)} configs (rule @ keep / phase / K V bits), grouped by rule")
    ax.set_title(title, fontsize=9)
    fig.colorbar(im, ax=ax, label="log10 loss (lower is better)", fraction=0.03)
    if stat is not None:
        values, columns, name = stat
        ax2 = axes[0, 1]
        im2 = ax2.imshow(values, aspect="auto", cmap="magma", interpolation="nearest")
        ax2.set_xticks(range(len(columns)))
        ax2.set_xticklabels(columns, rotation=90, fontsize=7)
        ax2.set_title(name, fontsize=9)
        fig.colorbar(im2, ax=ax2, fraction=0.08)
    fig.tight_layout()
    return _save(fig, path)


FIGURE_SOFTWARE = "polykv report"
"""The PNG ``Software`` text every report figure carries: how a later report knows the file is its own."""


def _save(fig, path: str) -> str:
    """Write ``fig`` atomically in the format its extension names (``png``, ``svg`` or ``pdf``), at the
    ``savefig.dpi`` in force, marked as polykv's own (:func:`is_report_figure`)."""
    fmt = os.path.splitext(path)[1].lstrip(".").lower() or "png"
    meta = {"Software": FIGURE_SOFTWARE} if fmt == "png" else {"Creator": FIGURE_SOFTWARE}
    if fmt == "svg":
        meta["Date"] = None  # the same figure gives the same file
    try:
        replace_with(path, lambda tmp: fig.savefig(tmp, format=fmt, metadata=meta))
    finally:
        plt.close(fig)
    return path


def is_report_figure(path: str) -> bool:
    """True when ``path`` is a figure a polykv report wrote: a PNG with its ``Software`` text chunk (before the
    image data), an SVG whose metadata names it as creator, or a PDF whose information dictionary does."""
    with open(path, "rb") as fh:
        head = fh.read(8)
        if head == b"\x89PNG\r\n\x1a\n":
            return _png_is_ours(fh)
        if head.startswith(b"%PDF-"):
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - (1 << 20)))  # the information dictionary sits before the xref table
            return b"/Creator (" + FIGURE_SOFTWARE.encode() + b")" in fh.read()
        if head.startswith(b"<?xml"):
            text = head + fh.read(8192)
            return b"<svg" in text and b"<dc:title>" + FIGURE_SOFTWARE.encode() + b"</dc:title>" in text
    return False


def _png_is_ours(fh) -> bool:
    want = b"Software\0" + FIGURE_SOFTWARE.encode()
    for _ in range(64):
        head = fh.read(8)
        if len(head) < 8:
            return False
        size, kind = struct.unpack(">I4s", head)
        if kind in (b"IDAT", b"IEND") or size > 1 << 20:
            return False
        body = fh.read(size)
        fh.read(4)  # CRC
        if kind == b"tEXt" and body == want:
            return True
    return False
