"""A griffe extension for the API reference (loaded by mkdocstrings, never by the package).

What griffe's static loading cannot do alone for this project:

* The torch bridge lives in the checkout's ``bridge/`` folder and installs as
  ``kvcanary_jax.bridge`` (pyproject's ``package-dir``), so it is not below ``kvcanary_jax/`` on
  disk. Once the package is loaded, the folder is loaded and attached to it under its installed
  name, which makes ``kvcanary_jax.bridge`` and the bridge's own imports of
  ``kvcanary_jax.bridge.*`` resolve.
* The docstrings are written in reStructuredText's habits, which Markdown reads otherwise:
  Sphinx roles (``:func:`canary_plan```, ``:class:`~a.B```) become code (the role dropped, a
  ``~`` keeping the last name only); a paragraph ending in ``::`` ends in ``:`` (its indented
  block is a code block in Markdown too); a simple table (``====  ====`` borders) is shown as
  preformatted text, aligned as written, instead of one run-on paragraph.
"""

from __future__ import annotations

import pathlib
import re
import textwrap

import griffe

ROOT = pathlib.Path(__file__).resolve().parents[1]
FOLDERS = {"bridge": "bridge"}  # installed name under kvcanary_jax -> checkout folder
ROLE = re.compile(r":(?:py:)?(?:func|class|mod|meth|attr|data|exc|obj|const):`(~?)([^`]+)`")
LITERAL = re.compile(r"(?<=\S)::$", flags=re.M)
BORDER = re.compile(r"^\s*=+( +=+)+\s*$")


def _as_code(match: re.Match) -> str:
    short, target = match.groups()
    name = target.rsplit(".", 1)[-1] if short else target
    return f"`{name}`"


def _tables_as_text(text: str) -> str:
    """Each simple table, from its first border to the border that a blank line (or the end)
    follows, inside a ``text`` fence."""
    lines, out, i = text.splitlines(), [], 0
    while i < len(lines):
        if not BORDER.match(lines[i]):
            out.append(lines[i])
            i += 1
            continue
        end = i + 1
        while end < len(lines) and not (BORDER.match(lines[end])
                                         and (end + 1 == len(lines) or not lines[end + 1].strip())):
            end += 1
        table = textwrap.dedent("\n".join(lines[i:end + 1]))
        out += ["", "```text", *table.splitlines(), "```", ""]
        i = end + 1
    return "\n".join(out)


def markdown(text: str) -> str:
    return _tables_as_text(LITERAL.sub(":", ROLE.sub(_as_code, text)))


def _convert(obj: griffe.Object) -> None:
    if obj.docstring is not None:
        obj.docstring.value = markdown(obj.docstring.value)
    for member in obj.members.values():
        if not member.is_alias:
            _convert(member)


class KvcanaryDocs(griffe.Extension):
    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader, **kwargs) -> None:
        if pkg.name != "kvcanary_jax":
            return
        for name, folder in FOLDERS.items():
            if name not in pkg.members:
                module = loader.load(str(ROOT / folder), try_relative_path=True)
                loader.modules_collection.del_member(module.name)
                pkg.set_member(name, module)
        _convert(pkg)
