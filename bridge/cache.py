"""Every cache of the bridge, owned in one place, each bounded, all cleared by :func:`clear_cache`.

The caches and what they hold (none holds a caller's tensor; see :mod:`kvcanary_jax.bridge.views`
for the one that refers to tensors, weakly):

``prepared``  :class:`~kvcanary_jax.bridge.launcher.Signature` (shapes, strides, dtypes, devices of
              every tensor, the non-tensor arguments, the outputs' addresses) -> the call's
              :class:`~kvcanary_jax.bridge.launcher.Prepared` arguments. An entry means the static
              checks passed on that signature; a call whose signature is here skips its contract and
              reuses its arguments. 4,096 entries.
``front``     each launcher's last signature per set of output addresses and its prepared call,
              matched in C++ on the next call (:mod:`kvcanary_jax.bridge.front`); cleared with
              ``prepared``.
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
``lengths``   a bucketed token array's true length, the operand the scatter's kernel reads
              (``Arg.length_of``): per device, a table of int64 lengths kept the same way (8
              bytes a length; 65,536 to 1,048,575 of them, sized to the longest ``flat_in``
              seen: 16 MiB at most with the tables it outgrew), read by address on the direct
              path; the DLPack path keeps the 256 newest views. A length past the table inside
              a graph capture, or of 1,048,576 tokens or more, is a per-call tensor (in the
              graph's own memory in a capture).

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

    def __init__(self, name: str, max_entries: int, also_clear: Callable[[], None] | None = None):
        self.name = name
        self.max_entries = max_entries
        self._also_clear = also_clear
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
            if self._also_clear is not None:
                self._also_clear()

    def __len__(self) -> int:
        with self._lock:
            return len(self._d)


_MISSING = object()


class Counts:
    """Read-only device scalars: ``view(device, n)`` is a one-element tensor (``dtype``) holding
    ``n``, ``row`` elements after ``n - 1``'s (a ``row`` of 32 bytes keeps every count as aligned
    as a kernel's operands may assume), and ``address(device, n)`` its address. A view is made
    once and kept (the same tensor for every call with ``(device, n)``), the ``keep_views`` most
    recent where that is a number (the lengths of a growing history: a view kept for each would
    be a host object per length ever seen). Tables grow by doubling, at least ``minimum`` counts
    and, with a ``maximum``, never to hold it or more (``view`` and ``address`` give None there:
    the caller makes a per-call tensor). An outgrown table is kept alive, as its addresses may be
    in a captured CUDA graph. A new table is waited for once on the stream that fills it, so any
    stream may read it at once."""

    def __init__(self, dtype: str = "int32", row: int = 8, minimum: int = 4096,
                 keep_views: int | None = None, maximum: int | None = None,
                 what: str = "launch_canary_plan_kernels with {n} requests needs a device scalar "
                             "for its batch size"):
        self.dtype, self.row, self.minimum, self.what = dtype, row, minimum, what
        self.keep_views, self.maximum = keep_views, maximum
        self._views: dict[tuple, Any] = {}
        self._tables: dict[Any, list] = {}
        # Per device, the newest table's (counts, address, bytes a count): address() in one read.
        self._latest: dict[Any, tuple[int, int, int]] = {}
        self._lock = threading.Lock()

    def view(self, device, n: int):
        """The count ``n`` on ``device``; None for 0 or a device without kernels."""
        key = (device, n)
        v = self._views.get(key, _MISSING)
        if v is not _MISSING:
            return v
        if n == 0 or device.type not in ("cpu", "cuda"):
            return self._views.setdefault(key, None)
        if self.maximum is not None and n >= self.maximum:
            return None
        v = self._table(device, n)[n, :1]
        if self.keep_views is not None:
            with self._lock:
                while len(self._views) >= self.keep_views:
                    del self._views[next(iter(self._views))]
        return self._views.setdefault(key, v)

    def address(self, device, n: int) -> int | None:
        """``view(device, n).data_ptr()`` without making the view (``n > 0``, a CPU or CUDA
        device); None at or past ``maximum``."""
        latest = self._latest.get(device)
        if latest is None or latest[0] <= n:
            if self.maximum is not None and n >= self.maximum:
                return None
            self._table(device, n)
            latest = self._latest[device]
        return latest[1] + n * latest[2]

    def _table(self, device, n: int):
        """The newest table on ``device``, made (or outgrown) to hold ``n``."""
        import torch

        with self._lock:
            tables = self._tables.setdefault(device, [])
            if not tables or tables[-1].shape[0] <= n:
                cuda = device.type == "cuda"
                if cuda and torch.cuda.is_current_stream_capturing():
                    # A table made now would be filled only when the graph first replays.
                    from kvcanary_jax.bridge.dlpack import BridgeError

                    raise BridgeError(
                        f"kv-canary bridge: {self.what.format(n=n)}, which cannot be made during "
                        f"a CUDA graph capture; call it once with as many (or more) before "
                        "capturing (as a warm-up run does)")
                size = 1 << max(n, self.minimum - 1).bit_length()
                if self.maximum is not None:
                    size = min(size, self.maximum)
                table = torch.arange(size, dtype=getattr(torch, self.dtype), device=device)
                table = table[:, None].repeat(1, self.row) if self.row > 1 else table[:, None]
                if cuda:
                    torch.cuda.current_stream(device).synchronize()
                tables.append(table)
                self._latest[device] = (size, table.data_ptr(),
                                        table.stride(0) * table.element_size())
            return tables[-1]


class Caches:
    """The bridge's caches (see the module docstring)."""

    def __init__(self):
        # Each launcher's last signature, matched in C++ (:mod:`kvcanary_jax.bridge.front`):
        # (launcher name, output addresses) -> Front, at most front.MAX_FRONTS keys; forgotten
        # with ``prepared``.
        self.front: dict[tuple, Any] = {}
        self.prepared = Bounded("prepared", 4096, also_clear=self.front.clear)
        self.programs = Bounded("programs", 256)
        self.variants = Bounded("variants", 512)
        self.jitted = Bounded("jitted", 256)
        self.counts = Counts()
        self.lengths = Counts("int64", row=1, minimum=1 << 16, keep_views=256,
                              maximum=1 << 20, what="a token array's true length of {n}")
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
