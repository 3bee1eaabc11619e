"""CanaryManager under the ordinary events of a server: every violation is reported exactly once,
in every mode, across raises, closes, state swaps, failing callbacks and threads; what the
manager cannot honour it refuses where the mistake is made, keeping the step's KV.

Each scenario is run as an operator would meet it, on the simulated server of
``tests/_manager_support.py`` (hand-checked outcomes: ring rows counted on the device state)."""

from __future__ import annotations

import dataclasses
import logging
import re
import sys
import threading
import time
import warnings

import jax
import jax.numpy as jnp
import pytest

from kvcanary_jax import runtime as rt
from kvcanary_jax.sim.server import Server

from _manager_support import SIM, Harness, forward_for

warnings.filterwarnings("ignore", message=".*donated buffers.*")

LOGGER = "kvcanary_jax.runtime.manager"
ON = dict(real_data="all", enable_verify_token_assert=True, enable_write_input_assert=True)
# Far past every test's length: no launch-health check interferes where it is not the subject.
NO_HEALTH = dict(health_check_warmup_steps=10_000)


def _ring_rows(state) -> list[int]:
    """The ring rows a state holds (each must be reported exactly once)."""
    return list(range(min(rt.violation_count(state), int(state.violation_ring.shape[-2]))))


def _logged_rows(caplog) -> list[str]:
    return [r.getMessage().split("\n")[0] for r in caplog.records
            if r.getMessage().startswith("kv_canary violation")]


def _corrupted(h: Harness, warm: int = 3) -> int:
    """``warm`` clean steps, then one KV byte of a live prefix slot flipped; returns the slot."""
    h.serve(warm)
    _, slot = h.live_prefix_slot()
    h.corrupt_kv(slot)
    return slot


def _serve_corrupting(h: Harness, n: int) -> None:
    """``n`` steps, a KV byte of a live prefix slot not flipped before flipped before each (a new
    violation every step), served on through errors as :meth:`Harness.serve`."""
    flipped = set()
    for _ in range(n):
        slots = [s for r in h.srv.live for s in r.slots if s not in flipped]
        if slots:
            flipped.add(slots[0])
            h.corrupt_kv(slots[0])
        h.serve(1)


# ------------------------------------------------------------------ a raise silences nothing


def test_raise_mode_raises_every_later_violation_once():
    """Serving on from the error's KV: the fault keeps being found (a new ring row each step
    that reads the slot), and each new row is raised once; none is raised twice."""
    h = Harness(rt.ManagerConfig(mode="raise", **ON, **NO_HEALTH))
    h.mgr.mark_init_finished()
    _corrupted(h)
    errors = h.serve(5) + h.close()
    rows = _ring_rows(h.mgr.state)
    assert len(rows) >= 3
    raised = sorted(r.violation.index for e in errors for r in e.reports)
    assert raised == rows, (raised, rows)
    assert len(errors) >= 2


def test_log_mode_keeps_logging_after_a_health_raise(caplog):
    """A health-check raise in log mode (HEAD ran, TAIL never did) does not stop the logging of
    the violations found after it."""
    h = Harness(rt.ManagerConfig(mode="log", health_check_warmup_steps=2,
                                 health_check_every_n_steps=2, **ON))
    with pytest.raises(rt.CanaryViolationError, match="canary path is not executing"):
        for _ in range(4):
            sched, batch, rtt, lut = h.prepare()
            h.mgr.head(batch, rtt, lut)
            h.mgr.observe()
            h.srv.complete(sched, time.perf_counter(), poll=False)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        _corrupted(h, warm=1)
        errors = h.serve(3) + h.close()
    assert not errors
    rows = _ring_rows(h.mgr.state)
    assert rows and len(_logged_rows(caplog)) == len(rows)


# ------------------------------------------------------- close and flush report the last sweep


def _sweeping(**extra) -> Harness:
    return Harness(rt.ManagerConfig(mode="log", padding_guard=True, **ON, **NO_HEALTH, **extra))


def test_close_reports_the_last_steps_sweep():
    seen = []
    h = _sweeping(sweep_interval=2)
    h.mgr._on_violation = seen.append
    h.serve(2)  # the sweep ran at the first step: clean
    h.dirty_padding_slot()
    h.serve(1)  # the third step sweeps after its own readback was taken
    assert h.close() == []
    assert [r.violation.slot for r in seen] == [0]
    assert seen[0].violation.reasons == ("PADDING_SLOT_NOT_ZERO",)


def test_one_close_in_raise_mode_reports_the_last_step_and_its_sweep():
    """The pending readback raised, and the readback of the state as it is (what the last
    step's sweep found) never ran: one ``close()`` at shutdown lost the sweep's rows (a second
    ``close()`` found them). Both run now; the one error carries the violations of both, each
    handed to ``on_violation``, and a second ``close()`` has nothing left."""
    seen = []
    h = Harness(rt.ManagerConfig(mode="raise", padding_guard=True, sweep_interval=2, **ON,
                                 **NO_HEALTH), on_violation=seen.append)
    h.mgr.mark_init_finished()
    h.serve(2)
    _, slot = h.live_prefix_slot()
    h.corrupt_kv(slot)
    h.dirty_padding_slot()
    assert h.serve(1) == []  # its readback is pending; its sweep ran after that readback
    errors = h.close()
    assert len(errors) == 1
    reported = [(r.violation.slot, r.violation.tag) for r in errors[0].reports]
    assert any(s == slot and not t.startswith("SWEEP") for s, t in reported), reported
    assert any(s == 0 and t.startswith("SWEEP") for s, t in reported), reported
    assert [(r.violation.slot, r.violation.tag) for r in seen] == reported
    assert sorted(r.violation.index for r in errors[0].reports) == _ring_rows(h.mgr.state)
    assert h.close() == []


