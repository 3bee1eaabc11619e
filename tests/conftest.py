"""Shared fixtures: the SGLang oracle (torch references from the installed sglang==0.5.23 wheel)."""

from __future__ import annotations

import os

import pytest

import jax

from kvcanary_jax import oracle as _oracle


def pytest_collection_modifyitems(config, items):
    # GPU tests run on the H200 only; on CPU machines they are deselected, not skipped.
    if jax.default_backend() != "gpu":
        kept = [it for it in items if "gpu" not in it.keywords]
        if len(kept) != len(items):
            config.hook.pytest_deselected(items=[it for it in items if "gpu" in it.keywords])
            items[:] = kept


@pytest.fixture(scope="session")
def sgl():
    """SGLang 0.5.23's kv-canary modules (references, consts, dataclasses)."""
    return _oracle.load()
