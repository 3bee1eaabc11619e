"""The canary runtime a server holds: SGLang 0.5.23's ``CanaryManager`` and its guards, in JAX.

:class:`CanaryManager` owns the canary's device state and runs, per forward step, what SGLang's
runtime (``sglang/srt/kv_canary/runner/``) runs around its kernels:

* **the step**: HEAD -> the model forward -> TAIL in one ``jax.jit`` with the state and the KV
  donated (:meth:`CanaryManager.step`), or HEAD and TAIL around a forward the server runs itself
  (:meth:`CanaryManager.head` / :meth:`CanaryManager.tail`), or only the host side after a step
  the server jitted itself (:meth:`CanaryManager.observe`, e.g. the sglang-jax hook);
* **readback one step late** (``future_tensor.py``): each step's jit also returns a small
  readback in buffers of its own: the ring's write index, the run counters, the plans' enable
  flags and the phase packed into one int64 array, and a copy of the ring. The manager starts
  ``copy_to_host_async`` on the packed array and reads it (``jax.device_get``, an explicit
  transfer) after the *next* step is dispatched, so the step never waits on the host and the
  host never waits on the step it just launched; the ring is copied to the host only for a step
  whose write index shows rows not yet reported (one copy a step instead of one per field);
* **incremental, deduplicated reporting** (``violation_reporter.py``): rows from the last reported
  index on, SGLang's message format, the ring overflow flagged; ``log`` logs each through
  :mod:`logging` (logger ``kvcanary_jax.runtime.manager``), ``raise`` raises
  :class:`CanaryViolationError` (a ``RuntimeError``) once;
* **launch health** (``health_checker.py``): from step 100 on, every 100 steps, a launch tag the
  config runs whose kernel-run counter did not grow raises "canary path is not executing";
* **the overflow warner** (``enable_warner.py``): a verify plan over its capacity is skipped; a
  warning with the running total says so;
* **stats** (``stats_logger.py``): "[canary] step=... protected_tokens=... sweep_passes=...
  violations=..." every ``stats_print_every_n_steps`` steps;
* **the phase check** (SGLang's ``SimplePhaseChecker``): a device-side IDLE -> AFTER_HEAD -> IDLE
  state machine; a TAIL without its HEAD, or two HEADs, is counted on the device and raised on
  the host once :meth:`CanaryManager.mark_init_finished` enabled it;
* **the sweep** (``sweep.py``): every ``sweep_interval`` steps, the prefixes of the attached radix
  walk are re-verified against the TAIL buffers;
* **draft workers**: ``ManagerConfig(draft_worker=True)`` sets SGLang's
  ``kv_token_id_vs_position_offset=1`` and leaves the sweep tags out of the health check (SGLang
  attaches the radix cache to the target worker only); run one manager per draft step.

Ours, not SGLang's:

* **agreement**: the decision to raise (a violation in ``raise`` mode, a stalled launch, a phase
  error, a corrupted write index) is agreed before anyone raises. Over a device mesh
  (``mesh=``, one canary per data-parallel shard) the error flag is reduced (max) over the mesh
  axis inside the step. Across processes (``jax.distributed``), every process all-gathers a small
  summary of what it read back (``multihost_utils.process_allgather``) at every step, so every
  process raises on the same step, naming the rank and the slot, and none is left waiting in a
  collective;
* **remediation**: ``on_violation(report)`` gets each new violation with the request it belongs
  to (the ring row's slot mapped back through the step's batch), before a raise;
* **the padding-slot guard** (``padding_guard``): the sweep also checks that slot 0 (the padding
  slot SGLang's and sglang-jax's allocators never hand out) of the real KV stays all zero; a
  nonzero byte appends a ring row with reason :data:`PADDING_SLOT_NOT_ZERO` (bit 16, ours).

Mode ``none`` builds no state and traces nothing of the canary: :meth:`CanaryManager.step` runs
the forward alone.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from kvcanary_jax import _config, consts
from kvcanary_jax.context import check_write_index
from kvcanary_jax.runtime import host as _host
from kvcanary_jax.runtime import step as _step
from kvcanary_jax.runtime.config import ManagerConfig
from kvcanary_jax.runtime.state import CanaryConfig, CanaryState, check_state, init_state, tag

__all__ = [
    "CanaryManager",
    "CanaryViolationError",
    "ViolationReport",
    "PADDING_SLOT_NOT_ZERO",
    "format_violation",
]

logger = logging.getLogger(__name__)

# Ours: the padding slot 0 of the real KV is not all zero (a ring row with slot 0, position -1,
# ``stored_token`` = how many of its bytes are nonzero). Not one of SGLang's FailReason bits.
PADDING_SLOT_NOT_ZERO = consts.PADDING_SLOT_NOT_ZERO

_IDLE, _AFTER_HEAD = 0, 1
_NUM_TAGS = len(consts.CanaryLaunchTag)
_SWEEP_TAGS = frozenset(t for t in consts.CanaryLaunchTag if t.name.startswith("SWEEP_"))
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


def _reason_label(bit: int) -> str:
    if bit == PADDING_SLOT_NOT_ZERO:
        return "padding_slot_not_zero"
    return consts.FailReason(bit).name.lower().removesuffix("_mismatch")


def _reasons(bits: int) -> list[str]:
    out = [_reason_label(b) for b in consts.FailReason if bits & int(b)]
    if bits & PADDING_SLOT_NOT_ZERO:
        out.append(_reason_label(PADDING_SLOT_NOT_ZERO))
    return out


def format_violation(row: Sequence[int], *, total: int, ring_overflow: bool,
                     step_when_pumped: int) -> str:
    """SGLang's ``_format_violation`` (runner/violation_reporter.py): the frozen one-line
    ``kv_canary violation: key=value ...`` summary, then the human-readable block."""
    (kind, slot, position, stored_token, expected_token, stored_chain_hash, expected_aux,
     bits) = (int(x) for x in row)
    try:
        tag_label = consts.CanaryLaunchTag(kind).name
        canary_kind = (tag_label.lower() if consts.CanaryLaunchTag(kind) in _SWEEP_TAGS
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
    if bits & int(_WRITE_BITS):
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


# ------------------------------------------------------------------------------- device side


def _phase_update(phase, expect, nxt):
    """``phase``: int32 [3] = (phase, errors, enabled). A transition from the wrong phase counts
    an error when enabled (SGLang's device assert, as a counter the host reads back)."""
    bad = (phase[0] != expect) & (phase[2] != 0)
    return jnp.stack([jnp.int32(nxt), phase[1] + bad.astype(jnp.int32), phase[2]])


# The readback's counters and flags, packed per shard into one int64 row (one buffer, one copy to
# the host per step): name -> width. Over a mesh the step appends ``errored`` (the mesh-wide max
# of the shards' error flags, 1 word).
def _word_fields(cfg: CanaryConfig, *, mesh: bool) -> dict[str, slice]:
    widths = (("write_index", 1), ("kernel_runs", _NUM_TAGS), ("slot_runs", _NUM_TAGS),
              ("verify_enable", len(cfg.groups)), ("phase", 3)) + ((("errored", 1),) if mesh else ())
    fields, at = {}, 0
    for name, width in widths:
        fields[name] = slice(at, at + width)
        at += width
    return fields


def _readback(cfg: CanaryConfig, state: CanaryState, phase):
    """What the host reads one step late, as fresh buffers (never aliases of the donated state):
    ``words``, every counter and flag of :func:`_word_fields` in one int64 ``[shards, W]`` array,
    which the host copies every step; and ``ring``, the violation ring, which it copies only when
    ``words`` shows rows not yet reported. A leading shard axis (stacked per-shard states) is kept
    as the first axis of both."""
    shards = state.violation_write_index.size
    # The phase is per shard over a mesh, one for a stack of states handed to observe().
    phase = jnp.broadcast_to(phase.reshape(-1, 3), (shards, 3))
    parts = (state.violation_write_index, state.kernel_run_counters, state.slot_run_counters,
             jnp.stack([state.plans[g][0].enable.reshape(-1) for g in cfg.groups], -1), phase)
    words = jnp.concatenate([x.astype(jnp.int64).reshape(shards, -1) for x in parts], axis=1)
    ring = state.violation_ring
    return {"words": words, "ring": ring.reshape((-1,) + ring.shape[-2:])}


def _append_row(ring, write_index, row):
    """Append one ring row under the ring guard the kernels use: a negative write index records
    nothing and stays; past the capacity only the count grows (saturating at int32 max)."""
    idx = write_index[0]
    cap = ring.shape[0]
    ok = (idx >= 0) & (idx < cap)
    ring = ring.at[jnp.where(ok, idx, cap)].set(row, mode="drop")
    grown = jnp.minimum(idx.astype(jnp.int64) + 1, 2**31 - 1).astype(jnp.int32)
    return ring, jnp.where(idx >= 0, grown, idx).reshape(1)


def _slot0_bytes(src) -> jax.Array:
    """The bytes of the padding row of a real-KV array (slot 0; page 0 of a paged source)."""
    tensor = getattr(src, "tensor", src)
    row = tensor[0]
    if row.dtype != jnp.uint8:
        row = jax.lax.bitcast_convert_type(row, jnp.uint8)
    return row.reshape(-1)


def _padding_guard(cfg: CanaryConfig, state: CanaryState, kv) -> CanaryState:
    kv = _step._as_kv_dict(cfg, kv)
    ring, wi = state.violation_ring, state.violation_write_index
    for group in cfg.groups:
        for half in cfg.halves:
            for src in kv[group][half]:
                nonzero = jnp.sum((_slot0_bytes(src) != 0).astype(jnp.int64))
                row = jnp.array([int(tag("SWEEP", half, group)), 0, -1, 0, 0, 0, 0,
                                 PADDING_SLOT_NOT_ZERO], jnp.int64).at[3].set(nonzero)
                new_ring, new_wi = _append_row(ring, wi, row)
                ring = jnp.where(nonzero > 0, new_ring, ring)
                wi = jnp.where(nonzero > 0, new_wi, wi)
    return dataclasses.replace(state, violation_ring=ring, violation_write_index=wi)


def _fused(state, phase, kv, batch, rtt, lut, *, cfg, forward):
    state = _step.head(cfg, state, batch, rtt, lut)
    phase = _phase_update(phase, _IDLE, _AFTER_HEAD)
    kv = forward(kv, batch, rtt, lut)
    state = _step.tail(cfg, state, batch, lut, kv)
    phase = _phase_update(phase, _AFTER_HEAD, _IDLE)
    return state, phase, kv, _readback(cfg, state, phase)


def _head_only(state, phase, batch, rtt, lut, *, cfg):
    state = _step.head(cfg, state, batch, rtt, lut)
    return state, _phase_update(phase, _IDLE, _AFTER_HEAD)


def _tail_only(state, phase, batch, lut, kv, *, cfg):
    state = _step.tail(cfg, state, batch, lut, kv)
    phase = _phase_update(phase, _AFTER_HEAD, _IDLE)
    return state, phase, _readback(cfg, state, phase)


def _sweep_fn(state, rows_table, row_indices, lengths, lut, kv, *, cfg, guard):
    state = _step._sweep(cfg, state, rows_table, row_indices, lengths, lut, kv)
    return _padding_guard(cfg, state, kv) if guard else state


def _observe_fn(state, phase, *, cfg):
    check_state_any(cfg, state)
    return _readback(cfg, state, phase)


_fused_jit = jax.jit(_fused, static_argnames=("cfg", "forward"), donate_argnums=(0, 1, 2))
_head_jit = jax.jit(_head_only, static_argnames=("cfg",), donate_argnums=(0, 1))
_tail_jit = jax.jit(_tail_only, static_argnames=("cfg",), donate_argnums=(0, 1))
_sweep_jit = jax.jit(_sweep_fn, static_argnames=("cfg", "guard"), donate_argnums=(0,))
_observe_jit = jax.jit(_observe_fn, static_argnames=("cfg",))


def check_state_any(cfg: CanaryConfig, state) -> None:
    """:func:`check_state` for a state or a stack of per-shard states (leading axis)."""
    if state.violation_write_index.ndim == 2:
        state = jax.tree.map(lambda x: x[0], state)
    check_state(cfg, state)


# --------------------------------------------------------------------------------- host side


@dataclasses.dataclass
class _StepContext:
    """What the host keeps of a step until its readback is consumed: the batch and tables (device
    arrays, only read when a violation needs its request) and the requests in batch order."""

    batch: Any = None
    req_to_token: Any = None
    lut: Any = None
    requests: Sequence | None = None
    resolve: Callable[[int, _host.Violation], Any] | None = None


def _resolve_request(ctx: _StepContext | None, v: _host.Violation):
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


class CanaryManager:
    """The canary of one model worker (see the module docstring).

    ``config``: a :class:`ManagerConfig` (SGLang's flags and environment variables).
    ``sizes``: a :class:`~kvcanary_jax.runtime.CanaryConfig` with the server's limits; its
    ring capacity, real-KV mode, token asserts and draft offset are taken from ``config``.
    ``forward(kv, batch, req_to_token, lut) -> kv``: the model forward :meth:`step` runs
    between HEAD and TAIL. ``on_violation(report)``: the remediation callback.
    ``mesh`` / ``axis``: one canary per data-parallel shard over that mesh axis (states, KV,
    batches and tables stacked along a leading axis, :func:`kvcanary_jax.stack_shards`), the
    error flag max-reduced over the axis inside the step.
    ``state``: a state to adopt (e.g. :meth:`observe` over a step the server runs itself).
    Every bad setting raises ``ValueError`` here, before anything is allocated.
    """

    def __init__(self, config: ManagerConfig, sizes: CanaryConfig | None = None, *,
                 forward: Callable | None = None,
                 on_violation: Callable[[ViolationReport], None] | None = None,
                 mesh: jax.sharding.Mesh | None = None, axis: str = "dp",
                 allocate: bool = True):
        if not isinstance(config, ManagerConfig):
            raise ValueError(f"kv-canary: config must be a ManagerConfig, got "
                             f"{type(config).__name__}")
        if on_violation is not None and not callable(on_violation):
            raise ValueError("kv-canary: on_violation must be callable")
        if forward is not None and not callable(forward):
            raise ValueError("kv-canary: forward must be callable")
        self.config = config
        self._forward = forward
        self._on_violation = on_violation
        self._mesh, self._axis = mesh, axis
        self.step_count = 0
        self.sweep_passes = 0
        self.overflow_count_total = 0
        self.state = None
        self.cfg = None
        self._raised = False
        self._pending = None
        self._radix_walk = None
        self._last_sweep_step = -1
        if mesh is not None and axis not in mesh.shape:
            raise ValueError(f"kv-canary: axis {axis!r} is not an axis of the mesh "
                             f"(axes: {', '.join(mesh.axis_names)})")
        if mesh is not None and any(d.process_index != jax.process_index()
                                    for d in mesh.devices.flat):
            # Each process reads back its own shards; across processes the host agreement
            # (agree_across_processes) is the one that decides.
            raise ValueError("kv-canary: the mesh spans devices of other processes; build one "
                             "manager per process over its local devices (processes agree "
                             "through agree_across_processes)")
        agree = config.agree_across_processes
        self._agree = jax.process_count() > 1 if agree is None else agree
        self._rank = jax.process_index()
        if self._agree and config.enabled:
            self._agree_on_config()
        if not config.enabled:
            self._forward_jit = jax.jit(forward, donate_argnums=(0,)) if forward else None
            return
        if not isinstance(sizes, CanaryConfig):
            raise ValueError(f"kv-canary: mode {config.mode!r} needs sizes=CanaryConfig(...) "
                             f"(the server's limits), got {type(sizes).__name__}")
        self.cfg = dataclasses.replace(
            sizes, ring_capacity=config.ring_capacity, real_kv_hash_mode=config.real_data,
            enable_verify_token_assert=config.enable_verify_token_assert,
            enable_write_input_assert=config.enable_write_input_assert,
            kv_token_id_vs_position_offset=config.kv_token_id_vs_position_offset)
        self._shards = 1 if mesh is None else mesh.shape[axis]
        self._reported: list[int] = []
        self._overflow_reported: list[int] = []
        self._prev_kernel_runs = None
        with _config.x64_scope():
            self._lut_dummy = jnp.zeros((1,), jnp.int64)
            self._phase = jnp.array([_IDLE, 0, 0], jnp.int32)
            if allocate:
                self.state = self._init_state()
        self._build()

    # ------------------------------------------------------------------ construction helpers
    def _agree_on_config(self):
        """The first agreement collective, at construction: every process must run the same
        mode, sweep and ring (a process in ``log`` never raises with one in ``raise``), and the
        collective's context is set up here, while the processes are still close in time (CPU
        collectives give a late peer 30 s to join the first one; after it, any delay waits)."""
        from jax.experimental import multihost_utils

        from kvcanary_jax.runtime.config import MODES
        c = self.config
        mine = np.array([MODES.index(c.mode), c.sweep_interval, c.ring_capacity,
                         int(c.padding_guard)], np.int64)
        with jax.transfer_guard("allow"):
            every = np.asarray(multihost_utils.process_allgather(mine)).reshape(-1, mine.size)
        if np.any(every != every[0]):
            rows = "; ".join(f"rank {r}: mode={MODES[int(m)]} sweep_interval={s} "
                             f"ring_capacity={k} padding_guard={bool(g)}"
                             for r, (m, s, k, g) in enumerate(every.tolist()))
            raise ValueError("kv-canary: the processes run different canary settings, so they "
                             f"cannot agree on when to raise: {rows}")

    def _init_state(self):
        # Chain-position assert off until mark_init_finished (SGLang: warm-up steps and graph
        # capture feed synthetic positions that trip it).
        one = init_state(self.cfg, chain_position_assert=False)
        if self._mesh is None:
            return one
        from kvcanary_jax.sharded import stack_shards
        return stack_shards([one] * self._shards, self._mesh, self._axis)

    def _wrap_shards(self, fn, n_in, reduce_flag):
        """``fn`` per shard under ``shard_map`` over stacked inputs (identity without a mesh)."""
        if self._mesh is None:
            return fn
        from jax.sharding import PartitionSpec as P
        axis = self._axis

        def per_shard(*args):
            take = functools.partial(jax.tree.map, lambda x: x[0])
            put = functools.partial(jax.tree.map, lambda x: x[None])
            outs = fn(*(take(a) for a in args))
            if reduce_flag:
                *rest, rb = outs
                # The agreement inside the step: every shard's readback carries the max of the
                # error flags and every shard's write index.
                words = rb["words"]
                wi = words[:, _word_fields(self.cfg, mesh=False)["write_index"]]
                errored = jax.lax.pmax((wi != 0).astype(jnp.int64), axis)
                rb = dict(rb, words=jnp.concatenate([words, errored], axis=1))
                outs = (*rest, rb)
            return put(outs)

        spec = P(axis)
        return jax.shard_map(per_shard, mesh=self._mesh, in_specs=(spec,) * n_in,
                             out_specs=spec, check_vma=False)

    def _build(self):
        cfg, guard, fwd = self.cfg, self.config.padding_guard, self._forward
        if self._mesh is None:
            # Module-level jits keyed by (cfg, forward, guard): managers of one config share
            # their compilations (a server restarts its manager, tests build many).
            self._fused_jit = (functools.partial(_fused_jit, cfg=cfg, forward=fwd)
                               if fwd is not None else None)
            self._head_jit = functools.partial(_head_jit, cfg=cfg)
            self._tail_jit = functools.partial(_tail_jit, cfg=cfg)
            self._sweep_jit = functools.partial(_sweep_jit, cfg=cfg, guard=guard)
            self._observe_jit = functools.partial(_observe_jit, cfg=cfg)
            return
        self._fused_jit = None
        if fwd is not None:
            self._fused_jit = jax.jit(
                self._shard_phase(functools.partial(_fused, cfg=cfg, forward=fwd), 6, True),
                donate_argnums=(0, 1, 2))
        self._head_jit = jax.jit(self._shard_phase(functools.partial(_head_only, cfg=cfg), 5,
                                                   False), donate_argnums=(0, 1))
        self._tail_jit = jax.jit(self._shard_phase(functools.partial(_tail_only, cfg=cfg), 5,
                                                   True), donate_argnums=(0, 1))
        self._sweep_jit = jax.jit(self._wrap_shards(
            functools.partial(_sweep_fn, cfg=cfg, guard=guard), 6, False), donate_argnums=(0,))
        self._observe_jit = jax.jit(functools.partial(_observe_fn, cfg=cfg))

    def _shard_phase(self, fn, n_in, has_readback):
        """Wrap ``fn(state, phase, ...)`` for the mesh: the phase array is replicated per shard
        (stacked inside), and shard 0's copy comes back."""
        if self._mesh is None:
            return fn
        wrapped = self._wrap_shards(fn, n_in, has_readback)
        n = self._shards

        def outer(state, phase, *rest):
            stacked = jnp.broadcast_to(phase, (n,) + phase.shape)
            outs = wrapped(state, stacked, *rest)
            return (outs[0], outs[1][0], *outs[2:])

        return outer

    # ---------------------------------------------------------------------- public surface
    @property
    def enabled(self) -> bool:
        return self.config.enabled

    def mark_init_finished(self) -> None:
        """SGLang's ``mark_init_finished``: warm-up is over; the chain-position assert and the
        phase check are on from the next step."""
        if not self.enabled:
            return
        with _config.x64_scope():
            if self.state is not None:  # observe mode without a state yet: the server's own
                on = jnp.ones_like(self.state.enable_chain_position_assert)
                self.state = dataclasses.replace(self.state, enable_chain_position_assert=on)
            self._phase = jnp.array([_IDLE, 0, 1], jnp.int32)

    def attach_radix_cache(self, walk: Callable[[], tuple]) -> None:
        """SGLang's ``attach_radix_cache``: ``walk()`` returns the sweep's ``(rows_table,
        row_indices, lengths)`` (see :func:`kvcanary_jax.runtime.canary_sweep`), called every
        ``sweep_interval`` steps. A draft worker's manager takes none (SGLang sweeps on the
        target worker only)."""
        if not callable(walk):
            raise ValueError("kv-canary: attach_radix_cache needs a callable returning "
                             "(rows_table, row_indices, lengths)")
        if self.config.draft_worker:
            raise ValueError("kv-canary: a draft worker's manager runs no sweep (SGLang attaches "
                             "the radix cache to the target worker only)")
        if self.config.sweep_interval == 0:
            raise ValueError("kv-canary: attach_radix_cache with --kv-canary-sweep-interval 0: "
                             "the sweep never runs")
        self._radix_walk = walk

    def step(self, kv, batch, req_to_token, lut=None, *, requests: Sequence | None = None,
             resolve: Callable | None = None):
        """One forward step: HEAD -> ``forward`` -> TAIL (state and ``kv`` donated), the sweep
        when due, then the host side (the previous step's readback). Returns the new ``kv``.
        ``requests``: the batch's requests in batch order, handed to ``on_violation`` with the
        violations of their slots (or ``resolve(slot, violation) -> request``)."""
        if not self.enabled:
            if self._forward_jit is None:
                raise ValueError("kv-canary: step() needs the manager built with forward=")
            # Under the same 64-bit scope as the canary modes, so the forward traces alike.
            with _config.x64_scope():
                return self._forward_jit(kv, batch, req_to_token, self._lut(lut))
        if self._fused_jit is None:
            raise ValueError("kv-canary: step() needs the manager built with forward=; use "
                             "head()/tail() around a forward you run yourself")
        if requests is not None and self._mesh is not None:
            raise ValueError("kv-canary: requests= maps slots through one batch; over a mesh "
                             "(stacked batches) pass resolve=(slot, violation) -> request")
        with _config.x64_scope():
            self.state, self._phase, kv, rb = self._fused_jit(
                self.state, self._phase, kv, batch, req_to_token, self._lut(lut))
            try:
                self._after_step(rb, kv, lut,
                                 _StepContext(batch, req_to_token, lut, requests, resolve))
            except CanaryViolationError as e:
                # The KV passed in was donated: the error carries the step's new KV, so a server
                # that survives the raise (remediation) keeps serving from it.
                e.kv = kv
                raise
        return kv

    def head(self, batch, req_to_token, lut=None) -> None:
        """HEAD before a forward the server runs itself (state donated)."""
        self._require_enabled("head")
        with _config.x64_scope():
            self.state, self._phase = self._head_jit(self.state, self._phase, batch, req_to_token,
                                                     self._lut(lut))

    def tail(self, batch, kv, lut=None, *, req_to_token=None, requests=None,
             resolve=None) -> None:
        """TAIL after that forward (fingerprinting ``kv``, not donated), then the sweep when due
        and the host side, as :meth:`step`."""
        self._require_enabled("tail")
        with _config.x64_scope():
            self.state, self._phase, rb = self._tail_jit(self.state, self._phase, batch,
                                                         self._lut(lut), kv)
            self._after_step(rb, kv, lut, _StepContext(batch, req_to_token, lut, requests, resolve))

    def observe(self, state=None, *, requests=None, resolve=None):
        """The host side only, after a step the server jitted itself (its state, possibly
        stacked per shard): stage this step's readback, consume the previous one. No sweep (the
        server runs its own). Returns nothing; raises as :meth:`step`."""
        self._require_enabled("observe")
        if state is not None:
            self.state = state
        with _config.x64_scope():
            rb = self._observe_jit(self.state, self._phase)
            self._after_step(rb, None, None, _StepContext(requests=requests, resolve=resolve),
                             sweep=False)

    def sweep(self, rows_table, row_indices, lengths, *, kv, lut=None) -> None:
        """Run the sweep now over the given rows (the same arrays the attached walk returns),
        for a server that keeps its own sweep schedule (``attach_radix_cache`` runs it every
        ``sweep_interval`` steps instead). Counts as a sweep pass."""
        self._require_enabled("sweep")
        if self.config.sweep_interval == 0:
            raise ValueError("kv-canary: sweep() with --kv-canary-sweep-interval 0")
        walk, self._radix_walk = self._radix_walk, (lambda: (rows_table, row_indices, lengths))
        try:
            self._run_sweep(kv, lut)
        finally:
            self._radix_walk = walk

    def resync(self) -> None:
        """After the state was replaced (a checkpoint restored): drop the pending readback and
        resume reporting from the state's current write index (a host read: not for the hot
        path). The raise-once latch is reset."""
        self._require_enabled("resync")
        self._pending = None
        self._raised = False
        wi = np.asarray(jax.device_get(self.state.violation_write_index)).reshape(-1)
        self._reported = [max(0, min(int(w), self.cfg.ring_capacity)) for w in wi]
        self._overflow_reported = [max(0, int(w)) for w in wi]
        self._prev_kernel_runs = np.asarray(
            jax.device_get(self.state.kernel_run_counters)).reshape(-1, _NUM_TAGS).copy()

    def flush(self) -> None:
        """Consume the pending readback now (end of serving, tests): waits for the last step."""
        if self.enabled and self._pending is not None:
            pending, self._pending = self._pending, None
            self._consume(*pending)

    def close(self) -> None:
        self.flush()

    # ------------------------------------------------------------------------- internals
    def _require_enabled(self, what):
        if not self.enabled:
            raise ValueError(f"kv-canary: {what}() with --kv-canary none (the canary is off)")

    def _lut(self, lut):
        return self._lut_dummy if lut is None else lut

    def _sweep_due(self) -> bool:
        interval = self.config.sweep_interval
        if interval == 0:
            return False
        c = self.step_count
        if self._last_sweep_step >= 0 and c - self._last_sweep_step < interval:
            return False
        self._last_sweep_step = c
        return self._radix_walk is not None

    def _run_sweep(self, kv, lut):
        table, rows, lengths = self._radix_walk()
        with _config.x64_scope():
            args = [jnp.asarray(table, jnp.int32), jnp.asarray(rows, jnp.int64),
                    jnp.asarray(lengths, jnp.int64), self._lut(lut)]
            if self._mesh is not None:
                from kvcanary_jax.sharded import stack_shards
                # One walk per shard: the walk returns stacked arrays, or one shard's arrays
                # repeated on every shard.
                if args[0].ndim == 2:
                    args[:3] = [stack_shards([a] * self._shards, self._mesh, self._axis)
                                for a in args[:3]]
                if args[3].ndim == 1:
                    args[3] = stack_shards([args[3]] * self._shards, self._mesh, self._axis)
            self.state = self._sweep_jit(self.state, *args, kv)
        self.sweep_passes += 1
        logger.info("[canary] sweep succeeded %d times (last_step=%d)", self.sweep_passes,
                    self.step_count)

    def _after_step(self, rb, kv, lut, ctx, *, sweep=True):
        # SGLang's _post_ops_outside_graph: sweep, count the step, then the delayed handlers.
        if sweep and kv is not None and self._sweep_due():
            self._run_sweep(kv, lut)
        self.step_count += 1
        # The ring's copy waits until a step's words show new rows (_consume).
        rb["words"].copy_to_host_async()
        pending, self._pending = self._pending, (self.step_count, rb, ctx)
        if pending is not None:
            self._consume(*pending)

    def _consume(self, step_no, rb, ctx):
        # jax.device_get: an explicit transfer, allowed under transfer_guard("disallow").
        words = np.asarray(jax.device_get(rb["words"]))
        words = words.reshape(-1, words.shape[-1])
        host = {name: words[:, at] for name, at in
                _word_fields(self.cfg, mesh=self._mesh is not None).items()}
        cfg = self.cfg
        cap = cfg.ring_capacity
        # Shards: the mesh's, or the leading axis of a stacked state handed to observe().
        write_index = host["write_index"].reshape(-1)
        shards = write_index.size
        ring_host = None
        if len(self._reported) != shards:
            self._reported = [0] * shards
            self._overflow_reported = [0] * shards
            self._prev_kernel_runs = np.zeros((shards, _NUM_TAGS), np.int64)
        # Phase check.
        phase_errors = int(np.max(np.asarray(host["phase"]).reshape(-1, 3)[:, 1]))
        # Overflow warner (one warning per shard and group whose plan was skipped).
        for s, row in enumerate(np.asarray(host["verify_enable"]).reshape(shards, -1)):
            for g, enable in zip(cfg.groups, row):
                if int(enable) == 0:
                    self.overflow_count_total += 1
                    logger.warning(
                        "kv-canary: per-forward verify skipped this step due to overflow "
                        "(total=%d, capacity=%d); check ServerArgs / pool sizing",
                        self.overflow_count_total, cfg.verify_cap)
        # Violations, from the last reported row on, per shard. Over a mesh, the flag the step
        # max-reduced over the mesh axis says whether any shard has any: none, no ring to scan.
        reports, negative = [], []
        any_errored = "errored" not in host or bool(np.max(host["errored"]))
        for s in range(shards):
            wi = int(write_index[s])
            try:
                check_write_index(wi, f"kv-canary (rank {self._rank} shard {s}):")
            except RuntimeError as e:
                negative.append(str(e))
                continue
            if self._raised or not any_errored:
                continue
            valid = min(wi, cap)
            start = min(self._reported[s], valid)
            overflow = wi > cap
            if overflow and wi > self._overflow_reported[s] and wi > self._reported[s]:
                logger.warning("kv-canary: violation ring overflow on rank %d shard %d: %d "
                               "violations recorded, the ring keeps the first %d "
                               "(SGLANG_KV_CANARY_RING_CAPACITY)", self._rank, s, wi, cap)
                self._overflow_reported[s] = wi
            if start >= valid:
                continue  # no row to report: the ring is not copied
            if ring_host is None:  # the first shard with rows to report this step
                ring_host = np.asarray(jax.device_get(rb["ring"])).reshape(shards, cap, -1)
            ring = ring_host[s]
            for v in _host.decode_ring(ring, wi, start=start):
                msg = format_violation(ring[v.index].tolist(), total=wi, ring_overflow=overflow,
                                       step_when_pumped=step_no)
                reports.append(ViolationReport(violation=v, step=step_no, rank=self._rank,
                                               shard=s, message=msg))
            self._reported[s] = max(self._reported[s], valid)
        # Launch health.
        stalled = self._health(step_no, np.asarray(host["kernel_runs"]))
        # Stats.
        n = self.config.stats_print_every_n_steps
        if n > 0 and step_no % n == 0:
            logger.info("[canary] step=%d protected_tokens=%d sweep_passes=%d violations=%d "
                        "launch_tags_active=%d/%d", step_no, int(np.sum(host["slot_runs"])),
                        self.sweep_passes, int(np.sum(np.maximum(write_index, 0))),
                        len(self._active_tags()), _NUM_TAGS)
        # Remediation: the callback sees every new violation, with its request, before a raise.
        if reports:
            reports = [dataclasses.replace(r, request=_resolve_request(ctx, r.violation))
                       for r in reports]
            if self._on_violation is not None:
                for r in reports:
                    self._on_violation(r)
        self._decide(step_no, reports, stalled, phase_errors, negative)

    def _active_tags(self):
        cfg = self.cfg
        tags = [tag(c, h, g) for g in cfg.groups for c in ("HEAD", "TAIL") for h in cfg.halves]
        if self.config.sweep_interval > 0 and not self.config.draft_worker:
            tags += [tag("SWEEP", h, g) for g in cfg.groups for h in cfg.halves]
        return tags

    def _health(self, step_no, kernel_runs):
        c = self.config
        if step_no < c.health_check_warmup_steps or step_no % c.health_check_every_n_steps:
            return []
        kernel_runs = kernel_runs.reshape(-1, _NUM_TAGS)
        delta = kernel_runs - self._prev_kernel_runs
        self._prev_kernel_runs = kernel_runs.copy()
        tags = self._active_tags()
        # A sweep rarer than the check cannot be expected to have run since the last check.
        if c.sweep_interval > c.health_check_every_n_steps:
            tags = [t for t in tags if t not in _SWEEP_TAGS]
        return [t.name for t in tags if np.any(delta[:, int(t)] == 0)]

    def _decide(self, step_no, reports, stalled, phase_errors, negative):
        raise_mode = self.config.mode == "raise" and not self._raised
        if self.config.mode == "log" or self._raised:
            for r in reports:
                logger.warning(r.message)
        first = reports[0] if reports else None
        kind = (int(consts.CanaryLaunchTag[first.violation.tag])
                if first and first.violation.tag in consts.CanaryLaunchTag.__members__ else -1)
        local = np.array([len(reports) if raise_mode else 0,
                          first.violation.slot if first else -1, kind,
                          first.shard if first else -1,
                          len(stalled), phase_errors, len(negative)], np.int64)
        if self._agree:
            from jax.experimental import multihost_utils
            # Every process calls this at every step (servers step in lockstep), so every
            # process sees every summary and takes the same decision: none raises alone and
            # leaves the others waiting in a collective.
            # A deliberate transfer of a few integers, off the step: allowed even where the
            # server disallows implicit transfers around its hot path.
            with jax.transfer_guard("allow"):
                everyone = np.asarray(multihost_utils.process_allgather(local)).reshape(
                    -1, local.size)
        else:
            everyone = local.reshape(1, -1)
        if not np.any(everyone[:, [0, 4, 5, 6]]):
            return
        ranks = {}
        lines = []
        for rank, (n_new, slot, kind, shard, n_stalled, n_phase, n_neg) in enumerate(
                everyone.tolist()):
            rank = rank if self._agree else self._rank
            where = f"rank {rank}" + (f" shard {shard}" if self._mesh is not None else "")
            if n_new:
                tag_name = consts.CanaryLaunchTag(kind).name if kind >= 0 else "?"
                ranks[rank] = (n_new, slot, tag_name)
                lines.append(f"kv-canary: {where}: {n_new} new violation(s) at step "
                             f"{step_no}, first slot_idx={slot} launch_tag={tag_name}")
            if n_stalled:
                lines.append(f"kv-canary: rank {rank}: {n_stalled} launch tag(s) stopped running")
            if n_phase:
                lines.append(f"kv-canary: rank {rank}: phase check failed {n_phase} time(s)")
            if n_neg:
                lines.append(f"kv-canary: rank {rank}: violation_write_index is negative")
        detail = []
        if stalled:
            # SGLang's health-checker message.
            detail.append(f"kv-canary: kernel_run_counter did not increase since previous check "
                          f"for tags=[{', '.join(stalled)}] at step={step_no}; canary path is "
                          "not executing")
        if phase_errors:
            detail.append(f"kv-canary: phase check failed: {phase_errors} HEAD/TAIL launch(es) "
                          "out of order (SimplePhaseChecker: phase mismatch; a TAIL needs its "
                          "HEAD first, and a HEAD its previous TAIL)")
        detail += negative
        if raise_mode:
            detail += [r.message for r in reports]
        self._raised = True
        raise CanaryViolationError("\n".join(lines + detail), step=step_no,
                                   reports=reports if raise_mode else (), ranks=ranks)