def test_flush_reports_an_explicit_sweep():
    seen = []
    h = _sweeping(sweep_interval=100)
    h.mgr._on_violation = seen.append
    h.serve(2)
    h.dirty_padding_slot()
    h.mgr.sweep(*h.srv.sweep_inputs(), kv=h.srv.kv, lut=jnp.asarray(h.srv.lut))
    h.mgr.flush()
    assert [r.violation.reasons for r in seen] == [("PADDING_SLOT_NOT_ZERO",)]
    h.mgr.flush()  # nothing new: nothing reported again
    assert len(seen) == 1


# ----------------------------------------------------------- observe mode: the state swapped


def _observing():
    """A manager in observe mode (log, reports collected), the simulated server, and the
    server's own jitted canary step."""
    seen = []
    mgr = rt.CanaryManager(rt.ManagerConfig(mode="log", **ON, **NO_HEALTH), SIM.canary_config(),
                           on_violation=seen.append, allocate=False)
    step = rt.make_canary_step(mgr.cfg, forward_for(mgr.cfg, SIM.kv_width))
    return seen, mgr, Server(SIM), step


@pytest.mark.parametrize("announced", [False, True], ids=["observed", "held_fresh"])
def test_a_fresh_state_is_reported_from_its_first_row(announced, caplog):
    """The server runs its own jitted step and hands each new state to observe(); it restarts
    its canary with a fresh init_state() (its write index below what was reported): the rows of
    the old state still pending, then every row of the fresh one, the first included. Handed
    unannounced, the swap is warned of ("state was replaced ... call resync()"); announced with
    ``hold(state, fresh=True)`` (an integration's restart after a failed step), it is not:
    before, a restart logged that warning, with advice that did not apply."""
    from kvcanary_jax.sim import faults

    seen, mgr, srv, step = _observing()
    state = rt.init_state(mgr.cfg)

    def run(n):
        nonlocal state
        for _ in range(n):
            t0 = time.perf_counter()
            sched, batch, rtt, lut = srv.prepare()
            state, srv.kv = step(state, srv.kv, batch, rtt, lut)
            mgr.observe(state)
            srv.complete(sched, t0, poll=False)

    run(3)
    faults._flip_kv_byte(srv, "FULL", next(r for r in srv.live if r.slots).slots[0])
    run(3)
    first_rows, swapped_at = _ring_rows(state), mgr.step_count
    assert first_rows
    state = rt.init_state(mgr.cfg)  # the canary restarted
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        if announced:
            mgr.hold(state, fresh=True)
        run(2)
        mgr.flush()
    warned = [r for r in caplog.records if "was replaced" in r.getMessage()]
    assert bool(warned) is not announced, warned
    # The first state's rows (the last of them read back after the swap), then the fresh one's.
    assert sorted(r.violation.index for r in seen if r.step <= swapped_at) == first_rows
    fresh = sorted(r.violation.index for r in seen if r.step > swapped_at)
    assert fresh == _ring_rows(state) and fresh[0] == 0, (first_rows, fresh)


def test_hold_reports_what_the_server_s_own_sweep_found_at_flush():
    """The server runs its own sweep between steps (observe mode) and hands the state to
    hold(): flush() reports what the sweep found, once, and the manager holds that state."""
    seen, mgr, srv, step = _observing()
    state = rt.init_state(mgr.cfg)
    for _ in range(3):
        t0 = time.perf_counter()
        sched, batch, rtt, lut = srv.prepare()
        state, srv.kv = step(state, srv.kv, batch, rtt, lut)
        mgr.observe(state)
        srv.complete(sched, t0, poll=False)
    mgr.flush()
    assert seen == [] and rt.violation_count(state) == 0
    req = next(r for r in srv.live if r.slots)
    from kvcanary_jax.sim import faults
    faults._flip_kv_byte(srv, "FULL", req.slots[0])
    table, rows, lengths = srv.sweep_inputs()
    with jax.enable_x64(True):
        state = rt.canary_sweep(mgr.cfg, state, rows_table=jnp.asarray(table),
                                row_indices=jnp.asarray(rows), lengths=jnp.asarray(lengths),
                                kv=srv.kv, lut=jnp.asarray(srv.lut))
    mgr.hold(state)
    mgr.flush()
    # Every ring row once (the walk lists the slot in a cache entry and in the live request's
    # prefix: a row each), all of them the sweep's, all of them the flipped slot.
    assert [r.violation.index for r in seen] == _ring_rows(state) != [], seen
    assert {(r.violation.slot, r.violation.phase) for r in seen} == {(req.slots[0], "SWEEP")}
    mgr.flush()  # nothing new: nothing reported again
    assert len(seen) == len(_ring_rows(state))
    assert mgr.state is state


