"""Remediation with sglang-jax 0.0.2's real RadixCache, Req and ScheduleBatch (Python 3.12 leg):
a violation reaches the manager's ``on_violation`` with the request it belongs to, the request is
aborted through sglang-jax's own ``to_abort``, and the radix-cache node holding the slot is dropped
(tests/_sglang_jax_remediate.py runs the scenarios in its own process: a 2-device CPU mesh)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.sglang_jax

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def remediated():
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, os.path.join(HERE, "_sglang_jax_remediate.py")],
                          capture_output=True, text=True, env=env, timeout=900,
                          cwd=os.path.dirname(HERE))
    assert proc.returncode == 0, proc.stderr[-6000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_running_request_is_aborted_and_its_prefix_dropped(remediated):
    r = remediated
    assert r["clean_reports"] == []  # four clean steps: nothing reported
    slot = r["running_slot"]
    first = r["reports"][0]
    # Found by the TAIL verify on the flipped shard, mapped to request "2" through the batch.
    assert first == {"slot": slot, "tag": "TAIL_K_FULL", "shard": 0, "request": "2"}
    assert r["aborted"] == ["2"]  # aborted once, whatever the later reports
    assert r["r2_finish"].startswith("{'type': 'abort', 'message': 'kv-canary: KV cache "
                                     f"corruption detected (slot {slot}, TAIL_K_FULL, "
                                     "VERIFY_REAL_KV_HASH_MISMATCH)'")
    # Flipped before step 4, found by step 4, reported (and aborted) at step 5, finished by
    # sglang-jax's check_finished at step 6.
    assert r["steps_to_abort"] == 3
    assert r["r2_match_before"] == 5 and r["r2_match_after"] == 0
    assert r["pending_after_retry"] == []
    assert r["dropped"][str(slot)] > 0


def test_sweep_finding_drops_the_cached_node_at_once(remediated):
    r = remediated
    slot = r["sweep_slot"]
    assert r["reports"][-1] == {"slot": slot, "tag": "SWEEP_K_FULL", "shard": 0, "request": None}
    # r1's cached 8 prompt tokens + 3 outputs formed one node: all of it goes back to the
    # allocator, and r1's prompt no longer matches anything cached.
    assert r["r1_match_before"] == 8 and r["r1_match_after"] == 0
    assert r["freed_by_sweep_drop"] == r["dropped_final"][str(slot)] == 11


def test_model_runner_with_the_managed_hook():
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, os.path.join(HERE, "_sglang_jax_managed_runner.py")],
                          capture_output=True, text=True, env=env, timeout=900,
                          cwd=os.path.dirname(HERE))
    assert proc.returncode == 0, proc.stderr[-6000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["clean_reports"] == [] and r["steps_before_flip"] == 4
    assert r["reports_after_finding_step"] == []  # readback one step late
    # Step 5 found it on the shard holding head 0; step 6 reported it, with request "0".
    assert r["reports"] == [{"step": 5, "shard": 0, "tag": "TAIL_K_FULL", "slot": r["slot"],
                             "request": "0"}]
    assert r["to_abort"] == [True, False]


def test_model_runner_with_the_managed_hook_in_raise_mode():
    """Raise mode: the step that reports the flip raises after it ran; the runner's pool is
    alive and holds that step's KV (byte-identical to sglang-jax alone after the same steps and
    flip), the error carries the same buffers; serving on from them, the next step reads the
    still-corrupted slot again and raises again, naming it (a raise silences nothing after it),
    with its KV byte-identical to sglang-jax alone. A step handed a delta for another batch is
    refused before anything is donated."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, os.path.join(HERE, "_sglang_jax_managed_runner.py"),
                           "--mode", "raise"], capture_output=True, text=True, env=env,
                          timeout=900, cwd=os.path.dirname(HERE))
    assert proc.returncode == 0, proc.stderr[-6000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    refused = r["refused"]
    assert refused["error"].startswith("kv-canary sglang-jax: the TokenDelta was made for "
                                       "another batch (rows (bs) 3, this batch's is 4)")
    assert not refused["pool_deleted"] and not refused["state_deleted"]
    assert r["raised"] == {"step": 5, "reports": 1, "pool_deleted": False,
                           "error_kv_is_the_pool": True}
    assert r["kv_after_raise"] == r["plain_kv_after_raise"]
    assert r["raised_again"] == {"step": 6, "same_slot": True, "pool_deleted": False}
    assert r["kv_after_next"] == r["plain_kv_after_next"]
