"""Checks shared by the launchers: required tensors, torch-only checks, opt-in value checks."""

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


# Value checks (negative / out-of-range indices, malformed offsets) read tensor contents, which on
# a GPU is a device-to-host synchronisation per call. The kernels stay in bounds whatever the
# values, so the checks are a diagnostic: on for CPU tensors by default, opt-in on the GPU.
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


def sig(t):
    """What the static checks of a tensor depend on (address included: the overlap check); the
    same tuple is the view cache's key, so launchers compute it once per tensor per call."""
    if t is None:
        return None
    if not isinstance(t, torch.Tensor):
        return (type(t),)
    return (t.data_ptr(), t.shape, t.stride(), t.dtype, t.device)


def isig(t):
    """:func:`sig` of a read-only input, without its address: per-step temporaries (new tensors
    every call) then hit the memo too. Never a cache key."""
    if t is None:
        return None
    if not isinstance(t, torch.Tensor):
        return (type(t),)
    return (t.shape, t.stride(), t.dtype, t.device)


class Validated:
    """Signatures whose static checks passed: a launcher called again on the same tensors (the
    serving loop's persistent buffers) skips re-evaluating its contract (~20-150 us of Python)."""

    def __init__(self, max_entries: int = 4096):
        self._ok: set = set()
        self.max_entries = max_entries

    def __contains__(self, key) -> bool:
        return key in self._ok

    def add(self, key) -> None:
        if len(self._ok) >= self.max_entries:
            self._ok.clear()
        self._ok.add(key)
