"""The KV digest (ours, docs/spec.md §16): device time of digest_write and digest_verify over
every layer of a model's KV, against the byte floor (the KV bytes the op must read / the copy
bandwidth).

    python -m bench.op_digest [--quick | --smoke] [--iters N] [--implementations a,b]
                              [--out DIR]

The model: sglang-jax's fused layout, one bf16 ``[slots, 2 * heads * head_dim]`` buffer per
layer (K and V of every head interleaved), one source per layer hashing its whole row: 32 layers
of 8 KV heads of 128 = 4 KiB a slot a layer, 128 KiB a slot. A verify's entries are a decode
batch's cached positions (``bs * ctx``, random slots of the pool, as a paged allocator leaves
them) at a window (64: every slot once in 64 steps; 1: every entry, the cost of re-hashing all
that attention reads); each timed call takes the next phase, so the slots read change from call
to call. A write digests a step's new tokens (a decode batch, a prefill chunk). Device time: the
project's ``bench/timing.py`` (CUPTI on a GPU: every kernel the call launches, XLA's compaction
included).

Correctness, per case: a write's digests of a few slots against numpy's
(:func:`kvcanary_jax.hashing.digest_np` of the slots' bytes); a verify after three stored digests
of selected slots were changed reports exactly those three.

Results: ``DIR/digest.json`` (every figure) and the table on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

from kvcanary_jax.bench import common, timing

LAYERS, HEADS, HEAD_DIM = 32, 8, 128
SMOKE_MODEL = dict(layers=2, heads=1, head_dim=16)
FULL_MODEL = dict(layers=LAYERS, heads=HEADS, head_dim=HEAD_DIM)

FULL_CASES = [
    dict(function="verify", bs=8, ctx=512, window=64),
    dict(function="verify", bs=64, ctx=2048, window=64),
    dict(function="verify", bs=8, ctx=512, window=1),
    dict(function="verify", bs=64, ctx=2048, window=1),
    dict(function="write", tokens=8),
    dict(function="write", tokens=64),
    dict(function="write", tokens=8192),
]
QUICK_CASES = [FULL_CASES[0], FULL_CASES[1], FULL_CASES[5]]
SMOKE_CASES = [dict(function="verify", bs=2, ctx=16, window=4),
               dict(function="write", tokens=8)]
RING = 1024


def _pool_slots(case) -> int:
    """A pool holding the case's slots with room to spare (slot 0 is the padding slot)."""
    need = case["bs"] * case["ctx"] if case["function"] == "verify" else case["tokens"]
    return max(2 * need, 1024)


def _kv(slots: int, model: dict, seed: int):
    """One fused bf16 buffer per layer, random bytes, on the device."""
    import jax
    import jax.numpy as jnp

    width = 2 * model["heads"] * model["head_dim"]
    keys = jax.random.split(jax.random.PRNGKey(seed), model["layers"])
    return [jax.lax.bitcast_convert_type(jax.random.bits(k, (slots, width), jnp.uint16),
                                         jnp.bfloat16) for k in keys]


def _sources(kv):
    import kvcanary_jax as kc

    row = int(kv[0].shape[1]) * 2
    return tuple(kc.RealKvSource(tensor=b, page_size=1, num_bytes_per_token=row, read_bytes=row)
                 for b in kv)


def _host_digests(kv, slots) -> np.ndarray:
    from kvcanary_jax import hashing

    import jax
    import jax.numpy as jnp

    idx = np.asarray(slots)
    # Gathered as integers: a compiler may carry bf16 through f32 and change a NaN's payload.
    strips = [np.asarray(jax.lax.bitcast_convert_type(b, jnp.uint16)[idx]).view(np.uint8)
              .reshape(len(idx), -1) for b in kv]
    return hashing.digest_np(strips)


def _case_name(case) -> str:
    if case["function"] == "verify":
        return f"verify bs={case['bs']} ctx={case['ctx']} window={case['window']}"
    return f"write tokens={case['tokens']}"


