"""The canary of a KV page carried through sglang-jax 0.1.0rc0's HiCache (L2 host memory).

With ``hicache_storage`` enabled, sglang-jax's ``UnifiedRadixCache`` backs KV pages up to pinned
host memory (``HiCacheController.write``: ``LRUHostKVPool.stage_backup`` gathers the device
pages, a worker thread copies them to the host) and, on a prefix hit on a page evicted from the
device, loads them back into *other* device pages (``load`` / ``flush_load``: ``write_kv_layer``
scatters them into the KV buffer), outside any model step. The canary's 32-byte record of each
slot stays where the page was, so without more every reloaded slot would fail its next verify
(its new slot holds another slot's, or no, record), and a page corrupted in host memory could
not be told from one that was never stamped.

:class:`HiCacheHook` makes the canary of a page travel with it: installed on the controller, it
copies the canary rows of the page's slots (each canary buffer, each head shard of the page's DP
rank: the chain link, token, position and the fingerprint of the KV bytes) to host memory when
the page is backed up, and writes them into the slots the page is loaded into, right after the
load. The chain link and the fingerprint depend on the contents only, never on the slot, so a
page moved intact verifies clean at its new slots, and a page whose bytes changed in host memory
(or on the way) fails the next verify that reads it (``VERIFY_REAL_KV_HASH_MISMATCH``), before
its KV serves a request.

With a coverage window (ours, ``coverage_window``; docs/spec.md §17.7) a page also carries each
slot's KV digest (every layer's K and V) and the step that stamped it: restored at the new slots,
an intact page is checked there like any other slot (a slot stamped by nothing would go unchecked,
one holding its previous occupant's digest would be a false alarm), and a byte changed in host
memory, in any layer, K or V, fails the next digest check of the slot (``KV_DIGEST_MISMATCH``). The
new slots' report counters (reads, checks, sweeps) start afresh. A page whose digests were never
stamped is restored unstamped (unchecked, and shown unverified in the coverage report).

Page ids are the controller's: global device pages (``dp_rank * pages_per_rank + local``), each
``page_size`` rank-local slots. Rows of host pages evicted through the controller
(``evict_callback``) are dropped. A page loaded whose rows were never backed up (backed up before
the hook was installed, or through the host pool directly: ``copy_into``, ``precompile_transfers``)
gets zeroed rows (and, with a window, a digest of 0 stamped at step 0): its slots fail their
next verify and digest check (the page cannot be vouched for), and a ``kv-canary`` warning says
so.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from kvcanary_jax import _config
from kvcanary_jax.integrations.sglang_jax.layout import SglangJaxCanary
from kvcanary_jax.integrations.sglang_jax.step import per_shard
from kvcanary_jax.runtime.state import SLOT_STEPS, state_jit

__all__ = ["HiCacheHook"]

logger = logging.getLogger("kvcanary_jax")

# Per slot, what travels with a page: the canary record of each buffer and, with a coverage
# window, the digest and the step counters (SlotCoverage.steps), of which only the digest's stamp
# (written_at) is kept: a reloaded slot starts its other counters afresh (-1: never).
_KEPT_STEPS = SLOT_STEPS.index("written_at")


def _carried(state) -> dict:
    """The per-slot arrays a page carries, by name: each canary buffer (``[shards, slots,
    32]``), and with a coverage window the digest (``[shards, slots]``) and the step counters
    (``[shards, slots, 5]``)."""
    out = {f"bufs.{name}": b for name, b in state.bufs.items()}
    if state.coverage is not None:
        sc = state.coverage.groups["FULL"]
        out.update({"coverage.digest": sc.digest, "coverage.steps": sc.steps})
    return out


def _with_carried(state, arrays: dict):
    """``state`` with the arrays of :func:`_carried` replaced."""
    bufs = {name: arrays[f"bufs.{name}"] for name in state.bufs}
    state = dataclasses.replace(state, bufs=bufs)
    if state.coverage is None:
        return state
    cov = state.coverage
    sc = dataclasses.replace(cov.groups["FULL"], digest=arrays["coverage.digest"],
                             steps=arrays["coverage.steps"])
    return dataclasses.replace(state, coverage=dataclasses.replace(
        cov, groups={**cov.groups, "FULL": sc}))


@functools.partial(jax.jit, static_argnames=("canary",))
def _gather_rows(arrays: dict, slots, *, canary: SglangJaxCanary) -> dict:
    """Each array's rows at ``slots`` (``[shards, m]``, rank-local; out of range: clamped, the
    caller drops those): ``[shards, m, ...]``."""

    def fn(local, _rank, _shared, _kv, shard_slots):
        return None, {name: b[jnp.clip(shard_slots, 0, b.shape[0] - 1)]
                      for name, b in local.items()}

    _, rows = per_shard(canary, fn, arrays, stacked=slots)
    return rows


@state_jit(static_argnames=("canary",), donate_argnames=("arrays",))
def _scatter_rows(arrays: dict, slots, rows: dict, *, canary: SglangJaxCanary) -> dict:
    """``arrays`` with ``rows[name]`` (``[shards, m, ...]``) at ``slots`` (``[shards, m]``; out
    of range: dropped, nothing written)."""

    def fn(local, _rank, _shared, _kv, stacked):
        shard_slots, shard_rows = stacked
        return {name: b.at[shard_slots].set(shard_rows[name], mode="drop")
                for name, b in local.items()}, None

    new, _ = per_shard(canary, fn, arrays, stacked=(slots, rows))
    return new


def _bucket(n: int) -> int:
    """Slots per transfer padded to a power of two: one compilation per bucket."""
    return 1 << max(n - 1, 0).bit_length()


class HiCacheHook:
    """Carries the canary rows of each KV page through an sglang-jax ``HiCacheController``.

    ``holder``: what holds the canary and its state, read and replaced as ``holder.canary`` /
    ``holder.state`` (a :class:`ModelRunnerHook`, or any object the caller steps the state
    through). ``controller``: the ``UnifiedRadixCache``'s ``hicache_controller``. Installing
    wraps the controller's ``write`` (backup), ``load`` and ``flush_load`` (load-back) and
    ``evict_callback`` (host pages freed); :meth:`uninstall` gives them back. Run backups and
    loads between steps, on the thread that steps the canary (sglang-jax runs them there: the
    model step donates the KV buffers). ``host_rows``: host page id -> the rows it carries.
    """

    def __init__(self, holder, controller):
        canary = getattr(holder, "canary", None)
        if not isinstance(canary, SglangJaxCanary) or not hasattr(holder, "state"):
            raise TypeError("kv-canary sglang-jax: HiCacheHook needs a holder with .canary (an "
                            "SglangJaxCanary) and .state (a ModelRunnerHook), got "
                            f"{type(holder).__name__}")
        missing = [m for m in ("write", "load", "flush_load", "evict_callback")
                   if not callable(getattr(controller, m, None))]
        if missing:
            raise TypeError("kv-canary sglang-jax: HiCacheHook needs sglang-jax 0.1.0rc0's "
                            f"HiCacheController (write, load, flush_load, evict_callback); "
                            f"{type(controller).__name__} lacks {missing}")
        if canary.num_slots % canary.page_size:
            raise ValueError(f"kv-canary sglang-jax: {canary.num_slots} slots per rank are not "
                             f"whole pages of {canary.page_size}")
        self.holder, self.controller = holder, controller
        self.host_rows: dict[int, dict[str, np.ndarray]] = {}
        self._own = {m: getattr(controller, m) for m in
                     ("write", "load", "flush_load", "evict_callback")}
        controller.write = self._write
        controller.load = self._load
        controller.flush_load = self._flush_load
        controller.evict_callback = self._evict

    def uninstall(self) -> None:
        for name, fn in self._own.items():
            setattr(self.controller, name, fn)

    # -- the controller's calls ---------------------------------------------------------------

    def _write(self, device_indices, host_buffer_ids):
        device_indices, host_buffer_ids = list(device_indices), list(host_buffer_ids)
        # Same thread, same moment as the page gather the controller starts: the rows match
        # the bytes being backed up.
        self._backup(device_indices, host_buffer_ids)
        return self._own["write"](device_indices, host_buffer_ids)

    def _load(self, host_buffer_ids, device_indices):
        self._own["load"](host_buffer_ids, device_indices)
        self._restore(list(host_buffer_ids), list(device_indices))

    def _flush_load(self, host_buffer_ids, device_indices):
        self._own["flush_load"](host_buffer_ids, device_indices)
        self._restore(list(host_buffer_ids), list(device_indices))

    def _evict(self, host_buffer_ids):
        self._own["evict_callback"](host_buffer_ids)
        for host_id in host_buffer_ids:
            self.host_rows.pop(int(host_id), None)

    # -- rows ---------------------------------------------------------------------------------

    def _page_slots(self, pages: Sequence[int]) -> np.ndarray:
        """``[shards, len(pages) * page_size]`` rank-local slots of global ``pages`` on each
        canary shard (``num_slots``, out of range, on shards of other ranks)."""
        canary = self.holder.canary
        ps, per_rank = canary.page_size, canary.num_slots // canary.page_size
        slots = np.full((canary.num_shards, _bucket(len(pages) * ps)), canary.num_slots,
                        np.int32)
        for i, page in enumerate(int(p) for p in pages):
            rank, local = divmod(page, per_rank)
            if not 0 <= rank < canary.dp_size:
                raise ValueError(f"kv-canary sglang-jax: device page {page} is outside the "
                                 f"{canary.dp_size * per_rank} pages of the KV pool")
            shards = slice(rank * canary.head_shards, (rank + 1) * canary.head_shards)
            slots[shards, i * ps:(i + 1) * ps] = local * ps + np.arange(ps)
        return slots

    @_config.with_x64  # the digests are int64
    def _backup(self, pages, host_ids) -> None:
        if not pages:
            return
        canary = self.holder.canary
        slots = self._page_slots(pages)
        rows = {name: np.asarray(jax.device_get(r)) for name, r in
                _gather_rows(_carried(self.holder.state), slots, canary=canary).items()}
        ps, t = canary.page_size, canary.head_shards
        per_rank = canary.num_slots // ps
        for i, (page, host_id) in enumerate(zip(pages, host_ids)):
            shards = slice(int(page) // per_rank * t, (int(page) // per_rank + 1) * t)
            self.host_rows[int(host_id)] = {
                name: r[shards, i * ps:(i + 1) * ps].copy() for name, r in rows.items()}

    @_config.with_x64
    def _restore(self, host_ids, pages) -> None:
        if not pages:
            return
        canary, state = self.holder.canary, self.holder.state
        slots = self._page_slots(pages)
        ps, t = canary.page_size, canary.head_shards
        per_rank = canary.num_slots // ps
        carried = _carried(state)
        # Zero rows (no record; a digest of 0 stamped at step 0) for a page never backed up.
        rows = {name: np.zeros(slots.shape + a.shape[2:], a.dtype) for name, a in carried.items()}
        lost = []
        for i, (host_id, page) in enumerate(zip(host_ids, pages)):
            kept = self.host_rows.get(int(host_id))
            if kept is None:
                lost.append(int(host_id))
                continue
            shards = slice(int(page) // per_rank * t, (int(page) // per_rank + 1) * t)
            for name in rows:
                rows[name][shards, i * ps:(i + 1) * ps] = kept[name]
        if lost:
            logger.warning("kv-canary: HiCache loaded host page(s) %s whose canary rows were "
                           "never backed up through the hook: their slots are cleared and fail "
                           "their next verify", lost)
        if "coverage.steps" in rows:  # the counters but the stamp start afresh
            fresh = np.arange(rows["coverage.steps"].shape[-1]) != _KEPT_STEPS
            rows["coverage.steps"][..., fresh] = -1
        # Only the per-slot arrays are replaced: the state keeps its expected-token pool (a
        # TokenFeed still knows the state).
        new = _scatter_rows(carried, slots, rows, canary=canary)
        self.holder.state = _with_carried(state, new)
