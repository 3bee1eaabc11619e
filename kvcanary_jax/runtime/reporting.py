"""Reporting: SGLang 0.5.23's ``violation_reporter.py`` (its message format, incremental rows, the
ring overflow flagged) and the once-only bookkeeping that holds across everything a server does.

**What is reported, and how often.** A *violation* is one ring row of the canary state. The
:class:`Reporter` keeps, per shard, how many rows were reported; a readback reports the rows from
there to its write index (capped at the ring's capacity), each exactly once, whatever happened in
between:

* **raises**: a raise reports the rows it carries, and only those; the next readback reports the
  rows recorded after them (a raise silences nothing that comes later);
* **state swaps**: a state whose write index or any launch tag's run counter went *back* since the
  previous readback does not continue the one reported so far (a fresh ``init_state()`` handed to
  ``observe``, a state assigned by hand): its ring is reported from row 0, with a warning. After
  restoring a checkpoint whose rows were reported already, :meth:`Reporter.rebase` (the manager's
  ``resync()``) resumes from its write index instead;
* **failing callbacks**: the requests are resolved (``resolve=`` or ``requests=``) and, in log
  mode, every row is logged before ``on_violation`` is called for any; a callback that raises is
  kept (:class:`CallbackFailure`), every other row still reaches ``on_violation``, and the caller
  raises :class:`CanaryCallbackError`, which carries the rows;
* a negative write index (something overwrote the canary's own state) is reported once per value.

Errors: :class:`CanaryViolationError` (a ``RuntimeError``, as SGLang raises) and its two kinds,
:class:`CanaryCallbackError` (a callable the server handed in raised; ``__cause__`` is its
exception) and :class:`CanaryAgreementError` (the processes could not agree within the agreement
timeout; ``peers`` names the ranks). Raised from a step, each carries that step's KV.

Every message goes through the logger named :data:`LOGGER_NAME` (``kvcanary_jax.runtime.manager``,
as before the runtime was split into these modules).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable, Sequence

import jax
import numpy as np

from kvcanary_jax import consts
from kvcanary_jax.context import check_write_index
from kvcanary_jax.runtime import host as _host

__all__ = [
    "LOGGER_NAME",
    "PADDING_SLOT_NOT_ZERO",
    "CanaryViolationError",
    "CanaryCallbackError",
    "CanaryAgreementError",
    "ViolationReport",
    "format_violation",
    "StepContext",
    "CallbackFailure",
    "Reporter",
]

LOGGER_NAME = "kvcanary_jax.runtime.manager"
logger = logging.getLogger(LOGGER_NAME)

# Ours: the padding slot 0 of the real KV is not all zero (a ring row with slot 0, position -1,
# ``stored_token`` = how many of its bytes are nonzero). Not one of SGLang's FailReason bits.
PADDING_SLOT_NOT_ZERO = consts.PADDING_SLOT_NOT_ZERO

SWEEP_TAGS = frozenset(t for t in consts.CanaryLaunchTag if t.name.startswith("SWEEP_"))
_WRITE_BITS = consts.FailReason.WRITE_TOKEN_MISMATCH | consts.FailReason.WRITE_POSITION_MISMATCH
_TOKEN_BITS = consts.FailReason.WRITE_TOKEN_MISMATCH | consts.FailReason.VERIFY_TOKEN_MISMATCH
_U64 = (1 << 64) - 1


class CanaryViolationError(RuntimeError):
    """Raised in ``raise`` mode (and, in every mode, by the health and phase checks). SGLang
    raises ``RuntimeError``; this subclass also carries what was found: ``step``, ``reports``
    (this process's :class:`ViolationReport` list) and ``ranks`` (``{rank: (new violations,
    first slot, first launch tag)}`` over every process that found something). Raised from
    :meth:`CanaryManager.step`, it also carries ``kv``: that step's new KV (the KV passed in was
    donated), for a server that remediates and keeps serving."""

    def __init__(self, message: str, *, step: int, reports=(), ranks=None):
        super().__init__(message)
        self.step = step
        self.kv = None  # set by CanaryManager.step: the KV of the step that raised
        self.reports = tuple(reports)
        self.ranks = dict(ranks or {})


class CanaryCallbackError(CanaryViolationError):
    """A callable the server handed the manager raised: ``on_violation``, ``resolve=`` or the
    radix walk of ``attach_radix_cache``. ``callback`` names it, ``__cause__`` is its exception;
    ``reports`` are the violations of that readback (each also logged in log mode, and handed to
    ``on_violation`` unless that is what failed for it); ``kv`` is the step's KV."""

    def __init__(self, message: str, *, callback: str, step: int, reports=(), ranks=None):
        super().__init__(message, step=step, reports=reports, ranks=ranks)
        self.callback = callback


