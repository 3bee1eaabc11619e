"""The coverage state's int32 step counters never wrap (docs/spec.md §17.4): a state whose step
reached 2**30 is rebased on the host (kvcanary_jax.runtime.rebase), keeping every comparison of
the TAIL, the sweep and the report as it was. A state far along (its counters moved up to within
a few steps of 2**31) gives, step for step, the same checks, ring rows and report as the state it
was made from; without the rebase it wraps and coverage stops."""

from __future__ import annotations

import dataclasses
import logging
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvcanary_jax as kc
from kvcanary_jax import runtime as rt
from kvcanary_jax import sim as sm
from kvcanary_jax.runtime import rebase
from kvcanary_jax.runtime.state import SLOT_STEPS
from kvcanary_jax.testing.forward import layered_kv, write_every_layer

from _manager_support import Harness

warnings.filterwarnings("ignore", message=".*donated buffers.*")

SIZES = dict(max_reqs=4, context_len=32, num_slots=24, max_bs=2, max_tokens=8, ring_capacity=32,
             implementation="xla")
WINDOW = 3
CFG = rt.CanaryConfig(**SIZES, coverage_window=WINDOW, num_layers=2)
WRAP = 2**31


def _batch(ids, prefix):
    n = len(ids)
    return rt.make_batch(CFG, req_pool_indices=[1], prefix_lens=[prefix],
                         extend_seq_lens=[n - prefix], all_ids=[ids], input_ids=ids[prefix:],
                         positions=list(range(prefix, n)),
                         out_cache_loc=list(range(prefix + 1, n + 1)))


def _table(n):
    t = np.zeros((CFG.max_reqs, CFG.context_len), np.int32)
    t[1, :n] = range(1, n + 1)
    return jnp.asarray(t)


def _flip(kv, slot):
    """Layer 1's V of ``slot``, one bit flipped."""
    layers = kv["FULL"]["layers"]
    v1 = jax.lax.bitcast_convert_type(layers["V"][1], jnp.uint16)
    v1 = v1.at[slot, 2].set(v1[slot, 2] ^ jnp.uint16(1 << 7))
    return {"FULL": {"layers": {**layers, "V": (layers["V"][0], jax.lax.bitcast_convert_type(
        v1, jnp.bfloat16))}}}


def _steps(step, state, kv, ids, n, *, flip_at=None):
    """``n`` decode steps of request 1 (``ids`` cached but the last); ``flip_at``: a slot whose
    KV is flipped before the first. Returns the state, the KV, the ids and each step's
    ``(step, checked slots)``."""
    seen = []
    for i in range(n):
        if flip_at is not None and i == 0:
            kv = _flip(kv, flip_at)
        state, kv = step(state, kv, _batch(ids, len(ids) - 1), _table(len(ids)))
        cov = state.coverage
        checked = np.nonzero(np.asarray(cov.groups["FULL"].checked_at) == int(cov.step[0]))[0]
        seen.append((int(cov.step[0]), checked.tolist()))
        ids = ids + [40 + i]
    return state, kv, ids, seen


def _moved_up(state, by):
    """``state`` with every coverage step counter at or above 0 moved up by ``by``."""
    cov = state.coverage
    up = lambda x: jnp.where(x >= 0, x + by, x).astype(x.dtype)  # noqa: E731
    groups = {g: dataclasses.replace(sc, steps=up(sc.steps)) for g, sc in cov.groups.items()}
    return dataclasses.replace(state, coverage=dataclasses.replace(
        cov, groups=groups, step=up(cov.step), last_sweep=up(cov.last_sweep)))


def _report(state):
    """The coverage report without its step numbers."""
    stats = rt.coverage_stats(CFG, state)
    return (stats.live_bytes, stats.verified_bytes, stats.read_bytes, stats.violations,
            stats.groups)


def _start():
    """Six steps of one request from a fresh state: (state, kv, ids)."""
    step = rt.make_canary_step(CFG, write_every_layer)
    kv = layered_kv(CFG.num_slots, 8, 2, ("K", "V"))
    with jax.enable_x64(True):
        state = rt.init_state(CFG)
        state, kv = step(state, kv, _batch([11, 12, 13], 0), _table(3))
        state, kv, ids, _ = _steps(step, state, kv, [11, 12, 13, 20], 5)
    return state, kv, ids


