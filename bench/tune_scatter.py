"""Sweep the scatter's launch parameters on the GPU, for ours and for the Triton 2-D baseline.

``python -m bench.tune_scatter [out.json] [--cases 64x128,8x2048] [--blocks 128,256]
[--warps 4,8] [--no-table]`` prints, per case, the device time of every (block,
warps) variant of both kernels, so the chosen constants (kvcanary_jax/ops/scatter/pallas_triton.py)
and the baseline's are both the best each design has; the outcome is recorded in bench/NOTES.md.
Each case's best variant of ours goes into the tuned table of the GPU's device kind
(``kvcanary_jax/tuning/scatter.<device kind>.json``), which ``kc.scatter_req_token_ids`` reads.
"""

from __future__ import annotations

import argparse
import json

from kvcanary_jax.bench import common, timing
from kvcanary_jax.bench.op_scatter import _inputs

CASES = [(1, 128), (1, 2048), (8, 2048), (64, 2048), (64, 8192), (256, 8192), (511, 8192), (2048, 2048)]
BLOCKS = (256, 512, 1024, 2048, 4096)
WARPS = (2, 4, 8)


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(","))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", nargs="?", default="tune_scatter.json")
    ap.add_argument("--cases", help="bs x tokens a request, e.g. 64x128,8x2048 (default: CASES)")
    ap.add_argument("--blocks", type=_ints, default=BLOCKS)
    ap.add_argument("--warps", type=_ints, default=WARPS)
    ap.add_argument("--no-table", action="store_true", help="leave the tuned table as it is")
    a = ap.parse_args(argv)
    cases = ([tuple(int(x) for x in c.split("x")) for c in a.cases.split(",")] if a.cases
             else CASES)
    import jax
    import torch
    import triton

    import kvcanary_jax as kc
    from kvcanary_jax.bench import triton_scatter as ts
    from kvcanary_jax.ops.scatter.pallas_triton import Config

    out = []
    for bs, seq in cases:
        flat, offsets, rpi, pool = _inputs(bs, seq, 1)
        k = timing.num_sets(flat.nbytes + pool.nbytes)
        res = {"case": f"bs={bs} seq={seq}", "ours": {}, "triton": {}}
        with jax.enable_x64(True):
            sets = [[common.to_jax(a) for a in _inputs(bs, seq, s)] for s in range(k)]
            for block in a.blocks:
                for warps in a.warps:
                    fn = jax.jit(lambda f, o, r, p, c=Config(block, warps):
                                 kc.scatter_req_token_ids(
                                     flat_in=f, offsets=o, req_pool_indices=r, pool_out=p,
                                     implementation="pallas_triton", config=c),
                                 donate_argnums=3)

                    def run(i, fn=fn):
                        s = sets[i % k]
                        s[3] = fn(*s)

                    t = timing.device_time(run, lambda: common.jax_sync([s[3] for s in sets]), iters=30)
                    res["ours"][f"{block}x{warps}"] = t["median_us"]
        tsets = [[common.to_torch(a) for a in _inputs(bs, seq, s)] for s in range(k)]
        for block in a.blocks:
            for warps in a.warps:
                span = min(seq, flat.shape[0])

                def run_t(i, block=block, warps=warps):
                    f, o, r, p = tsets[i % k]
                    ts._scatter_2d_kernel[(bs, triton.cdiv(span, block))](
                        f, o, r, p, f.shape[0], p.stride(0), p.shape[1], BLOCK=block, num_warps=warps)

                t = timing.device_time(run_t, torch.cuda.synchronize, iters=30)
                res["triton"][f"{block}x{warps}"] = t["median_us"]
        best_o = min(res["ours"].items(), key=lambda kv: kv[1])
        best_t = min(res["triton"].items(), key=lambda kv: kv[1])
        print(f"{res['case']:>16}: ours best {best_o[0]} {best_o[1]:.2f} us | triton best {best_t[0]} "
              f"{best_t[1]:.2f} us | ratio {best_o[1] / best_t[1]:.2f}",
              flush=True)
        out.append(res)
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)
    table = None if a.no_table else common.write_tuned_table("scatter", [_entry(r) for r in out])
    if table:
        print(f"tuned table: {table}")
    return 0


def _entry(res: dict) -> dict:
    """A tuned-table entry from one case's sweep (key: the op's static shapes)."""
    bs, seq = (int(x.split("=")[1]) for x in res["case"].split())
    name, us = min(res["ours"].items(), key=lambda kv: kv[1])
    block, warps = (int(x) for x in name.split("x"))
    return {"key": {"bs": bs, "num_tokens": bs * seq, "max_cols": seq},
            "config": {"block_cols": block, "num_warps": warps}, "median_us": round(us, 3),
            "source": "bench/tune_scatter.py"}


if __name__ == "__main__":
    raise SystemExit(main())
