"""The sweep of radix-cached prefixes, and the violations each shard recorded.

:func:`radix_prefixes` walks sglang-jax's ``RadixCache`` for the slot lists it holds;
:func:`sweep` re-verifies them against the TAIL buffers between steps (SWEEP tags, token check
off), ``canary.sweep_rows`` prefixes per launch, once per KV shard; with a coverage window it
also checks the KV digest (every layer's K and V) of every slot of those prefixes, which bounds
how long a cached slot no request reads stays unverified. :func:`violation_counts` and
:func:`read_violations` read each shard's ring on the host (a metadata fault is reported once per
shard; :class:`ShardViolation` says which shard saw what).
"""

from __future__ import annotations

import dataclasses
import jax
import numpy as np
from jax.sharding import NamedSharding

import kvcanary_jax as kc
from kvcanary_jax import _config
from kvcanary_jax.integrations.sglang_jax.layout import SglangJaxCanary, require_positive_int
from kvcanary_jax.integrations.sglang_jax.step import kv_dict, per_shard, shard_kv
from kvcanary_jax.integrations.sglang_jax.tokens import host_ints
from kvcanary_jax.runtime import decode_ring
from kvcanary_jax.runtime.state import state_jit

__all__ = [
    "radix_prefixes",
    "node_dp_rank",
    "sweep",
    "hold",
    "ShardViolation",
    "violation_counts",
    "read_violations",
]


def radix_prefixes(tree_cache, *, dp_size: int | None = None):
    """Slot lists of every root-to-leaf path of sglang-jax's ``RadixCache`` (evicted subtrees
    skipped): the cached prefixes a sweep re-verifies. ``dp_size``: with data parallelism
    (0.1.0rc0), one list per DP rank (``[rank][prefix]``, each node's rank from its key's
    ``dp_rank``; its slots are that rank's)."""
    root = getattr(tree_cache, "root_node", None)
    if root is None or not hasattr(root, "children"):
        raise TypeError("kv-canary sglang-jax: tree_cache must be an sglang-jax RadixCache (with "
                        f"root_node.children), got {type(tree_cache).__name__}")
    if dp_size is not None:
        require_positive_int("dp_size", dp_size)
    out = []
    stack = [(root, np.zeros((0,), np.int64))]
    while stack:
        node, prefix = stack.pop()
        kids = [c for c in node.children.values() if c.value is not None]
        if not kids and prefix.shape[0]:
            out.append((node_dp_rank(node), prefix))
        for child in kids:
            stack.append((child, np.concatenate([prefix, np.asarray(child.value, np.int64)])))
    if dp_size is None:
        return [prefix for _, prefix in out]
    ranks = [[] for _ in range(dp_size)]
    for rank, prefix in out:
        if not 0 <= rank < dp_size:
            raise ValueError(f"kv-canary sglang-jax: a radix node of DP rank {rank} for "
                             f"dp_size={dp_size}")
        ranks[rank].append(prefix)
    return ranks


def node_dp_rank(node) -> int:
    """The DP rank of a radix-cache node (its key's ``dp_rank``; 0 without one, and on 0.0.2)."""
    rank = getattr(getattr(node, "key", None), "dp_rank", None)
    return 0 if rank is None else int(rank)


@state_jit(static_argnames=("canary",), donate_argnames=("state",))
def _sweep_jit(state, expected_tokens, rows_table, row_indices, lengths, kv, *, canary):
    # The expected-token pool stays out of the donated state and out of the result (the sweep's
    # token check is off, it reads nothing there): the caller's state keeps the very pool array
    # its TokenFeed knows.
    cfg = canary.config

    def fn(st, rank, _shared, kv, _stacked):
        table, rows, lens = rank
        return kc.canary_sweep(cfg, st, rows_table=table, row_indices=rows, lengths=lens,
                               kv=kv_dict(canary, kv)), None

    state = dataclasses.replace(state, expected_tokens=expected_tokens)
    state, _ = per_shard(canary, fn, state, rank=(rows_table, row_indices, lengths), kv=kv)
    return dataclasses.replace(state, expected_tokens=None)


@_config.entry_point
def sweep(canary: SglangJaxCanary, state, kv_buffer: jax.Array, prefixes, *, layers=None,
          manager=None):
    """Verify cached prefixes (slot lists, position ``j`` at index ``j``) against the TAIL
    buffers with the SWEEP tags (token check off), ``canary.sweep_rows`` prefixes per launch.
    ``kv_buffer`` is the canary layer's current fused buffer. With ``canary.coverage_window``,
    ``layers`` is every layer's (the pool's ``kv_buffer`` list; required, refused without a
    window) and the digest of every slot of the prefixes is checked too. ``state`` is donated. With
    ``canary.dp_size > 1``, ``prefixes[rank]`` are DP rank ``rank``'s (rank-local slots:
    :func:`radix_prefixes` with ``dp_size``), each verified by that rank's canaries.

    Raises ValueError (our rule, before anything runs or is donated) for a prefix longer than
    ``canary.context_len`` (its tail would go unchecked) or holding a slot outside
    ``[0, canary.num_slots)`` (never verified), and for per-rank lists that are not one per DP
    rank, and for ``layers`` missing with a window (or not holding ``num_layers`` buffers) or
    given without one. The state's expected-token pool is not donated: the returned state keeps
    that very array (a :class:`TokenFeed` still knows the state).

    ``manager``: the :func:`canary_manager` that holds ``state`` (after :func:`observe`, or a
    :class:`ManagedModelRunnerHook`'s): the sweep runs under its lock and the manager holds the
    swept state (``manager.hold``), so a call from another thread never reads the state the
    sweep donated, and what the sweep found is reported by the next step or by ``flush()`` /
    ``close()``. Without it, hand the returned state to the manager yourself."""
    if manager is None:
        return _sweep(canary, state, kv_buffer, prefixes, layers=layers)
    if not getattr(manager, "enabled", False):
        raise ValueError("kv-canary sglang-jax: sweep(manager=...) with a manager that runs "
                         "--kv-canary none (the canary is off)")
    with manager.lock:
        state = _sweep(canary, state, kv_buffer, prefixes, layers=layers)
        hold(manager, canary, state)
    return state


