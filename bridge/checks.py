"""Checks shared by the launchers: required tensors, torch-only checks, opt-in value checks.

Value checks (negative / out-of-range indices, malformed offsets) read tensor contents, which on
a GPU is a device-to-host synchronisation per call. The kernels stay in bounds whatever the
values, so the checks are a diagnostic: on for CPU tensors by default, opt-in on the GPU
(:func:`set_value_checks`, ``KVCANARY_BRIDGE_VALUE_CHECKS=1``), per thread.
"""

from __future__ import annotations

import contextlib
import os
import threading

import torch

from kvcanary_jax.contracts import Contiguous, Contract, SameDevice

__all__ = [
    "require_tensors",
    "torch_checks",
    "value_checks_enabled",
    "value_checks",
    "set_value_checks",
    "check_range",
]


def require_tensors(prefix: str, tensors: dict) -> None:
    """``None`` (or a non-tensor) where SGLang requires a tensor: a TypeError naming it, before
    any other check (SGLang itself would fail with an AttributeError on ``.dim()``)."""
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{prefix} {name} must be a torch.Tensor, got {type(t).__name__}")


def torch_checks(op: str, anchor: str, contiguous: tuple[str, ...],
                 names: tuple[str, ...]) -> Contract:
    """The torch-only part of a contract: contiguity in SGLang's order and words, then one device
    for every tensor (the anchor's)."""
    checks = tuple(Contiguous(n) for n in contiguous) + (SameDevice(anchor, names),)
    return Contract(op=op + "[torch]", checks=checks)


_mode = threading.local()
_DEFAULT = os.environ.get("KVCANARY_BRIDGE_VALUE_CHECKS", "auto").lower()


def set_value_checks(mode) -> None:
    """``True`` / ``False`` / ``"auto"`` (CPU tensors only) for the current thread."""
    _mode.value = mode


def _current():
    return getattr(_mode, "value", _DEFAULT)


@contextlib.contextmanager
def value_checks(mode=True):
    old = _current()
    set_value_checks(mode)
    try:
        yield
    finally:
        set_value_checks(old)


def value_checks_enabled(device: torch.device) -> bool:
    mode = _current()
    if mode in (True, "1", "true", "on"):
        return True
    if mode in (False, "0", "false", "off"):
        return False
    return device.type == "cpu"


def check_range(prefix: str, name: str, t: torch.Tensor, lo: int, hi: int, what: str) -> None:
    """Every element of ``t`` in ``[lo, hi)`` or a ValueError naming the first offender."""
    if t.numel() == 0:
        return
    bad = (t < lo) | (t >= hi)
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise ValueError(
            f"{prefix} {name}[{i}]={int(t[i])} is outside [{lo}, {hi}) ({what})"
        )
