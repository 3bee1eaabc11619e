"""The README's Python examples run as written and print what their comments say they print.

Examples that import sglang-jax (``sgl_jax``: Python >= 3.12) are marked ``sglang_jax``: they run
in the Python 3.12 CI leg, which installs it, and are deselected where it is not installed.
Examples that import the torch bridge are marked ``torch``: they run in the Python 3.11 leg."""

from __future__ import annotations

import contextlib
import io
import pathlib
import re

import pytest

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def _stated_output(code: str) -> list[str]:
    """Lines the example states it prints: a trailing ``# ...`` on a print() line, or the
    comment lines that follow the last print() (one per printed line)."""
    lines = code.splitlines()
    out = []
    for i, line in enumerate(lines):
        if "print(" in line and "#" in line.split("print(", 1)[1]:
            out.append(line.rsplit("#", 1)[1].strip())
    if not out:
        last = max(i for i, line in enumerate(lines) if "print(" in line)
        out = [ln.strip()[2:] for ln in lines[last + 1:] if ln.strip().startswith("# ")]
    return out


def test_readme_has_examples():
    assert len(BLOCKS) >= 2


def _param(index: int):
    needs = ("sgl_jax" in BLOCKS[index]) * [pytest.mark.sglang_jax]
    # The torch bridge's examples need torch and SGLang 0.5.23 (the Python 3.11 leg).
    needs += ("kvcanary_jax.bridge" in BLOCKS[index]) * [pytest.mark.torch]
    return pytest.param(index, marks=needs, id=str(index))


@pytest.mark.parametrize("index", [_param(i) for i in range(len(BLOCKS))])
def test_readme_example_runs_and_prints_what_it_says(index):
    code = BLOCKS[index]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, f"README.md[python block {index}]", "exec"), {})
    expected = _stated_output(code)
    assert expected, "each README example states its output"
    assert out.getvalue().strip().splitlines() == expected