# ------------------------------------------------- sizes that contradict the config are refused


@pytest.mark.parametrize("sizes, config, names", [
    (dict(real_kv_hash_mode="partial"), dict(),
     ("real_kv_hash_mode='partial'", "real_data (--kv-canary-real-data) 'none'")),
    (dict(real_kv_hash_mode="none"), dict(real_data="all"),
     ("real_kv_hash_mode='none'", "real_data (--kv-canary-real-data) 'all'")),
    (dict(kv_token_id_vs_position_offset=1), dict(),
     ("kv_token_id_vs_position_offset=1", "draft_worker False")),
    (dict(enable_verify_token_assert=False), dict(enable_verify_token_assert=True),
     ("enable_verify_token_assert=False",
      "enable_verify_token_assert (SGLANG_KV_CANARY_ENABLE_VERIFY_TOKEN_ASSERT) True")),
])
def test_sizes_that_contradict_the_config_are_refused(sizes, config, names):
    sized = dataclasses.replace(SIM.canary_config(), **sizes)
    with pytest.raises(ValueError) as e:
        rt.CanaryManager(rt.ManagerConfig(mode="log", **config), sized, allocate=False)
    msg = str(e.value)
    assert msg.startswith("kv-canary: "), msg
    for name in names:
        assert name in msg, msg


def test_sizes_that_agree_or_ask_nothing_are_taken():
    base = SIM.canary_config()  # the real-KV mode, asserts and offset at CanaryConfig's defaults
    mgr = rt.CanaryManager(rt.ManagerConfig(mode="log", draft_worker=True), base, allocate=False)
    assert (mgr.cfg.real_kv_hash_mode, mgr.cfg.kv_token_id_vs_position_offset) == ("none", 1)
    sized = dataclasses.replace(base, real_kv_hash_mode="partial", kv_token_id_vs_position_offset=1,
                                enable_write_input_assert=False)
    mgr = rt.CanaryManager(rt.ManagerConfig(mode="raise", real_data="partial", draft_worker=True),
                           sized, allocate=False)
    assert mgr.cfg.real_kv_hash_mode == "partial" and mgr.cfg.kv_token_id_vs_position_offset == 1


# ------------------------------------------------------------- requests= must match the batch


@pytest.mark.parametrize("extra", [1, -1])
def test_requests_that_do_not_match_the_batch_are_refused(extra):
    h = Harness(rt.ManagerConfig(mode="log", **ON))
    h.serve(2)
    sched, batch, rtt, lut = h.prepare()
    requests = [r for r, _ in sched]
    assert len(requests) >= 2
    requests = requests + ["stranger"] if extra > 0 else requests[:-1]
    kv, state = h.srv.kv, h.mgr.state
    with pytest.raises(ValueError, match=rf"requests= has {len(requests)} entries, the batch "
                       rf"has {len(sched)} requests"):
        h.mgr.step(kv, batch, rtt, lut, requests=requests)
    # Refused before anything was donated.
    assert not jax.tree.leaves(kv)[0].is_deleted() and h.mgr.state is state
    assert not state.violation_ring.is_deleted()
    with pytest.raises(ValueError, match="requests= has"):
        h.mgr.tail(batch, kv, lut, req_to_token=rtt, requests=requests)


# -------------------------------------------------- a failing callback loses neither KV nor log


@pytest.mark.parametrize("which", ["on_violation", "resolve"])
def test_a_failing_callback_keeps_the_kv_and_the_log(which, caplog):
    class Boom(Exception):
        pass

    def fail(*args):
        raise Boom("remediation is down")

    h = Harness(rt.ManagerConfig(mode="log", **ON, **NO_HEALTH),
                **({"on_violation": fail} if which == "on_violation" else {}))
    h.mgr.mark_init_finished()
    slot = _corrupted(h)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        errors = []
        for _ in range(3):
            t0 = time.perf_counter()
            sched, batch, rtt, lut = h.prepare()
            extra = ({"resolve": fail} if which == "resolve"
                     else {"requests": [r for r, _ in sched]})
            try:
                h.srv.kv = h.mgr.step(h.srv.kv, batch, rtt, lut, **extra)
            except rt.CanaryViolationError as e:
                # The KV is the step's (the one passed in was donated), and usable.
                assert not jax.tree.leaves(e.kv)[0].is_deleted()
                errors.append(e)
                h.srv.kv = e.kv
            h.srv.complete(sched, t0, poll=False)
        errors += h.close()  # the last readback, its callback failing as well
    assert errors, "the callback's failure was not reported"
    e = errors[0]
    assert isinstance(e, rt.CanaryCallbackError) and isinstance(e.__cause__, Boom)
    assert f"{which} raised Boom('remediation is down')" in str(e)
    assert e.reports and e.reports[0].violation.slot == slot
    # Each violation is logged once, callback failure or not.
    assert len(_logged_rows(caplog)) == len(_ring_rows(h.mgr.state)) > 0
    assert all(isinstance(e, rt.CanaryCallbackError) for e in errors)


