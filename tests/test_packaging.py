"""What ``pip install .`` installs: one top-level import name, ``kvcanary_jax``.

The torch bridge and the benchmark keep their folders at the top of the checkout (``bridge/``,
``bench/``) and install as ``kvcanary_jax.bridge`` and ``kvcanary_jax.bench`` (pyproject's
``package-dir``), so that site-packages gets no generic ``bridge`` or ``bench`` that would clash
with another project's. Everything imports them by those names only: a module loaded under two
names is two modules (two caches, two ``BridgeError`` classes)."""

from __future__ import annotations

import ast
import os
import pathlib
import re
import subprocess
import sys
import tomllib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
FOLDERS = {"kvcanary_jax.bridge": "bridge", "kvcanary_jax.bench": "bench"}
SOURCE_DIRS = ("kvcanary_jax", "bridge", "bench", "tests")


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))


def _packages_under(folder: pathlib.Path, name: str) -> set[str]:
    return {".".join([name, *p.parent.relative_to(folder).parts])
            for p in folder.rglob("__init__.py")}


def test_the_wheel_lists_every_package_folder_under_kvcanary_jax():
    """The explicit package list (package-dir and ``packages.find`` do not combine) names every
    folder with an ``__init__.py`` (a new subpackage missing from it would be left out of the
    wheel, silently), and nothing installs outside kvcanary_jax."""
    tool = _pyproject()["tool"]["setuptools"]
    assert tool["package-dir"] == FOLDERS
    found = _packages_under(ROOT / "kvcanary_jax", "kvcanary_jax")
    for name, folder in FOLDERS.items():
        found |= _packages_under(ROOT / folder, name)
    assert sorted(tool["packages"]) == sorted(found)
    assert {p.split(".")[0] for p in tool["packages"]} == {"kvcanary_jax"}
    assert "tuning/*.json" in tool["package-data"]["kvcanary_jax"]


def _sources():
    for d in SOURCE_DIRS:
        yield from sorted((ROOT / d).rglob("*.py"))


def test_no_source_imports_the_folders_by_their_own_names():
    """Every import of the bridge and the bench, in any form (import statements, module names
    built as strings, code and ``-m`` command lines run in subprocesses, the examples of the
    README and the docs, the GPU session's steps), goes through kvcanary_jax."""
    bad = []
    as_string = re.compile(r"""(import_module\(\s*f?|["']-m["'],\s*)["'](bridge|bench)\b""")
    # Code in strings (``python -c``): an import statement naming a folder at the top level.
    in_code = re.compile(r"\b(import [\w.]+(, *[\w.]+)*|from [\w.]+ import)")
    for path in _sources():
        text = path.read_text(encoding="utf-8")
        rel = path.relative_to(ROOT)
        tree = ast.parse(text)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            else:
                continue
            bad += [f"{rel}:{node.lineno}: {n}" for n in names
                    if n.split(".")[0] in FOLDERS.values()]
        if path == pathlib.Path(__file__).resolve():  # this file runs `-m bench` on purpose
            continue
        bad += [f"{rel}: {m.group(0)}" for m in as_string.finditer(text)]
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                for m in in_code.finditer(node.value):
                    words = re.findall(r"[\w.]+", m.group(0).replace(" as ", " "))[1:]
                    if any(w.split(".")[0] in FOLDERS.values() for w in words if w != "import"):
                        bad.append(f"{rel}:{node.lineno}: {m.group(0)!r} in a string")
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        bad += [f"{page.relative_to(ROOT)}: {m.group(0)}"
                for m in re.finditer(r"(?m)^\s*(import|from) (bridge|bench)\b.*$",
                                     page.read_text(encoding="utf-8"))]
    script = (ROOT / "bench" / "gpu_session.sh").read_text(encoding="utf-8")
    bad += [f"bench/gpu_session.sh: {m.group(0)}"
            for m in re.finditer(r"python3? (-m (bench|bridge)\b|(bench|bridge)/\w+\.py)", script)]
    assert bad == []


def _python(code_or_args, *, cwd, timeout=300):
    args = ["-c", code_or_args] if isinstance(code_or_args, str) else code_or_args
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


