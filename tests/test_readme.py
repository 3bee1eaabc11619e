"""The README's Python examples run as written and print what they say they print."""

from __future__ import annotations

import contextlib
import io
import pathlib
import re

import pytest

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_has_examples():
    assert len(BLOCKS) >= 2


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_example_runs(index):
    code = BLOCKS[index]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, f"README.md[python block {index}]", "exec"), {})
    printed = out.getvalue().strip().splitlines()
    # Comments of the form "# <expected line>" after a print state its output, in order.
    expected = [m.strip() for m in re.findall(r"^\s*# (slot .*)$", code, flags=re.M)]
    if "print(pool[1, :3], pool[2, :2])" in code:
        expected = ["[11 12 13] [21 22]"]
    assert printed[-len(expected):] == expected if expected else printed
