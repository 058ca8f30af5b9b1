"""The README and the docs hold together: every relative link (and image) in ``README.md`` and
``docs/**/*.md`` names a file or folder that exists, every ``#anchor`` names a heading of the
file it points at, and the README stays short (its map sends the rest to ``docs/``)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
README_MAX_LINES = 220

# [text](target) and ![alt](target); a target ends at whitespace or ')'; an optional title
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^(```|~~~)")


def _unfenced(text: str) -> list[str]:
    """``text``'s lines outside fenced code blocks."""
    out, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line.lstrip()):
            fenced = not fenced
            continue
        if not fenced:
            out.append(line)
    return out


def _prose(text: str) -> str:
    """``text`` without code: fenced blocks and inline spans (their brackets are code)."""
    return "\n".join(re.sub(r"`[^`]*`", "", line) for line in _unfenced(text))


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    h = re.sub(r"`", "", heading.strip().lower())
    h = re.sub(r"[^\w\- ]", "", h)
    return h.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in _unfenced(page.read_text()):
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        a = _anchor(m.group(1))
        k = seen.get(a, 0)
        seen[a] = k + 1
        out.add(a if k == 0 else f"{a}-{k}")
    return out


def _links(page: Path) -> list[str]:
    return LINK.findall(_prose(page.read_text()))


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_relative_links_resolve(page: Path) -> None:
    bad = []
    for target in _links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            bad.append(f"{target}: no such file")
            continue
        if ROOT not in dest.parents and dest != ROOT:
            bad.append(f"{target}: outside the repository")
            continue
        if anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            bad.append(f"{target}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    assert not bad, f"{page.relative_to(ROOT)}: {bad}"


def test_readme_is_short_and_maps_the_docs() -> None:
    readme = ROOT / "README.md"
    lines = readme.read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines"
    linked = {(readme.parent / t.partition("#")[0]).resolve() for t in _links(readme)}
    unmapped = [
        str(p.relative_to(ROOT))
        for p in sorted((ROOT / "docs").glob("*.md"))
        if p.resolve() not in linked
    ]
    assert not unmapped, f"docs not in the README's map: {unmapped}"


def test_no_machine_paths_in_docs() -> None:
    bad = [
        f"{p.relative_to(ROOT)}:{i}"
        for p in PAGES
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if re.search(r"(?<![\w.])/(work|home|Users)/", line)
    ]
    assert not bad, bad
