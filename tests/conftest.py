"""Shared fixtures: the SGLang oracle (torch references from the installed sglang==0.5.23 wheel)."""

from __future__ import annotations

import importlib.util
import os

import pytest

import jax

from kvcanary_jax import oracle as _oracle


def _deselect(config, items, marker):
    kept = [it for it in items if marker not in it.keywords]
    if len(kept) != len(items):
        config.hook.pytest_deselected(items=[it for it in items if marker in it.keywords])
        items[:] = kept


def pytest_collection_modifyitems(config, items):
    # Tests that compare with SGLang's torch references need torch: the marker lets a run without
    # torch (the newest-JAX CI leg) select the rest with -m "not torch".
    for it in items:
        if "sgl" in getattr(it, "fixturenames", ()):
            it.add_marker(pytest.mark.torch)
    # GPU tests run on the H200 only; on CPU machines they are deselected, not skipped.
    if jax.default_backend() != "gpu":
        _deselect(config, items, "gpu")
    # sglang-jax needs Python >= 3.12: its tests run in the Python 3.12 CI leg, which installs it
    # (and fails on "no tests ran" if it did not); elsewhere they are deselected.
    if importlib.util.find_spec("sgl_jax") is None:
        _deselect(config, items, "sglang_jax")


@pytest.fixture(scope="session")
def sgl():
    """SGLang 0.5.23's kv-canary modules (references, consts, dataclasses)."""
    return _oracle.load()