def test_a_failing_radix_walk_keeps_the_kv_and_the_step():
    calls = []
    h = Harness(rt.ManagerConfig(mode="log", sweep_interval=2, **ON, **NO_HEALTH), attach=False)

    def walk():
        calls.append(len(calls))
        if len(calls) == 2:
            raise RuntimeError("the radix tree is being rebuilt")
        return h.srv.sweep_inputs()

    h.mgr.attach_radix_cache(walk)
    errors = h.serve(5) + h.close()  # sweeps due at steps 0, 2 (fails) and 4
    assert [type(e).__name__ for e in errors] == ["CanaryCallbackError"]
    assert errors[0].callback == "radix_walk" and "being rebuilt" in str(errors[0])
    assert (h.mgr.step_count, h.mgr.sweep_passes, len(calls)) == (5, 2, 3)


@pytest.mark.parametrize("bad, problem", [
    ("long", r"a prefix of 1000 slots \(lengths\[0\]\) for a table of \d+ columns"),
    ("row", r"row index -1 \(row_indices\[0\]\) for a table of \d+ rows")])
def test_a_walk_the_sweep_cannot_cover_is_refused_not_run_short(bad, problem):
    """A walk listing a prefix longer than its table's row (SGLang's plan reads past the row,
    and the sweep's plan overflows its capacity: it would check nothing) or a row outside the
    table: the sweep does not run and does not count (the coverage report and the steps'
    left-to-the-sweep rule take a sweep that ran for one that checked what it was given); the
    walk's failure is reported like a walk that raised, and so is a direct ``sweep()``'s."""
    h = Harness(rt.ManagerConfig(mode="log", sweep_interval=2, **ON, **NO_HEALTH), attach=False)

    def walk():
        table, rows, lengths = (jnp.asarray(a) for a in h.srv.sweep_inputs())
        if bad == "long":
            return table, rows, lengths.at[0].set(1000)
        return table, rows.at[0].set(-1), lengths

    h.mgr.attach_radix_cache(walk)
    errors = h.serve(3) + h.close()  # sweeps due at steps 0 and 2
    assert [type(e).__name__ for e in errors] == ["CanaryCallbackError"] * 2, errors
    assert errors[0].callback == "radix_walk", errors[0]
    assert re.search(problem, str(errors[0])) and "the sweep did not run" in str(errors[0])
    assert h.mgr.sweep_passes == 0
    with pytest.raises(ValueError, match=rf"kv-canary: sweep\(\): {problem}; the sweep did not "
                                         rf"run"):
        h.mgr.sweep(*walk(), kv=h.srv.kv)
    assert h.mgr.sweep_passes == 0


# -------------------------------------------------------------- a phase error is reported once


@pytest.mark.parametrize("mode", ["log", "raise"])
def test_a_phase_error_is_reported_once(mode):
    h = Harness(rt.ManagerConfig(mode=mode, **ON, **NO_HEALTH))
    h.mgr.mark_init_finished()
    sched, batch, rtt, lut = h.prepare()
    h.mgr.head(batch, rtt, lut)
    h.mgr.tail(batch, h.srv.kv, lut)
    h.mgr.tail(batch, h.srv.kv, lut)  # a TAIL without its HEAD
    with pytest.raises(rt.CanaryViolationError, match="phase check failed: 1 HEAD/TAIL launch"):
        h.mgr.flush()
    h.srv.complete(sched, time.perf_counter(), poll=False)
    errors = h.serve(4) + h.close()
    assert not any("phase check" in str(e) for e in errors), [str(e) for e in errors]


# ----------------------------------------------------------------- threads on one manager


def _threads(*targets):
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # many more interleavings than the default 5 ms
    failures = []

    def guarded(fn):
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - reported to the test below
            failures.append(e)

    try:
        threads = [threading.Thread(target=guarded, args=(t,)) for t in targets]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
    finally:
        sys.setswitchinterval(interval)
    return failures


def test_a_flushing_thread_reports_nothing_twice(monkeypatch):
    # A host transfer as slow as a GPU's: a readback being consumed takes a while.
    device_get = jax.device_get

    def slow_device_get(x):
        time.sleep(0.002)
        return device_get(x)

    monkeypatch.setattr(jax, "device_get", slow_device_get)
    seen = []
    h = Harness(rt.ManagerConfig(mode="log", **ON, **NO_HEALTH), on_violation=seen.append)
    h.mgr.mark_init_finished()
    _corrupted(h)
    done = threading.Event()

    def serve():
        try:
            _serve_corrupting(h, 30)
        finally:
            done.set()

    def flush():
        while not done.is_set():
            h.mgr.flush()

    assert _threads(serve, flush, flush) == []
    h.mgr.close()
    assert sorted(r.violation.index for r in seen) == _ring_rows(h.mgr.state)


def test_two_serving_threads_lose_no_step_and_report_nothing_twice():
    """Two servers stepping one manager from two threads (their canary state is shared, so their
    slots clash and the canary records rows): every step runs, every row is reported once."""
    seen = []
    h = Harness(rt.ManagerConfig(mode="log", **ON, **NO_HEALTH), on_violation=seen.append)
    other = Harness(rt.ManagerConfig(mode="none"))
    other.mgr = h.mgr
    assert _threads(lambda: _serve_corrupting(h, 10), lambda: other.serve(10)) == []
    h.mgr.close()
    assert h.mgr.step_count == 20
    assert sorted(r.violation.index for r in seen) == _ring_rows(h.mgr.state)