class CanaryAgreementError(CanaryViolationError):
    """The processes could not agree within ``ManagerConfig.agreement_timeout_s``: ``peers`` are
    the ranks that did not answer (hung, dead, or no longer stepping in lockstep). ``reports``
    are this process's own new violations of that readback (logged in log mode); ``kv`` is the
    step's KV."""

    def __init__(self, message: str, *, peers: Sequence[int], step: int, reports=(), ranks=None):
        super().__init__(message, step=step, reports=reports, ranks=ranks)
        self.peers = tuple(peers)


class CanaryStateLost(RuntimeError):
    """A step failed on the device after it had taken the canary's state (donated), and, for
    :meth:`CanaryManager.step`, the KV passed in: both are gone (``__cause__`` is the device's
    error). The manager holds no state from then on, and its steps refuse with this error until
    the server sets one (``manager.state = ...``)."""


def state_consumed(state) -> bool:
    """Whether any array of ``state`` was deleted: donated to a computation that failed on the
    device (a failure while tracing donates nothing)."""
    return state is not None and any(
        getattr(leaf, "is_deleted", lambda: False)() for leaf in jax.tree_util.tree_leaves(state))


def failure_line(e: BaseException) -> str:
    """``Type: first line`` of an error (XLA's run-time errors carry whole tracebacks)."""
    return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:200]}"


@dataclasses.dataclass(frozen=True)
class ViolationReport:
    """One new violation as the manager reports it: the decoded ring row, the outer step whose
    readback carried it, the process (``rank``) and shard (``shard``, 0 without a mesh), and the
    request it belongs to (``None`` where the slot maps to no request of that step's batch, e.g. a
    sweep row)."""

    violation: _host.Violation
    step: int
    rank: int
    shard: int
    request: Any = None
    message: str = ""


# Ours, beside SGLang's FailReason bits: bit -> label.
_OUR_LABELS = {PADDING_SLOT_NOT_ZERO: "padding_slot_not_zero",
               consts.KV_DIGEST_MISMATCH: "kv_digest"}


def _reason_label(bit: int) -> str:
    if bit in _OUR_LABELS:
        return _OUR_LABELS[bit]
    return consts.FailReason(bit).name.lower().removesuffix("_mismatch")


def _reasons(bits: int) -> list[str]:
    out = [_reason_label(b) for b in consts.FailReason if bits & int(b)]
    return out + [label for bit, label in _OUR_LABELS.items() if bits & bit]


def format_violation(row: Sequence[int], *, total: int, ring_overflow: bool,
                     step_when_pumped: int) -> str:
    """SGLang's ``_format_violation`` (runner/violation_reporter.py): the frozen one-line
    ``kv_canary violation: key=value ...`` summary, then the human-readable block."""
    (kind, slot, position, stored_token, expected_token, stored_chain_hash, expected_aux,
     bits) = (int(x) for x in row)
    try:
        tag_label = consts.CanaryLaunchTag(kind).name
        canary_kind = (tag_label.lower() if consts.CanaryLaunchTag(kind) in SWEEP_TAGS
                       else f"per_forward_{tag_label.lower()}")
    except ValueError:
        tag_label = canary_kind = f"unknown({kind})"
    reasons = _reasons(bits)
    structured = (
        f"kv_canary violation: launch_tag={tag_label} "
        f"fail_reason={'+'.join(reasons) if reasons else 'none'} slot_idx={slot} "
        f"position={position} stored_token={stored_token} expected_token={expected_token} "
        f"stored_chain_hash={stored_chain_hash & _U64:#018x} expected_aux={expected_aux & _U64:#018x}"
    )
    header = (f"KV cache canary violation detected (kernel_kind={tag_label}, slot_idx={slot}, "
              f"position={position})")
    if bits & consts.KV_DIGEST_MISMATCH:
        # Ours (the coverage digest): the stored digest in the chain-hash field, the one
        # recomputed from the KV bytes in the aux field.
        body = [f"  stored:   kv_digest={stored_chain_hash & _U64:#018x}   position={position}",
                f"  expected: kv_digest={expected_aux & _U64:#018x} (every layer's K and V, "
                "recomputed)"]
    elif bits & int(_WRITE_BITS):
        body = [f"  actual:   token_id={stored_token}   position={position} "
                f"prev_hash={stored_chain_hash & _U64:#018x}",
                f"  expected: token_id={expected_token}   position={expected_aux}"]
    else:
        expected = (f"  expected: token_id={expected_token} prev_hash={expected_aux & _U64:#018x}"
                    if bits & int(_TOKEN_BITS) else
                    f"  expected: prev_hash={expected_aux & _U64:#018x}")
        body = [f"  stored:   token_id={stored_token}   position={position} "
                f"prev_hash={stored_chain_hash & _U64:#018x}", expected]
    return "\n".join([structured, header, f"canary_kind:       {canary_kind}",
                      f"  fail_reasons: {' '.join(reasons) if reasons else 'none'}", *body,
                      f"  total_violations={total} ring_overflow={ring_overflow} "
                      f"step_when_pumped={step_when_pumped}"])


