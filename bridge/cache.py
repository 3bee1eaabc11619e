"""Every cache of the bridge, owned in one place, each bounded, all cleared by :func:`clear_cache`.

The caches and what they hold (none holds a caller's tensor; see :mod:`kvcanary_jax.bridge.views`
for the one that refers to tensors, weakly):

``prepared``  :class:`~kvcanary_jax.bridge.launcher.Signature` (shapes, strides, dtypes, devices of
              every tensor and the non-tensor arguments; no addresses) -> the call's
              :class:`~kvcanary_jax.bridge.launcher.Prepared` arguments. An entry means the static
              checks passed on that signature; a call whose signature is here skips its contract and
              reuses its arguments. 4,096 entries.
``programs``  direct path: :class:`~kvcanary_jax.bridge.launcher.ProgramKey` (launcher, static
              arguments, the arrays' lowered shapes and dtypes, device) -> a lowered and
              compiled program, or the reason the direct path cannot run it. 256 entries.
``variants``  direct path: one kernel compiled for one device and one set of pointer
              alignments. 512 entries.
``jitted``    DLPack path: one jitted array function per (launcher, static arguments, donated
              positions); XLA keeps one executable per shape under each. 256 entries.
``views``     DLPack path: JAX arrays aliasing live torch tensors, per device
              (:mod:`kvcanary_jax.bridge.views`).
``counts``    the plan's batch-size operand: per device, one int32 tensor per count ``n``
              holding ``n`` (:class:`Counts`). Never freed, not even by :func:`clear_cache`: a
              CUDA graph captured with a count's address reads it at every replay. Its size is
              that of the largest batch seen, at least 4,096 (32 bytes a count); it is made
              outside graph captures (a first plan call inside one is refused, asking for a
              warm-up call).

Lifetime: process-wide, from first use until evicted (oldest entry first, once a cache is full)
or :func:`clear_cache`. A lookup is one dict read (atomic in CPython, no lock on the hot path);
stores and evictions take the cache's lock. A value is built outside the lock (compiling takes
seconds) and the first one stored wins, so two threads that miss together may both build, and
both get a correct value.
"""

from __future__ import annotations

import collections
import threading
from typing import Any, Callable, Hashable

__all__ = ["Bounded", "CACHES", "clear_cache", "Caches"]


class Bounded:
    """A bounded, thread-safe mapping: when full, the oldest entry leaves first."""

    def __init__(self, name: str, max_entries: int):
        self.name = name
        self.max_entries = max_entries
        self._d: collections.OrderedDict[Hashable, Any] = collections.OrderedDict()
        self._lock = threading.Lock()

    def get(self, key, default=None):
        return self._d.get(key, default)

    def __contains__(self, key) -> bool:
        return key in self._d

    def put(self, key, value):
        """Store ``value`` unless another thread stored one first; returns the stored value."""
        with self._lock:
            if key in self._d:
                return self._d[key]
            self._d[key] = value
            while len(self._d) > self.max_entries:
                self._d.popitem(last=False)
            return value

    def get_or_build(self, key, build: Callable[[], Any]):
        value = self.get(key, _MISSING)
        if value is _MISSING:
            value = self.put(key, build())
        return value

    def pop(self, key) -> None:
        with self._lock:
            self._d.pop(key, None)

    def clear(self) -> None:
        with self._lock:
            self._d.clear()

    def __len__(self) -> int:
        with self._lock:
            return len(self._d)


_MISSING = object()


class Counts:
    """Read-only device scalars: ``view(device, n)`` is a one-element int32 tensor holding ``n``,
    the same tensor for every call with ``(device, n)``, at a 32-byte aligned address (so a
    kernel taking it keeps its aligned variant). Tables grow by doubling; an outgrown table is
    kept alive, as its addresses may be in a captured CUDA graph."""

    ROW = 8  # int32 per count: 32 bytes

    def __init__(self):
        self._views: dict[tuple, Any] = {}
        self._tables: dict[Any, list] = {}
        self._lock = threading.Lock()

    def view(self, device, n: int):
        """The count ``n`` on ``device``; None for 0 or a device without kernels."""
        key = (device, n)
        v = self._views.get(key, _MISSING)
        if v is not _MISSING:
            return v
        import torch

        if n == 0 or device.type not in ("cpu", "cuda"):
            return self._views.setdefault(key, None)
        with self._lock:
            tables = self._tables.setdefault(device, [])
            if not tables or tables[-1].shape[0] <= n:
                if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                    # A table made now would be filled only when the graph first replays.
                    from kvcanary_jax.bridge.dlpack import BridgeError

                    raise BridgeError(
                        f"kv-canary bridge: launch_canary_plan_kernels with {n} requests needs "
                        "a device scalar for its batch size, which cannot be made during a CUDA "
                        "graph capture; call it once with as many requests (or more) before "
                        "capturing (as a warm-up run does)")
                # SGLang's own batch cap (4,096) on first use: 128 KiB.
                size = 1 << max(n, 4095).bit_length()
                table = torch.arange(size, dtype=torch.int32, device=device)
                tables.append(table[:, None].repeat(1, self.ROW))
            v = self._views.setdefault(key, tables[-1][n, :1])
        return v


class Caches:
    """The bridge's caches (see the module docstring)."""

    def __init__(self):
        self.prepared = Bounded("prepared", 4096)
        self.programs = Bounded("programs", 256)
        self.variants = Bounded("variants", 512)
        self.jitted = Bounded("jitted", 256)
        self.counts = Counts()
        self._extra: list[Callable[[], None]] = []

    def on_clear(self, fn: Callable[[], None]) -> None:
        """Register the clear function of a cache kept elsewhere (the per-device view caches)."""
        self._extra.append(fn)

    def clear(self) -> None:
        for c in (self.prepared, self.programs, self.variants, self.jitted):
            c.clear()
        for fn in self._extra:
            fn()

    def sizes(self) -> dict[str, int]:
        return {c.name: len(c) for c in (self.prepared, self.programs, self.variants, self.jitted)}


CACHES = Caches()


def clear_cache() -> None:
    """Forget every checked signature, compiled program and kernel, jitted function and cached
    JAX view (releasing the torch storages those views keep alive)."""
    CACHES.clear()