# ------------------------------------------------------------------ mode none as the README


def test_mode_none_steps_without_a_lut():
    """``--kv-canary none`` runs the forward alone, called as the README calls step()."""
    h = Harness(rt.ManagerConfig(mode="none"))
    sched, batch, rtt, _ = h.prepare()
    kv = h.mgr.step(h.srv.kv, batch, rtt, requests=[r for r, _ in sched])
    assert kv["FULL"]["layers"]["K"][0].shape == h.srv.kv["FULL"]["layers"]["K"][0].shape
    h.mgr.flush()
    h.mgr.close()


def _callback_server(fail):
    """A manager over a one-slot-row KV whose forward calls the host (``jax.pure_callback``),
    which raises while ``fail["run"]``: a failure at run time, after the step took the donated
    state and KV. ``fail["trace"]`` raises while the forward is traced instead."""
    import numpy as np

    import kvcanary_jax as kc

    def host(x):
        if fail["run"]:
            raise RuntimeError("the device step failed")
        return x

    def forward(kv, batch, req_to_token, lut):
        if fail["trace"]:
            raise ValueError("the forward does not trace")
        k = kv["FULL"]["K"][0]
        rows = jnp.where(batch.out_cache_loc < 0, k.shape[0], batch.out_cache_loc)
        vals = jnp.broadcast_to(batch.input_ids[:, None], (rows.shape[0], k.shape[1]))
        k = k.at[rows].set(vals.astype(k.dtype), mode="drop")
        k = jax.pure_callback(host, jax.ShapeDtypeStruct(k.shape, k.dtype), k)
        return {"FULL": {"K": (k,)}}

    config = rt.ManagerConfig.from_env(kv_canary="raise", kv_canary_real_data="all", environ={})
    sizes = kc.CanaryConfig(max_reqs=4, context_len=16, num_slots=32, max_bs=2, max_tokens=8,
                            implementation="xla")
    m = rt.CanaryManager(config, sizes, forward=forward)
    m.mark_init_finished()
    table = np.zeros((4, 16), np.int32)

    def step(kv, tokens, new):
        n = len(tokens)
        table[1, :n] = range(1, n + 1)
        batch = rt.make_batch(sizes, req_pool_indices=[1], prefix_lens=[n - new],
                              extend_seq_lens=[new], all_ids=[tokens],
                              input_ids=tokens[n - new:], positions=list(range(n - new, n)),
                              out_cache_loc=list(range(n - new + 1, n + 1)))
        return m.step(kv, batch, jnp.asarray(table), requests=["r"])

    return m, step, lambda: {"FULL": {"K": (jnp.zeros((32, 8), jnp.bfloat16),)}}


def test_a_step_that_fails_on_the_device_says_the_state_is_gone_until_one_is_set(caplog):
    """A forward that fails at run time takes the donated state and KV with it. Before, the
    manager kept the deleted state and every later step failed with XLA's "Buffer has been
    deleted or donated". Now the failing step raises ``CanaryStateLost`` (its cause the device's
    error), later calls refuse with it, and a state set by the server serves on, clean. A
    forward that fails while it is traced takes nothing: its own error, the state kept."""
    fail = {"run": False, "trace": False}
    m, step, new_kv = _callback_server(fail)
    kv = step(new_kv(), [7, 8, 9], 3)
    fail["trace"] = True
    jax.clear_caches()  # traced again at the next step
    with pytest.raises(ValueError, match="does not trace"):
        step(kv, [7, 8, 9, 10], 1)
    fail["trace"] = False
    kv = step(kv, [7, 8, 9, 10], 1)  # the state and KV were kept: it serves on
    fail["run"] = True
    with pytest.raises(rt.CanaryStateLost, match=r"step\(\) at step \d+ failed on the device "
                       r"after taking it .* the canary's state and the KV passed in went") as e:
        step(kv, [7, 8, 9, 10, 11], 1)
    assert "the device step failed" in str(e.value.__cause__)
    assert m.state is None and kv["FULL"]["K"][0].is_deleted()
    fail["run"] = False
    for call in (lambda: step(new_kv(), [7, 8, 9, 10, 11], 1),
                 lambda: m.head(None, None), lambda: m.tail(None, None)):
        with pytest.raises(rt.CanaryStateLost, match=r"has no canary state: step\(\) at step "
                           r"\d+ failed on the device.* Set manager.state first"):
            call()
    m.state = rt.init_state(m.cfg)  # a fresh pool: nothing cached the new state lacks
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        kv = step(new_kv(), [5, 6], 2)
        kv = step(kv, [5, 6, 7], 1)
        m.flush()
    assert rt.violation_count(m.state) == 0
    # Setting a state is what this error asks for: no "the canary state was replaced" warning
    # (which tells a server to call resync() instead).
    assert not [r for r in caplog.records if "was replaced" in r.getMessage()]


def test_the_config_cannot_be_swapped_under_a_built_manager():
    """The manager's jits, health checks and sweep schedule are built from its config: a new
    one assigned later was taken half (the next step failed on a missing jit). Read-only now."""
    fail = {"run": False, "trace": False}
    m, step, new_kv = _callback_server(fail)
    with pytest.raises(AttributeError):
        m.config = dataclasses.replace(m.config, mode="log")
    assert m.config.mode == "raise"
    step(new_kv(), [1, 2], 2)


