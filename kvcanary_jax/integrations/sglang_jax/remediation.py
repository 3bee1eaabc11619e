"""The runtime manager over the canary's state, and remediation with sglang-jax's own objects.

:func:`canary_manager` builds a :class:`kvcanary_jax.runtime.CanaryManager` in observe mode (the
guarded step runs in :func:`guard_model_step`; the manager runs the host side after it, through
:func:`observe`).
:func:`coverage` reads its coverage report (the window's share of live KV bytes verified).
:func:`request_resolver` maps a violation's slot to the step's request, :func:`abort_request`
aborts it as sglang-jax's scheduler does, :func:`drop_radix_slot` drops the radix-cache nodes
over a corrupted slot, and :class:`Remediator` is the ``on_violation`` callback doing both.
"""

from __future__ import annotations

import sys

import jax
import numpy as np

from kvcanary_jax.integrations.sglang_jax.layout import SglangJaxCanary
from kvcanary_jax.integrations.sglang_jax.sweep import node_dp_rank, on_auto_mesh

__all__ = [
    "canary_manager",
    "observe",
    "coverage",
    "request_resolver",
    "abort_request",
    "abort_pending",
    "drop_radix_slot",
    "Remediator",
]


def canary_manager(canary: SglangJaxCanary, mode: str = "log", *, on_violation=None,
                   **fields):
    """A :class:`kvcanary_jax.runtime.CanaryManager` over the canary's state (observe mode: the
    guarded step runs in :func:`guard_model_step`, the manager runs the host side after it:
    readback one step late, reporting, health, stats, remediation). Its ring capacity, real-KV
    mode, token checks and coverage window are the canary's; ``fields`` are the other
    :class:`~kvcanary_jax.runtime.ManagerConfig` fields (``stats_print_every_n_steps``, ...).

    The sweep stays :func:`sweep`'s, run by the caller. Without a coverage window a
    ``sweep_interval`` here is refused. With one it is required (here, or as the canary's
    ``sweep_interval``, which it must then match): the steps between the caller's :func:`sweep`
    calls, the bound the coverage report states for cached slots (and,
    as for any manager, the SWEEP launches the launch-health check then expects); the
    report's share comes through :func:`observe` (the stats line, ``manager.coverage()``)."""
    from kvcanary_jax.runtime import CanaryManager, ManagerConfig

    window = canary.coverage_window
    if fields.get("coverage_window", window) != window:
        raise ValueError(f"kv-canary sglang-jax: coverage_window={fields['coverage_window']!r} "
                         f"here, but the canary's is {window}: the manager checks what the "
                         "canary's state holds; set it on the SglangJaxCanary")
    stated = canary.sweep_interval
    if stated and fields.setdefault("sweep_interval", stated) != stated:
        raise ValueError(f"kv-canary sglang-jax: sweep_interval={fields['sweep_interval']!r} "
                         f"here, but the canary's is {stated}: set it in one place (the "
                         "canary's steps leave read slots to your sweep by it)")
    if not window and fields.get("sweep_interval", 0):
        raise ValueError("kv-canary sglang-jax: run the radix sweep with sglang_jax.sweep(); the "
                         "observe-mode manager takes no sweep_interval")
    if window and not fields.get("sweep_interval"):
        raise ValueError(
            f"kv-canary sglang-jax: coverage_window {window} verifies cached slots at each "
            "sglang_jax.sweep(): pass sweep_interval=K, the steps between your sweep() calls "
            "(the bound stated for cached slots no request reads)")
    fields["coverage_window"] = window
    cfg = canary.config
    config = ManagerConfig(mode=mode, ring_capacity=cfg.ring_capacity,
                           real_data=cfg.real_kv_hash_mode if mode != "none" else "none",
                           enable_verify_token_assert=cfg.enable_verify_token_assert,
                           enable_write_input_assert=cfg.enable_write_input_assert, **fields)
    return CanaryManager(config, cfg, on_violation=on_violation, allocate=False)


def observe(manager, canary: SglangJaxCanary, state, *, resolve=None) -> None:
    """``manager.observe(state, resolve=resolve)`` (the host side after a guarded step) on any
    mesh: on sglang-jax 0.1.0rc0's Explicit mesh the state is handed over as the same buffers
    (no copy) on the mesh with Auto axes (:meth:`SglangJaxCanary.auto_mesh`), under that mesh."""
    on_auto_mesh(canary, state, lambda s: manager.observe(s, resolve=resolve))


def coverage(manager, canary: SglangJaxCanary):
    """``manager.coverage()`` (the coverage window's report of the state :func:`observe` handed
    over) on any mesh: on sglang-jax 0.1.0rc0's Explicit mesh, under the mesh with Auto axes
    that state lives on."""
    auto = canary.auto_mesh()
    if auto is None:
        return manager.coverage()
    with jax.set_mesh(auto):
        return manager.coverage()


