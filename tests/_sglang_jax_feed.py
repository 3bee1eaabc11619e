"""The TokenFeed under ordinary server events, through sglang-jax's own pools (0.0.2 or 0.1.0rc0), allocator,
radix cache, ``Req`` and ``ScheduleBatch`` (the world of tests/_sglang_jax_life.py, the token ids
kept on the device). Run as a script (its own process: the 2-device CPU mesh is set through
XLA_FLAGS before JAX starts); prints one JSON document that tests/test_sglang_jax.py checks.

Every scenario is clean: whatever the feed is handed, no step may report a violation.

* ``never run``: the delta of R3's prefill (a radix hit on R1's prompt) is made and never reaches
  a step (the scheduler dropped the batch); the batch is made again and run.
* ``failed before dispatch``: R3's prefill step fails before it runs (a slot table with one
  dimension); the same delta, then a fresh one, runs.
* ``two states``: the state is forked before R3's prefill; the live state runs it, then the fork
  runs the same batch with a delta from the same feed, then the live state decodes on.
* ``recycled id``: R1 finishes and is freed; a new ``Req`` with R1's rid takes R1's row, with a
  radix hit on R2's prompt (CPython hands the new ``Req`` R1's address, ``id()``, when it can).
* ``unpadded delta``: R3's prefill delta is made from the batch padded to its own size (one
  row), the step gets the batch padded to the bucket (four rows): refused before anything is
  donated, then the right delta runs.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import weakref

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(_HERE), _HERE]

import _sglang_jax_life as life  # noqa: E402  (sets the 2-device mesh before JAX starts)
import _sglang_jax_compat as compat  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
from sgl_jax.srt.managers.schedule_batch import Req  # noqa: E402
from sgl_jax.srt.model_executor.forward_batch_info import ForwardBatch  # noqa: E402
from sgl_jax.srt.sampling.sampling_params import SamplingParams  # noqa: E402

from kvcanary_jax.integrations import sglang_jax as ksj  # noqa: E402

R3_PROMPT = [11, 12, 13, 14, 15, 16, 17, 18, 31, 32, 33]  # R1's prompt, then its own


def world():
    return life.World(page_size=1, pool_size=36, layout="pool", kv_write="legacy",
                      tokens="feed")


def first_life(w):
    """R1 and R2 prefill, three decode steps: R1 finishes. Returns (R1, R2, running batch)."""
    r1 = w.new_req("1", [11, 12, 13, 14, 15, 16, 17, 18], max_new_tokens=4)
    r2 = w.new_req("2", [21, 22, 23, 24, 25], max_new_tokens=12)
    running = w.extend_batch([r1, r2])
    w.live_step("prefill r1 r2", running, extend=True)
    w.r1_row = r1.req_pool_idx  # 0.1.0rc0 clears it when R1's row is freed
    for i in range(3):
        running.prepare_for_decode()
        w.live_step(f"decode {i}", running, extend=False)
    assert r1.finished() and not r2.finished()
    running.filter_batch()
    return r1, r2, running


def decode_on(w, running, new, steps):
    running.merge_batch(new)
    for i in range(steps):
        running.prepare_for_decode()
        w.live_step(f"decode after {i}", running, extend=False)


def found(w):
    return [v for step in w.log for v in step["new_violations"]]


def deleted(tree) -> bool:
    return any(x.is_deleted() for x in jax.tree.leaves(tree) if isinstance(x, jax.Array))


def never_run() -> dict:
    w = world()
    _, _, running = first_life(w)
    r3 = w.new_req("3", R3_PROMPT, max_new_tokens=4)
    prefix = len(r3.prefix_indices)
    new = w.extend_batch([r3])
    w.worker_batch(new)  # made, never run
    w.live_step("prefill r3", new, extend=True)
    decode_on(w, running, new, 2)
    return {"r3_prefix_len": prefix, "violations": found(w)}


def failed_before_dispatch() -> dict:
    w = world()
    _, _, running = first_life(w)
    r3 = w.new_req("3", R3_PROMPT, max_new_tokens=4)
    new = w.extend_batch([r3])
    mwb, fb, delta = w.worker_batch(new)
    error = None
    try:
        w.run(fb, delta, table=np.zeros((life.CONTEXT,), np.int32))
    except Exception as e:  # noqa: BLE001  (whatever the step raises, it raised before running)
        error = type(e).__name__
    out = {"error": error, "state_deleted": deleted(w.state),
           "kv_deleted": deleted(w.kv_pool.kv_buffer)}
    w.live_step("prefill r3", new, extend=True)
    decode_on(w, running, new, 2)
    out["violations"] = found(w)
    return out


def two_states() -> dict:
    w = world()
    _, _, running = first_life(w)
    r3 = w.new_req("3", R3_PROMPT, max_new_tokens=4)
    new = w.extend_batch([r3])
    fork_state, fork_kv = life._copy(w.state), life._copy(w.kv_pool.kv_buffer)
    mwb, fb, delta = w.worker_batch(new)
    w.state, w.kv_pool.kv_buffer = w.run(fb, delta)  # the live state
    live = ksj.read_violations(w.state)
    mwb, fb, delta = w.worker_batch(new)  # the same batch on the fork, the same feed
    before = ksj.violation_counts(fork_state)
    fork_state, _ = w.run(fb, delta, state=fork_state, kv=fork_kv)
    fork = life._dump(ksj.read_violations(fork_state, start=before))
    w.finish_step(new, extend=True)
    decode_on(w, running, new, 2)  # the live state again
    return {"live_prefill": life._dump(live), "fork_prefill": fork, "violations": found(w)}


def recycled_id() -> dict:
    w = world()
    r1, r2, running = first_life(w)
    row = w.r1_row
    # R3 takes the row nobody used yet, so the next request gets R1's.
    r3 = w.new_req("3", [61, 62, 63], max_new_tokens=2)
    new = w.extend_batch([r3])
    w.live_step("prefill r3", new, extend=True)
    running.merge_batch(new)
    old_id, gone = id(r1), weakref.ref(r1)
    params = SamplingParams(max_new_tokens=3, ignore_eos=True)
    params.normalize(None)
    prompt = [21, 22, 23, 24, 25, 71, 72]  # a radix hit on R2's prompt
    del r1, new
    gc.collect()
    alive = gone() is not None  # only what the feed keeps can keep R1 alive now
    # A new Req with R1's rid; CPython reuses a freed object's memory, so one of the first
    # candidates usually gets R1's address (if nothing keeps R1 alive).
    keep, again = [], None
    ranked = {"dp_rank": 0} if compat.V01 else {}  # the rank R2's radix nodes are keyed by
    for _ in range(2000):
        cand = Req(rid="1", origin_input_text="", origin_input_ids=list(prompt),
                   sampling_params=params, **ranked)
        if id(cand) == old_id:
            again = cand
            break
        keep.append(cand)
    recycled = again is not None
    again = again if recycled else keep[0]
    del keep
    again.init_next_round_input(w.tree)
    w.tree.inc_lock_ref(again.last_node)
    prefix = len(again.prefix_indices)
    new = w.extend_batch([again])
    w.live_step("prefill r1 again", new, extend=True)
    again_row = int(again.req_pool_idx)  # 0.1.0rc0 clears it when the row is freed
    decode_on(w, running, new, 2)
    return {"id_recycled": recycled, "r1_alive": alive,
            "row": again_row, "r1_row": int(row),
            "prefix_len": prefix, "violations": found(w)}


def unpadded_delta() -> dict:
    w = world()
    _, _, running = first_life(w)
    r3 = w.new_req("3", R3_PROMPT, max_new_tokens=4)
    new = w.extend_batch([r3])
    own = new.get_model_worker_batch([life.TOKENS], [1], [life.CACHE_LOC], w.page_size)
    padded = new.get_model_worker_batch([life.TOKENS], [life.MAX_BS], [life.CACHE_LOC],
                                        w.page_size)
    fb = ForwardBatch.init_new(padded, w.runner)
    out = {"own_bs": len(own.seq_lens), "padded_bs": len(padded.seq_lens), "error": None}
    before = ksj.violation_counts(w.state)
    try:
        state, kv = w.run(fb, w.feed.delta(new.reqs, own))
        out["violations_when_run"] = life._dump(ksj.read_violations(state, start=before))
        w.state, w.kv_pool.kv_buffer = state, kv
    except ValueError as e:
        out["error"] = str(e)
        out["state_deleted"] = deleted(w.state)
        out["kv_deleted"] = deleted(w.kv_pool.kv_buffer)
        w.state, w.kv_pool.kv_buffer = w.run(fb, w.feed.delta(new.reqs, padded))
        out["violations_when_run"] = life._dump(ksj.read_violations(w.state, start=before))
    w.finish_step(new, extend=True)
    decode_on(w, running, new, 2)
    out["violations"] = found(w)
    return out


SCENARIOS = {"never run": never_run, "failed before dispatch": failed_before_dispatch,
             "two states": two_states, "recycled id": recycled_id,
             "unpadded delta": unpadded_delta}


if __name__ == "__main__":
    names = sys.argv[1:] or list(SCENARIOS)
    json.dump({name: SCENARIOS[name]() for name in names}, sys.stdout)
