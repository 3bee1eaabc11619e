"""Sweep canary_write's launch parameters on the GPU, next to SGLang 0.5.23's CUDA write.

``python -m bench.tune_write [out.json] [--quick | --smoke]`` prints, per case (reqs x tokens, the bench's
inputs: chains continued from seeded slots, chain-position assert on), the device time of every
(block, unroll, num_warps) variant, the best one, the shipped defaults' time and SGLang's time, so
one GPU run picks the constants of kvcanary_jax/ops/write/pallas_triton.py. Every variant's result
(canary, ring, counters) is checked against the default variant's on fresh inputs; a mismatch is
printed and the variant is excluded from "best". Each case's best variant goes into the tuned
table of the GPU's device kind (``kvcanary_jax/tuning/write.<device kind>.json``), which
``kc.canary_write`` reads.

Expected (per-token cost ~ one mix3 latency, ~85 ns on an H200, when the chain is the bottleneck):

* num_warps: 1 should win everywhere. A program is one serial chain; extra warps only repeat the
  scalar work and take registers / residency (1024 programs must fit in one wave).
* unroll: 8-16 best on long chains (the scalar loads of a trip issue together, one L1 latency per
  trip); no effect on 1-token requests (the remainder loop runs one step).
* block: small effect; 64-128 expected best (per-block vector work and the per-block violation
  check are amortised; a 1-token request still loads one block of lanes, cheap with one warp).
"""

from __future__ import annotations

import json
import sys

import numpy as np

from kvcanary_jax.bench import common, timing
from kvcanary_jax.bench.op_write import (FULL_CASES, QUICK_CASES, SMOKE_CASES, _inputs,
                                         jax_fresh, sglang_fresh)

BLOCKS = (32, 64, 128, 256)
UNROLLS = (4, 8, 16)
WARPS = (1, 2, 4)


def variants():
    """Full (block x unroll) grid at one warp, plus the warp counts at the default shape."""
    from kvcanary_jax.ops.write import pallas_triton

    out = [(b, u, 1) for b in BLOCKS for u in UNROLLS]
    out += [(pallas_triton.BLOCK, pallas_triton.CHAIN_UNROLL, w) for w in WARPS if w != 1]
    default = (pallas_triton.BLOCK, pallas_triton.CHAIN_UNROLL, pallas_triton.NUM_WARPS)
    if default not in out:
        out.append(default)
    out.remove(default)
    return [default] + out  # the default first: the others are checked against it


def _sglang_time(sgl, reqs, tokens, k, iters):
    import torch

    sets = [sglang_fresh(sgl, reqs, tokens, s) for s in range(k)]

    def run(i):
        c, p, ids, pos, loc = sets[i % k]
        sgl.write.launch_canary_write_kernel(
            context=c, plan=p, input_ids=ids, positions=pos, out_cache_loc=loc,
            enable_write_input_assert=False, expected_input_tokens=None,
            expected_input_positions=None)

    return timing.device_time(run, torch.cuda.synchronize, iters=iters)["median_us"]


def main() -> int:
    import jax
    import jax.numpy as jnp

    import kvcanary_jax as kc
    from kvcanary_jax.ops.write.pallas_triton import Config

    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    smoke = "--smoke" in sys.argv  # CPU check of the script itself: tiny cases, 3 variants
    cases = SMOKE_CASES if smoke else QUICK_CASES if "--quick" in sys.argv else FULL_CASES
    iters = 3 if smoke else 30
    # The smoke run checks the script on a CPU: the same kernel in interpret mode.
    impl = "pallas_triton" if common.on_gpu() else "pallas_interpret"
    sgl = common.sglang(cuda_jit=common.on_gpu())
    out = []
    for reqs, tokens in cases:
        n = reqs * tokens
        k = timing.num_sets(_inputs(reqs, tokens, 0)["canary_buf"].nbytes + 24 * n)
        res = {"case": f"reqs={reqs} tokens={tokens}", "ours": {}, "mismatch": []}
        with jax.enable_x64(True):
            check_in = jax_fresh(reqs, tokens, n + 1)
            sets = [jax_fresh(reqs, tokens, s) for s in range(k)]
            expect = None
            for block, unroll, warps in variants()[:3] if smoke else variants():
                name = f"b{block}u{unroll}w{warps}"
                fn = jax.jit(lambda ctx, plan, ids, pos, loc, c=Config(block, unroll, warps):
                             kc.canary_write(context=ctx, plan=plan, input_ids=ids, positions=pos,
                                             out_cache_loc=loc, enable_write_input_assert=False,
                                             expected_input_tokens=None,
                                             expected_input_positions=None,
                                             implementation=impl, config=c),
                             donate_argnums=0)
                ctx = fn(jax.tree_util.tree_map(jnp.copy, check_in[0]), *check_in[1:])
                got = [np.asarray(x) for x in (ctx.canary_buf, ctx.violation_ring,
                                               ctx.violation_write_index, ctx.slot_run_counter,
                                               ctx.kernel_run_counter)]
                if expect is None:
                    expect = got
                elif not all(np.array_equal(a, b) for a, b in zip(got, expect)):
                    res["mismatch"].append(name)

                def run(i, fn=fn):
                    s = sets[i % k]
                    s[0] = fn(*s)

                t = timing.device_time(run, lambda: common.jax_sync([s[0] for s in sets]),
                                       iters=iters)
                res["ours"][name] = t["median_us"]
            del sets, check_in
        if common.on_gpu():
            res["sglang"] = _sglang_time(sgl, reqs, tokens, k, iters)
        ok = {kk: v for kk, v in res["ours"].items() if kk not in res["mismatch"]}
        best = min(ok.items(), key=lambda kv: kv[1])
        b, u, w = (int(x) for x in best[0][1:].replace("u", " ").replace("w", " ").split())
        res["table_entry"] = {"key": {"write_capacity": reqs, "num_tokens": n},
                              "config": {"block": b, "unroll": u, "num_warps": w},
                              "median_us": round(best[1], 3), "source": "bench/tune_write.py"}
        default = next(iter(res["ours"].items()))
        sg = res.get("sglang", float("nan"))
        print(f"{res['case']:>22}: best {best[0]} {best[1]:.1f} us | default {default[0]} "
              f"{default[1]:.1f} us | sglang {sg:.1f} us | best/sglang {best[1] / sg:.2f}"
              + (f" | MISMATCH {res['mismatch']}" if res["mismatch"] else ""), flush=True)
        print("    " + " ".join(f"{kk}={v:.1f}" for kk, v in res["ours"].items()), flush=True)
        out.append(res)
    path = args[0] if args else "tune_write.json"
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    table = common.write_tuned_table("write", [r["table_entry"] for r in out])
    if table:
        print(f"tuned table: {table}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
