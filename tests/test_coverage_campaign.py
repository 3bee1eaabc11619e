"""Single-bit flips in every layer's K and V of live slots, used or cached, in the demo's server:
each one is reported at the first check the stated rule gives it (docs/spec.md §17.3), so within
the coverage window for slots steps keep reading and at the next sweep for cached slots, and a
clean run reports nothing.

The campaign (tests/_flip_campaign.py) is one compiled run per mode, flips applied between steps
(a few hundred per mode in the fast tier, more with ``--long``). Each flip's check is predicted on
the host from SGLang's plans (the slots a step reads, the slots a sweep walks) and the phase rule
``slot % window == step % window`` (less, with a sweep every window, the read slots the last
sweep checked), so a layer, a half, a group or a share of the window left unchecked fails here:
the flip is missed, or found at another step than its first check."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import _flip_campaign as fc
import _tier
from _impls import implementations
from kvcanary_jax import runtime as rt
from kvcanary_jax import sim as sm

warnings.filterwarnings("ignore", message=".*donated buffers.*")

# Random flips: a fast-tier count, the full one with --long (docs/testing.md, "Fuzz counts").
pytestmark = pytest.mark.fuzz

MODES = {
    # A window shorter than the sweep interval, so TAIL checks are what bound the read slots;
    # FULL and SWA groups; SGLang's K half only.
    "window3-sweep7-swa": dict(coverage_window=3, sweep_interval=7, swa_window_size=6),
    # Every read slot checked at every step; both SGLang halves on.
    "window1-sweep5-v-half": dict(coverage_window=1, sweep_interval=5, swa_window_size=0,
                                  enable_v_half=True),
    # A sweep every window: the TAILs leave to the sweep the read slots it checked (docs/spec.md
    # §17.2), and the sweep's checks are what bound most read slots. The sweep walks what SGLang's
    # radix cache holds (running requests' prompts, not their decoded tokens), in a pool short
    # enough that slots the sweep checked are evicted and handed out again to decoded tokens.
    "window4-sweep4-swa": dict(coverage_window=4, sweep_interval=4, swa_window_size=6,
                               sweep_decoded=False, num_slots=128),
}
STEPS = _tier.n(64, 400)
FLIPS_PER_STEP = 6
# The short pool erases more flips (their slots handed out again before a check): more a step.
FLIPS_PER_STEP_IN = {"window4-sweep4-swa": 8}
MIN_FOUND = _tier.n(200, 1200)


def _cases(interpreter: bool) -> list:
    """Every mode on every implementation of the step (pallas_triton on a GPU); the Pallas
    interpreter (the Triton path's kernels, slow on a CPU) in the first mode, when asked."""
    first = next(iter(MODES))
    return [pytest.param(mode, impl, id=f"{mode}-{impl}") for mode in MODES
            for impl in implementations()
            if impl != "pallas_interpret" or (interpreter and mode == first)]


def _sim(mode: str, impl: str, seed: int = 11) -> sm.SimConfig:
    return sm.SimConfig(steps=0, seed=seed, implementation=impl, **MODES[mode])


def _read_run_before(f: fc.Flip, window: int) -> int | None:
    """The last step of the first run of ``window`` consecutive TAIL reads of ``f``'s slot that
    ends before its detection (``None``: none)."""
    reads = set(f.reads)
    for start in sorted(reads):
        end = start + window - 1
        if end >= f.detected[0]:
            return None
        if all(s in reads for s in range(start, end + 1)):
            return end
    return None


@pytest.mark.parametrize("mode, impl", _cases(interpreter=_tier.LONG))
def test_every_flip_is_found_at_its_first_check(mode, impl):
    sim = _sim(mode, impl)
    window, interval = sim.coverage_window, sim.sweep_interval
    _tier.seeded(f"coverage flips {mode}", 5, STEPS)
    res = fc.run(sim, steps=STEPS, flips_per_step=FLIPS_PER_STEP_IN.get(mode, FLIPS_PER_STEP),
                 seed=5)
    assert res.problems() == []
    found = res.detected
    assert len(found) >= MIN_FOUND, (len(found), len(res.flips))
    # The campaign reached every layer, both halves, every group, used and cached slots, TAIL and
    # SWEEP checks and every phase of the window: each is a place a dropped check would show.
    assert {f.layer for f in found} == set(range(sim.num_layers))
    assert {f.half for f in found} == {"K", "V"}
    assert {f.group for f in found} == ({"FULL", "SWA"} if sim.swa_window_size else {"FULL"})
    assert {f.kind for f in found} == {"used", "cached"}
    assert {f.detected[1] for f in found} == {"TAIL", "SWEEP"}
    assert {f.slot % window for f in found if f.detected[1] == "TAIL"} == set(range(window))
    # A sweep at least every window: the steps left it slots it checked (none otherwise).
    assert (res.left_to_sweep > 0) == (interval <= window), res.left_to_sweep
    for f in found:
        # The stated bounds: a slot read by `window` consecutive steps is checked in them; a
        # slot the first sweep after the flip walks is checked by it.
        assert _read_run_before(f, window) is None, f
        first_sweep = -(-f.placed // interval) * interval
        if first_sweep in f.walks:
            assert f.detected[0] <= first_sweep <= f.placed + interval - 1, f


@pytest.mark.parametrize("mode, impl", _cases(interpreter=True))
def test_a_clean_run_reports_nothing_and_verifies_every_live_byte(mode, impl):
    """No flip: no ring row at all, and from the first full window on every live KV byte (a slot
    read in each of the last `window` steps, or walked by the last sweep) was verified in it."""
    sim = _sim(mode, impl, seed=12)
    server = sm.Server(sim)
    cfg = server.cfg
    checks, walks = fc.Checks(cfg), []
    walk = server.sweep_inputs
    server.sweep_inputs = lambda: walks.append(walk()) or walks[-1]
    shares, left = [], 0
    runs = {g: 0 for g in cfg.groups}
    for t in range(1, _tier.n(24, 120) + 1):
        batch = server.prepare()
        written = {g: fc._group_slots(server, g, [s for _, ss in batch[0] for s in ss])
                   for g in cfg.groups}
        server.state, server.kv = server.device_step(server.state, server.kv, *batch[1:])
        plans = {g: fc.plan_slots(server.state.plans[g][0]) for g in cfg.groups}
        walks.clear()
        server.complete(batch[0], 0.0, poll=False)
        cov = server.coverage()
        assert cov.step == server.step_idx == t
        if cov.live_bytes:
            shares.append(cov.share)
            assert cov.verified_bytes == cov.live_bytes, cov
        # Step t's TAIL checked exactly the entries of its plan the rule gives: slot % window ==
        # t % window, less (a sweep every window) the slots the last sweep checked.
        for g, sc in server.state.coverage.groups.items():
            due = checks.tail(t, g, set(int(s) for s in plans[g]), written[g])
            checked = int(sc.tail_slot_runs[0])
            assert checked - runs[g] == sum(int(s) in due for s in plans[g]), (g, t)
            left += sum(int(s) % cfg.coverage_window == t % cfg.coverage_window
                        for s in plans[g]) - (checked - runs[g])
            runs[g] = checked
        if walks:
            checks.sweep(t, {g: fc._sweep_slots(cfg, *walks[0], server.lut.copy(), g)
                             for g in cfg.groups})
    # The mode with a sweep every window left read slots to it; the others none.
    assert (left > 0) == cfg.sweep_covers_reads, left
    assert rt.violation_count(server.state) == 0, [str(v) for v in rt.read_violations(server.state)]
    assert len(shares) >= 10 and np.all(np.asarray(shares) == 1.0)
