"""The fault campaign: a clean run (its violations are false positives), then fault trials on
checkpoints of it, each reporting which launch caught the fault and how many steps it took.

A campaign can be stopped between steps (``should_stop``, polled before every step): it then
returns what it has, marked ``interrupted``: the clean steps run so far and the fault trials that
finished (a trial cut short is dropped)."""

from __future__ import annotations

import dataclasses
import time
from typing import Callable

import numpy as np

from kvcanary_jax import runtime as rt
from kvcanary_jax.sim.faults import FAULT_KINDS, disarm, hooks_armed, inject
from kvcanary_jax.sim.server import Server, SimConfig

__all__ = ["FaultReport", "CampaignResult", "run_clean", "fault_kinds", "default_window",
           "run_trial", "run_campaign", "checkpoint_count", "CHECKPOINT_WARMUP",
           "CHECKPOINT_EVERY"]


@dataclasses.dataclass
class FaultReport:
    kind: str
    injected: int = 0
    detected: int = 0
    first_step: int | None = None
    latencies: list = dataclasses.field(default_factory=list)
    tags: set = dataclasses.field(default_factory=set)
    reasons: set = dataclasses.field(default_factory=set)
    missed: list = dataclasses.field(default_factory=list)

    def add(self, rec: dict, found: int | None, start: int, violations=()):
        """Record one placed fault (``rec`` from :func:`inject`, armed on the checkpoint of step
        ``start``), detected by the poll after step ``found`` (None: missed); ``violations`` are
        the decoded ring rows of the faulted canary."""
        self.injected += 1
        if found is None:
            self.missed.append(rec)
            return
        self.detected += 1
        self.latencies.append(found - rec.get("step", start))
        if self.first_step is None:
            self.first_step = found
        for v in violations:
            self.tags.add(v.tag)
            self.reasons.update(v.reasons)

    def as_dict(self):
        return {
            "kind": self.kind, "injected": self.injected, "detected": self.detected,
            "first_step": self.first_step, "latencies": self.latencies,
            "tags": sorted(self.tags), "reasons": sorted(self.reasons),
        }


