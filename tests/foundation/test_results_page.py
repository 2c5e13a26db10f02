"""docs/results.md holds the measured numbers: each section dated, with the commit that measured it and
the command that reproduces it, and every link into it from the other pages lands on a section."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "docs" / "results.md"


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _sections() -> dict[str, str]:
    parts = re.split(r"^## (.+)$", RESULTS.read_text(encoding="utf-8"), flags=re.M)
    return {_slug(title): body for title, body in zip(parts[1::2], parts[2::2])}


def test_every_section_says_when_which_commit_and_how():
    sections = _sections()
    assert sections
    for slug, body in sections.items():
        first = body.strip().split("\n\n")[0]
        assert re.search(r"\*Measured:\* \d{4}-\d{2}-\d{2}", first), f"results.md#{slug} has no measured date"
        assert re.search(r"\bcommits? [0-9a-f]{7,40}\b", first), f"results.md#{slug} names no commit"
        assert "*Reproduce:*" in first, f"results.md#{slug} has no command to reproduce it"


def test_links_into_the_results_page_land_on_a_section():
    sections = _sections()
    pages = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]
    linked = set()
    for page in pages:
        for anchor in re.findall(r"\]\((?:docs/)?results\.md#([^)]+)\)", page.read_text(encoding="utf-8")):
            assert anchor in sections, f"{page.name} links to results.md#{anchor}, which is no section"
            linked.add(anchor)
    assert set(sections) <= linked, f"no page links to results.md#{sorted(set(sections) - linked)}"