def request_resolver(reqs, req_to_token_pool):
    """``resolve(slot, violation) -> Req | None`` for one step's requests (sglang-jax ``Req``:
    ``req_pool_idx``, ``origin_input_ids``, ``output_ids``): the request whose
    ``req_to_token`` row holds ``slot`` among its first ``len(origin_input_ids) +
    len(output_ids)`` entries. Reads the pool's table only when called (a violation).

    A slot several requests hold (a shared prefix) gives one ring row per request that read it:
    the resolver hands those rows the holders in turn (the k-th call for a slot gets the k-th
    holder, cycling), so a step's reports reach every request that read the corrupted slot, not
    the first one over and over.

    ``reqs`` may be per-DP lists (``[info.reqs for info in batch.reqs_info]``). Slots are
    rank-local there and the manager's ``resolve`` is given no rank, so a slot that requests of
    two ranks hold resolves to None (no request is aborted for another's fault; the report
    still names its shard, :meth:`SglangJaxCanary.dp_rank`)."""
    reqs = list(reqs)
    if reqs and all(isinstance(r, (list, tuple)) for r in reqs):
        reqs = [r for rank in reqs for r in rank]
    calls: dict[int, int] = {}

    def resolve(slot, violation=None):
        table = np.asarray(req_to_token_pool.req_to_token)
        found = []
        for req in reqs:
            row = getattr(req, "req_pool_idx", None)
            if row is None:
                continue
            n = len(req.origin_input_ids) + len(req.output_ids)
            if int(slot) in set(np.asarray(table[int(row), :n]).tolist()):
                found.append(req)
        ranks = {getattr(r, "dp_rank", None) or 0 for r in found}
        if not found or len(ranks) != 1:
            return None
        k = calls.get(int(slot), 0)
        calls[int(slot)] = k + 1
        return found[k % len(found)]

    return resolve


def abort_request(req, message: str) -> None:
    """sglang-jax's own abort, as its scheduler aborts a request: 0.1.0rc0, ``to_finish =
    FINISH_ABORT(message)``; 0.0.2, ``to_abort`` (with ``to_abort_message``). Either becomes the
    request's ``finished_reason`` in ``Req.check_finished`` at the end of the step, and the
    scheduler releases the request. (The version is read from the ``Req``: 0.1.0rc0's has
    ``to_finish``, its ``FINISH_ABORT`` lives in the ``Req``'s module.)"""
    if hasattr(req, "to_finish"):
        finish_abort = getattr(sys.modules[type(req).__module__], "FINISH_ABORT")
        req.to_finish = finish_abort(message)
        return
    req.to_abort = True
    req.to_abort_message = message


def abort_pending(req) -> bool:
    """Whether :func:`abort_request` (or sglang-jax's scheduler) already aborted ``req``."""
    pending = getattr(req, "to_finish", None)
    if pending is not None:
        return type(pending).__name__ == "FINISH_ABORT"
    return bool(getattr(req, "to_abort", False))


def _subtree(node):
    out, stack = [], [node]
    while stack:
        n = stack.pop()
        out.append(n)
        stack.extend(n.children.values())
    return out


def drop_radix_slot(tree_cache, slot: int, *, dp_rank: int = 0) -> tuple[int, bool]:
    """Drop from sglang-jax's ``RadixCache`` the node holding ``slot`` and every node below it
    (their KV extends the bad one), freeing their slots through the cache's allocator, as its
    ``evict`` does, so no later request matches the corrupted prefix. Nodes a running request
    still locks (``lock_ref > 0``) cannot be freed yet. Returns ``(tokens dropped, whether
    locked nodes remain)``; a slot no node holds drops nothing. ``dp_rank``: with data
    parallelism (0.1.0rc0), the rank whose nodes hold the (rank-local) slot, freed to that
    rank's allocator."""
    target = None
    for node in _subtree(tree_cache.root_node):
        if node is tree_cache.root_node or node.value is None or node_dp_rank(node) != dp_rank:
            continue
        if int(slot) in set(np.asarray(node.value).reshape(-1).tolist()):
            target = node
            break
    if target is None:
        return 0, False
    dropped, locked = 0, False
    # Leaves first: a node is deleted once its children are gone.
    for node in reversed(_subtree(target)):
        if node.lock_ref > 0 or node.children:
            locked = locked or node.lock_ref > 0
            continue
        if dp_rank:  # 0.1.0rc0's allocators free per rank (0.0.2's have no rank)
            tree_cache.token_to_kv_pool_allocator.free(node.value, dp_rank=dp_rank)
        else:
            tree_cache.token_to_kv_pool_allocator.free(node.value)
        dropped += len(node.value)
        tree_cache._delete_leaf(node)
    return dropped, locked


class Remediator:
    """The ``on_violation`` callback of a :func:`canary_manager`: aborts the request a violation
    belongs to (:func:`abort_request`) and drops the radix-cache node holding the slot
    (:func:`drop_radix_slot`). Slots whose nodes were still locked are kept in ``pending`` and
    retried at every later violation and by :meth:`retry` (call it after the scheduler released
    the aborted requests). ``aborted`` / ``dropped`` record what was done. ``canary``: with data
    parallelism, the canary whose shards report (a slot is its rank's: ``pending`` and
    ``dropped`` are then keyed ``(dp_rank, slot)``)."""

    def __init__(self, tree_cache, *, message: str = "kv-canary: KV cache corruption detected",
                 canary: SglangJaxCanary | None = None):
        self.tree_cache = tree_cache
        self.message = message
        self.canary = canary
        self.pending: set = set()
        self.aborted: list = []
        self.dropped: dict = {}

    def __call__(self, report) -> None:
        v = report.violation
        if report.request is not None and not abort_pending(report.request):
            abort_request(report.request, f"{self.message} (slot {v.slot}, {v.tag}, "
                                          f"{'|'.join(v.reasons)})")
            self.aborted.append(report.request)
        if v.slot > 0:  # slot 0 is the padding slot: no node holds it
            self.pending.add(self._key(report.shard, int(v.slot)))
        self.retry()

    def _key(self, shard: int, slot: int):
        if self.canary is None or self.canary.dp_size == 1:
            return slot
        return self.canary.dp_rank(shard), slot

    def retry(self) -> None:
        for key in sorted(self.pending):
            rank, slot = key if isinstance(key, tuple) else (0, key)
            n, locked = drop_radix_slot(self.tree_cache, slot, dp_rank=rank)
            if n:
                self.dropped[key] = self.dropped.get(key, 0) + n
            if not locked:
                self.pending.discard(key)
