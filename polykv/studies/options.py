"""What a reader of a study chooses for its report: figure formats and resolution, and what ranks the placement
control. A module of its own, importing nothing heavy, so the command line can name the choices in its help
without loading matplotlib."""

from __future__ import annotations

from typing import Sequence

from polykv.errors import StudyError

FORMATS = ("png", "svg", "pdf")
"""Figure formats a report writes (``polykv report --format``)."""
DEFAULT_DPI = 130
"""Resolution of raster (PNG) figures, and of the raster parts of SVG/PDF ones."""
PLACEMENT_METRICS = ("top-1", "kl")
"""What ranks the placements: ``top-1`` (the task's score: accuracy, or top-1 agreement with the full cache on a
teacher-forced task; the default) or ``kl`` (mean KL(full || policy), lower is better; teacher-forced tasks only)."""


def parse_formats(value: str | Sequence[str], option: str = "--format") -> tuple[str, ...]:
    """``"svg,pdf"`` (or a list) as distinct known formats in the given order; else a :class:`StudyError`."""
    items = value.split(",") if isinstance(value, str) else list(value)
    items = [str(v).strip().lower() for v in items]
    bad = [v for v in items if v not in FORMATS]
    if bad or not items:
        raise StudyError(f"{option} {','.join(items) if items else repr(value)}: unknown figure format "
                         f"{bad[0] if bad else '(none)'!r}; use one or more of {', '.join(FORMATS)}, comma separated "
                         f"(e.g. {option} svg,pdf)")
    return tuple(dict.fromkeys(items))


def check_dpi(dpi: int, option: str = "--dpi") -> int:
    """A resolution between 10 and 2400 dots per inch; else a :class:`StudyError`."""
    if isinstance(dpi, bool) or not isinstance(dpi, int) or not 10 <= dpi <= 2400:
        raise StudyError(f"{option} {dpi!r}: use a whole number of dots per inch between 10 and 2400 (default "
                         f"{DEFAULT_DPI})")
    return dpi


def check_placement_metric(metric: str) -> str:
    """One of :data:`PLACEMENT_METRICS`; else a :class:`StudyError`."""
    if metric not in PLACEMENT_METRICS:
        raise StudyError(f"placement metric {metric!r}: use one of {', '.join(PLACEMENT_METRICS)} (default top-1)")
    return metric
