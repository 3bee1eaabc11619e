"""Every cache of the bridge, owned in one place, each bounded, all cleared by :func:`clear_cache`.

The caches and what they hold (none holds a caller's tensor; see :mod:`bridge.views` for the one
that refers to tensors, weakly):

``checked``   :class:`~bridge.launcher.Signature` of calls whose static checks passed (shapes,
              strides, dtypes, devices and non-tensor arguments; no addresses). A call whose
              signature is here skips re-evaluating its contract. 4,096 entries.
``programs``  direct path: :class:`~bridge.launcher.ProgramKey` (launcher, static arguments,
              the arrays' lowered shapes and dtypes, device) -> a lowered and compiled program,
              or the reason the direct path cannot run it. 256 entries.
``variants``  direct path: one kernel compiled for one device and one set of pointer
              alignments. 512 entries.
``jitted``    DLPack path: one jitted array function per (launcher, static arguments, donated
              positions); XLA keeps one executable per shape under each. 256 entries.
``views``     DLPack path: JAX arrays aliasing live torch tensors, per device (:mod:`bridge.views`).

Lifetime: process-wide, from first use until evicted (least recently used first) or
:func:`clear_cache`. Each cache takes its own lock for its own operations; a value is built
outside the lock (compiling takes seconds) and the first one stored wins, so two threads that
miss together may both build, and both get a correct value.
"""

from __future__ import annotations

import collections
import threading
from typing import Any, Callable, Hashable

__all__ = ["LRU", "CACHES", "clear_cache", "Caches"]


class LRU:
    """A bounded, thread-safe mapping: least recently used entries leave first."""

    def __init__(self, name: str, max_entries: int):
        self.name = name
        self.max_entries = max_entries
        self._d: collections.OrderedDict[Hashable, Any] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def get(self, key, default=None):
        with self._lock:
            try:
                value = self._d[key]
            except KeyError:
                self.misses += 1
                return default
            self._d.move_to_end(key)
            self.hits += 1
            return value

    def __contains__(self, key) -> bool:
        with self._lock:
            return key in self._d

    def put(self, key, value):
        """Store ``value`` unless another thread stored one first; returns the stored value."""
        with self._lock:
            if key in self._d:
                self._d.move_to_end(key)
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


class Caches:
    """The bridge's caches (see the module docstring)."""

    def __init__(self):
        self.checked = LRU("checked", 4096)
        self.programs = LRU("programs", 256)
        self.variants = LRU("variants", 512)
        self.jitted = LRU("jitted", 256)
        self._extra: list[Callable[[], None]] = []

    def on_clear(self, fn: Callable[[], None]) -> None:
        """Register the clear function of a cache kept elsewhere (the per-device view caches)."""
        self._extra.append(fn)

    def clear(self) -> None:
        for c in (self.checked, self.programs, self.variants, self.jitted):
            c.clear()
        for fn in self._extra:
            fn()

    def sizes(self) -> dict[str, int]:
        return {c.name: len(c) for c in (self.checked, self.programs, self.variants, self.jitted)}


CACHES = Caches()


def clear_cache() -> None:
    """Forget every checked signature, compiled program and kernel, jitted function and cached
    JAX view (releasing the torch storages those views keep alive)."""
    CACHES.clear()