# ------------------------------------------------- a host table read one step late is the step's

_ONE_SIZES = dict(max_reqs=4, context_len=16, num_slots=32, max_bs=2, max_tokens=8,
                  implementation="xla")


def _one_layer_forward(kv, batch, req_to_token, lut):
    """Writes each new token's id into its slot's K row (one layer, K only)."""
    k = kv["FULL"]["K"][0]
    rows = jnp.where(batch.out_cache_loc < 0, k.shape[0], batch.out_cache_loc)
    vals = jnp.broadcast_to(batch.input_ids[:, None], (rows.shape[0], k.shape[1]))
    return {"FULL": {"K": (k.at[rows].set(vals.astype(k.dtype), mode="drop"),)}}


@pytest.mark.parametrize("how", ["step", "head_tail"])
def test_a_host_table_rewritten_after_the_step_still_names_the_steps_request(how):
    """A server's live numpy ``req_to_token`` was kept by reference and read when the step's
    readback was consumed, one step later: a pool row recycled in between named another
    request, or none (``request=None``: remediation aborted nothing). The step's table is read
    as it was."""
    import numpy as np

    from kvcanary_jax import _config

    sizes = rt.CanaryConfig(**_ONE_SIZES)
    found = []
    config = rt.ManagerConfig(mode="log", real_data="all", **NO_HEALTH)
    mgr = rt.CanaryManager(config, sizes, forward=_one_layer_forward, on_violation=found.append)
    mgr.mark_init_finished()
    kv = {"FULL": {"K": (jnp.zeros((32, 8), jnp.bfloat16),)}}
    rtt = np.zeros((4, 16), np.int32)  # the server's own table, rewritten in place
    forward = jax.jit(_one_layer_forward)

    def step(tokens, new, base, rid):
        nonlocal kv
        n = len(tokens)
        rtt[1, :n] = range(base, base + n)
        batch = rt.make_batch(sizes, req_pool_indices=[1], prefix_lens=[n - new],
                              extend_seq_lens=[new], all_ids=[tokens],
                              input_ids=tokens[n - new:], positions=list(range(n - new, n)),
                              out_cache_loc=list(range(base + n - new, base + n)))
        if how == "step":
            kv = mgr.step(kv, batch, rtt, requests=[rid])
            return
        mgr.head(batch, rtt)
        with _config.x64_scope():
            kv = forward(kv, batch, jnp.asarray(rtt), None)
        mgr.tail(batch, kv, req_to_token=rtt, requests=[rid])

    step([7, 8, 9], 3, 1, "r1")
    step([7, 8, 9, 10], 1, 1, "r1")
    kv["FULL"]["K"] = (kv["FULL"]["K"][0].at[2, 0].add(1),)
    step([7, 8, 9, 10, 11], 1, 1, "r1")  # r1's last step finds slot 2
    step([5, 6, 7], 3, 20, "r2")  # r1 finished: row 1 recycled by r2 before that readback
    mgr.close()
    assert [(r.violation.slot, r.request) for r in found] == [(2, "r1")]


@pytest.mark.parametrize("mode", ["log", "raise"])
def test_a_forward_that_fails_between_head_and_tail_is_aborted_and_retried(mode):
    """The server's own forward raised after ``head()``: with no TAIL, the retry's HEAD was a
    second HEAD, a phase error raised in every mode. ``abort_step()`` drops the step: the
    retry is clean, and a corruption the aborted HEAD verified is still reported, once."""
    import numpy as np

    from kvcanary_jax import _config

    sizes = rt.CanaryConfig(**_ONE_SIZES)
    found = []
    config = rt.ManagerConfig(mode=mode, real_data="all", **NO_HEALTH)
    mgr = rt.CanaryManager(config, sizes, on_violation=found.append)
    mgr.mark_init_finished()
    kv = {"FULL": {"K": (jnp.zeros((32, 8), jnp.bfloat16),)}}
    rtt = np.zeros((4, 16), np.int32)
    forward = jax.jit(_one_layer_forward)
    errors = []

    def step(tokens, new, *, fail=False):
        nonlocal kv
        n = len(tokens)
        rtt[1, :n] = range(1, 1 + n)
        batch = rt.make_batch(sizes, req_pool_indices=[1], prefix_lens=[n - new],
                              extend_seq_lens=[new], all_ids=[tokens],
                              input_ids=tokens[n - new:], positions=list(range(n - new, n)),
                              out_cache_loc=list(range(1 + n - new, 1 + n)))
        table = jnp.asarray(rtt)
        mgr.head(batch, table)
        try:
            if fail:
                raise RuntimeError("the model's forward failed")
            with _config.x64_scope():
                kv = forward(kv, batch, table, None)
        except RuntimeError:
            mgr.abort_step()
            raise
        try:
            mgr.tail(batch, kv, req_to_token=table, requests=["r1"])
        except rt.CanaryViolationError as e:
            errors.append(e)

    step([7, 8, 9], 3)
    step([7, 8, 9, 10], 1)
    kv["FULL"]["K"] = (kv["FULL"]["K"][0].at[2, 0].add(1),)
    with pytest.raises(RuntimeError, match="forward failed"):
        step([7, 8, 9, 10, 11], 1, fail=True)  # its HEAD verifies slot 2: a violation
    step([7, 8, 9, 10, 11], 1)  # the retry
    step([7, 8, 9, 10, 11, 12], 1)
    try:
        mgr.close()
    except rt.CanaryViolationError as e:
        errors.append(e)
    assert all("phase check" not in str(e) for e in errors), [str(e) for e in errors]
    slots = sorted({r.violation.slot for r in found})
    assert slots == [2], [(r.violation.slot, r.violation.tag) for r in found]
    assert sorted(r.violation.index for r in found) == _ring_rows(mgr.state)
    if mode == "raise":
        assert sorted(r.violation.index for e in errors for r in e.reports) == \
            _ring_rows(mgr.state)
    else:
        assert errors == []


