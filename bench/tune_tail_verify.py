"""Sweep the launch shape of the verifies that fold real KV, and the write's real-KV prefetch,
inside sglang-jax's canary-only step (the kernels as a server runs them).

    JAX_PLATFORMS=cuda python -m bench.tune_tail_verify [--bs 8,64] [--ctx 512,2048]
                                                      [--iters 10] [--out FILE] [--vec]
                                                      [--write-block] [--prefetch]

The TAIL verify fingerprints every verified slot's K strip (256 bytes, 32 words, in a serial
splitmix64 chain per slot), several times the work of the HEAD verify over the same plan, and
takes the same launch shape (the tuned table and ``SMALL_PLANS`` of
``kvcanary_jax.ops.verify.pallas_triton`` were swept without real KV). Each candidate here is
installed as the verify's fold shape (``FOLD_PLANS``, every capacity) and the canary-only step of
``bench.sglang_jax_step`` (the ``kv`` stack, an idle model, the token ids fed as deltas) is timed
after ``jax.clear_caches()``: the step's device time and each kernel's. ``write_prefetch`` rows
time the write's ``REAL_KV_PREFETCH_WRITE`` instead. Every timed step must end with 0
violations. Needs what ``bench.sglang_jax_step`` needs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings

os.environ.setdefault("FLAX_PYTREE_MODULE", "false")

import jax  # noqa: E402

from kvcanary_jax.bench import common, sglang_jax_step as sjs, timing  # noqa: E402
from kvcanary_jax.integrations import sglang_jax as ksj  # noqa: E402
from kvcanary_jax.ops import _kernel_lib  # noqa: E402
from kvcanary_jax.ops.verify import pallas_triton as vpt  # noqa: E402
from kvcanary_jax.ops.write import pallas_triton as wpt  # noqa: E402

# (block, num_warps, max_programs): the metadata-only small-plan shapes first, then more
# programs with fewer entries each (one entry per lane at block = 32 * num_warps).
FOLD_SHAPES = [None, (256, 2, 264), (128, 4, 528), (128, 2, 1 << 30), (64, 2, 1 << 30),
               (64, 1, 1 << 30), (32, 1, 1 << 30), (256, 4, 1 << 30), (512, 4, 1 << 30),
               (1024, 8, 528)]
WRITE_PREFETCH = [8, 16, 32]
# --vec: the strip's words a lane loads at once (``fold_vec``, 1, 2 or 4), the verify's at the
# shipped fold shape and two wider ones, then the write's (its prefetch as shipped).
VEC_SHAPES = [(32, 1, 1 << 30, 1), (32, 1, 1 << 30, 2), (32, 1, 1 << 30, 4),
              (64, 2, 1 << 30, 4), (128, 4, 1 << 30, 4)]
WRITE_VEC = [1, 2, 4]
# --write-block: the write's tokens per vector block (its fingerprints are folded on every lane
# of the block, valid or not: a decode step's request has one token).
WRITE_BLOCKS = [128, 64, 32]
# --prefetch: the strip's words the verify loads before it folds them (REAL_KV_PREFETCH; 32:
# the whole 256-byte strip in flight, as the CUDA C floor of bench/strip_floor.py loads it).
VERIFY_PREFETCH = [8, 16, 32]


def _case(bs: int, ctx: int, iters: int, done: list, path: str | None,
          vec: bool = False, write_block: bool = False,
          prefetch_sweep: bool = False) -> list[dict]:
    st = sjs.Stack("kv", bs, ctx, iters, "feed")
    st.build()
    canary, mesh = st.canary, st.mesh
    state = canary.init_state()
    guarded = ksj.guard_model_step(canary, st.kv_model, batch_argnum=0, pool_argnum=1,
                                   fused_kv=lambda out, pool: out[1][0])
    for _, fb, ids in st.prefills:
        with jax.set_mesh(mesh):
            state, out = guarded(state, fb, st.kv_pool, st.emb, expected=ids)
        st.kv_pool.kv_buffer = out[1]
    snap_kv, snap_state = sjs._copy(st.kv_pool.kv_buffer), sjs._copy(state)
    idle = ksj.guard_model_step(canary, st.idle_model, batch_argnum=0, pool_argnum=1,
                                fused_kv=lambda out, pool: out[1][0])

    def timed() -> dict:
        jax.clear_caches()
        st.kv_pool.kv_buffer = sjs._copy(snap_kv)
        holder = {"state": sjs._copy(snap_state)}

        def run(i):
            _, fb, ids = st.decodes[i % iters]
            with jax.set_mesh(mesh):
                holder["state"], out = idle(holder["state"], fb, st.kv_pool, expected=ids)
            st.kv_pool.kv_buffer = out[1]

        t = timing.device_time(run, lambda: jax.block_until_ready(holder["state"]), iters=iters)
        t["violations"] = int(ksj.violation_counts(holder["state"]).sum())
        return t

    rows = []

    def sweep(module, name, values, key, value_of=lambda v: v):
        """``value_of(v)`` installed as ``module.name`` for each of ``values`` in turn, a timed
        row each; the module's own value restored after."""
        kept = getattr(module, name)
        try:
            for v in values:
                setattr(module, name, value_of(v))
                rows.append({"bs": bs, "ctx": ctx, key: v, **timed()})
                _print(rows[-1])
                _save(done + rows, path)
        finally:
            setattr(module, name, kept)
        return rows

    if prefetch_sweep:
        return sweep(_kernel_lib, "REAL_KV_PREFETCH", VERIFY_PREFETCH, "verify_prefetch")
    if write_block:
        return sweep(wpt, "heuristics", WRITE_BLOCKS, "write_block", lambda b: (
            lambda shapes: wpt.Config(block=b, fold_vec=wpt.FOLD_VEC)))
    plans, prefetch = vpt.FOLD_PLANS, _kernel_lib.REAL_KV_PREFETCH_WRITE
    verify_vec, write_vec = vpt.FOLD_VEC, wpt.FOLD_VEC
    try:
        for shape in VEC_SHAPES if vec else FOLD_SHAPES:
            vpt.FOLD_PLANS = () if shape is None else (
                (1 << 62, dict(block=shape[0], num_warps=shape[1], max_programs=shape[2],
                               group=1, vec=1,
                               fold_vec=shape[3] if len(shape) > 3 else verify_vec)),)
            try:
                rows.append({"bs": bs, "ctx": ctx, "fold_shape": shape, **timed()})
            except Exception as e:  # a shape that fails to lower or compile is reported
                rows.append({"bs": bs, "ctx": ctx, "fold_shape": shape,
                             "error": f"{type(e).__name__}: {e}"[:400]})
            _print(rows[-1])
            _save(done + rows, path)
        vpt.FOLD_PLANS = plans
        for n in WRITE_VEC if vec else WRITE_PREFETCH:
            if vec:
                wpt.FOLD_VEC = n
            else:
                _kernel_lib.REAL_KV_PREFETCH_WRITE = n
            rows.append({"bs": bs, "ctx": ctx, ("write_fold_vec" if vec else "write_prefetch"): n,
                         **timed()})
            _print(rows[-1])
            _save(done + rows, path)
    finally:
        vpt.FOLD_PLANS, _kernel_lib.REAL_KV_PREFETCH_WRITE = plans, prefetch
        vpt.FOLD_VEC, wpt.FOLD_VEC = verify_vec, write_vec
    return rows


