"""CanaryManager: SGLang 0.5.23's runtime guards around the canary step, each failing when it
should (hand-checked scenarios on the simulated server), and its configuration refusing every bad
flag, variable and contradiction where it is built."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvcanary_jax import runtime as rt
from kvcanary_jax.runtime import config as rc
from kvcanary_jax.runtime import manager as rm

from _manager_support import SIM, Harness, device_inputs

warnings.filterwarnings("ignore", message=".*donated buffers.*")

LOGGER = "kvcanary_jax.runtime.manager"
# Token checks on so the config compiles one step shared by most tests here.
ON = dict(real_data="all", enable_verify_token_assert=True, enable_write_input_assert=True)


# ------------------------------------------------------------------------------ configuration


def test_defaults_are_sglangs():
    # sglang/srt/environ.py and arg_groups/fields/observability.py of SGLang 0.5.23.
    c = rt.ManagerConfig()
    assert (c.mode, c.real_data, c.sweep_interval) == ("none", "none", 0)
    assert (c.ring_capacity, c.stats_print_every_n_steps) == (1024, 100)
    assert (c.enable_write_input_assert, c.enable_verify_token_assert) == (False, False)
    assert (c.health_check_warmup_steps, c.health_check_every_n_steps) == (100, 100)
    assert rc.ENV_VARS == {
        "ring_capacity": "SGLANG_KV_CANARY_RING_CAPACITY",
        "stats_print_every_n_steps": "SGLANG_KV_CANARY_STATS_PRINT_EVERY_N_STEPS",
        "enable_write_input_assert": "SGLANG_KV_CANARY_ENABLE_WRITE_INPUT_ASSERT",
        "enable_verify_token_assert": "SGLANG_KV_CANARY_ENABLE_VERIFY_TOKEN_ASSERT",
    }
    assert rt.ManagerConfig(mode=" LOG ", real_data="Partial").mode == "log"
    assert rt.ManagerConfig(draft_worker=True).kv_token_id_vs_position_offset == 1
    assert rt.ManagerConfig().kv_token_id_vs_position_offset == 0


@pytest.mark.parametrize("fields, match", [
    (dict(mode="loud"), r"mode \(--kv-canary\) must be one of none/log/raise, got 'loud'"),
    (dict(mode=1), r"mode \(--kv-canary\) must be one of"),
    (dict(mode="log", real_data="half"),
     r"real_data \(--kv-canary-real-data\) must be one of none/partial/all, got 'half'"),
    (dict(mode="log", sweep_interval=-1),
     r"sweep_interval \(--kv-canary-sweep-interval\) must be >= 0, got -1"),
    (dict(mode="log", sweep_interval=True), r"sweep_interval .* must be an integer, got True"),
    (dict(mode="log", sweep_interval=2.0), r"sweep_interval .* must be an integer, got 2.0"),
    (dict(ring_capacity=0),
     r"ring_capacity \(SGLANG_KV_CANARY_RING_CAPACITY\) must be >= 1, got 0"),
    (dict(stats_print_every_n_steps=-5),
     r"stats_print_every_n_steps \(SGLANG_KV_CANARY_STATS_PRINT_EVERY_N_STEPS\) must be >= 0"),
    (dict(enable_write_input_assert="yes"),
     r"enable_write_input_assert \(SGLANG_KV_CANARY_ENABLE_WRITE_INPUT_ASSERT\) must be True or "
     r"False, got 'yes'"),
    (dict(enable_verify_token_assert=1), r"enable_verify_token_assert .* must be True or False"),
    (dict(draft_worker=None), r"draft_worker must be True or False, got None"),
    (dict(health_check_every_n_steps=0), r"health_check_every_n_steps must be >= 1, got 0"),
    (dict(health_check_warmup_steps=-1), r"health_check_warmup_steps must be >= 0, got -1"),
    (dict(agree_across_processes="yes"), r"agree_across_processes must be None, True or False"),
    (dict(agreement_timeout_s=0), r"agreement_timeout_s must be a number of seconds > 0, got 0"),
    (dict(agreement_timeout_s=True), r"agreement_timeout_s must be a number .*, got True"),
    (dict(agreement_timeout_s=float("nan")), r"agreement_timeout_s must be .*, got nan"),
])
def test_bad_values_name_the_setting(fields, match):
    with pytest.raises(ValueError, match=match):
        rt.ManagerConfig(**fields)


def test_numpy_integers_are_taken_as_ints():
    import numpy as np

    cfg = rt.ManagerConfig(mode="log", sweep_interval=np.int64(4), ring_capacity=np.int32(64))
    assert (cfg.sweep_interval, cfg.ring_capacity) == (4, 64)
    assert type(cfg.sweep_interval) is int and type(cfg.ring_capacity) is int


@pytest.mark.parametrize("fields, match", [
    # SGLang's validation hook, in its words.
    (dict(sweep_interval=4), r"^--kv-canary-sweep-interval requires --kv-canary in \{log, raise\}$"),
    (dict(real_data="all"), r"--kv-canary-real-data requires --kv-canary in \{log, raise\}"),
    (dict(mode="log", padding_guard=True),
     r"--kv-canary-padding-guard runs with the sweep: it requires --kv-canary-sweep-interval > 0"),
])
def test_contradictions_are_refused(fields, match):
    with pytest.raises(ValueError, match=match):
        rt.ManagerConfig(**fields)


def test_from_env_reads_sglangs_variables():
    env = {"SGLANG_KV_CANARY_RING_CAPACITY": "64", "SGLANG_KV_CANARY_STATS_PRINT_EVERY_N_STEPS": "0",
           "SGLANG_KV_CANARY_ENABLE_WRITE_INPUT_ASSERT": "Yes",
           "SGLANG_KV_CANARY_ENABLE_VERIFY_TOKEN_ASSERT": "0", "UNRELATED": "x"}
    c = rt.ManagerConfig.from_env(kv_canary="raise", kv_canary_real_data="partial",
                                  kv_canary_sweep_interval=3, environ=env)
    assert (c.mode, c.real_data, c.sweep_interval) == ("raise", "partial", 3)
    assert (c.ring_capacity, c.stats_print_every_n_steps) == (64, 0)
    assert (c.enable_write_input_assert, c.enable_verify_token_assert) == (True, False)
    # Explicit fields win over the environment.
    assert rt.ManagerConfig.from_env(kv_canary="log", environ=env, ring_capacity=8).ring_capacity == 8
    assert rt.ManagerConfig.from_env(environ={}).mode == "none"


@pytest.mark.parametrize("name, text, match", [
    ("SGLANG_KV_CANARY_RING_CAPACITY", "lots",
     r'SGLANG_KV_CANARY_RING_CAPACITY="lots" is not a valid integer value'),
    ("SGLANG_KV_CANARY_RING_CAPACITY", "0", r'SGLANG_KV_CANARY_RING_CAPACITY="0" must be >= 1'),
    ("SGLANG_KV_CANARY_STATS_PRINT_EVERY_N_STEPS", "-1",
     r'SGLANG_KV_CANARY_STATS_PRINT_EVERY_N_STEPS="-1" must be >= 0'),
    ("SGLANG_KV_CANARY_ENABLE_WRITE_INPUT_ASSERT", "maybe",
     r'SGLANG_KV_CANARY_ENABLE_WRITE_INPUT_ASSERT="maybe" is not a valid boolean value'),
    ("SGLANG_KV_CANARY_ENABLE_VERIFY_TOKEN_ASSERT", "",
     r'SGLANG_KV_CANARY_ENABLE_VERIFY_TOKEN_ASSERT="" is not a valid boolean value'),
])
def test_bad_environment_names_the_variable(name, text, match):
    with pytest.raises(ValueError, match=match):
        rt.ManagerConfig.from_env(kv_canary="log", environ={name: text})


def test_argparse_flags():
    p = argparse.ArgumentParser()
    rc.add_arguments(p)
    args = p.parse_args(["--kv-canary", "log", "--kv-canary-real-data", "all",
                         "--kv-canary-sweep-interval", "5", "--kv-canary-padding-guard"])
    c = rt.ManagerConfig.from_args(args, environ={})
    assert (c.mode, c.real_data, c.sweep_interval, c.padding_guard) == ("log", "all", 5, True)
    with pytest.raises(SystemExit):
        p.parse_args(["--kv-canary", "loud"])
    with pytest.raises(ValueError, match="requires --kv-canary in"):
        rt.ManagerConfig.from_args(p.parse_args(["--kv-canary-sweep-interval", "5"]), environ={})


def test_manager_refuses_bad_construction():
    with pytest.raises(ValueError, match="config must be a ManagerConfig, got dict"):
        rt.CanaryManager({"mode": "log"})
    with pytest.raises(ValueError, match="mode 'log' needs sizes=CanaryConfig"):
        rt.CanaryManager(rt.ManagerConfig(mode="log"))
    with pytest.raises(ValueError, match="on_violation must be callable"):
        rt.CanaryManager(rt.ManagerConfig(), on_violation=3)
    sizes = SIM.canary_config()
    mgr = rt.CanaryManager(rt.ManagerConfig(mode="log", draft_worker=True, sweep_interval=2),
                           sizes, allocate=False)
    assert mgr.cfg.kv_token_id_vs_position_offset == 1  # SGLang's draft-worker offset
    # SGLang's health check leaves the sweep tags out on a draft worker (it never sweeps).
    assert [t.name for t in mgr._active_tags()] == ["HEAD_K_FULL", "TAIL_K_FULL"]
    with pytest.raises(ValueError, match="draft worker's manager runs no sweep"):
        mgr.attach_radix_cache(lambda: None)
    mgr = rt.CanaryManager(rt.ManagerConfig(mode="log"), sizes, allocate=False)
    with pytest.raises(ValueError, match="sweep-interval 0: the sweep never runs"):
        mgr.attach_radix_cache(lambda: None)
    with pytest.raises(ValueError, match="step\\(\\) needs the manager built with forward="):
        mgr.step(None, None, None)
    # The manager's settings replace the sizes' (SGLang: one CanaryConfig holds both).
    mgr = rt.CanaryManager(rt.ManagerConfig(mode="raise", ring_capacity=7, real_data="partial"),
                           sizes, allocate=False)
    assert (mgr.cfg.ring_capacity, mgr.cfg.real_kv_hash_mode) == (7, "partial")
    assert (mgr.cfg.enable_verify_token_assert, mgr.cfg.enable_write_input_assert) == (False, False)


# ---------------------------------------------------------------------------------- the runtime


def test_mode_none_traces_nothing(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("mode none traced a canary op")

    from kvcanary_jax.runtime import step as rs
    for name in ("head", "tail", "_sweep"):
        monkeypatch.setattr(rs, name, boom)
    h = Harness(rt.ManagerConfig(mode="none"))
    assert h.mgr.state is None and h.mgr.cfg is None
    h.step(3)
    assert h.mgr.step_count == 0  # nothing counted: no canary
    with pytest.raises(ValueError, match="head\\(\\) with --kv-canary none"):
        h.mgr.head(None, None)


def test_clean_run_logs_stats_and_nothing_else(caplog):
    h = Harness(rt.ManagerConfig(mode="raise", stats_print_every_n_steps=3, **ON))
    h.mgr.mark_init_finished()
    with caplog.at_level(logging.INFO, logger=LOGGER):
        h.step(7)
        h.mgr.flush()
    stats = [r.getMessage() for r in caplog.records if "protected_tokens" in r.getMessage()]
    # Steps 3 and 6 (one step late: step 6's line comes with step 7).
    assert [s.split()[1] for s in stats] == ["step=3", "step=6"], stats
    assert "violations=0 launch_tags_active=2/12" in stats[-1]
    assert int(stats[-1].split("protected_tokens=")[1].split()[0]) > 0
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert rt.violation_count(h.mgr.state) == 0


def test_log_mode_reports_each_violation_once_with_its_request(caplog):
    seen = []
    h = Harness(rt.ManagerConfig(mode="log", **ON), on_violation=seen.append)
    h.mgr.mark_init_finished()
    h.step(3)
    req, slot = h.live_prefix_slot()
    h.corrupt_kv(slot)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        h.step(1)
        assert not caplog.records  # the step that finds it returns first: readback is one step late
        h.step(1)
        first = [r.getMessage() for r in caplog.records]
        assert first, "the violation was not reported one step later"
        h.step(2)
        h.mgr.flush()
    msgs = [r.getMessage() for r in caplog.records]
    # SGLang's frozen one-line format, then its block.
    assert msgs[0].startswith(f"kv_canary violation: launch_tag=TAIL_K_FULL "
                              f"fail_reason=verify_real_kv_hash slot_idx={slot} ")
    assert "KV cache canary violation detected (kernel_kind=TAIL_K_FULL" in msgs[0]
    assert "ring_overflow=False" in msgs[0]
    # Dedup: every ring row is logged exactly once.
    rows = [m.split("\n")[0] for m in msgs]
    assert len(rows) == rt.violation_count(h.mgr.state)
    # Remediation: the callback got each row, the first with the request owning the slot.
    assert len(seen) == len(msgs)
    assert seen[0].violation.slot == slot and seen[0].request is req
    assert seen[0].rank == 0 and seen[0].shard == 0


def test_raise_mode_raises_once_naming_the_slot():
    seen = []
    h = Harness(rt.ManagerConfig(mode="raise", **ON), on_violation=seen.append)
    h.mgr.mark_init_finished()
    h.step(3)
    req, slot = h.live_prefix_slot()
    h.corrupt_kv(slot)
    h.step(1)  # finds it; the host learns it at the next step
    with pytest.raises(rt.CanaryViolationError) as e:
        h.step(1)
    msg = str(e.value)
    assert f"rank 0: 1 new violation(s) at step 4, first slot_idx={slot} launch_tag=TAIL_K_FULL" in msg
    assert f"kv_canary violation: launch_tag=TAIL_K_FULL fail_reason=verify_real_kv_hash " \
           f"slot_idx={slot}" in msg
    assert isinstance(e.value, RuntimeError) and e.value.step == 4
    assert e.value.ranks == {0: (1, slot, "TAIL_K_FULL")}
    assert seen and seen[0].request is req  # remediation ran before the raise
    h.srv.kv = e.value.kv  # the step's KV (the one passed in was donated)
    h.srv.complete(h.srv.live and [], time.perf_counter(), poll=False)
    # Serving on: the fault is found again (new ring rows), each new row raised once; a raise
    # silences nothing later, and no row is raised twice.
    later = h.serve(2) + h.close()
    raised = [r.violation.index for err in [e.value, *later] for r in err.reports]
    assert sorted(raised) == list(range(rt.violation_count(h.mgr.state))), raised


def test_hot_path_never_waits_for_the_device():
    """The step dispatches, stages its readback with copy_to_host_async and reads the previous
    step's: no implicit transfer in either direction (the guard catches host-to-device on every
    backend and device-to-host on accelerators), and the step just launched is still running
    when step() returns (a forward made slow on purpose)."""
    h = Harness(rt.ManagerConfig(mode="raise", **ON))
    h.mgr.mark_init_finished()
    h.step(2)  # compile the ordinary step

    base = h.mgr._forward
    w = jnp.full((384, 384), 0.001, jnp.float32)

    def slow_forward(kv, batch, rtt, lut):
        spin = jax.lax.fori_loop(0, 60, lambda i, a: jnp.tanh(a @ a), w)
        kv = base(kv, batch, rtt, lut)
        k = kv["FULL"]["layers"]["K"]
        kv["FULL"]["layers"]["K"] = (k[0] + (spin[0, 0] * 0).astype(jnp.bfloat16),) + k[1:]
        return kv

    slow = rt.CanaryManager(h.mgr.config, h.mgr.cfg, forward=slow_forward)
    slow.state, h.mgr = h.mgr.state, slow
    slow.mark_init_finished()
    inputs = [device_inputs(h)]  # compile
    h.srv.kv = slow.step(h.srv.kv, *inputs[0][1:])
    h.srv.complete(inputs[0][0], time.perf_counter(), poll=False)
    jax.block_until_ready(h.srv.kv)
    not_ready = 0
    for _ in range(3):
        sched, batch, rtt, lut = device_inputs(h)
        with jax.transfer_guard("disallow"):
            kv = slow.step(h.srv.kv, batch, rtt, lut)
            not_ready += not jax.tree.leaves(kv)[0].is_ready()
        h.srv.kv = kv
        h.srv.complete(sched, time.perf_counter(), poll=False)
    assert not_ready >= 2, "step() returned only after its own step finished"
    slow.flush()
    assert rt.violation_count(slow.state) == 0


def test_health_check_fails_when_a_launch_stops():
    # HEAD runs, TAIL never does: SGLang's "canary path is not executing", naming TAIL.
    h = Harness(rt.ManagerConfig(mode="log", health_check_warmup_steps=2,
                                 health_check_every_n_steps=2, **ON))
    done = []
    with pytest.raises(RuntimeError, match=r"kernel_run_counter did not increase since previous "
                       r"check for tags=\[TAIL_K_FULL\] at step=2; canary path is not executing"):
        for _ in range(4):
            sched, batch, rtt, lut = h.prepare()
            h.mgr.head(batch, rtt, lut)
            h.mgr.observe()  # the host side, without a TAIL
            h.srv.complete(sched, time.perf_counter(), poll=False)
            done.append(h.mgr.step_count)
    assert done == [1, 2]  # step 2's readback is read (and fails) during step 3
    # The full step passes the same check.
    h = Harness(rt.ManagerConfig(mode="log", health_check_warmup_steps=2,
                                 health_check_every_n_steps=2, **ON))
    h.step(6)
    h.mgr.flush()


def test_health_check_fails_when_the_sweep_never_runs(caplog):
    # A sweep interval with no radix walk attached: SGLang fails the health check on it. Ours
    # says why in the error, and warns once, at the second sweep due, before the check fails.
    h = Harness(rt.ManagerConfig(mode="log", sweep_interval=1, health_check_warmup_steps=2,
                                 health_check_every_n_steps=2, **ON), attach=False)
    with caplog.at_level(logging.WARNING, logger=rm.logger.name), pytest.raises(
            RuntimeError, match=r"tags=\[SWEEP_K_FULL\] at step=2; canary path is not") as e:
        h.step(4)
    assert ("no sweep ran since the previous check: no radix walk is attached "
            "(attach_radix_cache) and sweep() was not called, while sweep_interval 1 asks for a "
            "sweep every 1 steps") in str(e.value)
    warned = [r.getMessage() for r in caplog.records if "no radix walk" in r.getMessage()]
    assert warned == ["kv-canary: sweep_interval 1 asks for a sweep every 1 steps, but none has "
                      "run in the first 1 steps (no radix walk is attached with "
                      "attach_radix_cache, and no sweep() came): cached slots are not checked "
                      "and not counted in the coverage report, and the launch-health check will "
                      "report the SWEEP tags as stalled"]


def test_an_observing_manager_s_stalled_sweep_names_the_server_s_own_sweep():
    """A manager fed the states of a step it does not run (observe(); the integrations' way)
    sweeps nothing itself, an attached walk included: its health error names the server's own
    sweep, not attach_radix_cache."""
    stepping = Harness(rt.ManagerConfig(mode="log", health_check_warmup_steps=10**6, **ON))
    observing = rt.CanaryManager(rt.ManagerConfig(mode="log", sweep_interval=1,
                                                  health_check_warmup_steps=2,
                                                  health_check_every_n_steps=2, **ON),
                                 stepping.srv.cfg, allocate=False)
    observing.attach_radix_cache(stepping.srv.sweep_inputs)  # never run by observe()
    with pytest.raises(RuntimeError, match=r"tags=\[SWEEP_K_FULL\] at step=2") as e:
        for _ in range(4):
            stepping.step(1)
            observing.observe(stepping.mgr.state)
    assert ("no sweep ran since the previous check: the server's own sweep (an integration's: "
            "sglang_jax.sweep, the tpu-inference guard's) did not run or was not handed to this "
            "manager, while sweep_interval 1 asks for a sweep every 1 steps") in str(e.value)


@pytest.mark.parametrize("case", ["draft_worker", "sweeps_itself", "rarer_than_the_check"])
def test_the_no_walk_warning_is_said_only_where_it_holds(caplog, case):
    """A draft worker runs no sweep (SGLang's rule): no warning. A server whose own sweep()
    comes in time: none. A sweep rarer than the health check: the warning, without the health
    check's part (that check leaves the SWEEP tags out then)."""
    interval = 4 if case == "rarer_than_the_check" else 2
    h = Harness(rt.ManagerConfig(mode="log", sweep_interval=interval, health_check_warmup_steps=2,
                                 health_check_every_n_steps=2,
                                 draft_worker=case == "draft_worker", **ON), attach=False)
    with caplog.at_level(logging.WARNING, logger=rm.logger.name):
        if case == "sweeps_itself":
            for _ in range(6):  # a sweep of its own after each step
                h.step(1)
                h.mgr.sweep(*h.srv.sweep_inputs(), kv=h.srv.kv, lut=jnp.asarray(h.srv.lut))
        else:
            h.step(12)
        h.mgr.flush()
    warned = [r.getMessage() for r in caplog.records
              if r.getMessage().startswith("kv-canary: sweep_interval")]
    if case == "rarer_than_the_check":
        assert len(warned) == 1 and warned[0].endswith("not counted in the coverage report")
    else:
        assert warned == []


def test_sweep_and_padding_guard():
    h = Harness(rt.ManagerConfig(mode="log", sweep_interval=2, padding_guard=True,
                                 health_check_warmup_steps=2, health_check_every_n_steps=2, **ON))
    h.step(5)
    h.mgr.flush()
    assert h.mgr.sweep_passes == 3  # steps 0, 2, 4 (SGLang's first sweep is at step 0)
    assert rt.violation_count(h.mgr.state) == 0  # slot 0 clean: the guard is silent
    h.dirty_padding_slot()
    seen = []
    h.mgr._on_violation = seen.append
    h.step(3)
    h.mgr.flush()
    rows = [r.violation for r in seen]
    assert rows and all(v.slot == 0 and v.tag == "SWEEP_K_FULL" and v.position == -1 for v in rows)
    # bf16 1.0 is 0x3f80: two nonzero bytes.
    assert rows[0].reason_bits == rt.PADDING_SLOT_NOT_ZERO and rows[0].stored_token == 2
    assert rows[0].reasons == ("PADDING_SLOT_NOT_ZERO",)
    assert "fail_reason=padding_slot_not_zero slot_idx=0" in seen[0].message


def test_overflow_warner_counts_skipped_verifies(caplog):
    sizes = dataclasses.replace(SIM.canary_config(), verify_capacity=2)
    h = Harness(rt.ManagerConfig(mode="log", **ON), sizes=sizes)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        h.step(6)
        h.mgr.flush()
    warned = [r.getMessage() for r in caplog.records if "due to overflow" in r.getMessage()]
    assert warned and warned[0] == ("kv-canary: per-forward verify skipped this step due to "
                                    "overflow (total=1, capacity=2); check ServerArgs / pool sizing")
    assert h.mgr.overflow_count_total == len(warned) >= 2
    assert "(total=2, capacity=2)" in warned[1]


def test_ring_overflow_is_flagged(caplog):
    h = Harness(rt.ManagerConfig(mode="log", ring_capacity=2, **ON))
    h.step(3)
    for req in h.srv.live:
        for s in req.slots:
            h.corrupt_kv(s)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        h.step(3)
        h.mgr.flush()
    msgs = [r.getMessage() for r in caplog.records]
    total = rt.violation_count(h.mgr.state)
    assert total > 2
    rows = [m for m in msgs if m.startswith("kv_canary violation")]
    assert len(rows) == 2  # the ring keeps two rows; each logged once
    assert any("ring_overflow=True" in m for m in rows)
    assert any("violation ring overflow on rank 0 shard 0" in m for m in msgs)


def test_phase_check_fails_on_a_tail_without_its_head():
    h = Harness(rt.ManagerConfig(mode="log", **ON))
    sched, batch, rtt, lut = h.prepare()
    h.mgr.head(batch, rtt, lut)
    h.mgr.tail(batch, h.srv.kv, lut)
    h.mgr.tail(batch, h.srv.kv, lut)  # before mark_init_finished: not checked (warm-up)
    h.mgr.flush()
    h.mgr.mark_init_finished()
    h.mgr.head(batch, rtt, lut)
    h.mgr.tail(batch, h.srv.kv, lut)
    h.mgr.tail(batch, h.srv.kv, lut)  # no HEAD before this TAIL
    with pytest.raises(RuntimeError, match="phase check failed: 1 HEAD/TAIL launch"):
        h.mgr.flush()


def test_negative_write_index_raises():
    h = Harness(rt.ManagerConfig(mode="log", **ON))
    h.step(1)
    h.mgr.state = dataclasses.replace(
        h.mgr.state, violation_write_index=jnp.full((1,), -3, jnp.int32))
    h.step(1)
    with pytest.raises(RuntimeError, match="violation_write_index is -3, negative"):
        h.mgr.flush()


def _sglang_formatter(sgl):
    """SGLang's ``_format_violation`` as written in the wheel: its module imports SGLang's server
    config (not installed here), so its functions and constants are taken from the source and run
    with SGLang's own FailReason and CanaryLaunchTag."""
    import ast
    import pathlib

    path = pathlib.Path(sgl.root) / "srt/kv_canary/runner/violation_reporter.py"
    tree = ast.parse(path.read_text())
    keep = [n for n in tree.body if isinstance(n, ast.FunctionDef) or (
        isinstance(n, ast.Assign) and "logger" not in ast.unparse(n))]
    ns = {"FailReason": sgl.consts.FailReason, "CanaryLaunchTag": sgl.verify.CanaryLaunchTag}
    exec(compile(ast.Module(body=keep, type_ignores=[]), str(path), "exec"), ns)
    return ns["_format_violation"]


def test_format_matches_sglangs_reporter(sgl):
    """Our formatter against SGLang's own ``_format_violation`` on the same rows."""
    theirs = _sglang_formatter(sgl)
    rows = [[2, 5, 3, 104, 103, -1, 77, 32 | 1], [0, 9, 4, 7, 8, -(1 << 63), 3, 8 | 16],
            [6, 1, 0, 11, -1, 5, 6, 4], [99, 1, 2, 3, 4, 5, 6, 0], [1, 2, 3, 4, 5, 6, 7, 2]]
    for row in rows:
        for overflow in (False, True):
            ours = rm.format_violation(row, total=7, ring_overflow=overflow, step_when_pumped=12)
            assert ours == theirs(row=row, total=7, ring_overflow=overflow, step_when_pumped=12)


def test_sglang_jax_manager_takes_the_canarys_settings():
    from kvcanary_jax.integrations import sglang_jax as ksj

    canary = ksj.SglangJaxCanary(num_slots=32, page_size=1, context_len=16, max_bs=2,
                                 ring_capacity=64, real_kv_hash_mode="partial")
    mgr = ksj.canary_manager(canary, "raise", stats_print_every_n_steps=0)
    assert mgr.cfg == canary.config and mgr.state is None  # observe mode: the hook's state
    with pytest.raises(ValueError, match="takes no sweep_interval"):
        ksj.canary_manager(canary, "log", sweep_interval=3)
    with pytest.raises(ValueError, match="must be one of none/log/raise, got 'loud'"):
        ksj.canary_manager(canary, "loud")
    with pytest.raises(ValueError, match="runs --kv-canary none: install no hook"):
        ksj.ManagedModelRunnerHook(canary, object(), ksj.canary_manager(canary, "none"))
    # A sweep handed to a manager that runs none is refused before it runs (nothing donated).
    state = canary.init_state()
    with pytest.raises(ValueError, match=r"sweep\(manager=\.\.\.\) with a manager that runs "
                                         r"--kv-canary none"):
        ksj.sweep(canary, state, None, [], manager=ksj.canary_manager(canary, "none"))
    assert not state.violation_ring.is_deleted()


@pytest.mark.parametrize("window", [0, 4])
def test_compile_observe_leaves_observe_nothing_to_compile(window):
    """``compile_observe(state)`` (for a server that forbids compiling while it steps: the
    tpu-inference guard calls it in the runner's warm-up) compiles what ``observe()`` runs, and
    with a coverage window the stats line's count: the observes after it lower nothing (what
    ``VLLM_XLA_CHECK_RECOMPILATION`` counts), and report as before."""
    from jax._src.interpreters import pxla

    kw = dict(coverage_window=window, sweep_interval=window, stats_print_every_n_steps=1) \
        if window else {}
    stepping = Harness(rt.ManagerConfig(mode="log", health_check_warmup_steps=10**6, **ON))
    observing = rt.CanaryManager(rt.ManagerConfig(mode="log", health_check_warmup_steps=10**6,
                                                  **kw, **ON),
                                 dataclasses.replace(stepping.srv.cfg, coverage_window=window),
                                 allocate=False)
    stepping.step(1)
    state = stepping.mgr.state
    if window:  # a state of the window's shape (the stepping manager's has none)
        state = rt.init_state(observing.cfg)
    with pytest.raises(ValueError, match=r"compile_observe\(\) needs the server's canary state"):
        observing.compile_observe()
    observing.compile_observe(state)
    before = pxla._cached_lowering_to_hlo.cache_info().misses
    for _ in range(3):
        observing.observe(state)
    assert pxla._cached_lowering_to_hlo.cache_info().misses == before
    observing.flush()
