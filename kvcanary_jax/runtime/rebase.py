"""The coverage state's int32 step counters kept from wrapping (ours; docs/spec.md §17.4).

``CoverageState.step`` and the per-slot counters of ``SlotCoverage.steps`` are int32: after
2**31 - 1 TAILs (about 25 days at 1,000 steps a second) they would wrap negative, every slot
would read as never stamped, and coverage would stop while the report went on reading 100%.
:func:`rebase_steps` moves every counter of a state down by a multiple of the window, on the
host (a read of the counters and a write of them back, on the devices and with the shardings they
had; no device program changes), keeping the last :data:`KEEP` steps exact: every comparison
the TAIL, the sweep and the report make (a read run, a check within the window, the last sweep's
slots, the digest phase ``T % N``) gives what it gave before. What is older than that reads as
never (``written_at`` as stamped: only whether a slot was ever stamped is read of it).

:class:`Rebaser` is what each owner of a state calls with the state its next step takes: at its
first call and every :data:`CHECK_EVERY` calls it reads the state's step (one small host read),
and rebases once the step reached :data:`REBASE_AT`. The manager (its ``resync()`` makes it read
the step again) and the integrations' guarded steps hold one, as do the steps
:func:`~kvcanary_jax.runtime.make_canary_step` and :func:`~kvcanary_jax.make_sharded_step`
return (``step.rebaser``).
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from kvcanary_jax.runtime.state import (MAX_COVERAGE_WINDOW, SLOT_STEPS, CanaryConfig, CanaryState,
                                         check_state_any)

__all__ = ["rebase_steps", "Rebaser", "REBASE_AT", "KEEP", "CHECK_EVERY"]

REBASE_AT = 2**30  # a state whose step reached this is rebased (2**30 steps short of the wrap)
KEEP = MAX_COVERAGE_WINDOW  # the last steps kept exact (CanaryConfig refuses a longer window)
CHECK_EVERY = 2**20  # calls between two reads of the state's step

_W = SLOT_STEPS.index("written_at")


def _host_map(array: jax.Array, fn) -> jax.Array:
    """``fn(data, index)`` applied on the host to each addressable shard of ``array`` (``index``:
    the shard's slice of the global array), put back on the shard's device: an array of the same
    shape, dtype and sharding."""
    pieces = [jax.device_put(np.asarray(fn(np.asarray(s.data), s.index)).astype(array.dtype),
                             s.device)
              for s in array.addressable_shards]
    return jax.make_array_from_single_device_arrays(array.shape, array.sharding, pieces)


def _host_steps(step: jax.Array) -> np.ndarray:
    """``CoverageState.step`` on the host: ``[1]``, or ``[shards, 1]`` for a stack."""
    out = np.zeros(step.shape, np.int64)
    for s in step.addressable_shards:
        out[s.index] = np.asarray(s.data)
    return out


def rebase_steps(cfg: CanaryConfig, state: CanaryState, *, keep: int = KEEP) -> CanaryState:
    """``state`` (or a stack of per-shard states, each moved by its own step) with its coverage
    step counters moved down by ``by``, the largest multiple of ``cfg.coverage_window`` that leaves
    the last ``keep`` steps (at least the window) exact; the state itself when there is nothing to
    move. A counter older than ``by`` reads as never (-1), except ``written_at``, which stays
    stamped (0); the last sweep too, if older. ``cfg`` is the config the state ran under (a state
    that does not fit it is refused; its window, which the state does not record, sets the
    phase ``by`` keeps). Host work; not for a traced function."""
    check_state_any(cfg, state)
    cov = state.coverage
    if cov is None:
        return state
    window = cfg.coverage_window
    keep = max(int(keep), window)
    # One shift per shard (the leading axis of a stack), from its own step: [1] or [shards, 1].
    by = np.maximum((_host_steps(cov.step) - keep) // window * window, 0)
    if not np.any(by > 0):
        return state
    stacked = cov.step.ndim == 2

    def shift(index) -> np.ndarray:
        """The shift of the shards a piece holds, broadcast against its trailing axes."""
        return by[index[0]] if stacked else by[0]

    def steps(x, index):
        b = shift(index)
        b = b.reshape(b.shape + (1,) * (x.ndim - b.ndim))
        x = x.astype(np.int64)
        out = np.where(x < b, -1, x - b)
        out[..., _W] = np.where(x[..., _W] < 0, x[..., _W], np.maximum(x[..., _W] - b[..., 0], 0))
        return out

    def step(s, index):
        return np.maximum(s.astype(np.int64) - shift(index), 0)

    def last_sweep(s, index):
        b = shift(index)
        return np.where(s < b, -1, s.astype(np.int64) - b)

    groups = {g: dataclasses.replace(sc, steps=_host_map(sc.steps, steps))
              for g, sc in cov.groups.items()}
    return dataclasses.replace(state, coverage=dataclasses.replace(
        cov, groups=groups, step=_host_map(cov.step, step),
        last_sweep=_host_map(cov.last_sweep, last_sweep)))


class Rebaser:
    """Called with each state a step is about to take: returns it, rebased (:func:`rebase_steps`)
    when its step reached ``at``. Reads the step at the first call, then every ``every`` calls,
    and at the next call after :meth:`reset` (a state replaced from outside, e.g. restored from a
    checkpoint, may already be near the wrap)."""

    def __init__(self, cfg: CanaryConfig, *, every: int = CHECK_EVERY, at: int = REBASE_AT,
                 keep: int = KEEP):
        if not isinstance(cfg, CanaryConfig):
            raise TypeError(f"kv-canary runtime: Rebaser needs a CanaryConfig, got "
                            f"{type(cfg).__name__}")
        for name, value in (("every", every), ("at", at), ("keep", keep)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"kv-canary runtime: Rebaser's {name} must be an int >= 1, got "
                                 f"{value!r}")
        self.cfg, self.every, self.at, self.keep = cfg, every, at, keep
        self.calls = 0

    def reset(self) -> None:
        """Read the step at the next call."""
        self.calls = 0

    def __call__(self, state: CanaryState) -> CanaryState:
        if state is None or not self.cfg.coverage_window:
            return state
        self.calls += 1
        if (self.calls - 1) % self.every:
            return state
        check_state_any(self.cfg, state)
        if state.coverage is None or _host_steps(state.coverage.step).max() < self.at:
            return state
        return rebase_steps(self.cfg, state, keep=self.keep)
