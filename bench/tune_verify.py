"""Sweep the verify kernel's variants and launch parameters on the GPU.

``python -m bench.tune_verify [out.json [entries,entries,...]]`` times, per case of
bench.op_verify (clean chains at random slots, three corrupted tokens, token check on), a
coordinate descent over the fields of the Pallas kernel's launch config
(``kvcanary_jax.ops.verify.pallas_triton.Config``):

1. structure: ``group`` (column vectors that reuse the predecessor's fields) x ``vec`` (canary
   words per gather instruction), plus the previous design (group 1, vec 1, no hoist);
2. launch shape: ``block`` x ``num_warps``;
3. grid: ``max_programs`` (persistent grid-stride ... one program per block);
4. ``num_stages``, ``hoist``.

Each stage keeps the best of the previous ones. A variant that fails to lower or compile is
reported and skipped. Prints the best variant per case next to the heuristics' choice and the
previous design, and writes every measurement to the JSON file after each case. Each case's best
variant goes into the tuned table of the GPU's device kind
(``kvcanary_jax/tuning/verify.<device kind>.json``), which ``kc.canary_verify`` reads.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
import traceback

from kvcanary_jax.bench import common, timing
from kvcanary_jax.bench.op_verify import _inputs, gather_floor, jax_fresh

# Largest first: the byte-floor target is at 4M entries, and BUDGET_S may cut the tail.
CASES = [1 << 22, 1 << 20, 1 << 10, 1 << 16]
ITERS = 20
OLD = dict(group=1, vec=1, hoist=False, block=512, num_warps=4, max_programs=264, num_stages=1)
STRUCTURE = [(1, 1), (1, 4), (2, 4), (4, 2), (4, 4), (8, 4)]
# Stop starting new variants after this many seconds (the device allows 600 s per command).
BUDGET_S = float(os.environ.get("KVCANARY_TUNE_BUDGET_S", 500))
SHAPES = [(256, 4), (512, 4), (512, 8), (1024, 4), (1024, 8), (2048, 8)]
SMALL_SHAPES = [(64, 1), (128, 1), (128, 2), (128, 4), (256, 2), (256, 4), (256, 8), (512, 4),
                (1024, 4), (1024, 8)]

PROGRAMS = [132, 264, 528, 1056, 2112, 1 << 30]
MID_PLAN = 1 << 18
EXTRAS = [dict(num_stages=2), dict(num_stages=3), dict(hoist=False)]
# KVCANARY_TUNE_VARIANTS='[{"group": 8, "block": 2048}, ...]': time only these, each over the
# heuristics' config, and write no tuned table.
VARIANTS = json.loads(os.environ.get("KVCANARY_TUNE_VARIANTS", "[]"))


def main() -> int:
    import jax

    import kvcanary_jax as kc
    from kvcanary_jax.ops.verify import pallas_triton

    def heuristic(capacity):
        # The tuned fields only: ``interpret`` is no launch parameter, and a table refuses it.
        fields = dataclasses.asdict(pallas_triton.heuristics({"capacity": capacity,
                                                              "real_kv_words": 0}))
        del fields["interpret"]
        return fields

    large = heuristic(1 << 30)
    path = sys.argv[1] if len(sys.argv) > 1 else "tune_verify.json"
    cases = [int(c) for c in sys.argv[2].split(",")] if len(sys.argv) > 2 else CASES
    out = []
    t_start = time.perf_counter()
    for entries in cases:
        probe = _inputs(entries, seed=entries)
        k = timing.num_sets(probe["canary_buf"].nbytes + 32 * entries)
        del probe
        res = {"case": f"entries={entries}", "entries": entries, "times": {}, "errors": {}}
        default = heuristic(entries)  # what a call without a tuned entry uses
        with jax.enable_x64(True):
            sets = [jax_fresh(entries, seed) for seed in range(k)]
            expect = None

            def measure(kw: dict):
                name = common.config_key(kw)
                if name in res["times"] or name in res["errors"]:
                    return res["times"].get(name)
                if time.perf_counter() - t_start > BUDGET_S:
                    return None
                nonlocal expect
                fn = jax.jit(lambda ctx, plan, c=pallas_triton.Config(**kw): kc.canary_verify(
                    context=ctx, plan=plan, check_verify_expected_token=True,
                    implementation="pallas_triton", config=c), donate_argnums=0)
                try:
                    # Correctness on set 0 against the reference (violation count, counters).
                    s0 = sets[0]
                    before = (int(s0[0].violation_write_index[0]), int(s0[0].slot_run_counter[0]))
                    s0[0] = fn(s0[0], s0[1])
                    got = (int(s0[0].violation_write_index[0]) - before[0],
                           int(s0[0].slot_run_counter[0]) - before[1])
                    if expect is None:
                        expect = got
                    if got != expect:
                        raise AssertionError(f"counts {got} != {expect}")

                    def run(i, fn=fn):
                        s = sets[i % k]
                        s[0] = fn(s[0], s[1])

                    t = timing.device_time(
                        run, lambda: common.jax_sync([s[0] for s in sets]), iters=ITERS)
                    res["times"][name] = t["median_us"]
                    return t["median_us"]
                except Exception as e:  # noqa: BLE001 - a variant that does not build is data
                    res["errors"][name] = f"{type(e).__name__}: {e}"[:300]
                    traceback.print_exc(limit=1)
                    return None

            def best_of(cands):
                scored = [(measure(c), i, c) for i, c in enumerate(cands)]
                scored = [s for s in scored if s[0] is not None]
                return min(scored)[2] if scored else cands[0]

            # References first: the previous design and the module's defaults.
            measure(dict(OLD))
            measure(dict(large))
            measure(dict(default))
            cur = dict(default)
            if VARIANTS:
                # Only the given variants, each over the heuristics' config, and the gather
                # floor in the same process.
                cur = best_of([cur] + [{**cur, **v} for v in VARIANTS])
                del sets
                res["gather_floor"] = gather_floor(entries, iters=ITERS)
                _finish(res, cur, default, out, path, t_start)
                continue
            cur = best_of([{**cur, "group": g, "vec": v} for g, v in STRUCTURE] + [dict(OLD)])
            # Mid-size plans (a batch's whole context, 64 x 2,048 cached tokens) get both lists:
            # the large shapes leave most SMs one program there.
            shapes = (SMALL_SHAPES if entries <= 65536 else
                      SMALL_SHAPES + SHAPES if entries <= MID_PLAN else SHAPES)
            cur = best_of([{**cur, "block": b, "num_warps": w} for b, w in shapes])
            if entries > 4096:
                cur = best_of([{**cur, "max_programs": p} for p in PROGRAMS])
            cur = best_of([cur] + [{**cur, **x} for x in EXTRAS])
            # Second look at the structure under the chosen launch shape.
            cur = best_of([cur] + [{**cur, "group": g} for g in (2, 4, 8)])
            del sets
        _finish(res, cur, default, out, path, t_start)
    table = common.write_tuned_table("verify", [
        # The cases fold no real KV: the entries apply to verifies that do not either.
        {"key": {"capacity": r["entries"], "real_kv_words": 0}, "config": r["best_config"],
         "median_us": round(r["best_us"], 3), "source": "bench/tune_verify.py"}
        for r in out if r["best_us"] is not None and not VARIANTS])
    if table:
        print(f"tuned table: {table}")
    for res in out:
        top = sorted(res["times"].items(), key=lambda kv: kv[1])[:5]
        print(res["case"], "top 5:", "; ".join(f"{t:.2f} [{n}]" for n, t in top))
        for n, e in list(res["errors"].items())[:3]:
            print("  failed:", n, "->", e)
    return 0


def _finish(res, cur, default, out, path, t_start):
    res["best"] = common.config_key(cur)
    res["best_config"] = dict(cur)
    res["best_us"] = res["times"].get(res["best"])
    res["default_us"] = res["times"].get(common.config_key(default))
    res["old_us"] = res["times"].get(common.config_key(OLD))
    fmt = lambda x: "n/a" if x is None else f"{x:.2f}"  # noqa: E731
    if "gather_floor" in res:
        print(f"{res['case']:>16}: gather floor {res['gather_floor']}")
    print(f"{res['case']:>16}: best {fmt(res['best_us'])} us [{res['best']}] | defaults "
          f"{fmt(res['default_us'])} | previous design {fmt(res['old_us'])} | "
          f"{len(res['times'])} variants, {len(res['errors'])} failed | "
          f"{time.perf_counter() - t_start:.0f} s", flush=True)
    out.append(res)
    with open(path, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    raise SystemExit(main())