def hold(manager, canary: SglangJaxCanary, state) -> None:
    """``manager.hold(state)`` (a state the server's own launches made between steps: a sweep)
    on any mesh, handed over as :func:`~kvcanary_jax.integrations.sglang_jax.observe` hands a
    step's. :func:`sweep` with ``manager=`` calls it under the manager's lock."""
    on_auto_mesh(canary, state, manager.hold)


def on_auto_mesh(canary: SglangJaxCanary, state, call) -> None:
    """``call(state)``, or, on sglang-jax 0.1.0rc0's Explicit mesh, ``call`` of the same buffers
    (no copy) on the mesh with Auto axes (:meth:`SglangJaxCanary.auto_mesh`), under that mesh:
    how a state reaches the manager."""
    auto = canary.auto_mesh()
    if auto is None:
        call(state)
        return
    view = jax.tree.map(lambda x: jax.device_put(x, NamedSharding(auto, x.sharding.spec)), state)
    with jax.set_mesh(auto):
        call(view)


def _sweep(canary: SglangJaxCanary, state, kv_buffer: jax.Array, prefixes, *, layers=None):
    n, dp = canary.sweep_rows, canary.dp_size
    if layers is not None and not canary.coverage_window:
        raise ValueError("kv-canary sglang-jax: layers= is read by the coverage window only, and "
                         "this canary has coverage_window=0: set it on the canary, or drop layers")
    if canary.coverage_window and layers is None:
        raise ValueError(
            f"kv-canary sglang-jax: coverage_window {canary.coverage_window} checks the digest "
            "of every layer of the cached slots: pass layers= (the pool's kv_buffer list)")
    kv = shard_kv(canary, kv_buffer, layers)
    if dp == 1:
        per_rank = [prefixes]
    else:
        per_rank = list(prefixes)
        if len(per_rank) != dp:
            raise ValueError(f"kv-canary sglang-jax: with {dp} data-parallel ranks, prefixes is "
                             f"one list per rank (radix_prefixes(..., dp_size={dp})), got "
                             f"{len(per_rank)} lists")
    checked = []
    for d, rank_prefixes in enumerate(per_rank):
        where = "prefixes" if dp == 1 else f"prefixes[{d}]"
        rank_prefixes = [host_ints(f"{where}[{i}]", p) for i, p in enumerate(rank_prefixes)]
        for i, p in enumerate(rank_prefixes):
            if p.shape[0] > canary.context_len:
                raise ValueError(f"kv-canary sglang-jax: {where}[{i}] has {p.shape[0]} slots, "
                                 f"more than context_len={canary.context_len}")
            bad = np.nonzero((p < 0) | (p >= canary.num_slots))[0]
            if bad.size:
                raise ValueError(f"kv-canary sglang-jax: {where}[{i}][{bad[0]}] must be a slot "
                                 f"in [0, {canary.num_slots}), got {p[bad[0]]}")
        checked.append(rank_prefixes)
    pool = state.expected_tokens
    state = dataclasses.replace(state, expected_tokens=None)
    launches = max(max((len(r) for r in checked), default=0), 1)
    for start in range(0, launches, n):
        table = np.zeros((dp, n + 1, canary.context_len), np.int32)
        rows = np.zeros((dp, n), np.int64)
        lens = np.zeros((dp, n), np.int64)
        for d, rank_prefixes in enumerate(checked):
            for i, slots in enumerate(rank_prefixes[start : start + n]):
                k = slots.shape[0]
                table[d, i + 1, :k] = slots
                rows[d, i], lens[d, i] = i + 1, k
        state = _sweep_jit(state, pool, table.reshape(dp * (n + 1), -1), rows.reshape(-1),
                           lens.reshape(-1), kv, canary=canary)
    return dataclasses.replace(state, expected_tokens=pool)


# --------------------------------------------------------------------------------------------
# Host side: violations per shard
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ShardViolation:
    """A decoded ring row and the shard (index along :attr:`SglangJaxCanary.axes`) that saw it."""

    shard: int
    violation: kc.Violation

    def __str__(self) -> str:
        return f"shard {self.shard}: {self.violation}"


def violation_counts(state) -> np.ndarray:
    """Violations ever recorded, per shard (negative: the ring guard's host-visible report)."""
    return np.asarray(state.violation_write_index)[:, 0].astype(np.int64)


def read_violations(state, *, start=0) -> list[ShardViolation]:
    """Every shard's ring rows from ``start`` on, shard by shard, in ring order. ``start``: one
    ring index for every shard, or one per shard (e.g. :func:`violation_counts` taken before a
    step, to read what that step added)."""
    ring = np.asarray(state.violation_ring)
    counts = violation_counts(state)
    starts = np.broadcast_to(np.asarray(start, np.int64), counts.shape)
    return [
        ShardViolation(shard=i, violation=v)
        for i in range(ring.shape[0])
        for v in decode_ring(ring[i], int(counts[i]), start=int(starts[i]))
    ]
