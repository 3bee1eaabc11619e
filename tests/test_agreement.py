"""Agreement before raising: a violation on one rank (or one shard) makes every rank raise on the
same step, naming the rank (shard) and the slot, and no process is left waiting.

Across processes: 2 to 4 processes joined by ``jax.distributed`` on 127.0.0.1 (CPU devices, a
free port, every process bounded by a timeout), each running the simulated server through its
own ``CanaryManager`` in raise mode. A hung peer, a dead peer or a mode mismatch gives every live
process a kv-canary error naming the peer within the agreement timeout, with its KV attached.
Within one process: a mesh of two CPU devices, the error flag max-reduced over the mesh axis
inside the step."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
WORKER = os.path.join(HERE, "_agreement_worker.py")
TIMEOUT = 480

pytestmark = pytest.mark.e2e  # whole runs in processes of their own (pyproject.toml: markers)


def _env(devices: int = 1) -> dict:
    # No persistent compilation cache: in a multi-process run JAX reads it on process 0 only,
    # which then reaches the first collective long before the others.
    env = dict(os.environ)
    env["JAX_PLATFORMS"] = "cpu"
    if devices > 1:
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "")
                            + f" --xla_force_host_platform_device_count={devices}").strip()
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _result(proc_out: str) -> dict:
    lines = [ln for ln in proc_out.splitlines() if ln.startswith("{")]
    assert lines, proc_out[-3000:]
    return json.loads(lines[-1])


def _run_processes(n: int, victim: int, extra=(), *, dead=()) -> list[dict]:
    """The JSON line of every process but the ``dead`` ones (killed on purpose)."""
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, WORKER, "--nproc", str(n), "--rank", str(r),
                               "--port", str(port), "--victim", str(victim), *extra],
                              cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for r in range(n)]
    outs = []
    try:
        for rank, p in enumerate(procs):
            out, err = p.communicate(timeout=TIMEOUT)
            if rank in dead:
                assert p.returncode == -signal.SIGKILL, err[-3000:]
                continue
            assert p.returncode == 0, err[-3000:]
            outs.append(_result(out))
    finally:
        for p in procs:  # a hung process fails the test, it does not hang it
            if p.poll() is None:
                p.kill()
                p.wait()
    return outs


@pytest.mark.parametrize("n, victim", [(2, 1), (4, 2)])
def test_every_process_raises_on_the_same_step(n, victim):
    outs = _run_processes(n, victim)
    assert sorted(o["rank"] for o in outs) == list(range(n))
    slot = next(o["slot"] for o in outs if o["rank"] == victim)
    # The fault is written before step 3's forward, found by step 3's TAIL, read back (and
    # agreed on) during step 4: every process raises there, naming rank and slot.
    for o in outs:
        assert (o["raised_at"], o["loop_step"]) == (4, 4), o
        assert o["message"] == (f"kv-canary: rank {victim}: 1 new violation(s) at step 4, "
                                f"first slot_idx={slot} launch_tag=TAIL_K_FULL"), o
        assert o["ranks"] == {str(victim): [1, slot, "TAIL_K_FULL"]}
        # Only the victim holds the ring rows; the others raise on its word.
        assert o["local_slots"] == ([slot] if o["rank"] == victim else [])


def test_processes_with_different_settings_are_refused():
    # Rank 1 runs log mode: nobody could agree with it on a raise; every process is told so
    # when its manager is built.
    outs = _run_processes(2, 0, extra=("--log-on-rank", "1"))
    for o in outs:
        assert o["config_error"] == ("kv-canary: the processes run different canary settings, "
                                     "so they cannot agree on when to raise: rank 0: mode=raise "
                                     "sweep_interval=0 ring_capacity=1024 padding_guard=False "
                                     "coverage_window=0; rank 1: mode=log sweep_interval=0 "
                                     "ring_capacity=1024 padding_guard=False coverage_window=0")


# Short: the workers compile before they meet, so the timeout measures the peers alone.
AGREE_S = 4.0


def _told(o: dict, peer: int, step: int) -> None:
    """``o`` raised the agreement error at ``step``, naming ``peer``, within the timeout, with
    the step's KV."""
    assert o["error"] == "CanaryAgreementError" and o["peers"] == [peer], o
    assert o["raised_at"] == o["loop_step"] == step, o
    assert o["message"].startswith(f"kv-canary agreement: rank {peer} did not report step "
                                   f"{step} within {AGREE_S:g} s (agreement_timeout_s)"), o
    assert AGREE_S <= o["elapsed_s"] < AGREE_S + 3, o
    assert o["kv_attached"] is True, o


def test_a_hung_peer_is_named_within_the_timeout():
    # Rank 1 stops for longer than the timeout before its step 3: rank 0 raises on step 3,
    # naming it, and stops serving; rank 1, back, raises on step 4, naming rank 0.
    outs = _run_processes(2, -1, ("--agreement-timeout", str(AGREE_S), "--hang-rank", "1",
                                  "--hang-step", "3", "--hang-s", str(AGREE_S + 2)))
    by_rank = {o["rank"]: o for o in outs}
    _told(by_rank[0], 1, 3)
    _told(by_rank[1], 0, 4)


def test_a_peer_that_never_builds_its_manager_is_named():
    outs = _run_processes(2, -1, ("--agreement-timeout", str(AGREE_S), "--hang-rank", "1",
                                  "--hang-step", "-1", "--hang-s", str(AGREE_S + 2)))
    by_rank = {o["rank"]: o for o in outs}
    assert by_rank[0]["peers"] == [1] and by_rank[0]["config_error"] == (
        f"kv-canary agreement: rank 1 did not report its canary settings while the managers were "
        f"built within {AGREE_S:g} s (agreement_timeout_s): hung, dead, or no longer stepping in "
        "lockstep with this process (rank 0)")
    assert AGREE_S <= by_rank[0]["elapsed_s"] < AGREE_S + 3
    _told(by_rank[1], 0, 1)  # its first agreement, at the first readback


def test_a_dead_peer_is_named_by_every_live_process():
    # Rank 1 of 3 is killed before its step 3: ranks 0 and 2 each raise on step 3, naming it.
    outs = _run_processes(3, -1, ("--agreement-timeout", str(AGREE_S), "--die-rank", "1",
                                  "--die-step", "3"), dead=(1,))
    assert sorted(o["rank"] for o in outs) == [0, 2]
    for o in outs:
        _told(o, 1, 3)


def test_a_process_in_mode_none_is_refused_by_every_process():
    outs = _run_processes(2, 0, ("--agreement-timeout", str(AGREE_S), "--none-on-rank", "1"))
    for o in outs:
        assert o["config_error"] == ("kv-canary: the processes run different canary settings, "
                                     "so they cannot agree on when to raise: rank 0: mode=raise "
                                     "sweep_interval=0 ring_capacity=1024 padding_guard=False "
                                     "coverage_window=0; rank 1: mode=none sweep_interval=0 "
                                     "ring_capacity=1024 padding_guard=False coverage_window=0"), o


def test_mesh_shards_agree_inside_the_step():
    proc = subprocess.run([sys.executable, WORKER, "--shards", "2", "--victim", "1"], cwd=ROOT,
                          env=_env(devices=2), capture_output=True, text=True,
                          timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    o = _result(proc.stdout)
    assert (o["raised_at"], o["loop_step"]) == (4, 4), o
    assert o["message"] == (f"kv-canary: rank 0 shard 1: 1 new violation(s) at step 4, "
                            f"first slot_idx={o['slot']} launch_tag=TAIL_K_FULL")
    assert o["shards"] == [1] and o["local_slots"] == [o["slot"]]
