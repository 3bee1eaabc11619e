"""Checks shared by the launchers: required tensors, torch-only checks, outputs apart from
inputs, opt-in value checks.

Value checks (negative / out-of-range indices, malformed offsets) read tensor contents, which on
a GPU is a device-to-host synchronisation per call. The kernels stay in bounds whatever the
values, so the checks are a diagnostic: on for CPU tensors by default, opt-in on the GPU
(:func:`set_value_checks`, ``KVCANARY_BRIDGE_VALUE_CHECKS=1``), per thread.
"""

from __future__ import annotations

import bisect
import contextlib
import threading

import torch

from kvcanary_jax.bridge.dlpack import BridgeError
from kvcanary_jax.bridge.switches import env_switch, switch
from kvcanary_jax.contracts import Contiguous, Contract, SameDevice

__all__ = [
    "require_tensors",
    "torch_checks",
    "value_checks_enabled",
    "value_checks",
    "set_value_checks",
    "check_range",
    "check_outputs_apart_from_inputs",
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
_DEFAULT = env_switch("KVCANARY_BRIDGE_VALUE_CHECKS", "auto", others=("auto",))


def set_value_checks(mode) -> None:
    """``True`` / ``False`` / ``"auto"`` (CPU tensors only) for the current thread; the words of
    ``KVCANARY_BRIDGE_VALUE_CHECKS`` (``"on"``, ``"0"``, ...) too. Anything else: ValueError."""
    _mode.value = switch("set_value_checks", mode, others=("auto",))


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
    return device.type == "cpu" if mode == "auto" else mode


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


def _span(t) -> tuple[int, int]:
    lo = t.data_ptr()
    last = sum((int(n) - 1) * int(st) for n, st in zip(t.shape, t.stride()))
    return lo, lo + (last + 1) * t.element_size()


def check_outputs_apart_from_inputs(launcher: str, written: tuple, tensors: dict) -> None:
    """Our rule (SGLang checks nothing of the kind): a tensor a launcher writes must not share
    memory with one it reads (scatter's ``pool_out`` over ``flat_in``, a plan's ``prefix_lens``
    inside ``write_plan_out``, the step's expected-token pool over ``req_to_token``): the
    kernels would read what they are writing, a result neither SGLang's reference nor any
    defined one. Refused naming both; spans are compared by address (a strided output whose
    span encloses an input is refused even where their elements interleave)."""
    outs = written_spans(written, tensors)
    if not outs:
        return
    for name, t in tensors.items():
        if name not in written:
            check_apart(launcher, outs, name, t)


def _has_memory(t) -> bool:  # meta tensors (address 0) hold none: the launcher refuses them
    return bool(isinstance(t, torch.Tensor) and t.numel() and t.device.type != "meta")


def written_spans(written: tuple, tensors: dict) -> tuple:
    """``(name, device, start, end)`` of each written tensor that holds memory."""
    return tuple((name, t.device, *_span(t)) for name in written
                 if _has_memory(t := tensors.get(name)))


def check_apart(launcher: str, outs: tuple, name: str, t) -> None:
    """Input ``name`` apart from every span of :func:`written_spans`, else the rule's error."""
    if not _has_memory(t):
        return
    lo, hi = _span(t)
    for out, device, a, b in outs:
        if lo < b and a < hi and t.device == device:
            raise BridgeError(
                f"kv-canary bridge: {launcher} {out} shares memory with {name}; a tensor "
                "the launcher writes must not overlap one it reads (pass distinct tensors)"
            )


class Apart:
    """The written spans of one prepared call, for a per-call check of an input whose extent the
    call signature does not hold (a bucketed array): the spans' union sorted once, so a call
    costs one bisection; a hit is named by :func:`check_apart`."""

    def __init__(self, launcher: str, outs: tuple):
        self.launcher, self.outs = launcher, outs
        merged: list[list[int]] = []
        for _, _, a, b in sorted(outs, key=lambda o: o[2]):
            if merged and a <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], b)
            else:
                merged.append([a, b])
        self.starts = [a for a, _ in merged]
        self.ends = [b for _, b in merged]

    def check(self, name: str, t) -> None:
        """``t`` as the call signature admitted it: a tensor of the prepared call's device."""
        shape = t.shape
        if len(shape) == 1:  # a token array: its span without the general walk
            n = shape[0]
            if not n:
                return
            lo = t.data_ptr()
            hi = lo + ((n - 1) * t.stride(0) + 1) * t.element_size()
        elif not _has_memory(t):
            return
        else:
            lo, hi = _span(t)
        i = bisect.bisect_left(self.starts, hi) - 1  # the last span starting below hi
        if i >= 0 and self.ends[i] > lo:
            check_apart(self.launcher, self.outs, name, t)