def test_violations_past_a_full_ring_raise_in_raise_mode(caplog):
    """The ring keeps its first rows; a violation past its capacity is counted, its row
    dropped. In raise mode a server serving on after a long incident got only an overflow
    warning for every later, unrelated violation: blind. Each readback whose count grew past a
    full ring now raises, saying how many went unrecorded (logged in every mode)."""
    import numpy as np

    sizes = rt.CanaryConfig(**_ONE_SIZES, ring_capacity=4)
    config = rt.ManagerConfig(mode="raise", real_data="all", ring_capacity=4, **NO_HEALTH)
    found = []
    mgr = rt.CanaryManager(config, sizes, forward=_one_layer_forward, on_violation=found.append)
    mgr.mark_init_finished()
    kv = {"FULL": {"K": (jnp.zeros((32, 8), jnp.bfloat16),)}}
    rtt = np.zeros((4, 16), np.int32)
    errors = []

    def step(tokens, new, row, base, rid):
        nonlocal kv
        n = len(tokens)
        rtt[row, :n] = range(base, base + n)
        batch = rt.make_batch(sizes, req_pool_indices=[row], prefix_lens=[n - new],
                              extend_seq_lens=[new], all_ids=[tokens],
                              input_ids=tokens[n - new:], positions=list(range(n - new, n)),
                              out_cache_loc=list(range(base + n - new, base + n)))
        try:
            kv = mgr.step(kv, batch, jnp.asarray(rtt), requests=[rid])
        except rt.CanaryViolationError as e:
            kv = e.kv
            errors.append(e)

    t = [7, 8, 9]
    step(t, 3, 1, 1, "r1")
    kv["FULL"]["K"] = (kv["FULL"]["K"][0].at[2, 0].add(1),)  # incident 1: r1's slot 2
    for x in range(10, 14):  # four steps re-verify slot 2: the ring's four rows
        t = t + [x]
        step(t, 1, 1, 1, "r1")
    p = [1, 2, 3]
    step(p, 3, 2, 20, "r2")  # r1 is done; r2 runs alone
    kv["FULL"]["K"] = (kv["FULL"]["K"][0].at[21, 0].add(1),)  # incident 2: r2's slot 21
    for x in range(4, 7):
        p = p + [x]
        step(p, 1, 2, 20, "r2")
    try:
        mgr.close()
    except rt.CanaryViolationError as e:
        errors.append(e)
    assert rt.violation_count(mgr.state) > 4
    assert {r.violation.slot for r in found} == {2}  # the ring's rows: incident 1's
    late = [e for e in errors if "not recorded: the violation ring is full" in str(e)]
    assert late, [str(e) for e in errors]
    counted = sum(int(re.search(r"(\d+) more violation\(s\)", str(e)).group(1)) for e in late)
    assert counted == rt.violation_count(mgr.state) - 4


@pytest.mark.parametrize("make,message", [
    (lambda k: k, "the step's kv must map each buffer group ('FULL') to its KV"),
    (lambda k: {"FULL": {"K": k}}, "kv['FULL']['K'] must be a list of sources"),
    (lambda k: {"FULL": (k,)}, "kv['FULL'][0] must be a list of sources"),
])
def test_a_malformed_kv_is_refused_by_name_and_the_state_kept(make, message):
    """A bare array, or one array where a list of sources goes, failed with a TypeError or an
    IndexError from inside the trace (a single array was taken row by row)."""
    import numpy as np

    sizes = rt.CanaryConfig(**_ONE_SIZES)
    mgr = rt.CanaryManager(rt.ManagerConfig(mode="log", real_data="all", **NO_HEALTH), sizes)
    rtt = np.zeros((4, 16), np.int32)
    rtt[1, :3] = [1, 2, 3]
    batch = rt.make_batch(sizes, req_pool_indices=[1], prefix_lens=[0], extend_seq_lens=[3],
                          all_ids=[[7, 8, 9]], input_ids=[7, 8, 9], positions=[0, 1, 2],
                          out_cache_loc=[1, 2, 3])
    k = jnp.zeros((32, 8), jnp.bfloat16)
    with pytest.raises(ValueError, match="^kv-canary runtime: " + re.escape(message)):
        mgr.head(batch, jnp.asarray(rtt))
        mgr.tail(batch, make(k), req_to_token=jnp.asarray(rtt))
    mgr.abort_step()
    mgr.head(batch, jnp.asarray(rtt))
    mgr.tail(batch, {"FULL": {"K": [k]}}, req_to_token=jnp.asarray(rtt))
    mgr.flush()
    assert rt.violation_count(mgr.state) == 0


