"""Coverage (ours, not SGLang's; docs/spec.md §17): every byte of every layer's K and V of every
live slot verified within a stated window of steps, at a share of the read traffic per step.

SGLang's real-KV fingerprint (``none`` / ``partial`` / ``all``) reads layer 0 only; it is left as it
is. With ``CanaryConfig.coverage_window`` N >= 1, each buffer group also keeps a per-slot KV digest
(:func:`kvcanary_jax.digest_write` / :func:`kvcanary_jax.digest_verify`, docs/spec.md §16) over
every layer of the group's KV (:func:`kvcanary_jax.runtime.kv.digest_sources`):

* **TAIL of step T** (steps numbered from 1, after the forward wrote the KV): stamp the digest of
  every slot the step wrote (``out_cache_loc``, SWA slots through the LUT), then check the digest
  of the TAIL verify plan's slots with ``slot % N == T % N``. A slot read by N consecutive steps
  is checked in one of them. The step's counters (the written slots' stamps, the read slots'
  runs and checks) go in with one scatter.
* **the sweep** (after a step): check the digest of every slot its plan walks (the cached
  prefixes), whatever the phase. When the sweep runs at least every N steps
  (``CanaryConfig.sweep_interval``), a TAIL leaves out of its check the read slots of the
  FULL group whose content the last sweep checked, fewer than N steps before: the next sweep
  checks them within N steps of the last, so the guarantee holds without reading their bytes
  twice in a window (a sweep that does not come shows in the report below).
* **never-stamped slots are not checked**: a slot whose digest no earlier step stamped under
  this state (warm-up or capture batches that read slots no guarded forward wrote, a state built
  over a pool that already held KV) has nothing to be checked against; it is left out of the
  launch (its slot passed as -1) instead of reported against a digest of 0. It counts as live and
  unverified in the report below, so the gap shows.
* **the report** (:func:`counts`, on the device; :class:`CoverageStats` on the host): per slot,
  the step counters of :class:`~kvcanary_jax.runtime.state.SlotCoverage`. The guarantee is due
  for the slots *read in each of the last N steps* (a read run of N steps) and the slots *the
  last sweep walked*; these are the live slots, and a live slot is verified when its digest was
  checked in the last N steps (a slot in a read run, whoever checked it) or at or after the
  last sweep (a walked slot in no read run). The
  share is over KV bytes (each slot counts its group's digest bytes), and is exactly 1 when the
  guarantee held; ``read`` bytes (slots read at least once in the last N steps) are given beside
  it. Computing it reads every counter of the pool once: the manager does it only for its stats
  line (``stats_print_every_n_steps``) and on request.

Digest mismatches are ring rows with reason ``KV_DIGEST_MISMATCH`` (1 << 17) under the group's
``TAIL_K`` or ``SWEEP_K`` launch tag (the digest covers both halves of every layer); the digest
launches count in :class:`~kvcanary_jax.runtime.state.SlotCoverage`'s own counters, so SGLang's
per-tag counters keep their meaning.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from kvcanary_jax import _config
from kvcanary_jax.context import DigestContext
from kvcanary_jax.ops._contract_lib import int64_stand_in
from kvcanary_jax.ops.digest import api as digest_api
from kvcanary_jax.ops.digest import base as digest_base
from kvcanary_jax.ops.digest import digest_verify
from kvcanary_jax.runtime.kv import digest_sources, translate
from kvcanary_jax.runtime.state import (SLOT_STEPS, CanaryConfig, CanaryState, check_state_any,
                                         tag)

__all__ = ["at_tail", "at_sweep", "counts", "GroupCoverage", "CoverageStats", "from_counts",
           "coverage_stats"]


# The columns of SlotCoverage.steps.
_W, _RF, _RA, _CK, _SW = (SLOT_STEPS.index(f) for f in (
    "written_at", "read_from", "read_at", "checked_at", "swept_at"))


def _stamps(steps, *parts):
    """``steps`` (``[slots, 5]``) with, for each part ``(where, idx, column, value)``,
    ``steps[idx[e], column] = value[e]`` where ``where[e]`` holds (the other entries dropped):
    one scatter for every part. Entries naming the same slot and column carry the same value."""
    n = steps.shape[0]
    rows, cols, vals = [], [], []
    for where, idx, column, value in parts:
        rows.append(jnp.where(where, idx, n).astype(jnp.int64))
        cols.append(jnp.full(idx.shape, column, jnp.int64))
        vals.append(jnp.broadcast_to(value, idx.shape).astype(steps.dtype))
    return steps.at[jnp.concatenate(rows), jnp.concatenate(cols)].set(
        jnp.concatenate(vals), mode="drop")


def _at(arr, idx, where):
    """``arr[idx[e]]`` where ``where`` holds (slot 0's value elsewhere, to be masked)."""
    return arr[jnp.where(where, idx, 0)]


def _plan_reads(vplan, num_slots: int):
    """The plan's slots and which entries a verify reads: below its count, plan enabled (an
    overflowed plan verifies nothing, and says so through the overflow warning), slot in
    ``(0, num_slots)`` (slot 0 is the padding slot)."""
    slots = vplan.verify_slot_indices
    cap = slots.shape[0]
    n = jnp.clip(vplan.verify_num_valid[0], 0, cap)
    read = ((jnp.arange(cap) < n) & (vplan.enable[0] != 0) & (slots > 0) & (slots < num_slots))
    return slots, read


def _check(cfg, sc, vplan, checkable, *, phase, window, sources, group, ring, widx, copy,
           checked_slots=None):
    """One digest check (``copy``: ``"TAIL"`` or ``"SWEEP"``) of the plan's entries that
    ``checkable`` holds (read, and stamped; ``checked_slots``: the plan's slots there, -1
    elsewhere, when the caller has them); returns ``(context after the launch, the entries it
    checked)``."""
    slots = vplan.verify_slot_indices
    if checked_slots is None:
        checked_slots = jnp.where(checkable, slots, -1)
    prefix = copy.lower()
    ctx = DigestContext(digest_buf=sc.digest, kernel_kind=int(tag(copy, "K", group)),
                        violation_ring=ring, violation_write_index=widx,
                        slot_run_counter=getattr(sc, f"{prefix}_slot_runs"),
                        kernel_run_counter=getattr(sc, f"{prefix}_kernel_runs"))
    ctx = digest_verify(ctx, checked_slots, vplan.verify_expected_positions,
                        vplan.verify_num_valid, phase, window=window, sources=sources,
                        implementation=cfg.implementation)
    # The op's selection (docs/spec.md §16.3), on the entries handed to it.
    p = jnp.remainder(phase[0].astype(jnp.int64), window)
    checked = checkable & (jnp.remainder(jnp.where(checkable, slots, 0), window) == p)
    return ctx, checked


def at_tail(cfg: CanaryConfig, state: CanaryState, batch, lut, kv) -> CanaryState:
    """The coverage part of step T's TAIL (traceable; after SGLang's TAIL launches): stamp the
    written slots' digests, check the read slots of phase ``T % N`` stamped by an earlier step,
    advance the counters."""
    cov = state.coverage
    window = cfg.coverage_window
    # Materialized once: fused into each reader, the step's old value would have to outlive its
    # in-place update, and XLA would copy it.
    t = jax.lax.optimization_barrier(cov.step + 1)
    ring, widx = state.violation_ring, state.violation_write_index
    groups = {}
    for group in cfg.groups:
        sc = cov.groups[group]
        n = cfg.group_slots(group)
        sources = digest_sources(cfg, kv, group)
        nbytes = sum(s.read_bytes for s in sources)
        loc = translate(group, batch.out_cache_loc, lut)
        # digest_write's checks and its array-level write, which takes int32 slots as they are.
        bound = digest_base.validate_write(sc.digest, int64_stand_in(loc), sources)
        sc = dataclasses.replace(sc, digest=digest_api.write(
            sc.digest, loc, bound, implementation=cfg.implementation))
        vplan = state.plans[group][0]
        slots, read = _plan_reads(vplan, n)
        # The read slots' counters as the step found them, gathered once before the one scatter
        # that stamps this step's: the slots pass through a barrier with them, so that the
        # scatter (indexed by those slots) runs after the gather (a reader of the old values
        # left unordered makes XLA copy the array). What the check takes is computed before the
        # barrier too. Each counter is gathered as a column of its own, so that every array here
        # has one element a plan entry and XLA computes them all in one kernel (a [entries, 5]
        # gather was a kernel of its own, and the check's slots recomputed it in another).
        at = jnp.where(read, slots, 0)
        written, read_from, read_at = (sc.steps[at, c] for c in (_W, _RF, _RA))
        due = read & (written >= 0)
        if cfg.sweep_covers_reads and not cfg.window(group):
            # A slot whose content the last sweep checked, fewer than N steps ago, is checked
            # again by the next sweep, within N steps of the last: this phase check is left to
            # it (a slot checked by a TAIL since is due again N steps later, after that sweep;
            # one written since holds content no sweep checked: a slot freed and handed out
            # again keeps its old checked_at). Not in the SWA group: its read window slides, a
            # slot the sweep walked may still be read after the next sweep's window left it.
            last = cov.last_sweep[0]
            recent = (last >= 0) & (t[0] - last < window)
            swept = (sc.steps[at, _CK] >= last) & (written <= last)
            due = due & ~(recent & swept)
        read_from, read_at, due, checked_slots, slots = jax.lax.optimization_barrier(
            (read_from, read_at, due, jnp.where(due, slots, -1), slots))
        ctx, checked = _check(cfg, sc, vplan, due, phase=t, window=window, sources=sources,
                              group=group, ring=ring, widx=widx, copy="TAIL",
                              checked_slots=checked_slots)
        ring, widx = ctx.violation_ring, ctx.violation_write_index
        # A read run goes on when the slot was read by the step before.
        run_from = jnp.where(read_at == t - 1, read_from, t)
        steps = _stamps(sc.steps, ((loc >= 0) & (loc < n), loc, _W, t),
                        (read, slots, _RF, run_from), (read, slots, _RA, t),
                        (checked, slots, _CK, t))
        groups[group] = dataclasses.replace(
            sc, steps=steps,
            # Updated from its own value, not stored as a constant (a copy into place each step).
            digest_bytes=jnp.where(sc.digest_bytes == nbytes, sc.digest_bytes, nbytes),
            tail_slot_runs=ctx.slot_run_counter, tail_kernel_runs=ctx.kernel_run_counter)
    return dataclasses.replace(state, violation_ring=ring, violation_write_index=widx,
                               coverage=dataclasses.replace(cov, groups=groups, step=t))


def at_sweep(cfg: CanaryConfig, state: CanaryState, plans: dict, kv) -> CanaryState:
    """The coverage part of a sweep (traceable): check every slot of each group's sweep plan
    (``plans[group]``, a :class:`~kvcanary_jax.VerifyPlan`) whose digest was stamped."""
    cov = state.coverage
    t = cov.step
    ring, widx = state.violation_ring, state.violation_write_index
    groups = {}
    for group in cfg.groups:
        sc = cov.groups[group]
        vplan = plans[group]
        slots, read = _plan_reads(vplan, cfg.group_slots(group))
        written, slots = jax.lax.optimization_barrier((_at(sc.written_at, slots, read), slots))
        # Every walked slot, whatever the phase: window 1.
        ctx, checked = _check(cfg, sc, vplan, read & (written >= 0),
                              phase=jnp.zeros((1,), jnp.int32), window=1,
                              sources=digest_sources(cfg, kv, group), group=group, ring=ring,
                              widx=widx, copy="SWEEP")
        ring, widx = ctx.violation_ring, ctx.violation_write_index
        groups[group] = dataclasses.replace(
            sc, steps=_stamps(sc.steps, (checked, slots, _CK, t), (read, slots, _SW, t)),
            sweep_slot_runs=ctx.slot_run_counter, sweep_kernel_runs=ctx.kernel_run_counter)
    return dataclasses.replace(state, violation_ring=ring, violation_write_index=widx,
                               coverage=dataclasses.replace(cov, groups=groups, last_sweep=t))


# ----------------------------------------------------------------------------------- the report

def counts(cfg: CanaryConfig, state: CanaryState) -> dict:
    """The report's counts (traceable; a stack of per-shard states is summed), int64 scalars:
    ``groups[group]`` by :class:`GroupCoverage` field, ``step`` and ``last_sweep``."""
    cov = state.coverage
    window = cfg.coverage_window
    t, last = cov.step, cov.last_sweep  # [1], or [shards, 1]: broadcast against [..., slots]
    groups = {}
    for group in cfg.groups:
        sc = cov.groups[group]
        in_run = (sc.read_at == t) & (sc.read_from <= t - window + 1)
        # Cached as the last sweep walked it: a slot written since (freed and handed out again)
        # holds other content, live again once read N steps in a row.
        walked = (sc.swept_at == last) & (last >= 0) & (sc.written_at <= last)
        # A slot in a read run is verified by a check in the last N steps, whoever made it, or
        # by the last sweep when that sweep is N steps old: the steps left the slot to the next
        # one, due after this step (the report may be read before it runs). A cached slot is
        # verified by the last sweep while it is at most K steps old (the stated interval; N
        # where none is; not aged where the interval counts calls, not steps). A sweep that did
        # not come (late, its walk failed) shows from the next step on, for both. A check
        # before the slot's last write saw other content.
        by_sweep = walked & (sc.checked_at >= last)
        due = by_sweep & (last >= t - window)
        cached = by_sweep
        if cfg.sweep_in_steps:
            cached = cached & (last >= t - (cfg.sweep_interval or window))
        checked = (sc.checked_at > t - window) & (sc.checked_at >= sc.written_at)
        verified = jnp.where(in_run, checked | due, cached)
        read = (sc.read_at >= 1) & (sc.read_at > t - window)
        groups[group] = dict(live_slots=jnp.sum(in_run | walked, dtype=jnp.int64),
                             verified_slots=jnp.sum(verified, dtype=jnp.int64),
                             read_slots=jnp.sum(read, dtype=jnp.int64),
                             bytes_per_slot=jnp.max(sc.digest_bytes).astype(jnp.int64))
    return {"groups": groups, "step": jnp.max(t).astype(jnp.int64),
            "last_sweep": jnp.max(last).astype(jnp.int64)}


@dataclasses.dataclass(frozen=True)
class GroupCoverage:
    """One group's report: slots live, verified, read in the window; digest bytes per slot."""

    live_slots: int
    verified_slots: int
    read_slots: int
    bytes_per_slot: int


@dataclasses.dataclass(frozen=True)
class CoverageStats:
    """The coverage report (see the module docstring): ``window`` (N: a slot read in N
    consecutive steps is verified in them), ``step`` (the state's step counter: steps run, less
    what a rebase took off, :mod:`kvcanary_jax.runtime.rebase`), ``last_sweep`` (its step, -1:
    none), the KV bytes ``live`` (the guarantee is due for them), ``verified`` (of those)
    and ``read`` (slots read at least once in the last N steps), ``groups`` by group, and the
    manager's ``sweep_interval`` (the bound for cached slots; ``None`` outside a manager).

    *Verified* means *checked against its digest*, whatever the check found: a check that fails
    appends a ``KV_DIGEST_MISMATCH`` ring row, a violation like any other. ``violations`` is
    the state's count of ring rows so far (every reason; ``None`` where the report was built
    without the state's write index, or that index is negative), so that a report of 100% never
    reads as "all clean" when checks failed.
    """

    window: int
    step: int
    last_sweep: int
    live_bytes: int
    verified_bytes: int
    read_bytes: int
    groups: dict
    sweep_interval: int | None = None
    violations: int | None = None

    @property
    def share(self) -> float | None:
        """Verified / live KV bytes (``None`` while nothing is live)."""
        return self.verified_bytes / self.live_bytes if self.live_bytes else None

    def summary(self) -> str:
        share = "n/a" if self.share is None else f"{100 * self.share:.1f}%"
        sweep = ("" if self.sweep_interval is None else
                 ", no sweep: cached slots unchecked" if not self.sweep_interval else
                 f", cached slots every {self.sweep_interval}, but no sweep on record: cached "
                 "slots unchecked and not counted" if self.last_sweep < 0 and self.step > 0 else
                 f", cached slots every {self.sweep_interval}")
        found = ("" if self.violations is None else
                 f"; {self.violations} violation(s) so far" if self.violations else
                 "; no violation so far")
        return (f"window {self.window} steps{sweep}: {share} of live KV bytes verified "
                f"({self.verified_bytes} of {self.live_bytes} B checked against their digests; "
                f"{self.read_bytes} B read in the window{found})")


def from_counts(cfg: CanaryConfig, host: dict, *, sweep_interval: int | None = None,
                write_index=None) -> CoverageStats:
    """:class:`CoverageStats` from :func:`counts`' arrays on the host (``write_index``: the
    state's violation write index on the host, per shard, for ``violations``)."""
    groups = {g: GroupCoverage(**{f: int(v) for f, v in fields.items()})
              for g, fields in host["groups"].items()}

    def total(field):
        return sum(getattr(c, field) * c.bytes_per_slot for c in groups.values())

    return CoverageStats(window=cfg.coverage_window, step=int(host["step"]),
                         last_sweep=int(host["last_sweep"]),
                         live_bytes=total("live_slots"), verified_bytes=total("verified_slots"),
                         read_bytes=total("read_slots"), groups=groups,
                         sweep_interval=sweep_interval,
                         violations=_violations(write_index))


def _violations(write_index) -> int | None:
    """The ring rows appended so far, from a state's write index on the host (summed over the
    shards of a stack); ``None`` without one, or when one is negative (only something writing
    over the canary's state makes it so: the manager reports that on its own)."""
    if write_index is None:
        return None
    index = np.asarray(write_index)
    return None if np.any(index < 0) else int(np.sum(index, dtype=np.int64))


_counts_jit = jax.jit(counts, static_argnums=0)


@_config.with_x64
def coverage_stats(cfg: CanaryConfig, state: CanaryState, *,
                   sweep_interval: int | None = None) -> CoverageStats | None:
    """The coverage report of ``state`` (or of a stack of per-shard states) now: a device
    computation and a host read, not for the hot path; ``None`` when ``cfg`` runs no coverage.
    ``cfg`` must be the config the state ran under: a state that does not fit it is refused
    (:func:`~kvcanary_jax.runtime.state.check_state`). The state does not record its window, so
    a config of another window is not caught, and its report would read the counters against
    that window."""
    check_state_any(cfg, state)
    if not cfg.coverage_window:
        return None
    host, write_index = jax.device_get((_counts_jit(cfg, state), state.violation_write_index))
    return from_counts(cfg, host, sweep_interval=sweep_interval, write_index=write_index)