LOADED_UNDER_FOLDER_NAMES = ("import sys; print(sorted(m for m in sys.modules "
                             "if m.split('.')[0] in ('bridge', 'bench')))")


def test_the_bench_and_the_command_line_load_every_module_once():
    """From the checkout's root, where the folders are importable by their own names too,
    importing the bench and the command line loads nothing under those names."""
    proc = _python("import kvcanary_jax.bench.run, kvcanary_jax.bench.cpu, "
                   "kvcanary_jax.testing.cases, kvcanary_jax.cli; " + LOADED_UNDER_FOLDER_NAMES,
                   cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "[]"


@pytest.mark.torch
def test_the_bridge_and_its_benchmarks_load_every_module_once():
    proc = _python("import kvcanary_jax.bridge, kvcanary_jax.bench.bridge_overhead, "
                   "kvcanary_jax.bench.op_bridge, kvcanary_jax.bench.sanitize_cases; "
                   + LOADED_UNDER_FOLDER_NAMES, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "[]"


def test_import_bridge_by_its_folder_name_says_what_to_import():
    proc = _python("import bridge", cwd=ROOT)
    assert proc.returncode == 1
    assert proc.stderr.rstrip().splitlines()[-1] == (
        "ImportError: the torch bridge is kvcanary_jax.bridge, not 'bridge': "
        "`import kvcanary_jax.bridge as bridge` (from a checkout, after `pip install -e .`)")


@pytest.mark.parametrize("args,cwd,prog", [
    (["-m", "bench", "--help"], "root", "python -m bench"),
    (["-m", "kvcanary_jax.bench", "--help"], "elsewhere", "python -m kvcanary_jax.bench"),
    (["-m", "bench.cpu", "--help"], "root", "python -m bench.cpu"),
])
def test_the_bench_runs_as_the_readme_types_it(args, cwd, prog, tmp_path):
    """``python -m bench[.<module>]`` from the checkout's root (the docs' performance page and
    bench/NOTES.md type it) and ``python -m kvcanary_jax.bench`` from anywhere."""
    proc = _python(args, cwd=ROOT if cwd == "root" else tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith(f"usage: {prog} "), proc.stdout[:300]
    page = ROOT / "docs" / "performance.md"
    assert "`python -m bench [options]`" in page.read_text(encoding="utf-8")


def test_python_m_bench_refuses_a_checkout_that_is_not_the_installed_one(tmp_path):
    """Another checkout's ``bench/`` (here a copy of this one's package marker) run from its root
    while this checkout is the installed one: an error naming both folders, before any of the
    installed checkout's modules runs under the other's name."""
    other = tmp_path / "bench"
    other.mkdir()
    (other / "__init__.py").write_text((ROOT / "bench" / "__init__.py").read_text())
    proc = _python(["-m", "bench", "--help"], cwd=tmp_path)
    assert proc.returncode == 1
    last = proc.stderr.rstrip().splitlines()[-1]
    assert last == (
        f"ImportError: python -m bench runs this checkout's benchmark as kvcanary_jax.bench, "
        f"which resolves to {ROOT / 'bench'}, not {other}: install the checkout (pip install -e "
        f"{tmp_path}), or run python -m kvcanary_jax.bench"), last


def test_the_bench_command_without_the_install_says_how_to_get_it():
    """kvcanary_jax put on the path without being installed (here: this process's editable
    finder removed) has no kvcanary_jax.bench: ``kvcanary-jax bench`` says so and how to install,
    instead of a traceback."""
    code = ("import sys; sys.meta_path[:] = [f for f in sys.meta_path if not "
            "getattr(f, '__module__', '').startswith('__editable__')]; "
            "from kvcanary_jax import cli; sys.exit(cli._run_bench(['--help']))")
    proc = _python(code, cwd=ROOT)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip() == (
        f"kvcanary-jax bench: kvcanary_jax.bench is not importable here (kvcanary_jax from "
        f"{ROOT / 'kvcanary_jax'}); install kvcanary-jax (from a checkout: pip install -e .)")
    assert proc.stdout == ""
