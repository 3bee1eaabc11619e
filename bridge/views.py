"""JAX views of the caller's torch tensors, kept only while the caller keeps the tensor (DLPack path).

A DLPack import costs a host round trip (57 us measured on the H200), so a serving loop's persistent
buffers are imported once. An entry is keyed by the caller's tensor object and holds a weak
reference to it: when the caller drops the tensor, the entry goes (a ``weakref`` callback), and with
it the JAX array and the storage it pins (imports go through ``detach()`` aliases, so the array
never keeps the caller's tensor object alive; :mod:`kvcanary_jax.bridge.dlpack`). An entry also
records the tensor's address, shape, strides and dtype at import; a tensor changed in place since
(``as_strided_``, ``set_``, ``resize_``) misses and is imported again, never served stale.

An import that copied (JAX's CPU client copies from addresses less than 64-byte aligned) is a
snapshot and never cached. After a donated call the output array, checked to alias the tensor,
replaces the entry's array (the donated one is deleted). Bounded per device (512 entries, least
recently used first); :func:`kvcanary_jax.bridge.clear_cache` empties every device's cache.

At the interpreter's exit (:func:`_freeze`, an ``atexit`` hook) nothing imported on the CPU is
released any more, and the hook waits for the imports already released. XLA's CPU client ends a
launch on a worker thread, whose hold on the launch's operands can outlive the results' ready event
by a moment; where that thread dropped the last reference to an import during the interpreter's
finalization, torch's DLPack deleter took the GIL there, which finalization answers by killing the
thread: the process aborted after the script's last line ("terminate called without an active
exception"). So every CPU import is tracked (:func:`kvcanary_jax.bridge.dlpack.import_tensor`): an
import whose JAX array is gone or deleted (a donated operand) but whose torch alias is not is still
held by a worker, and the hook sleeps (the GIL released) until each such alias has died, at most
:data:`EXIT_WAIT_S`; the caches' arrays, which are still alive, are kept with the process instead.
A CPU launch after the hook (from an ``atexit`` handler registered before the bridge was
imported, which runs after the hook) waits the same way before it returns
(:func:`wait_if_exiting`). A caller's memory still comes back when the caller drops its tensor.
"""

from __future__ import annotations

import atexit
import collections
import ctypes
import threading
import time
import weakref
from typing import Any

from kvcanary_jax.bridge.cache import CACHES
from kvcanary_jax.bridge.dlpack import released_but_held

__all__ = ["ViewCache", "for_device", "layout_of", "wait_if_exiting", "EXIT_WAIT_S"]

# The longest the exit hook waits for a worker thread to release the imports it still holds.
EXIT_WAIT_S = 2.0

# Set once, at the interpreter's exit: nothing imported is released after it. Read by weakref
# callbacks through their default arguments (module globals are cleared during finalization).
_FROZEN = threading.Event()


def layout_of(t) -> tuple:
    """What an entry must still match: address, shape, strides, dtype."""
    return (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype)


class _Entry:
    __slots__ = ("ref", "layout", "array")

    def __init__(self, ref, layout, array):
        self.ref, self.layout, self.array = ref, layout, array


class ViewCache:
    """Per-device cache of JAX arrays over live tensors (see the module docstring).

    An entry's weakref callback may run inside the cache's own critical section: the garbage
    collector can run at any allocation there, and it may free a cached tensor. So a callback
    never waits for the lock: it queues its entry and removes what is queued only if it gets the
    lock at once; otherwise whoever holds the lock removes it on the way out (:meth:`_drain`)."""

    def __init__(self, max_entries: int = 512):
        self.max_entries = max_entries
        self._d: collections.OrderedDict[tuple, _Entry] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._gone: collections.deque = collections.deque()  # (key, dead weak reference)

    def get(self, t, tag: Hashable = None):
        """The cached array of ``t`` (presented as ``tag``), or None."""
        key = (id(t), tag)
        with self._lock:
            e = self._d.get(key)
            if e is not None and (e.ref() is not t or e.layout != layout_of(t)
                                  or e.array.is_deleted()):
                del self._d[key]
                e = None
            elif e is not None:
                self._d.move_to_end(key)
        if self._gone:
            self._drain()
        return None if e is None else e.array

    def put(self, t, array, tag: Hashable = None) -> None:
        key = (id(t), tag)

        def gone(_ref, key=key, queue=self._gone, drain=self._drain, frozen=_FROZEN):
            if not frozen.is_set():
                queue.append((key, _ref))
                drain()

        e = _Entry(weakref.ref(t, gone), layout_of(t), array)
        d = self._d
        with self._lock:
            d[key] = e
            d.move_to_end(key)
            while len(d) > self.max_entries:
                d.popitem(last=False)
        if self._gone:
            self._drain()

    def _drain(self) -> None:
        """Remove the entries whose tensors died, unless another holder of the lock (this thread
        included) is inside the cache: that holder drains on its way out."""
        queue, d, lock = self._gone, self._d, self._lock
        while queue and lock.acquire(blocking=False):
            try:
                while queue:
                    key, ref = queue.popleft()
                    e = d.get(key)
                    if e is not None and e.ref is ref:
                        del d[key]
            finally:
                lock.release()

    def clear(self) -> None:
        with self._lock:
            self._d.clear()
            self._gone.clear()

    def __len__(self) -> int:
        if self._gone:
            self._drain()
        with self._lock:
            n = len(self._d)
        if self._gone:  # a tensor freed meanwhile: gone before the count is returned
            self._drain()
            with self._lock:
                n = len(self._d)
        return n


Hashable = Any
_CACHES: dict[Any, ViewCache] = {}
_LOCK = threading.Lock()


def for_device(device) -> ViewCache:
    with _LOCK:
        c = _CACHES.get(device)
        if c is None:
            c = _CACHES[device] = ViewCache()
        return c


@atexit.register
def _freeze() -> None:
    """At the interpreter's exit: keep every cached view, and wait for the released imports'
    last holders (see the module docstring)."""
    _FROZEN.set()
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(_CACHES))
    _wait_released()


def wait_if_exiting() -> None:
    """After the exit hook has run (a launch from an ``atexit`` handler that runs after it):
    wait, as the hook does, for the released imports' last holders. Before it: nothing."""
    if _FROZEN.is_set():
        _wait_released()


def _wait_released() -> None:
    deadline = time.monotonic() + EXIT_WAIT_S
    while released_but_held() and time.monotonic() < deadline:
        time.sleep(0.001)


def _clear_all() -> None:
    with _LOCK:
        caches = list(_CACHES.values())
    for c in caches:
        c.clear()


CACHES.on_clear(_clear_all)
