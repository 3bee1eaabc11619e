"""Data parallelism through sglang-jax 0.1.0rc0's own objects: two DP ranks (a ``("data",
"tensor")`` mesh of 2 CPU devices, data 2), the pool ``MHATokenToKVPool(dp_size=2)`` (slots
sharded over ``data``, each rank its own slots), allocators and ``RadixCache`` per rank,
``Req(dp_rank=...)`` and ``ScheduleBatch.init_new(reqs=[rank 0's, rank 1's], dp_size=2)``: each
rank's batch segment at its fixed stride. The model is tests/_sglang_jax_life.py's stand-in,
writing KV through the pool's ``set_kv_buffer`` (the Pallas kernel under ``shard_map`` over
``data``, in TPU interpret mode), with one canary per rank around every step. Run as a script
(its own process: the 2-device CPU mesh is set through XLA_FLAGS before JAX starts); prints one
JSON document that tests/test_sglang_jax.py checks.

    python tests/_sglang_jax_dp.py --tokens feed|full

Both ranks hand out the same rank-local slot numbers (from 1), so one canary for both would see
every slot written twice. A fault on one rank is reported by that rank's canary only.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import types

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(_HERE), _HERE]

import _sglang_jax_life as life  # noqa: E402  (sets the 2-device mesh before JAX starts)
import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402
from jax.experimental.pallas import tpu as pltpu  # noqa: E402

from kvcanary_jax.integrations import sglang_jax as ksj  # noqa: E402


def main(tokens: str) -> None:
    w = life.World(page_size=1, pool_size=36, layout="pool", kv_write="kernel", tokens=tokens,
                   dp=2)
    report = {"num_shards": w.canary.num_shards, "dp_size": w.canary.dp_size,
              "num_slots": w.canary.num_slots, "axes": list(w.canary.axes),
              "kv_shape": list(w.kv_pool.kv_buffer[0].shape),
              "kv_spec": str(w.kv_pool.kv_buffer[0].sharding.spec)}

    # R1 on rank 0 and R2 on rank 1, prefilled together, three decode steps: R1 finishes.
    r1 = w.new_req("1", [11, 12, 13, 14, 15, 16, 17, 18], max_new_tokens=4, dp_rank=0)
    r2 = w.new_req("2", [21, 22, 23, 24, 25], max_new_tokens=9, dp_rank=1)
    running = w.extend_batch([[r1], [r2]])
    w.live_step("prefill r1 (rank 0) r2 (rank 1)", running, extend=True)
    report["r1_slots"] = w.req_pool.req_to_token[r1.req_pool_idx, :8].tolist()
    report["r2_slots"] = w.req_pool.req_to_token[r2.req_pool_idx, :5].tolist()
    for i in range(3):
        running.prepare_for_decode()
        w.live_step(f"decode {i}", running, extend=False)
    assert r1.finished() and not r2.finished()
    running.filter_batch()

    # R3 on rank 0 shares R1's prompt: a prefix-cache hit on rank 0's radix nodes.
    r3 = w.new_req("3", [11, 12, 13, 14, 15, 16, 17, 18, 31, 32], max_new_tokens=6, dp_rank=0)
    report["r3_prefix_len"] = len(r3.prefix_indices)
    new = w.extend_batch([[r3], []])
    w.live_step("prefill r3 (rank 0, prefix hit)", new, extend=True)
    running.merge_batch(new)
    running.prepare_for_decode()
    w.live_step("decode r2 r3 0", running, extend=False)

    prefixes = ksj.radix_prefixes(w.tree, dp_size=2)
    report["prefixes_per_rank"] = [len(p) for p in prefixes]
    before = ksj.violation_counts(w.state)
    w.state = ksj.sweep(w.canary, w.state, w.kv_pool.kv_buffer[0], prefixes)
    report["sweep_clean"] = life._dump(ksj.read_violations(w.state, start=before))

    # The step every fault is replayed on.
    running.prepare_for_decode()
    mwb, fb, ids = w.worker_batch(running)
    snapshot = (life._copy(w.state), life._copy(w.kv_pool.kv_buffer))
    report["replay"] = {"seq_lens": mwb.seq_lens.tolist(), "positions": mwb.positions.tolist(),
                        "out_cache_loc": mwb.out_cache_loc.tolist(),
                        "cache_loc_len": int(mwb.cache_loc.shape[0])}
    r2_slots = w.req_pool.req_to_token[r2.req_pool_idx].tolist()
    r3_slots = w.req_pool.req_to_token[r3.req_pool_idx].tolist()
    w.live_step("decode r2 r3 1", running, extend=False)  # the live world goes on, clean

    def replay(name, *, kv_fault=None, fb_=fb):
        state, kv = life._copy(snapshot[0]), life._copy(snapshot[1])
        if kv_fault is not None:
            kv = kv_fault(kv)
        state, _ = w.run(fb_, ids, state=state, kv=kv)
        return {"fault": name, "step": life._dump(ksj.read_violations(state))}

    def with_field(name, values):
        arr = getattr(fb, name)
        leaves, treedef = jax.tree.flatten(fb)
        out = jax.tree.unflatten(treedef, leaves)
        setattr(out, name, jax.device_put(np.asarray(values, np.asarray(arr).dtype),
                                          arr.sharding))
        return out

    per_rank_slots = w.canary.num_slots
    faults = [replay("clean replay")]
    # A flipped K byte in R3's cached position 3 (rank 0) and in R2's position 2 (rank 1): the
    # buffer's rows are global (rank d's slot s is row d * slots + s).
    report["flip_r3"] = {"slot": r3_slots[3], "position": 3}
    faults.append(replay("flip K byte rank 0", kv_fault=lambda kv: [
        life._flip_byte(kv[0], r3_slots[3], 0, 5)] + kv[1:]))
    report["flip_r2"] = {"slot": r2_slots[2], "position": 2}
    faults.append(replay("flip K byte rank 1", kv_fault=lambda kv: [
        life._flip_byte(kv[0], per_rank_slots + r2_slots[2], 0, 5)] + kv[1:]))
    # Rank 1's cache_loc segment (at its fixed stride) names, for R2's position 1, a slot of R2's
    # own prefix at position 3: a wrong slot seen by rank 1's canary only.
    cache_loc = np.asarray(fb.cache_loc).copy()
    stride = cache_loc.shape[0] // 2
    cache_loc[stride + 1] = r2_slots[3]
    report["stale"] = {"slot": r2_slots[3], "position": 1, "stride": stride}
    faults.append(replay("wrong cache_loc entry rank 1", fb_=with_field("cache_loc", cache_loc)))
    # R3's (rank 0) input id this step is not its history's.
    input_ids = np.asarray(fb.input_ids).copy()
    report["wrong_input"] = {"slot": int(mwb.out_cache_loc[0]),
                             "position": int(mwb.positions[0]),
                             "right": int(input_ids[0]), "token": int(input_ids[0]) + 1}
    input_ids[0] += 1
    faults.append(replay("input id not the request's rank 0",
                         fb_=with_field("input_ids", input_ids)))
    # A flipped byte in a slot rank 1's radix cache holds, found by the sweep on rank 1.
    prefixes = ksj.radix_prefixes(w.tree, dp_size=2)
    target = int(prefixes[1][0][2])
    state, kv = life._copy(w.state), life._copy(w.kv_pool.kv_buffer)
    before = ksj.violation_counts(state)
    state = ksj.sweep(w.canary, state, life._flip_byte(kv[0], per_rank_slots + target, 0, 9),
                      prefixes)
    report["sweep_fault"] = {"slot": target, "position": 2,
                             "found": life._dump(ksj.read_violations(state, start=before))}
    report["faults"] = faults
    report["life"] = w.log
    report["total_violations_live"] = ksj.violation_counts(w.state).tolist()
    json.dump(report, sys.stdout)


if __name__ == "__main__":
    if not hasattr(pltpu, "TPUMemorySpace"):
        pltpu.TPUMemorySpace = types.SimpleNamespace(ANY=pl.ANY)
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", choices=("full", "feed"), default="feed")
    main(parser.parse_args().tokens)
