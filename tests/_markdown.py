"""The fenced code blocks of the README and the docs pages, and the marker comment before each.

A block is runnable when the line before its ```` ```python ```` fence (blank lines between
allowed) is an HTML comment: ``<!-- runnable -->`` (this package only), ``<!-- runnable: torch
-->`` (needs torch and SGLang 0.5.23), ``<!-- runnable: sglang_jax -->`` (needs sglang-jax
0.0.2), ``<!-- runnable: sglang_jax_01 -->`` (needs sglang-jax 0.1.0rc0) or
``<!-- runnable: tpu_inference -->`` (needs tpu-inference and vllm-tpu);
``<!-- fragment -->`` marks code that does not run alone. docs/testing.md ("Runnable examples")
documents the markers; tests/test_docs.py runs the runnable blocks and tests/test_readme.py holds
the README to them."""

from __future__ import annotations

import dataclasses
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PYTHON_LANGUAGES = ("python", "py", "python3")
MARKER = re.compile(r"<!-- (?P<kind>runnable|fragment)(?:: *(?P<needs>[\w, ]+))? -->")
FENCE = re.compile(r"^(?P<ticks>`{3,})(?P<info>.*)$")


@dataclasses.dataclass(frozen=True)
class Block:
    page: pathlib.Path
    line: int  # the fence's, 1-based
    language: str
    code: str
    marker: str | None  # "runnable", "fragment" or None
    needs: tuple[str, ...]

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"

    @property
    def is_python(self) -> bool:
        return self.language in PYTHON_LANGUAGES


def pages() -> list[pathlib.Path]:
    return [README, *sorted(DOCS.rglob("*.md"))]


def blocks(page: pathlib.Path) -> list[Block]:
    """The fenced blocks of a Markdown page, each with the marker comment right before it (a
    fence inside another, as in a page that shows Markdown, is the outer block's text)."""
    lines = page.read_text(encoding="utf-8").splitlines()
    out, i, marker, needs = [], 0, None, ()
    while i < len(lines):
        line = lines[i]
        mark = MARKER.fullmatch(line.strip())
        fence = FENCE.match(line)
        if mark:
            marker = mark.group("kind")
            needs = tuple(n.strip() for n in (mark.group("needs") or "").split(",") if n.strip())
        elif fence:
            ticks, start = fence.group("ticks"), i
            i += 1
            while i < len(lines) and lines[i].rstrip() != ticks:
                i += 1
            language = fence.group("info").strip().split(" ")[0]
            out.append(Block(page, start + 1, language, "\n".join(lines[start + 1:i]) + "\n",
                             marker, needs))
            marker, needs = None, ()
        elif line.strip():
            marker, needs = None, ()  # a marker applies to the fence right after it
        i += 1
    return out


def stated_output(code: str) -> list[str]:
    """Lines the example states it prints: a trailing ``# ...`` on a print() line, or, where no
    print line has one, the comment lines that follow the last print() (one per printed line)."""
    lines = code.splitlines()
    out = [line.rsplit("#", 1)[1].strip() for line in lines
           if "print(" in line and "#" in line.split("print(", 1)[1]]
    if not out:
        printing = [i for i, line in enumerate(lines) if "print(" in line]
        if printing:
            out = [ln.strip()[2:] for ln in lines[printing[-1] + 1:] if ln.strip().startswith("# ")]
    return out
