"""The runnable examples of the README and the docs run as written, each in a fresh Python
process (``JAX_PLATFORMS=cpu``, a timeout), and print what their comments say they print.

Which blocks are runnable, and what they need, is said by a comment before each fence
(tests/_markdown.py; docs/testing.md, "Runnable examples"): those that need torch and SGLang
carry the ``torch`` marker (the Python 3.11 leg), those that need sglang-jax the ``sglang_jax``
marker (deselected where it is not installed) and the version's (``sglang_jax_002`` or
``sglang_jax_01``: deselected where the other version is installed), and those that need
tpu-inference the ``tpu_inference`` marker (deselected where it is not installed). Every
Python block carries a marker, so that no
example goes untested by omission; the docs include the README's examples (pymdownx.snippets)
rather than copying them, so each runs once.

Also here: the serving page's flags table names every field, flag and environment variable of
:class:`kvcanary_jax.runtime.ManagerConfig` (a new setting fails here until the table has its row), and the docs include the README's sections that
they say they do."""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import subprocess
import sys

import pytest

import _markdown as md

# What a block needs -> its markers: "sglang_jax" is sglang-jax 0.0.2 (the README's wiring),
# "sglang_jax_01" sglang-jax 0.1.0rc0 (tests/conftest.py deselects each where the other version is
# installed).
NEEDS = {"torch": (pytest.mark.torch,),
         "sglang_jax": (pytest.mark.sglang_jax, pytest.mark.sglang_jax_002),
         "sglang_jax_01": (pytest.mark.sglang_jax, pytest.mark.sglang_jax_01),
         "tpu_inference": (pytest.mark.tpu_inference,)}
PYTHON = [b for page in md.pages() for b in md.blocks(page) if b.is_python]
RUNNABLE = [b for b in PYTHON if b.marker == "runnable"]
# A fresh process imports JAX (and torch and SGLang, or sglang-jax) and compiles the example.
TIMEOUT_S = 300


def test_every_python_block_is_marked():
    unmarked = [b.where for b in PYTHON if b.marker is None]
    assert unmarked == [], ("a ```python block needs <!-- runnable -->, <!-- runnable: torch -->, "
                            "<!-- runnable: sglang_jax -->, <!-- runnable: sglang_jax_01 -->, <!-- runnable: tpu_inference --> or "
                            "<!-- fragment --> before it")
    unknown = [f"{b.where}: {n}" for b in PYTHON for n in b.needs if n not in NEEDS]
    assert unknown == []


def test_the_examples_are_found():
    """The README's three smallest uses and the docs' own examples (a changed marker or fence
    syntax would find none, and the test below would pass on nothing)."""
    readme = sorted(b.needs for b in RUNNABLE if b.page == md.README)
    assert readme == [(), ("sglang_jax",), ("torch",)]
    assert {b.page.name for b in RUNNABLE} >= {"README.md", "getting-started.md", "serving.md",
                                                "torch.md", "tpu-inference.md"}
    assert [b.needs for b in RUNNABLE if b.page.name == "tpu-inference.md"] == [
        ("tpu_inference",)]


def test_the_docs_include_readme_sections_that_exist():
    readme = md.README.read_text(encoding="utf-8")
    included = {m.group(1) for page in md.DOCS.rglob("*.md")
                for m in re.finditer(r'^--8<-- "README\.md:([\w-]+)"$',
                                     page.read_text(encoding="utf-8"), flags=re.M)}
    assert included >= {"jax-example", "torch-example", "sglang-jax-example", "test-commands"}
    for name in included:
        start, end = f"<!-- --8<-- [start:{name}] -->", f"<!-- --8<-- [end:{name}] -->"
        assert readme.count(start) == 1 and readme.count(end) == 1, name
        assert readme.index(start) < readme.index(end), name


def _param(block: md.Block):
    return pytest.param(block, marks=[m for n in block.needs if n in NEEDS for m in NEEDS[n]],
                        id=block.where)


@pytest.mark.parametrize("block", [_param(b) for b in RUNNABLE])
def test_example_runs_and_prints_what_it_says(block):
    expected = md.stated_output(block.code)
    assert expected, f"{block.where}: a runnable example states its output"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", block.code], cwd=md.ROOT, env=env,
                          capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, f"{block.where} failed:\n{proc.stderr[-4000:]}"
    assert proc.stdout.strip().splitlines() == expected, block.where


def test_the_serving_page_names_every_flag_field_and_variable():
    from kvcanary_jax.runtime import ManagerConfig
    from kvcanary_jax.runtime import config

    parser = argparse.ArgumentParser()
    config.add_arguments(parser)
    flags = set(re.findall(r"--kv-canary[\w-]*", parser.format_help()))
    names = ({f.name for f in dataclasses.fields(ManagerConfig)} | flags
             | set(config.ENV_VARS.values()) | set(config.OUR_ENV_VARS.values()))
    assert len(flags) >= 5 and len(names) >= 18  # the fields, flags and variables were found
    page = (md.DOCS / "serving.md").read_text(encoding="utf-8")
    section = page.split("## Flags and environment variables", 1)[1].split("\n## ", 1)[0]
    table = "\n".join(line for line in section.splitlines() if line.startswith("| "))
    assert sorted(n for n in names if f"`{n}" not in table) == []