class _OneLayer:
    """A one-layer server on the manager's fused step (raise mode by default)."""

    def __init__(self, mode="raise", **config):
        import numpy as np

        self.sizes = rt.CanaryConfig(**_ONE_SIZES)
        self.seen = []
        self.mgr = rt.CanaryManager(
            rt.ManagerConfig(mode=mode, real_data="all", **NO_HEALTH, **config), self.sizes,
            forward=_one_layer_forward, on_violation=self.seen.append)
        self.mgr.mark_init_finished()
        self.kv = {"FULL": {"K": (jnp.zeros((32, 8), jnp.bfloat16),)}}
        self.rtt = np.zeros((4, 16), np.int32)

    def step(self, tokens, new):
        n = len(tokens)
        self.rtt[1, :n] = range(1, 1 + n)
        batch = rt.make_batch(self.sizes, req_pool_indices=[1], prefix_lens=[n - new],
                              extend_seq_lens=[new], all_ids=[tokens],
                              input_ids=tokens[n - new:], positions=list(range(n - new, n)),
                              out_cache_loc=list(range(1 + n - new, 1 + n)))
        try:
            self.kv = self.mgr.step(self.kv, batch, jnp.asarray(self.rtt), requests=["r1"])
        except rt.CanaryViolationError as e:
            self.kv = e.kv
            return e
        return None

    def corrupt(self, slot):
        self.kv["FULL"]["K"] = (self.kv["FULL"]["K"][0].at[slot, 0].add(1),)


def test_a_close_whose_two_readbacks_raise_keeps_the_specific_error_and_both_counts():
    """Both of ``close()``'s readbacks raised: the merged error counted only the first's
    violations per rank, and an agreement failure in the second became a plain violation error
    (a server that stops on lost agreement would not)."""
    import numpy as np

    from kvcanary_jax.runtime.agreement import AgreementFailure

    s = _OneLayer(sweep_interval=100)
    t = [7, 8, 9]
    s.step(t, 3)
    s.step(t + [10], 1)
    s.corrupt(2)
    assert s.step(t + [10, 11], 1) is None  # its readback (slot 2, by the TAIL) is pending
    s.mgr.sweep(s.rtt.copy(), np.array([1]), np.array([5]), kv=s.kv)  # slot 2 again
    with pytest.raises(rt.CanaryViolationError) as e:
        s.mgr.close()
    tags = [r.violation.tag for r in e.value.reports]
    assert tags == ["TAIL_K_FULL", "SWEEP_K_FULL"]
    assert e.value.ranks[0][0] == 2

    s = _OneLayer()
    s.step(t, 3)
    s.step(t + [10], 1)
    s.corrupt(2)
    s.step(t + [10, 11], 1)
    s.mgr.hold(s.mgr.state)  # a readback of the state as it is follows the pending one
    exchange, calls = s.mgr._agreement.exchange, []

    def failing_second(finding):
        calls.append(finding)
        if len(calls) == 2:
            raise AgreementFailure("rank 1 did not report within 1 s", [1])
        return exchange(finding)

    s.mgr._agreement.exchange = failing_second
    with pytest.raises(rt.CanaryAgreementError, match="rank 1 did not report") as e:
        s.mgr.close()
    assert [r.violation.slot for r in e.value.reports] == [2]  # the first readback's


def test_a_checkpoint_set_after_a_lost_state_reports_each_row_once():
    """After ``CanaryStateLost`` the server sets a checkpoint taken at its last readback (as
    the error asks): it continues what was reported, so no row is reported twice (a fresh
    ``init_state()`` is reported from its first row, without a warning: the test above)."""
    fail = {"run": False, "trace": False}
    m, step, new_kv = _callback_server(fail)
    seen = []
    m._on_violation = seen.append

    def serve(kv, tokens):
        try:
            return step(kv, tokens, 1)
        except rt.CanaryViolationError as e:
            return e.kv

    kv = step(new_kv(), [7, 8, 9], 3)
    kv = step(kv, [7, 8, 9, 10], 1)
    kv = {"FULL": {"K": (kv["FULL"]["K"][0].at[2, 0].add(1),)}}
    kv = serve(kv, [7, 8, 9, 10, 11])
    kv = serve(kv, [7, 8, 9, 10, 11, 12])
    checkpoint, kv_checkpoint = jax.tree.map(jnp.copy, (m.state, kv))
    fail["run"] = True
    with pytest.raises(rt.CanaryStateLost):
        step(kv, [7, 8, 9, 10, 11, 12, 13], 1)
    fail["run"] = False
    m.state = checkpoint
    kv = serve(kv_checkpoint, [7, 8, 9, 10, 11, 12, 13])
    kv = serve(kv, [7, 8, 9, 10, 11, 12, 13, 14])
    try:
        m.close()
    except rt.CanaryViolationError:
        pass
    rows = [r.violation.index for r in seen]
    assert len(rows) == len(set(rows)), rows
    assert sorted(rows) == _ring_rows(m.state)
