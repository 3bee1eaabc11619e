"""Remediation through sglang-jax's own objects (0.0.2 or 0.1.0rc0) (run as a script: the 2-device CPU mesh is
set before JAX starts; prints one JSON document that tests/test_sglang_jax_remediation.py checks).

The world of tests/_sglang_jax_life.py (sglang-jax's ``ReqToTokenPool``, ``MHATokenToKVPool`` on
a 2-device mesh, allocator, ``RadixCache``, ``Req``, ``ScheduleBatch``), the guarded step, and a
``CanaryManager`` (``sglang_jax.canary_manager``) running the host side after every step with a
``Remediator`` as its ``on_violation``:

1. a running request's prefix slot gets a flipped K byte: the TAIL verify of the next step finds
   it, the manager reports it one step later with the request (through the batch), the request is
   aborted through sglang-jax's own ``to_abort``, and its radix-cache node, locked while the
   request runs, is dropped once the scheduler has released it;
2. a finished request's cached prefix gets a flipped byte: the radix sweep finds it (no request;
   ``sweep(..., manager=)`` hands the swept state to the manager, whose ``flush()`` reports it),
   and its node is dropped at once, its slots back in the allocator.
"""

from __future__ import annotations

import json
import os
import sys
import types

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(_HERE), _HERE]

import _sglang_jax_life as life  # noqa: E402  (sets the 2-device mesh before JAX starts)
import _sglang_jax_compat as compat  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402
from jax.experimental.pallas import tpu as pltpu  # noqa: E402

from kvcanary_jax.integrations import sglang_jax as ksj  # noqa: E402


def main() -> None:
    w = life.World(page_size=1, pool_size=36, layout="pool", kv_write="legacy", tokens="feed")
    remedy = ksj.Remediator(w.tree)
    mgr = ksj.canary_manager(w.canary, "log", on_violation=remedy)
    report = {"reports": []}
    seen = report["reports"]

    def on_violation(r):
        seen.append({"slot": r.violation.slot, "tag": r.violation.tag, "shard": r.shard,
                     "request": getattr(r.request, "rid", None)})
        remedy(r)

    mgr._on_violation = on_violation

    def step(name, batch, extend):
        w.live_step(name, batch, extend)
        ksj.observe(mgr, w.canary, w.state, resolve=ksj.request_resolver(batch.reqs, w.req_pool))

    r1 = w.new_req("1", [11, 12, 13, 14, 15, 16, 17, 18], max_new_tokens=4)
    r2 = w.new_req("2", [21, 22, 23, 24, 25], max_new_tokens=12)
    running = w.extend_batch([r1, r2])
    step("prefill r1 r2", running, extend=True)
    for i in range(3):
        running.prepare_for_decode()
        step(f"decode {i}", running, extend=False)
    assert r1.finished() and not r2.finished()
    running.filter_batch()
    report["clean_reports"] = list(seen)

    # 1. A running request's prefix slot.
    bad = int(np.asarray(w.req_pool.req_to_token[r2.req_pool_idx, 2]))
    report["running_slot"] = bad
    report["r2_match_before"] = compat.match_len(w.tree, r2.origin_input_ids)
    w.kv_pool.kv_buffer = [life._flip_byte(w.kv_pool.kv_buffer[0], bad, 0, 3),
                           *w.kv_pool.kv_buffer[1:]]
    steps_to_abort = 0
    while not r2.finished() and steps_to_abort < 4:
        running.prepare_for_decode()
        step(f"decode after flip {steps_to_abort}", running, extend=False)
        steps_to_abort += 1
    report["steps_to_abort"] = steps_to_abort
    report["r2_finish"] = str(r2.finished_reason.to_json()) if r2.finished_reason else None
    report["pending_after_abort"] = sorted(remedy.pending)
    running.filter_batch()
    remedy.retry()  # the scheduler released r2: its node is unlocked now
    report["pending_after_retry"] = sorted(remedy.pending)
    report["dropped"] = {str(k): v for k, v in remedy.dropped.items()}
    report["r2_match_after"] = compat.match_len(w.tree, r2.origin_input_ids)
    report["aborted"] = [r.rid for r in remedy.aborted]

    # 2. A finished request's cached prefix, found by the sweep.
    prefixes = ksj.radix_prefixes(w.tree)
    r1_prefix = next(p for p in prefixes if len(p) >= 8 and
                     int(p[0]) == int(compat.matched_slots(w.tree, r1.origin_input_ids)[0]))
    target = int(r1_prefix[5])
    report["sweep_slot"] = target
    free_before = w.allocator.available_size()
    report["r1_match_before"] = compat.match_len(w.tree, r1.origin_input_ids)
    w.kv_pool.kv_buffer = [life._flip_byte(w.kv_pool.kv_buffer[0], target, 0, 9),
                           *w.kv_pool.kv_buffer[1:]]
    # The sweep hands the swept state to the manager (manager=): flush() reports its finding
    # with no step after it (without manager=, the manager would still hold the state before
    # the sweep, and flush() or close() had nothing new to read).
    w.state = ksj.sweep(w.canary, w.state, w.kv_pool.kv_buffer[0], prefixes, manager=mgr)
    mgr.flush()
    report["r1_match_after"] = compat.match_len(w.tree, r1.origin_input_ids)
    report["freed_by_sweep_drop"] = w.allocator.available_size() - free_before
    report["dropped_final"] = {str(k): v for k, v in remedy.dropped.items()}
    json.dump(report, sys.stdout)


if __name__ == "__main__":
    if not hasattr(pltpu, "TPUMemorySpace"):
        pltpu.TPUMemorySpace = types.SimpleNamespace(ANY=pl.ANY)
    main()
