"""Serving runtime: the canary's device state and one jitted step per forward batch.

:mod:`.state` (:class:`CanaryConfig`, :class:`CanaryState`, :class:`ForwardBatch`,
:func:`init_state`), :mod:`.step` (the device step: HEAD -> forward -> TAIL, the sweep), :mod:`.kv`
(the KV a step takes: SGLang's sources per half, or every layer), :mod:`.coverage` (ours: every
layer's K and V verified within a window, and its report; :mod:`.rebase` keeps its int32 step
counters from wrapping) and :mod:`.host` (batch padding, violation and counter decoding),
:mod:`.sharded` (one canary per data-parallel shard), :mod:`.config` and :mod:`.manager`
(:class:`CanaryManager`, the runtime a server holds, orchestrating :mod:`.device` (its jitted
calls), :mod:`.readback` (one step late), :mod:`.reporting` (SGLang's messages, each violation
once), :mod:`.health` (launch health, the phase check, the overflow warner, stats) and
:mod:`.agreement` (across ranks, with a timeout)).
Everything is importable from here.
"""

from kvcanary_jax.runtime.host import (
    TAG_NAMES,
    Violation,
    decode_ring,
    make_batch,
    read_counters,
    read_violations,
    reason_names,
    violation_count,
)
from kvcanary_jax.runtime.config import ManagerConfig
from kvcanary_jax.runtime.coverage import CoverageStats, GroupCoverage, coverage_stats
from kvcanary_jax.runtime.rebase import Rebaser, rebase_steps
from kvcanary_jax.runtime.manager import (
    PADDING_SLOT_NOT_ZERO,
    CanaryAgreementError,
    CanaryCallbackError,
    CanaryManager,
    CanaryStateLost,
    CanaryViolationError,
    ViolationReport,
    format_violation,
)
from kvcanary_jax.runtime.state import (
    CanaryConfig,
    CanaryState,
    ForwardBatch,
    check_state,
    enable_chain_assert,
    init_state,
    init_state_stacked,
    launch_tags,
    state_bytes,
)
from kvcanary_jax.runtime.step import (
    canary_step_head,
    canary_step_tail,
    canary_sweep,
    kv_sources,
    make_canary_step,
    step_fn,
)

__all__ = [
    "CanaryManager",
    "ManagerConfig",
    "CanaryViolationError",
    "CanaryCallbackError",
    "CanaryAgreementError",
    "CanaryStateLost",
    "ViolationReport",
    "PADDING_SLOT_NOT_ZERO",
    "format_violation",
    "CanaryConfig",
    "CanaryState",
    "ForwardBatch",
    "CoverageStats",
    "GroupCoverage",
    "coverage_stats",
    "rebase_steps",
    "Rebaser",
    "Violation",
    "TAG_NAMES",
    "init_state",
    "init_state_stacked",
    "state_bytes",
    "check_state",
    "enable_chain_assert",
    "launch_tags",
    "make_batch",
    "kv_sources",
    "canary_step_head",
    "canary_step_tail",
    "make_canary_step",
    "step_fn",
    "canary_sweep",
    "read_violations",
    "decode_ring",
    "reason_names",
    "read_counters",
    "violation_count",
]
