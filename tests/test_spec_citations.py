"""Every ``docs/spec.md §N`` a source file cites names a section that docs/spec.md has, and no
file cites a document the repository does not ship (a user's clone has only what is tracked)."""

from __future__ import annotations

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SPEC = ROOT / "docs" / "spec.md"
SOURCES = sorted(p for d in ("kvcanary_jax", "bridge", "bench", "tests")
                 for p in (ROOT / d).rglob("*.py"))
# "docs/spec.md §8, §11.2, §11.3": the first section after the file name, then any that follow it.
CITATION = re.compile(r"docs/spec\.md((?:,?\s*§\d+(?:\.\d+)?)+)")


def _sections() -> set[str]:
    text = SPEC.read_text(encoding="utf-8")
    return set(re.findall(r"^#{2,3} (\d+(?:\.\d+)?)\.? ", text, flags=re.M))


def test_spec_has_its_sections():
    # The sections the package's docstrings are written against (hand-listed, so that a renumbered
    # spec fails here rather than leaving citations that silently point elsewhere).
    assert {"2.4", "2.5", "3.2", "8", "9", "10", "11.2", "11.3", "13", "14.1", "15"} <= _sections()


def test_citations_point_to_sections():
    sections = _sections()
    cited, bad = 0, []
    for path in SOURCES:
        for match in CITATION.finditer(path.read_text(encoding="utf-8")):
            for sec in re.findall(r"§(\d+(?:\.\d+)?)", match.group(1)):
                cited += 1
                if sec not in sections:
                    bad.append(f"{path.relative_to(ROOT)}: §{sec}")
    assert cited >= 10, cited  # the scan finds the citations (a changed pattern would find none)
    assert not bad, bad


@pytest.mark.parametrize("pattern", [r"\bspec section \d", r"\(spec §", r"\bDESIGN\.md\b"])
def test_no_citation_of_unshipped_documents(pattern):
    hits = [f"{p.relative_to(ROOT)}:{i + 1}" for p in SOURCES if p != pathlib.Path(__file__)
            for i, line in enumerate(p.read_text(encoding="utf-8").splitlines())
            if re.search(pattern, line)]
    assert not hits, hits
