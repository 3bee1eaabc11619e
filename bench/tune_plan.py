"""Sweep the plan kernels' launch parameters on the GPU.

``python -m bench.tune_plan [out.json [bs,bs,...]]`` times, per case of bench.op_plan (decode
batches, prefixes up to 2,048, the expected-token pool on), the two halves of the Pallas plan
(``kvcanary_jax.ops.plan.pallas_triton.Config``) by their own kernels' device time:

1. offsets: the one-program path at several warp counts, and the multi-block path at several
   block sizes and warps; scored by the offsets kernels' time (the block sums' included);
2. entries (under the best offsets): ``block_entries`` x ``entries_num_warps``, then
   ``max_programs``; scored by the entries kernel's time.

Every variant's plan is compared with the defaults' on one input set (all nine arrays) before it
is timed. Writes every measurement to the JSON file after each case and prints the best variant
per case next to the defaults.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
import traceback

import numpy as np

from kvcanary_jax.bench import common, timing
from kvcanary_jax.bench.op_plan import MAX_PREFIX, _inputs

CASES = [4096, 16384, 1024, 256, 64]
ITERS = 20
BUDGET_S = float(os.environ.get("KVCANARY_TUNE_BUDGET_S", 400))
SINGLE_WARPS = [4, 8, 16, 32]
MULTI = [(256, 4), (512, 4), (512, 8), (1024, 8), (2048, 8)]
ENTRY_SHAPES = [(128, 4), (256, 2), (256, 4), (512, 2), (512, 4), (512, 8), (1024, 4),
                (1024, 8), (2048, 8)]
PROGRAMS = [264, 528, 2048, 1 << 30]
OFFSETS_KERNELS = ("kvcanary_plan_offsets", "kvcanary_plan_offsets_block_sums")
ENTRIES_KERNEL = "kvcanary_plan_entries"


def main() -> int:
    import jax

    import kvcanary_jax as kc
    from kvcanary_jax.ops.plan import pallas_triton

    fields = dataclasses.asdict(pallas_triton.Config())
    del fields["interpret"]
    # Off the GPU (a check of this script), the same kernels in interpret mode.
    interpret = not common.on_gpu()
    path = sys.argv[1] if len(sys.argv) > 1 else "tune_plan.json"
    cases = [int(c) for c in sys.argv[2].split(",")] if len(sys.argv) > 2 else CASES
    out = []
    t_start = time.perf_counter()
    for bs in cases:
        probe = _inputs(bs, seed=bs, max_prefix=MAX_PREFIX)
        cap = bs * MAX_PREFIX
        k = timing.num_sets(sum(a.nbytes for a in probe.values()) + cap * 32)
        total = int(probe["prefix_lens"].sum())
        del probe
        res = {"case": f"bs={bs}", "bs": bs, "entries": total, "offsets": {}, "entries_us": {},
               "total": {}, "errors": {}}
        kw = dict(swa_window_size=0, full_to_swa_index_mapping=None, verify_capacity=cap,
                  kv_token_id_vs_position_offset=0)
        with jax.enable_x64(True):
            def fresh(seed):
                return [kc.VerifyPlan.allocate(verify_capacity=cap),
                        kc.WritePlan.allocate(write_req_capacity=bs),
                        {n: common.to_jax(a) for n, a in _inputs(bs, seed, MAX_PREFIX).items()}]

            sets = [fresh(s) for s in range(k)]
            expect = None

            def measure(cfg: dict):
                name = common.config_key(cfg)
                if name in res["total"] or name in res["errors"]:
                    return name if name in res["total"] else None
                if time.perf_counter() - t_start > BUDGET_S:
                    return None
                nonlocal expect
                fn = jax.jit(lambda vp, wp, a, c=pallas_triton.Config(
                    **cfg, interpret=interpret): kc.canary_plan(
                    verify_plan_out=vp, write_plan_out=wp, **a, **kw,
                    implementation="pallas_triton", config=c), donate_argnums=(0, 1))
                try:
                    vp, wp = fn(*fresh(0))
                    got = [np.asarray(x) for x in jax.tree.leaves((vp, wp))]
                    if expect is None:
                        expect = got
                    if not all(np.array_equal(a, b) for a, b in zip(got, expect)):
                        raise AssertionError("plan differs from the defaults'")

                    def run(i, fn=fn):
                        s = sets[i % k]
                        s[0], s[1] = fn(s[0], s[1], s[2])

                    t = timing.device_time(run, lambda: common.jax_sync([s[:2] for s in sets]),
                                           iters=ITERS)
                    per = t.get("kernel_us_per_call", {})
                    res["total"][name] = t["median_us"]
                    res["offsets"][name] = round(sum(per.get(n, 0.0) for n in OFFSETS_KERNELS), 3)
                    res["entries_us"][name] = per.get(ENTRIES_KERNEL)
                    return name
                except Exception as e:  # noqa: BLE001 - a variant that does not build is data
                    res["errors"][name] = f"{type(e).__name__}: {e}"[:300]
                    traceback.print_exc(limit=1)
                    return None

            def best_of(cands, score):
                names = [(measure(c), i, c) for i, c in enumerate(cands)]
                scored = [(res[score][n], i, c) for n, i, c in names
                          if n is not None and res[score].get(n) is not None]
                return min(scored)[2] if scored else cands[0]

            default = dict(fields)
            measure(default)
            offsets = [{**default, "offsets_num_warps": w} for w in SINGLE_WARPS
                       if bs <= default["single_block_max"]]
            offsets += [{**default, "single_block_max": 1, "multi_block": b,
                         "offsets_num_warps": w} for b, w in MULTI if b < bs]
            if bs <= 4096:  # SGLang's one program of up to 4,096 requests, for reference
                offsets.append({**default, "single_block_max": 4096, "multi_block": 4096,
                                "offsets_num_warps": 8})
            cur = best_of([default] + offsets, "offsets")
            cur = best_of([cur] + [{**cur, "block_entries": b, "entries_num_warps": w}
                                   for b, w in ENTRY_SHAPES], "entries_us")
            cur = best_of([cur] + [{**cur, "max_programs": p} for p in PROGRAMS], "entries_us")
            del sets
        res["best"] = common.config_key(cur)
        res["best_config"] = dict(cur)
        for what in ("total", "offsets", "entries_us"):
            res[f"best_{what}"] = res[what].get(res["best"])
            res[f"default_{what}"] = res[what].get(common.config_key(default))
        print(f"{res['case']:>10}: best {res['best_total']} us (offsets {res['best_offsets']}, "
              f"entries {res['best_entries_us']}) [{res['best']}] | defaults "
              f"{res['default_total']} ({res['default_offsets']}, {res['default_entries_us']}) | "
              f"{len(res['total'])} variants, {len(res['errors'])} failed | "
              f"{time.perf_counter() - t_start:.0f} s", flush=True)
        out.append(res)
        with open(path, "w") as f:
            json.dump(out, f, indent=1)
    for res in out:
        for what in ("offsets", "entries_us"):
            top = sorted(res[what].items(), key=lambda kv: kv[1] if kv[1] is not None else 1e9)[:4]
            print(res["case"], what, "top 4:", "; ".join(f"{t} [{n}]" for n, t in top))
        for n, e in list(res["errors"].items())[:3]:
            print("  failed:", n, "->", e)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
