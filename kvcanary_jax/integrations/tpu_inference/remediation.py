"""Remediation for the tpu-inference guard: :class:`Remediator`, the ``on_violation`` callback
that aborts the request a violation belongs to and evicts its block from vLLM's prefix cache,
and :class:`RequestId`, the request a report names (which request of an id its step ran)."""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from kvcanary_jax.integrations.tpu_inference.guard import TpuInferenceGuard

__all__ = ["Remediator", "RequestId"]


# Incarnation numbers, drawn for the process (guards installed one after another never reuse
# one: a Remediator may see a previous guard's late reports).
_INCARNATIONS = itertools.count(1)


class RequestId(str):
    """A report's request: vLLM's request id (a ``str``, equal to it), and ``incarnation``, which
    request of that id the step ran. A client may send an id again once its request finished,
    and a report arrives a step or two after its step (the readback is a step late, one more
    under async scheduling): :class:`Remediator` aborts the id only while it still names the
    request the step ran."""

    incarnation: int | None

    def __new__(cls, value: str, incarnation: int | None = None):
        out = super().__new__(cls, value)
        out.incarnation = incarnation
        return out

    def __repr__(self) -> str:
        return f"RequestId({str(self)!r}, incarnation={self.incarnation!r})"


class Remediator:
    """The ``on_violation`` callback: aborts the request a violation belongs to through vLLM's
    scheduler (``finish_requests(..., FINISHED_ABORTED)``: its blocks are freed) and evicts the
    violation's block from vLLM's prefix cache, so no later request is served the corrupted
    prefix; the guard forgets every chain through the block.

    ``scheduler``: vLLM's ``Scheduler`` or tpu-inference's ``DPScheduler`` (in the engine
    core's process: with vLLM's multiprocess executors the callback must forward the request
    ids and blocks there). ``evict(rank, block)``: evicts a data-parallel rank's block; by
    default ``scheduler.kv_cache_manager.block_pool.evict_blocks``, which a ``DPScheduler``
    lacks (each rank's scheduler and block pool live in a process of their own, which takes no
    such command): give it one there, idempotent as the pool's is. ``aborted`` / ``evicted``
    (``(rank, block)``) record what was done.

    Every report is acted on, not only a request's or a block's first: vLLM hands an evicted
    block out again and caches it under a new prefix, and a request id may come back. A request
    is aborted while the scheduler still runs it (``finish_requests`` is a no-op on one it
    finished: ``aborted`` records it again only when the scheduler says it finished it again); a
    block is evicted at its first report, and again at a report more than two steps later (the
    rows of the steps that ran before the eviction arrive up to two steps late) once the pool
    has cached it since (with an ``evict`` of your own, which says nothing of the pool, without
    that last condition). A report's request whose id vLLM has given to a new request since (a
    client sending an id again) is not aborted: the report names the step's
    (:class:`RequestId`), and the new one has read nothing of that step."""

    def __init__(self, scheduler, guard: TpuInferenceGuard | None = None, *,
                 evict: Callable[[int, int], Any] | None = None):
        pool = None
        if evict is None:
            pool = getattr(getattr(scheduler, "kv_cache_manager", None), "block_pool", None)
            if pool is None:
                raise ValueError(
                    f"kv-canary tpu-inference: {type(scheduler).__name__} has no "
                    "kv_cache_manager.block_pool to evict a corrupted block from (a DPScheduler "
                    "keeps one per data-parallel rank, in processes of their own): pass "
                    "evict=(rank, block) -> None")
            evict = _pool_evict(pool)
        if not callable(evict):
            raise ValueError("kv-canary tpu-inference: evict must be callable (rank, block)")
        self.scheduler, self.guard, self.evict = scheduler, guard, evict
        self._pool = pool  # the block pool evicted from, where it is the scheduler's
        self.aborted: list[str] = []
        self.evicted: list[tuple[int, int]] = []
        self._step, self._acted = None, set()  # what this report step already did
        self._evicted_at: dict[tuple[int, int], int] = {}  # (rank, block) -> its report step

    def __call__(self, report) -> None:
        from vllm.v1.request import RequestStatus

        v = report.violation
        bs = self.guard.canary.layout.block_size if self.guard is not None else None
        heads = 1
        if self.guard is not None:
            heads = max(self.guard.canary.num_shards // self.guard.canary.data_shards, 1)
        rank = report.shard // heads  # shards are numbered rank-major
        req_id = report.request
        if isinstance(req_id, tuple):  # the block's owners on several ranks: the report's
            req_id = dict(req_id).get(rank)
        if report.step != self._step:
            self._step, self._acted = report.step, set()
        if req_id is not None and not self._same_request(req_id):
            req_id = None  # the id names another request now: nothing of it to abort
        if req_id is not None and ("abort", req_id) not in self._acted:
            self._acted.add(("abort", req_id))
            done = self.scheduler.finish_requests(req_id, RequestStatus.FINISHED_ABORTED)
            # vLLM's and tpu-inference's schedulers return what they finished ([] for an id
            # already finished); a scheduler that returns nothing is recorded once an id.
            if done or (done is None and req_id not in self.aborted):
                self.aborted.append(str(req_id))
        if bs is not None and v.slot >= bs:  # block 0 is vLLM's null block
            block = int(v.slot) // bs
            key = (rank, block)
            last = self._evicted_at.get(key)
            # Rows of the steps that ran before an eviction still arrive after it (the readback
            # is a step late, one more under async scheduling): those are the same incident,
            # and the pool may have cached the block again, for a new request's clean KV.
            if key not in self._acted and (last is None or (
                    report.step > last + _REPORT_LAG and self._cached(block))):
                self._acted.add(key)
                self.evict(rank, block)
                if self.guard is not None:
                    self.guard.cached.drop(rank, block)
                self.evicted.append(key)
                self._evicted_at[key] = report.step

    def _same_request(self, req_id) -> bool:
        """Whether ``req_id`` (a :class:`RequestId`) still names the request its step ran:
        False once that request finished (a new one under the same id may run or wait). True
        where either side does not say (a plain ``str``, no guard to ask)."""
        then = getattr(req_id, "incarnation", None)
        now_of = getattr(self.guard, "incarnation", None)
        if then is None or not callable(now_of):
            return True
        # None now: the step's request finished. vLLM's finish_requests would abort a request of
        # that id still waiting for its first step, which read nothing of it.
        return now_of(req_id) == then

    def _cached(self, block: int) -> bool:
        """Whether the pool caches ``block`` now (True without a pool to ask)."""
        if self._pool is None:
            return True
        blocks = getattr(self._pool, "blocks", None)
        if blocks is None or block >= len(blocks):
            return True
        return getattr(blocks[block], "block_hash", True) is not None


# Steps after an eviction whose reports may still be rows recorded before it: the readback is
# one step late, and one more under async scheduling.
_REPORT_LAG = 2


def _pool_evict(pool):
    def evict(rank, block):
        pool.evict_blocks({block})
    return evict