# ------------------------------------------------------------------ the requests of a step


@dataclasses.dataclass
class StepContext:
    """What the host keeps of a step until its readback is consumed: the batch and tables (device
    arrays, only read when a violation needs its request), the requests in batch order, and the
    epoch of the phase array the step ran with (see :class:`~kvcanary_jax.runtime.health.
    PhaseCheck`)."""

    batch: Any = None
    req_to_token: Any = None
    lut: Any = None
    requests: Sequence | None = None
    resolve: Callable[[int, _host.Violation], Any] | None = None
    phase_epoch: int = 0


def resolve_request(ctx: StepContext | None, v: _host.Violation):
    """The request owning ``v``'s slot: ``ctx.resolve(slot, v)``, or the request of
    ``ctx.requests`` whose row of the step's batch holds the slot (``None``: no such request)."""
    if ctx is None:
        return None
    if ctx.resolve is not None:
        return ctx.resolve(v.slot, v)
    if ctx.requests is None or ctx.batch is None or ctx.req_to_token is None:
        return None
    # The violation path only (rare): the batch is read back here, explicitly.
    rpi, pre, ext = (np.asarray(jax.device_get(x)) for x in (
        ctx.batch.req_pool_indices, ctx.batch.prefix_lens, ctx.batch.extend_seq_lens))
    table = np.asarray(jax.device_get(ctx.req_to_token))
    slots = {int(v.slot)}
    if v.group == "SWA" and ctx.lut is not None:
        lut = np.asarray(jax.device_get(ctx.lut))
        slots = {int(s) for s in np.nonzero(lut == v.slot)[0]}
    for i, req in enumerate(ctx.requests):
        n = int(pre[i] + ext[i])
        if n and slots.intersection(int(s) for s in table[int(rpi[i]), :n]):
            return req
    return None


@dataclasses.dataclass(frozen=True)
class CallbackFailure:
    """The first exception a server's callable raised while a readback was reported."""

    callback: str  # "on_violation" or "resolve"
    error: BaseException


# ------------------------------------------------------------------ once-only bookkeeping


@dataclasses.dataclass
class _Shard:
    reported: int = 0  # ring rows reported
    overflow_reported: int = 0  # the write index the last overflow warning named
    negative_reported: int = 0  # the negative write index reported last (0: none)
    write_index: int | None = None  # as the previous readback saw it
    kernel_runs: np.ndarray | None = None  # per launch tag, as the previous readback saw them


