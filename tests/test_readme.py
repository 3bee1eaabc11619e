"""The README leads with use, and everything it shows runs.

- Its Python examples (the smallest JAX use, the smallest torch / SGLang drop-in, the smallest
  sglang-jax wiring) are marked runnable, so tests/test_docs.py runs each in a fresh process and
  checks that it prints what its comments say: the examples that import sglang-jax (Python >=
  3.12) are marked ``sglang_jax`` and those that import the torch bridge ``torch``.
- Its test command (the fast tier) stays between its markers, where ``.ci/run`` finds it, and so
  do the other tiers' in docs/testing.md: every marker a CI leg names gives one command, found in
  one place.
- It stays short, its relative links point at files of the checkout, and it carries no timing
  figures (dated measurements live in bench/NOTES.md and bench/results/, which the docs cite)."""

from __future__ import annotations

import re
import subprocess

import pytest

import _markdown as md

TEXT = md.README.read_text(encoding="utf-8")
BLOCKS = md.blocks(md.README)
CI = md.ROOT / ".ci" / "run"
TESTING = md.DOCS / "testing.md"  # the other tiers' commands
# The smallest uses, by section, and what each example needs besides this package.
SMALLEST = {
    "## The smallest JAX use": (),
    "## The smallest torch / SGLang drop-in": ("torch",),
    "## The smallest sglang-jax wiring": ("sglang_jax",),
}


def _sections() -> dict[str, str]:
    parts = re.split(r"(?m)^(## .*)$", TEXT)
    return dict(zip(parts[1::2], parts[2::2]))


def test_readme_examples_are_runnable_and_state_their_output():
    python = [b for b in BLOCKS if b.is_python]
    assert len(python) >= 3
    for block in python:
        assert block.marker == "runnable", block.where
        assert md.stated_output(block.code), f"{block.where}: each README example states its output"
        # What the example imports decides where it can run: the marker must say so.
        assert ("sglang_jax" in block.needs) == ("sgl_jax" in block.code), block.where
        assert ("torch" in block.needs) == ("kvcanary_jax.bridge" in block.code), block.where


@pytest.mark.parametrize("heading", list(SMALLEST))
def test_each_smallest_use_has_its_runnable_example(heading):
    assert heading in _sections()
    runnable = [b for b in BLOCKS if b.is_python and b.marker == "runnable"
                and _section_of(b.line) == heading]
    assert [b.needs for b in runnable] == [SMALLEST[heading]]


def _section_of(line: int) -> str | None:
    heading = None
    for text in TEXT.splitlines()[:line]:
        if text.startswith("## "):
            heading = text
    return heading


def _ci_markers() -> list[str]:
    """Every command marker a leg of .ci/run names (``leg <name> <python> <marker>...``; a
    ``fresh:`` marker runs in a fresh venv)."""
    markers = []
    for line in CI.read_text(encoding="utf-8").splitlines():
        words = re.split(r"\|\||&", line)[0].split()
        if words[:1] == ["leg"]:
            markers += [w.removeprefix("fresh:") for w in words[3:]]  # after its name, python
    return markers


def test_ci_finds_every_command_between_its_markers():
    markers = _ci_markers()
    assert {"test-command", "test-command-e2e", "test-command-long", "test-command-py312",
            "test-command-tpu-compile", "docs-command", "test-command-sglang-jax-0.1",
            "test-command-tpu-inference"} <= set(markers)
    assert TEXT.count("<!-- test-command -->") == 1  # the README's test command is the fast tier
    texts = [TEXT, TESTING.read_text(encoding="utf-8")]
    for marker in set(markers):
        # .ci/run's own extraction, run as CI runs it.
        proc = subprocess.run(
            ["bash", "-c", f'source <(sed -n "/^DOCS=/p;/^doc_cmd()/,/^}}/p" .ci/run); '
                           f"doc_cmd {marker}"],
            cwd=md.ROOT, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        lines = proc.stdout.strip().splitlines()
        assert len(lines) == 1 and lines[0].strip(), (marker, lines)
        assert sum(t.count(f"<!-- {marker} -->") for t in texts) == 1, marker
        assert sum(t.count(f"<!-- /{marker} -->") for t in texts) == 1, marker


def test_readme_is_short():
    assert len(TEXT.splitlines()) <= 215


def test_readme_links_resolve():
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", TEXT)
    relative = [link for link in links if "://" not in link]
    assert relative, "the README links to its docs"
    assert [link for link in relative if not (md.ROOT / link).exists()] == []
    assert {link for link in relative if link.startswith("docs/")} >= {
        "docs/serving.md", "docs/sglang-jax.md", "docs/testing.md", "docs/performance.md"}


# Timings in seconds and the hours they were taken in: machine-load figures that went stale with
# every run. The docs cite dated results instead.
TIMING = re.compile(r"\b\d[\d,.]*\s?(?:s|secs?|seconds)\b|\b(?:quick|slow|middling|busy) hours?\b")


@pytest.mark.parametrize("page", [p for p in md.pages() if p.name != "spec.md"],
                         ids=lambda p: str(p.relative_to(md.ROOT)))
def test_no_timing_figures(page):
    hits = [f"{page.name}:{i + 1}: {m.group(0)}"
            for i, line in enumerate(page.read_text(encoding="utf-8").splitlines())
            for m in TIMING.finditer(line)]
    assert hits == []
