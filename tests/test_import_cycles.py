"""The package has no import circle: the imports of every module it installs (``kvcanary_jax`` and
its subpackages, ``bridge/`` as ``kvcanary_jax.bridge``, ``bench/`` as ``kvcanary_jax.bench``: the
packages and directories ``pyproject.toml`` lists, a list ``tests/test_packaging.py`` checks
names every package folder) form a graph without a cycle.

The graph is read statically: every ``import`` and ``from ... import`` statement of a module's
source (``ast``), at module level *and* inside functions, relative names resolved against the
module's package. A lazy import inside a function is an edge too: it is still a module that needs
another one, and moving an import into a function is how a circle is usually hidden rather than
ended (the runtime's circle ``runtime/__init__ -> manager -> sharded -> runtime`` ran through one).
Imports under ``if TYPE_CHECKING:`` are not edges: they never run.

An edge goes to the module whose code must have run: ``import a.b`` -> ``a.b``;
``from p import name`` -> ``p.name`` when that is a module of the package, else ``p`` (its names
are read). The parent packages Python runs first are not edges: a package's ``__init__`` is
already importing when its own modules import their siblings, so counting it would make every
package that re-exports its modules a circle; a module reading names from its package's
``__init__`` (``from kvcanary_jax import runtime`` inside ``kvcanary_jax.runtime``'s own modules,
say) is one, and is found.
"""

from __future__ import annotations

import ast
import pathlib
import tomllib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def installed_modules(root: pathlib.Path = ROOT) -> dict[str, pathlib.Path]:
    """Module name -> source file, for every package ``pyproject.toml`` installs."""
    setup = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    dirs = setup.get("package-dir", {})
    modules = {}
    for package in setup["packages"]:
        where = root / _package_dir(package, dirs)
        for path in sorted(where.glob("*.py")):
            name = package if path.stem == "__init__" else f"{package}.{path.stem}"
            modules[name] = path
    return modules


def _package_dir(package: str, dirs: dict[str, str]) -> str:
    """Where setuptools finds ``package``: the ``package-dir`` entry of its longest listed prefix
    (``kvcanary_jax.bridge.declarations`` -> ``bridge/declarations``), else its dotted path."""
    parts = package.split(".")
    for n in range(len(parts), 0, -1):
        prefix = ".".join(parts[:n])
        if prefix in dirs:
            return "/".join([dirs[prefix], *parts[n:]])
    return package.replace(".", "/")


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST):
    """Every import statement of ``tree``, those under ``if TYPE_CHECKING:`` left out."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def import_graph(modules: dict[str, pathlib.Path]) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (see the module docstring)."""
    graph = {}
    for name, path in modules.items():
        package = name if path.stem == "__init__" else name.rpartition(".")[0]
        edges = set()
        for node in _imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    parts = alias.name.split(".")
                    # The longest of the package's modules the dotted name starts with.
                    for n in range(len(parts), 0, -1):
                        if ".".join(parts[:n]) in modules:
                            edges.add(".".join(parts[:n]))
                            break
                continue
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                if sub in modules:
                    edges.add(sub)
                elif base in modules:
                    edges.add(base)
        edges.discard(name)
        graph[name] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (a path back to its start) per strongly connected component of more than one
    module (Tarjan's algorithm, iterative)."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(_cycle_in(graph, set(component)))
    return found


def _cycle_in(graph, component: set[str]) -> list[str]:
    """A path from the component's first module back to it, through the component."""
    first = min(component)
    paths = {first: [first]}
    queue = [first]
    while queue:
        node = queue.pop(0)
        for child in sorted(graph[node] & component):
            if child == first:
                return paths[node] + [first]
            if child not in paths:
                paths[child] = paths[node] + [child]
                queue.append(child)
    raise AssertionError(f"no cycle through {sorted(component)}")


def test_the_walk_sees_every_installed_package():
    modules = installed_modules()
    for name in ("kvcanary_jax", "kvcanary_jax.runtime.manager", "kvcanary_jax.runtime.sharded",
                 "kvcanary_jax.sharded", "kvcanary_jax.bridge.launcher", "kvcanary_jax.bench.run",
                 "kvcanary_jax.integrations.sglang_jax", "kvcanary_jax.ops.verify.api"):
        assert name in modules, name
    graph = import_graph(modules)
    # Edges of each kind: module level, in a function, relative, from a package's names.
    assert "kvcanary_jax.runtime.manager" in graph["kvcanary_jax.runtime"]
    assert "kvcanary_jax.runtime.sharded" in graph["kvcanary_jax.sharded"]
    assert "kvcanary_jax.runtime.state" in graph["kvcanary_jax.runtime.device"]


def test_the_package_has_no_import_cycle():
    found = cycles(import_graph(installed_modules()))
    assert not found, "import cycles: " + "; ".join(" -> ".join(c) for c in found)


@pytest.mark.parametrize("files, cycle", [
    # The circle the runtime had: a lazy import, and a module reading its package's names.
    ({"pkg/__init__.py": "from pkg.manager import M\n",
      "pkg/manager.py": "def f():\n    from pkg.sharded import g\n",
      "pkg/sharded.py": "from pkg import manager\nfrom pkg import M\n"},
     ["pkg", "pkg.manager", "pkg.sharded", "pkg"]),
    ({"pkg/__init__.py": "", "pkg/a.py": "from . import b\n", "pkg/b.py": "import pkg.a\n"},
     ["pkg.a", "pkg.b", "pkg.a"]),
    ({"pkg/__init__.py": "from .a import x\n", "pkg/a.py": "from .b import y\n",
      "pkg/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.a import x\n"},
     None),
])
def test_the_walk_finds_a_cycle(tmp_path, files, cycle):
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    (tmp_path / "pyproject.toml").write_text('[tool.setuptools]\npackages = ["pkg"]\n')
    found = cycles(import_graph(installed_modules(tmp_path)))
    assert found == ([cycle] if cycle else []), found
