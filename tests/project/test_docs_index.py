"""docs/README.md is the index of docs/: each page is listed exactly once, and no entry names a page that
is not there."""

from __future__ import annotations

import re

from harness import ROOT


def test_the_docs_index_lists_every_page_once():
    index = (ROOT / "docs" / "README.md").read_text()
    listed = re.findall(r"^- \[[^\]]+\]\(([^)#]+\.md)\)", index, flags=re.MULTILINE)
    pages = sorted(p.name for p in (ROOT / "docs").glob("*.md") if p.name != "README.md")
    assert sorted(listed) == pages


def test_the_readme_names_every_docs_page():
    """The README's documentation paragraph links each page of docs/ (a new page is easy to leave out of it)."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Documentation", 1)[1]
    linked = set(re.findall(r"\]\(docs/([^)#]+\.md)\)", section))
    pages = {p.name for p in (ROOT / "docs").glob("*.md")}
    assert linked == pages, sorted(pages ^ linked)
