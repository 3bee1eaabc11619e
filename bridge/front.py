"""A launcher's last call signature, matched again in C++: the prepared call without the Python
signature.

A call's :class:`~kvcanary_jax.bridge.launcher.Signature` reads every tensor's shape, strides,
dtype and device in Python, builds a nested tuple and hashes it: about a third of a launcher's
own host time. Servers call each launcher with one signature step after step. So each launcher
keeps, for each set of written tensors' addresses (its key), its last signature as a
:class:`Front`: the non-tensor arguments, each value's type, the bucketed arrays' buckets, and
torch's C++ tensor check (``torch._C._dynamo.guards.TensorGuards``: Python type, dtype, device,
dispatch keys, ``requires_grad``, sizes and strides) over the tensors. A call that matches all of
it has the front's signature, so it takes the front's prepared call; any other call computes its
signature as before, and that signature's front (built once per prepared call) takes the key.

The check is torch's own (what ``torch.compile`` guarded tensors with before its guard trees),
not a public API: :func:`available` builds one on CPU tensors once and uses it only if it accepts
the same tensors and refuses a changed size, stride, dtype and type. Where it is missing or
fails, every call computes its signature (``KVCANARY_BRIDGE_FRONT=0`` does the same).

The check is stricter than the signature in two ways, each costing a signature, never a wrong
match: ``requires_grad`` and the dispatch keys (a grad mode or an inference-mode tensor) are
compared, and a tensor passed twice in one call is never matched (the check refuses aliases),
so such a call keeps no front. A prepared call's front is built from its first call: calls of
the same signature whose tensors differ from that one in those flags (a warm-up outside
``torch.inference_mode()``, serving inside it) compute their signature every time, as every
call did before fronts.
"""

from __future__ import annotations

import operator
import threading
from typing import Callable

import torch

from kvcanary_jax import buckets
from kvcanary_jax.bridge.switches import env_switch

__all__ = ["Front", "available", "getter", "keep", "make", "set_enabled", "enabled"]

_ON = {"on": env_switch("KVCANARY_BRIDGE_FRONT", True)}
_CHECK: list = []  # [TensorGuards class or None]
_LOCK = threading.Lock()
_Tensor = torch.Tensor
# buckets.bucket(n) is 1 << max(_FLOOR_BITS, (n - 1).bit_length()) for n >= 1.
_FLOOR_BITS = (buckets.FLOOR - 1).bit_length()


def set_enabled(on: bool) -> None:
    """Match calls against each launcher's front (True, the default) or compute every call's
    signature (False; ``KVCANARY_BRIDGE_FRONT=0`` at import)."""
    from kvcanary_jax.bridge.cache import CACHES
    from kvcanary_jax.bridge.switches import switch

    _ON["on"] = switch("front.set_enabled", on)
    CACHES.front.clear()


def enabled() -> bool:
    return _ON["on"] and available()


def _guards(tensors, sizes, strides):
    return _CHECK[0](*tensors, dynamic_dims_sizes=sizes, dynamic_dims_strides=strides)


def available() -> bool:
    """Whether torch's C++ tensor check is here and behaves as this module relies on."""
    if not _CHECK:
        with _LOCK:
            if not _CHECK:
                _CHECK.append(_probe())
    return _CHECK[0] is not None


def _probe():
    try:
        from torch._C._dynamo.guards import TensorGuards
    except Exception:
        return None
    try:
        a = torch.zeros(4, 3, dtype=torch.int64)
        b = torch.zeros(5, dtype=torch.int32)
        g = TensorGuards(a, b, dynamic_dims_sizes=[[4, 3], [None]],
                         dynamic_dims_strides=[[3, 1], [1]])
        same = g.check(torch.ones(4, 3, dtype=torch.int64), torch.ones(9, dtype=torch.int32))
        refused = (
            g.check(torch.zeros(4, 4, dtype=torch.int64), b),  # size
            g.check(torch.zeros(3, 4, dtype=torch.int64).t(), b),  # strides
            g.check(torch.zeros(4, 3, dtype=torch.int32), b),  # dtype
            g.check(a, torch.zeros(10, dtype=torch.int32)[::2]),  # a dynamic size's stride
            g.check(a, torch.zeros(2, 5, dtype=torch.int32)),  # rank
            g.check(a.as_subclass(_Probe), b),  # type
        )
    except Exception:
        return None
    if same is not True or any(r is not False for r in refused):
        return None
    return TensorGuards