@dataclasses.dataclass
class CampaignResult:
    steps: int
    false_positives: int
    clean_violations: list
    faults: list
    step_seconds: list
    first_step_seconds: float
    campaign_seconds: float
    counters: dict
    interrupted: bool = False
    coverage: rt.CoverageStats | None = None  # the clean run's, at its end (window 0: None)

    def as_dict(self):
        s = sorted(self.step_seconds[1:]) or [0.0]
        cov = self.coverage
        return {
            "steps": self.steps,
            "interrupted": self.interrupted,
            "false_positives": self.false_positives,
            "coverage": None if cov is None else {
                "window": cov.window, "sweep_interval": cov.sweep_interval, "share": cov.share,
                "live_bytes": cov.live_bytes, "verified_bytes": cov.verified_bytes,
                "read_bytes": cov.read_bytes, "violations": cov.violations},
            "faults": [f.as_dict() for f in self.faults],
            "timing": {
                "first_step_s": round(self.first_step_seconds, 4),
                "step_median_s": round(s[len(s) // 2], 5),
                "step_mean_s": round(sum(s) / len(s), 5),
                "clean_total_s": round(sum(self.step_seconds), 3),
                "campaign_s": round(self.campaign_seconds, 3),
                "per_step_s": [round(x, 5) for x in self.step_seconds],
            },
            "counters": self.counters,
        }


# Fault trials start from checkpoints of the clean run: one every CHECKPOINT_EVERY steps from
# step CHECKPOINT_WARMUP on (the first steps fill the pool and compile).
CHECKPOINT_WARMUP = 4
CHECKPOINT_EVERY = 2


def checkpoint_count(steps: int) -> int:
    """Clean checkpoints a run of ``steps`` steps leaves to place fault trials on (each trial
    takes one; a kind whose fault finds no target on a checkpoint tries the next)."""
    return max(0, -(-(steps - CHECKPOINT_WARMUP) // CHECKPOINT_EVERY))


class _Stopped(Exception):
    """``should_stop`` said so (raised between steps, caught by :func:`run_campaign`)."""


def run_clean(sim: SimConfig, *, checkpoint_every: int = 0, warmup: int = CHECKPOINT_WARMUP,
              progress=None,
              should_stop: Callable[[], bool] | None = None):
    """Run ``sim.steps`` clean steps (fewer when ``should_stop()`` turns true before a step);
    returns (server, step infos, checkpoints {step: snapshot})."""
    server = Server(sim)
    infos, ckpts = [], {}
    for i in range(sim.steps):
        if should_stop is not None and should_stop():
            break
        if checkpoint_every and i >= warmup and (i - warmup) % checkpoint_every == 0:
            ckpts[i] = server.snapshot()
        infos.append(server.step())
        if progress is not None:
            progress(1)
    return server, infos, ckpts


def fault_kinds(faults=None) -> list[str]:
    """``faults`` (None: every kind of :data:`FAULT_KINDS`), checked."""
    kinds = list(FAULT_KINDS) if faults is None else list(faults)
    for k in kinds:
        if k not in FAULT_KINDS:
            raise ValueError(f"unknown fault kind {k!r}; known: {', '.join(FAULT_KINDS)}")
    return kinds


def default_window(sim: SimConfig) -> int:
    """Steps a placed fault gets to show up in the host poll (two sweeps for sweep-only faults)."""
    return default_window_steps(sim.sweep_interval)


def default_window_steps(sweep_interval: int) -> int:
    """:func:`default_window` of a sweep interval."""
    return max(4, 2 * sweep_interval + 1)


def run_trial(server: Server, kind: str, rng: np.random.Generator, *, window: int,
              step: Callable[[], object] | None = None, poll: Callable[[], int] | None = None,
              tick: Callable[[int], object] | None = None,
              should_stop: Callable[[], bool] | None = None) -> tuple[dict, int | None]:
    """One fault trial on ``server`` (restored to a clean checkpoint by the caller).

    Arms a fault of ``kind`` (:func:`inject`), steps until its hook has placed it (hooks fire
    during a later step, and some wait for a sweep step), disarms, then steps until ``poll()``
    sees a violation or ``window`` steps have run. ``step`` advances the server by one step
    (default ``server.step``; a data-parallel driver steps every shard), ``poll`` returns the
    violation count the host sees (default: ``server``'s). Returns the fault record and the
    index of the step after which the poll saw the violation (None: not placed or missed).
    ``should_stop`` is polled before every step; when it turns true the trial is abandoned
    (an internal exception that :func:`run_campaign` catches).
    """
    raw_step = server.step if step is None else step

    def step():
        if should_stop is not None and should_stop():
            raise _Stopped
        try:
            return raw_step()
        except rt.CanaryViolationError:
            # A manager in raise mode raised on the fault (the server finished the step first):
            # the poll below sees the same violations; the trial counts them there.
            return None

    poll = (lambda: rt.violation_count(server.state)) if poll is None else poll
    rec = inject(server, kind, rng)
    for _ in range(max(1, server.sim.sweep_interval)):
        step()
        if tick:
            tick(1)
        if rec["placed"] or not hooks_armed(server):
            break
    disarm(server)
    if not rec["placed"]:
        return rec, None
    found = None
    n_steps = 1
    while True:
        if poll() > 0:
            found = server.step_idx - 1
            break
        if n_steps >= window:
            break
        step()
        n_steps += 1
        if tick:
            tick(1)
    if tick and n_steps < window:
        tick(window - n_steps)
    return rec, found


def run_campaign(sim: SimConfig, *, faults=None, injections: int = 2, window: int | None = None,
                 progress_factory=None,
                 should_stop: Callable[[], bool] | None = None) -> CampaignResult:
    """Clean run (false positives = every violation it records), then for each fault kind
    ``injections`` trials, each restored from a different clean checkpoint: arm the fault, run
    until the host poll sees a violation or ``window`` steps pass. ``should_stop`` (polled
    before every step) ends the campaign early with a partial result (see the module
    docstring)."""
    kinds = fault_kinds(faults)
    if injections < 0:
        raise ValueError(f"injections must be >= 0, got {injections}")
    window = window or default_window(sim)
    total = sim.steps + len(kinds) * injections * window
    bar = progress_factory(total) if progress_factory else None
    tick = (lambda n: bar.update(n)) if bar is not None else None
    stopped = should_stop if should_stop is not None else (lambda: False)

    try:
        server, infos, ckpts = run_clean(sim, checkpoint_every=CHECKPOINT_EVERY, progress=tick,
                                         should_stop=stopped)
        clean_count = rt.violation_count(server.state)
        clean_viol = rt.read_violations(server.state)
        counters = rt.read_counters(server.state)
        clean_coverage = server.coverage()
        t_campaign = time.perf_counter()
        reports = []
        steps_order = sorted(ckpts)
        for ki, kind in enumerate(kinds):
            if stopped():
                break
            rep = FaultReport(kind=kind)
            used = 0
            for ci, start in enumerate(steps_order):
                if used == injections:
                    break
                server.restore(ckpts[start])
                rng = np.random.default_rng((sim.seed, ki, ci))
                try:
                    rec, found = run_trial(server, kind, rng, window=window, tick=tick,
                                           should_stop=stopped)
                except _Stopped:
                    break
                if not rec["placed"]:
                    continue
                used += 1
                rep.add(rec, found, start,
                        rt.read_violations(server.state) if found is not None else ())
            if rep.injected or not stopped():  # a kind cut short before its first trial: left out
                reports.append(rep)
    finally:
        if bar is not None:
            bar.close()
    return CampaignResult(
        steps=len(infos),
        false_positives=clean_count,
        clean_violations=clean_viol,
        faults=reports,
        step_seconds=[i.seconds for i in infos],
        first_step_seconds=infos[0].seconds if infos else 0.0,
        campaign_seconds=time.perf_counter() - t_campaign,
        counters=counters,
        interrupted=len(infos) < sim.steps or stopped(),
        coverage=clean_coverage,
    )
