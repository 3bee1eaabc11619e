"""Readback one step late: SGLang 0.5.23's ``future_tensor.py``, both sides.

Device side (:func:`readback`, traced into each step's jit): the step also returns, in buffers of
its own (never aliases of the donated state), what the host needs of it: ``words``, the ring's
write index, the run counters, the plans' enable flags and the phase packed into one int64
``[shards, W]`` array (:func:`word_fields` names the columns), and ``ring``, a copy of the
violation ring.

Host side (:class:`Readbacks`): the manager stages each step's readback and starts
``copy_to_host_async`` on its ``words`` (and on the coverage counts a stats step adds); it reads
them (``jax.device_get``, an explicit transfer, allowed under ``jax.transfer_guard("disallow")``)
after the *next* step is dispatched, so the step never waits on the host and the host never waits
on the step it just launched. The ring is copied
to the host only for a readback whose write index shows rows not yet reported (one copy a step
instead of one per field). One readback is staged at a time; a readback handed back by
:meth:`Readbacks.stage` or :meth:`Readbacks.take` is the caller's to consume.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kvcanary_jax.runtime.health import NUM_TAGS
from kvcanary_jax.runtime.state import CanaryConfig, CanaryState

__all__ = ["word_fields", "readback", "Staged", "Readbacks"]


def word_fields(cfg: CanaryConfig, *, mesh: bool) -> dict[str, slice]:
    """The readback's counters and flags, packed per shard into one int64 row (one buffer, one
    copy to the host per step): name -> columns. Over a mesh the step appends ``errored`` (the
    mesh-wide max of the shards' error flags, 1 word)."""
    widths = (("write_index", 1), ("kernel_runs", NUM_TAGS), ("slot_runs", NUM_TAGS),
              ("verify_enable", len(cfg.groups)), ("phase", 3)) + ((("errored", 1),) if mesh else ())
    fields, at = {}, 0
    for name, width in widths:
        fields[name] = slice(at, at + width)
        at += width
    return fields


def readback(cfg: CanaryConfig, state: CanaryState, phase) -> dict:
    """What the host reads one step late, as fresh buffers: ``words`` (every column of
    :func:`word_fields`, without ``errored``) and ``ring``. A leading shard axis (stacked
    per-shard states) is kept as the first axis of both."""
    shards = state.violation_write_index.size
    # The phase is per shard over a mesh, one for a stack of states handed to observe().
    phase = jnp.broadcast_to(phase.reshape(-1, 3), (shards, 3))
    parts = (state.violation_write_index, state.kernel_run_counters, state.slot_run_counters,
             jnp.stack([state.plans[g][0].enable.reshape(-1) for g in cfg.groups], -1), phase)
    words = jnp.concatenate([x.astype(jnp.int64).reshape(shards, -1) for x in parts], axis=1)
    ring = state.violation_ring
    return {"words": words, "ring": ring.reshape((-1,) + ring.shape[-2:])}


@dataclasses.dataclass
class Staged:
    """One readback waiting for the host: the outer step it belongs to (``step``), its device
    arrays, the step's context (what reporting needs of the step: see
    :class:`~kvcanary_jax.runtime.reporting.StepContext`); ``final``: a readback taken after the
    step's own (by ``flush()``, a sweep having run since), whose plans and counters the step's
    readback reported already (only its violations are new); ``rebase``: where reporting
    resumes once this readback is consumed (``resync()`` after the state was replaced: the
    readback of the state before is reported under the bookkeeping it was taken with)."""

    step: int
    arrays: dict
    context: Any = None
    final: bool = False
    rebase: Any = None
    host_ring: np.ndarray | None = dataclasses.field(default=None, repr=False)


class Readbacks:
    """The staged readback of a manager (see the module docstring)."""

    def __init__(self, cfg: CanaryConfig):
        self.cfg = cfg
        self._staged: Staged | None = None

    @property
    def staged(self) -> Staged | None:
        """The readback waiting for the host (still staged)."""
        return self._staged

    def stage(self, staged: Staged) -> Staged | None:
        """Start the host copy of ``staged``'s words (and coverage counts, when it carries
        them); return the readback staged before it."""
        staged.arrays["words"].copy_to_host_async()
        for arr in jax.tree.leaves(staged.arrays.get("coverage")):
            arr.copy_to_host_async()
        previous, self._staged = self._staged, staged
        return previous

    def take(self) -> Staged | None:
        """The staged readback, if any, now the caller's."""
        staged, self._staged = self._staged, None
        return staged

    def words(self, staged: Staged) -> dict[str, np.ndarray]:
        """``staged``'s words on the host, by field, each ``[shards, width]``."""
        words = np.asarray(jax.device_get(staged.arrays["words"]))
        words = words.reshape(-1, words.shape[-1])
        # A step over a mesh appends the shards' error flag; a state's readback has none.
        plain = word_fields(self.cfg, mesh=False)
        fields = word_fields(self.cfg, mesh=words.shape[-1] > max(f.stop for f in plain.values()))
        return {name: words[:, at] for name, at in fields.items()}

    @staticmethod
    def coverage(staged: Staged) -> dict | None:
        """``staged``'s coverage counts on the host (``None``: it carries none)."""
        counts = staged.arrays.get("coverage")
        return None if counts is None else jax.device_get(counts)

    def ring(self, staged: Staged, shards: int) -> np.ndarray:
        """``staged``'s rings on the host, ``[shards, capacity, fields]`` (copied once)."""
        if staged.host_ring is None:
            ring = np.asarray(jax.device_get(staged.arrays["ring"]))
            staged.host_ring = ring.reshape(shards, self.cfg.ring_capacity, -1)
        return staged.host_ring