class _Probe(torch.Tensor):
    pass


class Front:
    """A signature and its prepared call, matched by torch's C++ tensor check (see the module
    docstring). Its launcher and written tensors' addresses are its key in ``CACHES.front``."""

    __slots__ = ("statics", "size", "others", "pick", "guard", "buckets", "prepared")

    def __init__(self, statics, size, others, pick, guard, buckets, prepared):
        self.statics = statics
        self.size = size
        self.others = others
        self.pick = pick
        self.guard = guard
        self.buckets = buckets
        self.prepared = prepared

    def match(self, values: tuple, statics):
        """The prepared call if ``values`` (the call's tensors, in order) and ``statics`` have
        this front's signature, else None. The check compares the tensors' Python types; the
        values that were not tensors (None, mostly) are compared here."""
        if statics != self.statics or len(values) != self.size:
            return None
        for i, kind in self.others:
            if type(values[i]) is not kind:
                return None
        # The check first: it has found each bucketed value a tensor of one dimension (a call
        # may pass None or a 0-d tensor where the front had a history) before its length is read.
        if not self.guard.check(*self.pick(values)):
            return None
        for i, bits in self.buckets:
            n = values[i].shape[0]
            if n < 2 or max(_FLOOR_BITS, (n - 1).bit_length()) != bits:
                return None
        return self.prepared


# More keys than this (launchers x sets of written tensors' addresses) start the map afresh.
MAX_FRONTS = 1024


def keep(fronts: dict, key, prepared, values: tuple, metas: tuple, statics) -> None:
    """Make ``prepared``'s front (once per prepared call: built from this call, whose signature
    it is) the one ``fronts`` holds for ``key``."""
    slot = prepared.front
    if not slot:
        slot.append(make(values, metas, statics, prepared))
    f = slot[0]
    if f is not None:
        if len(fronts) >= MAX_FRONTS and key not in fronts:
            fronts.clear()
        fronts[key] = f


def make(values: tuple, metas: tuple, statics, prepared):
    """A front for a call with ``values`` (its tensors, in order), whose signature's tensor
    ``metas`` are ``metas`` (a bucketed array's holds its bucket), or None where the check
    cannot hold it (a tensor passed twice, a size it cannot read)."""
    positions, tensors, sizes, strides, bucketed, others = [], [], [], [], [], []
    seen = set()
    for i, (t, m) in enumerate(zip(values, metas)):
        if not isinstance(t, _Tensor):
            others.append((i, type(t)))
            continue
        if id(t) in seen:
            return None
        seen.add(id(t))
        positions.append(i)
        tensors.append(t)
        if m[0] and m[0][0] == "bucket":
            sizes.append([None])
            bucketed.append((i, m[0][1]))
        else:
            sizes.append(list(t.shape))
        strides.append(list(t.stride()))
    if not positions:
        return None
    try:
        guard = _guards(tensors, sizes, strides)
    except Exception:
        return None
    return Front(statics, len(values), tuple(others), getter(positions), guard,
                 tuple(bucketed), prepared)


def getter(keys) -> Callable:
    """``lambda d: tuple(d[k] for k in keys)`` in one call."""
    if len(keys) > 1:
        return operator.itemgetter(*keys)
    if keys:
        return lambda d, k=keys[0]: (d[k],)
    return lambda d: ()