def test_a_state_near_the_wrap_checks_and_reports_as_the_state_it_was_made_from():
    state, kv, ids = _start()
    # Moved up by a multiple of the window (the digest phase T % N unchanged), to 4 steps short
    # of 2**31.
    by = (WRAP - 4 - int(state.coverage.step[0])) // WINDOW * WINDOW
    far = jax.tree.map(jnp.copy, _moved_up(state, by))  # both are stepped (and donated)
    assert int(far.coverage.step[0]) > 2**31 - 4 - WINDOW

    ref_step = rt.make_canary_step(CFG, write_every_layer)
    step = rt.make_canary_step(CFG, write_every_layer)
    step.rebaser.every = 1  # read the step at every call (2**20 calls in serving)
    with jax.enable_x64(True):
        kv_far = jax.tree.map(jnp.copy, kv)
        ref, _, _, ref_seen = _steps(ref_step, state, kv, ids, 8, flip_at=3)
        got, _, _, got_seen = _steps(step, far, kv_far, ids, 8, flip_at=3)
    # Rebased at its first step: the counters are small again, and never went negative.
    assert 0 < int(got.coverage.step[0]) <= rebase.KEEP + WINDOW + 8
    # The same slots checked at each step, the same phase.
    assert [c for _, c in got_seen] == [c for _, c in ref_seen]
    assert all(s % WINDOW == r % WINDOW for (s, _), (r, _) in zip(got_seen, ref_seen))
    # The same ring (the flip of slot 3 found by each of its checks, steps 3 and 6 of the 8),
    # the same report.
    rows = [(v.tag, v.slot, v.position, v.reasons) for v in rt.read_violations(got)]
    assert rows == [(v.tag, v.slot, v.position, v.reasons) for v in rt.read_violations(ref)]
    assert rows == [("TAIL_K_FULL", 3, 2, ("KV_DIGEST_MISMATCH",))] * 2
    assert _report(got) == _report(ref)
    assert rt.coverage_stats(CFG, got).share == 1.0


def test_without_the_rebase_the_counters_wrap_and_coverage_stops():
    """What the rebase prevents: run past 2**31 with it off, the step goes negative and the
    digest checks stop."""
    state, kv, ids = _start()
    far = _moved_up(state, WRAP - 1 - int(state.coverage.step[0]))  # its next TAIL wraps
    step = rt.make_canary_step(CFG, write_every_layer)
    step.rebaser.at = WRAP  # never due
    step.rebaser.every = 1
    with jax.enable_x64(True):
        got, kv, ids, _ = _steps(step, far, kv, ids, 2)
        # A slot written after the wrap, flipped, then read by 6 steps (two windows).
        slot = len(ids) - 1
        got, _, _, seen = _steps(step, got, kv, ids, 6, flip_at=slot)
    assert int(got.coverage.step[0]) < 0
    assert not [c for _, c in seen if slot in c]  # never checked
    assert not [v for v in rt.read_violations(got) if "KV_DIGEST_MISMATCH" in v.reasons]


def test_the_rebase_moves_every_counter_by_a_multiple_of_the_window():
    state, _, _ = _start()
    far = _moved_up(state, 2**30 + 7)
    moved = rebase.rebase_steps(CFG, far, keep=4)
    t_far = int(far.coverage.step[0])
    by = (t_far - 4) // WINDOW * WINDOW
    assert int(moved.coverage.step[0]) == t_far - by
    old = np.asarray(far.coverage.groups["FULL"].steps).astype(np.int64)
    new = np.asarray(moved.coverage.groups["FULL"].steps)
    assert new.dtype == np.int32
    w = SLOT_STEPS.index("written_at")
    for col in range(len(SLOT_STEPS)):
        o, n = old[:, col], new[:, col]
        if col == w:  # stamped stays stamped, never stamped stays -1
            want = np.where(o < 0, o, np.maximum(o - by, 0))
        else:  # older than the kept steps: never
            want = np.where(o < by, -1, o - by)
        np.testing.assert_array_equal(n, want)
    # The rest of the state is the same arrays.
    assert moved.violation_ring is far.violation_ring
    assert moved.coverage.groups["FULL"].digest is far.coverage.groups["FULL"].digest
    # Nothing to move: the state itself.
    assert rebase.rebase_steps(CFG, state) is state