def measure_case(case, model, *, implementation, iters: int, bw_gbs: float) -> dict:
    import jax
    import jax.numpy as jnp

    import kvcanary_jax as kc

    rng = np.random.default_rng(7)
    slots = _pool_slots(case)
    slot_bytes = model["layers"] * 2 * model["heads"] * model["head_dim"] * 2
    row = {"op": "digest", "case": _case_name(case), "implementation": implementation or "default",
           "slot_bytes": slot_bytes, "pool_slots": slots, "layers": model["layers"]}
    with jax.enable_x64(True):
        kv = _kv(slots, model, seed=1)
        sources = _sources(kv)
        if case["function"] == "write":
            n = case["tokens"]
            targets = jnp.asarray(rng.choice(np.arange(1, slots), n, replace=False), jnp.int64)
            fn = jax.jit(lambda b, s, src: kc.digest_write(b, s, src,
                                                           implementation=implementation),
                         donate_argnums=0)
            bufs = [jnp.zeros((slots,), jnp.int64) for _ in range(2)]
            bufs[0] = fn(bufs[0], targets, sources)
            pick = np.asarray(targets)[:4]
            row["ours_correct"] = bool(np.array_equal(np.asarray(bufs[0])[pick],
                                                      _host_digests(kv, pick)))
            row["bytes"] = n * (slot_bytes + 8)

            def run(i):
                bufs[i % 2] = fn(bufs[i % 2], targets, sources)

            sync = lambda: jax.block_until_ready(bufs)  # noqa: E731
        else:
            entries, window = case["bs"] * case["ctx"], case["window"]
            plan = rng.choice(np.arange(1, slots), entries, replace=False)
            write = jax.jit(lambda b, s, src: kc.digest_write(b, s, src), donate_argnums=0)
            digests = write(jnp.zeros((slots,), jnp.int64), jnp.arange(slots, dtype=jnp.int64),
                            sources)
            picked = plan[plan % window == 0][:3]
            bad = digests.at[jnp.asarray(picked)].add(1)
            fresh = lambda d: kc.DigestContext.allocate(  # noqa: E731  (donated: one each)
                num_slots=slots, ring_capacity=RING).replace(digest_buf=jnp.array(d))

            def verify(c, s, p, nv, ph, src):
                return kc.digest_verify(c, s, p, nv, ph, window=window, sources=src,
                                        implementation=implementation)

            fn = jax.jit(verify, donate_argnums=0)
            s, pos = jnp.asarray(plan, jnp.int64), jnp.arange(entries, dtype=jnp.int64)
            nv = jnp.asarray([entries], jnp.int32)
            phases = [jnp.asarray([p], jnp.int32) for p in range(window)]
            out = fn(fresh(bad), s, pos, nv, phases[0], sources)
            n_rows = int(out.violation_write_index[0])
            found = sorted(int(r[1]) for r in np.asarray(out.violation_ring)[:n_rows])
            row["ours_correct"] = found == sorted(int(x) for x in picked) and \
                int(out.slot_run_counter[0]) == int((plan % window == 0).sum())
            selected = np.mean([(plan % window == p).sum() for p in range(window)])
            row.update(entries=entries, window=window, selected=float(selected))
            row["bytes"] = int(selected * (slot_bytes + 8) + entries * 16)
            states = [fresh(digests) for _ in range(2)]

            def run(i):
                states[i % 2] = fn(states[i % 2], s, pos, nv, phases[i % window], sources)

            sync = lambda: jax.block_until_ready(states)  # noqa: E731
        row["floor_us"] = row["bytes"] / (bw_gbs * 1e3) if bw_gbs == bw_gbs else None
        row["ours"] = timing.device_time(run, sync, iters=iters)
        row["ours_call"] = timing.call_time(run, sync, iters=iters)
    med = row["ours"]["median_us"]
    row["gbs"] = row["bytes"] / (med * 1e3) if med else None
    return row


def measure(cases, *, iters: int, bw_gbs: float, progress, model=None) -> list[dict]:
    """The ``bench.run`` interface: the cases with the platform's implementation (``common.
    implementation()``)."""
    out = []
    for case in cases:
        progress.set_postfix_str(_case_name(case))
        out.append(measure_case(case, model or FULL_MODEL, implementation=common.implementation(),
                                iters=iters, bw_gbs=bw_gbs))
        progress.update(1)
    return out


def table(rows) -> str:
    lines = ["| case | implementation | ours (us) | byte floor (us) | ours/floor | GB/s "
             "| correct |",
             "| --- | --- | ---: | ---: | ---: | ---: | --- |"]
    for r in rows:
        med, floor = r["ours"]["median_us"], r.get("floor_us")
        ratio = f"{med / floor:.2f}" if floor else "-"
        lines.append(f"| {r['case']} | {r['implementation']} | {med:.1f} | "
                     f"{'-' if floor is None else f'{floor:.1f}'} | {ratio} | "
                     f"{r['gbs']:.0f} | {'yes' if r['ours_correct'] else 'NO'} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.op_digest",
                                 description=__doc__.splitlines()[0])
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="three cases")
    mode.add_argument("--smoke", action="store_true", help="tiny cases and model (any machine)")
    ap.add_argument("--iters", type=int, default=None, help="timed iterations per case")
    ap.add_argument("--implementations", default="",
                    help="comma list (default: the platform's implementation)")
    ap.add_argument("--out", default=os.path.join("bench", "results"),
                    help="output directory (digest.json)")
    args = ap.parse_args(argv)
    smoke = args.smoke or not common.on_gpu()
    if smoke and not args.smoke:
        print("no GPU: running the smoke mode", file=sys.stderr)
    cases = SMOKE_CASES if smoke else QUICK_CASES if args.quick else FULL_CASES
    model = SMOKE_MODEL if smoke else FULL_MODEL
    iters = args.iters or (3 if smoke else 30 if args.quick else 50)
    impls = [i for i in args.implementations.split(",") if i] or [None]
    bw = timing.copy_bandwidth_gbs()
    rows = [measure_case(c, model, implementation=impl, iters=iters, bw_gbs=bw)
            for impl in impls for c in cases]
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "digest.json"), "w") as f:
        json.dump({"mode": "smoke" if smoke else "quick" if args.quick else "full",
                   "iters": iters, "model": model, "copy_bandwidth_gbs": bw,
                   "environment": common.environment(), "rows": rows}, f, indent=1)
    print(f"copy bandwidth {bw:.0f} GB/s; model {model}")
    print(table(rows))
    return 0 if all(r["ours_correct"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
