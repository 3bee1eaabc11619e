"""Health and phase checks: SGLang 0.5.23's ``health_checker.py``, ``enable_warner.py``,
``stats_logger.py`` and ``SimplePhaseChecker``, on the counters a readback carries.

* **launch health** (:class:`LaunchHealth`): from step ``health_check_warmup_steps`` on, every
  ``health_check_every_n_steps`` steps, a launch tag the config runs whose kernel-run counter did
  not grow since the previous check is named: "canary path is not executing". The sweep tags are
  left out on a draft worker (SGLang attaches the radix cache to the target worker only), and
  where the sweep is rarer than the check.
* **the phase check** (:func:`phase_update` on the device, :class:`PhaseCheck` on the host): an
  IDLE -> AFTER_HEAD -> IDLE state machine in an int32 ``[3]`` array ``(phase, errors,
  enabled)``; a TAIL without its HEAD, or two HEADs, counts an error once enabled
  (``mark_init_finished``). The device counter is cumulative, so the host reports its *growth*:
  one phase error is reported once, not at every later step. A phase array replaced by the host
  (``mark_init_finished``) starts a new epoch, whose count starts from 0.
* **the overflow warner** (:class:`OverflowWarner`): a verify plan over its capacity is skipped; a
  warning with the running total says so, once per skipped plan.
* **stats** (:func:`log_stats`): "[canary] step=... protected_tokens=... sweep_passes=...
  violations=..." every ``stats_print_every_n_steps`` steps; with a coverage window (ours), the
  line goes on with the window and the share of live KV bytes verified in it
  (:class:`~kvcanary_jax.runtime.coverage.CoverageStats`).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from kvcanary_jax import consts
from kvcanary_jax.runtime.config import ManagerConfig
from kvcanary_jax.runtime.reporting import SWEEP_TAGS, logger
from kvcanary_jax.runtime.state import CanaryConfig, tag

__all__ = [
    "IDLE",
    "AFTER_HEAD",
    "NUM_TAGS",
    "phase_update",
    "initial_phase",
    "PhaseCheck",
    "LaunchHealth",
    "OverflowWarner",
    "log_stats",
    "stats_due",
    "stalled_message",
    "phase_message",
]

IDLE, AFTER_HEAD = 0, 1
NUM_TAGS = len(consts.CanaryLaunchTag)


def phase_update(phase, expect, nxt):
    """``phase``: int32 [3] = (phase, errors, enabled). A transition from the wrong phase counts
    an error when enabled (SGLang's device assert, as a counter the host reads back)."""
    bad = (phase[0] != expect) & (phase[2] != 0)
    return jnp.stack([jnp.int32(nxt), phase[1] + bad.astype(jnp.int32), phase[2]])


def initial_phase(enabled: bool):
    """A fresh phase array: IDLE, no error, the check on or off."""
    return jnp.array([IDLE, 0, int(enabled)], jnp.int32)


class PhaseCheck:
    """The growth of the device's phase-error counter since the last readback of its epoch."""

    def __init__(self):
        self._epoch = None
        self._seen = 0

    def growth(self, phase_rows: np.ndarray, epoch: int) -> int:
        """``phase_rows``: the readback's ``[shards, 3]`` phase words (every shard runs the same
        transitions; the max is taken)."""
        count = int(np.max(np.asarray(phase_rows).reshape(-1, 3)[:, 1]))
        if epoch != self._epoch:
            self._epoch, self._seen = epoch, 0
        new = max(0, count - self._seen)
        self._seen = max(self._seen, count)
        return new


class LaunchHealth:
    """SGLang's launch-health check over the readback's kernel-run counters."""

    def __init__(self, config: ManagerConfig, cfg: CanaryConfig):
        self.config = config
        self.cfg = cfg
        self._previous = None  # kernel-run counters at the previous check

    def active_tags(self) -> list:
        cfg = self.cfg
        tags = [tag(c, h, g) for g in cfg.groups for c in ("HEAD", "TAIL") for h in cfg.halves]
        if self.config.sweep_interval > 0 and not self.config.draft_worker:
            tags += [tag("SWEEP", h, g) for g in cfg.groups for h in cfg.halves]
        return tags

    def rebase(self, kernel_runs: np.ndarray) -> None:
        self._previous = np.asarray(kernel_runs).reshape(-1, NUM_TAGS).copy()

    def stalled(self, step_no: int, kernel_runs: np.ndarray) -> list[str]:
        """The tags that did not run since the previous check, when ``step_no`` is a check."""
        c = self.config
        if step_no < c.health_check_warmup_steps or step_no % c.health_check_every_n_steps:
            return []
        kernel_runs = np.asarray(kernel_runs).reshape(-1, NUM_TAGS)
        previous = (np.zeros_like(kernel_runs) if self._previous is None
                    or self._previous.shape != kernel_runs.shape else self._previous)
        delta = kernel_runs - previous
        self._previous = kernel_runs.copy()
        tags = self.active_tags()
        # A sweep rarer than the check cannot be expected to have run since the last check.
        if c.sweep_interval > c.health_check_every_n_steps:
            tags = [t for t in tags if t not in SWEEP_TAGS]
        return [t.name for t in tags if np.any(delta[:, int(t)] == 0)]


class OverflowWarner:
    """One warning per shard and group whose verify plan was skipped (over its capacity)."""

    def __init__(self, cfg: CanaryConfig):
        self.cfg = cfg
        self.total = 0

    def warn(self, verify_enable: np.ndarray) -> None:
        shards = np.asarray(verify_enable).reshape(-1, len(self.cfg.groups))
        for row in shards:
            for enable in row:
                if int(enable) == 0:
                    self.total += 1
                    logger.warning(
                        "kv-canary: per-forward verify skipped this step due to overflow "
                        "(total=%d, capacity=%d); check ServerArgs / pool sizing",
                        self.total, self.cfg.verify_cap)


def stats_due(config: ManagerConfig, step_no: int) -> bool:
    """Whether step ``step_no`` logs the stats line."""
    n = config.stats_print_every_n_steps
    return n > 0 and step_no % n == 0


def log_stats(config: ManagerConfig, step_no: int, *, slot_runs, write_index, sweep_passes: int,
              active_tags: int, coverage=None) -> None:
    """SGLang's periodic stats line, every ``stats_print_every_n_steps`` steps (0: never), then
    (ours) the coverage window and share when ``coverage`` (a ``CoverageStats``) is given."""
    if not stats_due(config, step_no):
        return
    line = ("[canary] step=%d protected_tokens=%d sweep_passes=%d violations=%d "
            "launch_tags_active=%d/%d")
    args = [step_no, int(np.sum(slot_runs)), sweep_passes,
            int(np.sum(np.maximum(write_index, 0))), active_tags, NUM_TAGS]
    if coverage is not None:
        line += " coverage_window=%d coverage=%s live_kv_bytes=%d verified_kv_bytes=%d"
        share = "n/a" if coverage.share is None else f"{100 * coverage.share:.2f}%"
        args += [coverage.window, share, coverage.live_bytes, coverage.verified_bytes]
    logger.info(line, *args)


def stalled_message(stalled: list[str], step_no: int) -> str:
    """SGLang's health-checker message."""
    return (f"kv-canary: kernel_run_counter did not increase since previous check for "
            f"tags=[{', '.join(stalled)}] at step={step_no}; canary path is not executing")


def phase_message(errors: int) -> str:
    return (f"kv-canary: phase check failed: {errors} HEAD/TAIL launch(es) out of order "
            "(SimplePhaseChecker: phase mismatch; a TAIL needs its HEAD first, and a HEAD its "
            "previous TAIL)")