def test_the_manager_rebases_the_state_it_steps(caplog):
    """The manager's own state, rebased as it steps: the report stays whole past 2**31."""
    sim = sm.SimConfig(max_reqs=6, context_len=32, num_slots=96, max_bs=3, max_tokens=16,
                       chunk_size=8, swa_window_size=0, sweep_interval=0, max_cache_entries=3,
                       kv_width=8, implementation="xla", coverage_window=2)
    config = rt.ManagerConfig(mode="log", real_data="all", sweep_interval=3, coverage_window=2)
    h = Harness(config, sim)
    h.mgr.mark_init_finished()
    h.step(4)
    h.mgr.flush()
    before = h.mgr.coverage()
    with jax.enable_x64(True):
        h.mgr.state = _moved_up(h.mgr.state, (WRAP - 3 - before.step) // 2 * 2)
    h.mgr._rebaser.every = 1
    with caplog.at_level(logging.WARNING, logger="kvcanary_jax.runtime.manager"):
        h.step(6)
        h.mgr.flush()
    after = h.mgr.coverage()
    assert 0 < after.step <= rebase.KEEP + 2 + 6
    assert after.share == 1.0 and after.violations == 0 and after.live_bytes > 0
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_a_window_longer_than_the_kept_steps_is_refused():
    with pytest.raises(ValueError, match=r"coverage_window must be at most 536870912 steps"):
        rt.CanaryConfig(**SIZES, coverage_window=2**29 + 1, num_layers=2)
    with pytest.raises(ValueError, match=r"^--kv-canary-coverage-window 536870913: a window is "
                                         r"at most 536870912 steps$"):
        rt.ManagerConfig(mode="log", sweep_interval=2, coverage_window=2**29 + 1)


def test_the_sharded_step_rebases_its_stacked_states_each_by_its_own_step():
    """``make_sharded_step`` holds a Rebaser too; a stack is moved shard by shard (a shard far
    behind the others keeps its counters and its phase)."""
    from jax.sharding import Mesh

    state, _, _ = _start()
    mesh = Mesh(np.array(jax.devices()[:1]), ("dp",))
    step = kc.make_sharded_step(CFG, write_every_layer, mesh)
    assert isinstance(step.rebaser, rebase.Rebaser) and step.rebaser.cfg is CFG
    far = _moved_up(state, 2**30 + 2 * WINDOW)
    with jax.enable_x64(True):
        stacked = jax.tree.map(lambda a, b: jnp.stack([a, b]), far, state)
    moved = rebase.rebase_steps(CFG, stacked, keep=4)
    steps = np.asarray(moved.coverage.step)[:, 0]
    assert 4 <= steps[0] < 4 + WINDOW and steps[0] % WINDOW == int(far.coverage.step[0]) % WINDOW
    np.testing.assert_array_equal(np.asarray(moved.coverage.groups["FULL"].steps)[1],
                                  np.asarray(state.coverage.groups["FULL"].steps))


def test_a_state_set_from_outside_is_read_at_the_next_step():
    """The rebaser reads the step at its first call and after a reset (the manager resets it
    when its state is replaced), not only every 2**20 calls."""
    state, kv, ids = _start()
    step = rt.make_canary_step(CFG, write_every_layer)
    far = _moved_up(state, (WRAP - 4 - int(state.coverage.step[0])) // WINDOW * WINDOW)
    with jax.enable_x64(True):
        got, _, _, _ = _steps(step, far, kv, ids, 1)  # the first call: read, rebased
    assert 0 < int(got.coverage.step[0]) <= rebase.KEEP + WINDOW + 1
    assert step.rebaser.calls == 1
    h = Harness(rt.ManagerConfig(mode="log", sweep_interval=3, coverage_window=2),
                sm.SimConfig(max_reqs=6, context_len=32, num_slots=96, max_bs=3, max_tokens=16,
                             chunk_size=8, swa_window_size=0, sweep_interval=0,
                             max_cache_entries=3, kv_width=8, implementation="xla",
                             coverage_window=2))
    h.step(2)
    assert h.mgr._rebaser.calls == 2
    h.mgr.state = h.mgr.state  # replaced from outside
    assert h.mgr._rebaser.calls == 0


@pytest.mark.parametrize("call, error, match", [
    (lambda s: rebase.rebase_steps(CFG, None), TypeError,
     r"^kv-canary runtime: expected a CanaryState \(init_state\(cfg\)\), got NoneType$"),
    (lambda s: rebase.rebase_steps(None, s), TypeError,
     r"^kv-canary runtime: expected a CanaryConfig, got NoneType$"),
    (lambda s: rebase.rebase_steps(dataclasses.replace(CFG, num_slots=32), s), ValueError,
     r"the state does not fit its config: bufs\[HEAD_K_FULL\] is uint8 \(24, 32\), the config "
     r"needs uint8 \(32, 32\)"),
    (lambda s: rebase.Rebaser(None), TypeError,
     r"^kv-canary runtime: Rebaser needs a CanaryConfig, got NoneType$"),
    (lambda s: rebase.Rebaser(CFG, every=0), ValueError,
     r"^kv-canary runtime: Rebaser's every must be an int >= 1, got 0$"),
    (lambda s: rebase.Rebaser(CFG)({"coverage": None}), TypeError,
     r"^kv-canary runtime: expected a CanaryState \(init_state\(cfg\)\), got dict$"),
])
def test_bad_arguments_are_refused_naming_them(call, error, match):
    with jax.enable_x64(True):
        state = rt.init_state(CFG)
    with pytest.raises(error, match=match):
        call(state)
    assert rebase.Rebaser(CFG)(None) is None
