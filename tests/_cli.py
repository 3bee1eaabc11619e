"""Runs ``kvcanary-jax`` the way a user types it: the installed console script (beside this
interpreter, else on PATH; ``python -m kvcanary_jax.cli`` only where no script is installed), in a
subprocess whose imports resolve to this checkout and whose JAX runs on the CPU."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def entry_point() -> list[str]:
    script = pathlib.Path(sys.executable).with_name("kvcanary-jax")
    if script.is_file():
        return [str(script)]
    found = shutil.which("kvcanary-jax")
    if found:
        return [found]
    return [sys.executable, "-m", "kvcanary_jax.cli"]


def env() -> dict:
    e = dict(os.environ)
    e["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), e.get("PYTHONPATH")]))
    e["JAX_PLATFORMS"] = "cpu"
    e.pop("KVCANARY_TEST_IMPLEMENTATIONS", None)
    return e


def command(typed: str) -> list[str]:
    """``typed`` (a command line starting with ``kvcanary-jax``) as an argv."""
    words = typed.split()
    assert words[0] == "kvcanary-jax", typed
    return entry_point() + words[1:]


def run(typed: str, *, cwd=None, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run(command(typed), cwd=cwd, env=env(), capture_output=True, text=True,
                          timeout=timeout)