def _save(rows: list, out: str | None) -> None:
    if out:  # after every row: a run cut short by its time limit keeps what it measured
        with open(out, "w") as f:
            json.dump({"environment": common.environment(), "rows": rows}, f, indent=1)


def _print(row: dict) -> None:
    what = (f"fold {row['fold_shape']}" if "fold_shape" in row
            else f"write fold_vec {row['write_fold_vec']}" if "write_fold_vec" in row
            else f"write block {row['write_block']}" if "write_block" in row
            else f"verify prefetch {row['verify_prefetch']}" if "verify_prefetch" in row
            else f"write prefetch {row['write_prefetch']}")
    if "error" in row:
        print(f"bs={row['bs']} ctx={row['ctx']} {what}: {row['error']}", flush=True)
        return
    top = sorted(row.get("kernel_us_per_call", {}).items(), key=lambda kv: -kv[1])[:4]
    print(f"bs={row['bs']:3d} ctx={row['ctx']:5d} {what:28s} step {row['median_us']:7.1f} us  "
          + "  ".join(f"{k} {v:.2f}" for k, v in top) + f"  violations {row['violations']}",
          flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--bs", default="8,64")
    p.add_argument("--ctx", default="512,2048")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--out", default=None)
    p.add_argument("--vec", action="store_true",
                   help="time the real-KV words loaded at once (fold_vec) instead of the shapes")
    p.add_argument("--write-block", action="store_true",
                   help="time the write's tokens per vector block (block) instead")
    p.add_argument("--prefetch", action="store_true",
                   help="time the verify's real-KV words loaded before folding instead")
    a = p.parse_args(argv)
    rows = []
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*donated buffers.*")
        for bs, ctx in zip((int(x) for x in a.bs.split(",")), (int(x) for x in a.ctx.split(","))):
            rows += _case(bs, ctx, a.iters, rows, a.out, a.vec, a.write_block, a.prefetch)
    _save(rows, a.out)
    return 1 if any(r.get("violations") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
