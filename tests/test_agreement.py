"""Agreement before raising: a violation on one rank (or one shard) makes every rank raise on the
same step, naming the rank (shard) and the slot, and no process is left waiting.

Across processes: 2 and 4 processes joined by ``jax.distributed`` on 127.0.0.1 (CPU devices, a
free port, every process bounded by a timeout), each running the simulated server through its
own ``CanaryManager`` in raise mode. Within one process: a mesh of two CPU devices, the error
flag max-reduced over the mesh axis inside the step."""

from __future__ import annotations

import json
import os
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


def _run_processes(n: int, victim: int, extra=()) -> list[dict]:
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, WORKER, "--nproc", str(n), "--rank", str(r),
                               "--port", str(port), "--victim", str(victim), *extra],
                              cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for r in range(n)]
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=TIMEOUT)
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
                                     "sweep_interval=0 ring_capacity=1024 padding_guard=False; "
                                     "rank 1: mode=log sweep_interval=0 ring_capacity=1024 "
                                     "padding_guard=False")


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