class Reporter:
    """Which ring rows of each shard were reported (see the module docstring)."""

    def __init__(self, ring_capacity: int, rank: int):
        self.capacity = ring_capacity
        self.rank = rank
        self._shards: list[_Shard] = []

    def _fit(self, shards: int) -> None:
        # Shards: the mesh's, or the leading axis of a stacked state handed to observe().
        if len(self._shards) != shards:
            self._shards = [_Shard() for _ in range(shards)]

    def rebase(self, write_index: np.ndarray, kernel_runs: np.ndarray) -> None:
        """Resume from these write indices (a restored checkpoint whose rows were reported)."""
        write_index = np.asarray(write_index).reshape(-1)
        kernel_runs = np.asarray(kernel_runs).reshape(write_index.size, -1)
        self._shards = [_Shard(reported=max(0, min(int(w), self.capacity)),
                               overflow_reported=max(0, int(w)), write_index=int(w),
                               kernel_runs=k.copy())
                        for w, k in zip(write_index, kernel_runs)]

    def _replaced(self, s: int, shard: _Shard, wi: int, kernel_runs: np.ndarray) -> bool:
        if shard.write_index is None:
            return False
        went_back = [f"write index {shard.write_index} -> {wi}"] if wi < shard.write_index else []
        if np.any(kernel_runs < shard.kernel_runs):
            went_back.append("launch run counters went back")
        if not went_back:
            return False
        logger.warning("kv-canary: rank %d shard %d: the canary state was replaced (%s): it does "
                       "not continue the state reported so far, so its ring is reported from row "
                       "0 (after restoring a checkpoint whose rows were reported, call resync() "
                       "instead)", self.rank, s, "; ".join(went_back))
        return True

    def new_rows(self, step_no: int, write_index: np.ndarray, kernel_runs: np.ndarray, *,
                 any_errored: bool, ring: Callable[[], np.ndarray]):
        """The rows not reported yet, per shard, as :class:`ViolationReport` (no request yet);
        the messages of the shards whose write index turned negative; and, per shard whose ring
        is full, the violations recorded since the last readback past its capacity (counted,
        their rows dropped: ``(shard, count, message)``). ``ring()`` copies the rings to the
        host (``[shards, capacity, fields]``), called only when a row is due."""
        write_index = np.asarray(write_index).reshape(-1)
        kernel_runs = np.asarray(kernel_runs).reshape(write_index.size, -1)
        self._fit(write_index.size)
        reports, negative, unrecorded = [], [], []
        ring_host = None
        for s, shard in enumerate(self._shards):
            wi = int(write_index[s])
            try:
                check_write_index(wi, f"kv-canary (rank {self.rank} shard {s}):")
            except RuntimeError as e:
                if shard.negative_reported != wi:
                    negative.append(str(e))
                    shard.negative_reported = wi
                continue
            shard.negative_reported = 0
            if self._replaced(s, shard, wi, kernel_runs[s]):
                shard.reported = shard.overflow_reported = 0
            shard.write_index, shard.kernel_runs = wi, kernel_runs[s].copy()
            if not any_errored:
                continue
            valid = min(wi, self.capacity)
            start = min(shard.reported, valid)
            overflow = wi > self.capacity
            if overflow and wi > shard.overflow_reported and wi > shard.reported:
                logger.warning("kv-canary: violation ring overflow on rank %d shard %d: %d "
                               "violations recorded, the ring keeps the first %d "
                               "(SGLANG_KV_CANARY_RING_CAPACITY)", self.rank, s, wi,
                               self.capacity)
                lost = wi - max(shard.overflow_reported, self.capacity)
                unrecorded.append((s, lost, (
                    f"kv-canary: rank {self.rank} shard {s}: {lost} more violation(s) by step "
                    f"{step_no} past the ring's {self.capacity} rows, not recorded (their slots "
                    f"are unknown; {wi} recorded in all; SGLANG_KV_CANARY_RING_CAPACITY)")))
                shard.overflow_reported = wi
            if start >= valid:
                continue  # no row to report: the ring is not copied
            if ring_host is None:  # the first shard with rows to report in this readback
                ring_host = ring()
            rows = ring_host[s]
            for v in _host.decode_ring(rows, wi, start=start):
                msg = format_violation(rows[v.index].tolist(), total=wi, ring_overflow=overflow,
                                       step_when_pumped=step_no)
                reports.append(ViolationReport(violation=v, step=step_no, rank=self.rank,
                                               shard=s, message=msg))
            shard.reported = valid
        return reports, negative, unrecorded

    @staticmethod
    def hand_over(reports: list[ViolationReport], ctx: StepContext | None, *, log: bool,
                  on_violation: Callable | None):
        """Resolve each report's request, log it (``log``), then hand each to ``on_violation``.
        A callable that raises stops nothing: the report keeps no request (``resolve``) or the
        next report is handed over still (``on_violation``). Returns the reports and the first
        :class:`CallbackFailure` (or ``None``)."""
        failure = None
        resolved = []
        for r in reports:
            try:
                request = resolve_request(ctx, r.violation)
            except Exception as e:  # noqa: BLE001 - kept, and raised by the caller
                request = None
                failure = failure or CallbackFailure("resolve", e)
            resolved.append(dataclasses.replace(r, request=request))
        if log:
            for r in resolved:
                logger.warning(r.message)
        if on_violation is not None:
            for r in resolved:
                try:
                    on_violation(r)
                except Exception as e:  # noqa: BLE001 - kept, and raised by the caller
                    failure = failure or CallbackFailure("on_violation", e)
        return resolved, failure
