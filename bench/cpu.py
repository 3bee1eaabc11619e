"""``python -m bench.cpu``: every op's ``xla`` implementation against ``pallas_interpret`` on the
CPU, in one run, plus the demo's median step.

Cases: verify 64k and 1M entries (clean chains, three corrupted tokens), write 64 x 128 and
1 x 2,048 tokens (seeded chains, chain-position assert on), plan bs 256 and 4,096 (decode
batches, prefixes up to 2,048, the expected-token pool on), scatter 256 x 2,048, and the demo's
clean run (``kvcanary-jax demo`` settings; median step, first step excluded). Inputs are the GPU
bench's (``bench/op_*.py``).

Method: wall time per call on the host clock, a jitted call then ``block_until_ready``, the
outputs donated as in serving (updated in place; each call gets fresh copies, made outside the
timed region); the implementations alternate
round by round, so the load of a shared machine weighs on both alike (past two rounds an
implementation whose calls of a case took ``--budget-s`` in all stops: the interpreter on the
large cases). Medians and minima over the rounds; the ratio is interpret / xla of the medians.
Before timing, the two implementations' outputs are compared byte for byte (``equal``; violation
rows as a multiset, see :func:`_same`); the demo's row says whether both clean runs recorded no
violation.

Writes ``results.json`` and ``results.md`` under ``--out`` (default ``bench/results/cpu`` under
the current directory) and prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import numpy as np

from kvcanary_jax.bench import op_plan, op_scatter, op_verify, op_write
from kvcanary_jax.bench.run import positive_int, unwritable

IMPLEMENTATIONS = ("xla", "pallas_interpret")
PLAN_MAX_PREFIX = op_plan.MAX_PREFIX  # the GPU bench's decode prefixes


def _verify(entries):
    import kvcanary_jax as kc

    ctx, plan = op_verify.jax_fresh(entries, seed=entries)

    def fn(impl):
        return lambda c, p: kc.canary_verify(context=c, plan=p, check_verify_expected_token=True,
                                             implementation=impl)

    return fn, (ctx, plan), (0,)


def _verify_floor(entries):
    """The gather every verify implementation makes: each entry's canary row, read from the
    uint8 buffer as four int64 fields (folded to one word so that nothing is dead)."""
    import jax.numpy as jnp

    from kvcanary_jax.bench import common
    from kvcanary_jax.ops import _xla_lib

    d = op_verify._inputs(entries, seed=entries)
    cb = common.to_jax(d["canary_buf"])
    slots = common.to_jax(d["entries"]["verify_slot_indices"])

    def floor(cb, slots):
        f = _xla_lib.canary_fields(cb, slots, slots > 0)
        return jnp.bitwise_xor.reduce(f[0] ^ f[1] ^ f[2] ^ f[3])

    return floor, (cb, slots)


def _write(reqs, tokens):
    import kvcanary_jax as kc

    ctx, plan, *arrays = op_write.jax_fresh(reqs, tokens, seed=reqs * tokens)

    def fn(impl):
        return lambda c, p, ids, pos, loc: kc.canary_write(
            context=c, plan=p, input_ids=ids, positions=pos, out_cache_loc=loc,
            enable_write_input_assert=False, expected_input_tokens=None,
            expected_input_positions=None, implementation=impl)

    return fn, (ctx, plan, *arrays), (0,)


def _plan(bs, max_prefix=PLAN_MAX_PREFIX):
    import kvcanary_jax as kc
    from kvcanary_jax.bench import common

    d = op_plan._inputs(bs, seed=bs, max_prefix=max_prefix)
    cap = bs * max_prefix
    vp = kc.VerifyPlan.allocate(verify_capacity=cap)
    wp = kc.WritePlan.allocate(write_req_capacity=bs)
    args = {k: common.to_jax(v) for k, v in d.items()}

    def fn(impl):
        return lambda vp, wp, a: kc.canary_plan(
            verify_plan_out=vp, write_plan_out=wp, **a, swa_window_size=0,
            full_to_swa_index_mapping=None, verify_capacity=cap,
            kv_token_id_vs_position_offset=0, implementation=impl)

    return fn, (vp, wp, args), (0, 1)


def _scatter(bs, seq):
    import kvcanary_jax as kc
    from kvcanary_jax.bench import common

    arrays = [common.to_jax(a) for a in op_scatter._inputs(bs, seq, seed=bs * 7 + seq)]

    def fn(impl):
        return lambda f, o, r, p: kc.scatter_req_token_ids(
            flat_in=f, offsets=o, req_pool_indices=r, pool_out=p, implementation=impl)

    return fn, tuple(arrays), (3,)


CASES = (
    ("verify", "64k entries", lambda: _verify(1 << 16)),
    ("verify", "1M entries", lambda: _verify(1 << 20)),
    ("write", "64 x 128 tokens", lambda: _write(64, 128)),
    ("write", "1 x 2,048 tokens", lambda: _write(1, 2048)),
    ("plan", "bs 256", lambda: _plan(256)),
    ("plan", "bs 4,096", lambda: _plan(4096)),
    ("scatter", "256 x 2,048", lambda: _scatter(256, 2048)),
)
ENTRIES = {"64k entries": 1 << 16, "1M entries": 1 << 20, "256 entries": 256}
# Tiny cases for the smoke test (tests/test_bench_smoke.py): the bench cannot rot unseen.
SMOKE_CASES = (
    ("verify", "256 entries", lambda: _verify(256)),
    ("write", "3 x 17 tokens", lambda: _write(3, 17)),
    ("plan", "bs 5", lambda: _plan(5, max_prefix=16)),
    ("scatter", "5 x 40", lambda: _scatter(5, 40)),
)


def _leaves(tree):
    import jax

    return [np.asarray(x) for x in jax.tree_util.tree_leaves(tree)]


def _time_op(build, rounds, impls, budget_s):
    import jax
    import jax.numpy as jnp

    with jax.enable_x64(True):
        fn, args, donate = build()
        jitted = {i: jax.jit(fn(i), donate_argnums=donate) for i in impls}

        def fresh():
            """The arguments, the donated ones copied (a call consumes them)."""
            out = [jax.tree_util.tree_map(jnp.copy, a) if n in donate else a
                   for n, a in enumerate(args)]
            return jax.block_until_ready(out)

        out, compile_s = {}, {}
        for i in impls:
            a = fresh()
            t0 = time.perf_counter()
            out[i] = _leaves(jax.block_until_ready(jitted[i](*a)))
            compile_s[i] = time.perf_counter() - t0
        equal = _same(out[impls[0]], out[impls[1]])
        times = {i: [] for i in impls}
        for r in range(rounds):
            for i in impls:
                if r >= 2 and sum(times[i]) > budget_s:  # the interpreter on large cases
                    continue
                a = fresh()
                t0 = time.perf_counter()
                jax.block_until_ready(jitted[i](*a))
                times[i].append(time.perf_counter() - t0)
    return equal, compile_s, times


def _time_floor(fn, args, rounds):
    import jax

    with jax.enable_x64(True):
        f = jax.jit(fn)
        jax.block_until_ready(f(*args))
        times = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            jax.block_until_ready(f(*args))
            times.append(time.perf_counter() - t0)
    return times


def _same(a, b) -> bool:
    """Outputs equal byte for byte, violation rings as multisets of rows: the interpreter runs
    the verify kernel's persistent grid program after program, so on plans of more blocks than
    programs its rows come in program order, not entry order (the xla rows are in entry order,
    as the reference's)."""
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if x.ndim == 2 and x.shape[1:] == (8,) and x.dtype == np.int64:  # a violation ring
            x, y = np.sort(x.view("V64"), axis=0), np.sort(y.view("V64"), axis=0)
        if x.shape != y.shape or x.dtype != y.dtype or not np.array_equal(x, y):
            return False
    return True


def _time_demo(steps, impls):
    """Median step of the demo's clean run (first step, which compiles, excluded)."""
    from kvcanary_jax import sim

    times, ok = {}, True
    for i in impls:
        cfg = sim.SimConfig(steps=steps, implementation=i)
        server, infos, _ = sim.run_clean(cfg)
        times[i] = [s.seconds for s in infos[1:]]
        from kvcanary_jax import runtime as rt

        ok = ok and rt.violation_count(server.state) == 0
    return ok, times


def _summary(times):
    return {"median_ms": 1e3 * float(np.median(times)), "min_ms": 1e3 * float(np.min(times)),
            "rounds": len(times)}


def markdown(result) -> str:
    impls = result["implementations"]
    head = ["op", "case"] + [f"{i} median ms (min)" for i in impls] + [
        f"{impls[1]} / {impls[0]}", "gather floor ms", f"{impls[0]} / floor", "equal"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * 2 + " ---: |" * (len(impls) + 3)
             + " --- |"]
    for r in result["rows"]:
        cells = [r["op"], r["case"]]
        for i in impls:
            s = r[i]
            cells.append(f"{s['median_ms']:.2f} ({s['min_ms']:.2f})")
        ratio = r[impls[1]]["median_ms"] / r[impls[0]]["median_ms"]
        cells.append(f"{ratio:.1f}x" if ratio < 10 else f"{ratio:.0f}x")
        floor = r.get("gather_floor")
        if floor:
            over = r[impls[0]]["median_ms"] / floor["median_ms"]
            cells += [f"{floor['median_ms']:.2f}", f"{over:.1f}"]
        else:
            cells += ["-", "-"]
        cells.append("yes" if r["equal"] else "NO")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.cpu", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny cases, one round, 3 demo steps")
    ap.add_argument("--rounds", type=positive_int, default=5,
                    help="timed calls per implementation (>= 1)")
    ap.add_argument("--budget-s", type=float, default=60.0,
                    help="past two rounds, an implementation stops once its calls of a case "
                    "took this long")
    ap.add_argument("--demo-steps", type=positive_int, default=12,
                    help="clean demo steps per impl. (>= 1)")
    ap.add_argument("--only", default="", help="comma list of ops (verify,write,plan,scatter,"
                    "demo); default all")
    # Relative to the current directory (a checkout's root), never inside an installed package.
    ap.add_argument("--out", default=os.path.join("bench", "results", "cpu"),
                    help="output directory (default: bench/results/cpu under the current "
                    "directory)")
    args = ap.parse_args(argv)
    if not args.budget_s > 0:
        ap.error(f"argument --budget-s: must be > 0, got {args.budget_s}")
    why = unwritable(args.out)
    if why:  # before the run, not after it (its figures would be lost)
        ap.error(f"argument --out: {args.out!r} is not a writable directory ({why})")

    from kvcanary_jax._devices import select_device

    select_device("cpu")
    only = {o for o in args.only.split(",") if o}
    if args.smoke:
        args.rounds, args.demo_steps = 1, 3
    rows = []
    for op, case, build in SMOKE_CASES if args.smoke else CASES:
        if only and op not in only:
            continue
        print(f"bench.cpu: {op} {case} ...", file=sys.stderr, flush=True)
        equal, compile_s, times = _time_op(build, args.rounds, IMPLEMENTATIONS, args.budget_s)
        row = {"op": op, "case": case, "equal": equal, "compile_s": compile_s,
               **{i: _summary(t) for i, t in times.items()}}
        if op == "verify":
            row["gather_floor"] = _summary(_time_floor(*_verify_floor(ENTRIES[case]),
                                                       args.rounds))
        rows.append(row)
        _save(args.out, _result(rows, args))
    if not only or "demo" in only:
        print("bench.cpu: demo ...", file=sys.stderr, flush=True)
        ok, times = _time_demo(args.demo_steps, IMPLEMENTATIONS)
        rows.append({"op": "demo", "case": f"median step ({args.demo_steps} clean steps)",
                     "equal": ok, **{i: _summary(t) for i, t in times.items()}})
    result = _result(rows, args)
    _save(args.out, result)
    print(markdown(result))
    return 0 if all(r["equal"] for r in rows) else 1


def _result(rows, args) -> dict:
    import jax

    return {
        "implementations": list(IMPLEMENTATIONS),
        "environment": {"python": platform.python_version(), "jax": jax.__version__,
                        "cpu": platform.processor() or platform.machine(),
                        "cpu_count": os.cpu_count(), "load_avg": os.getloadavg()},
        "rounds": args.rounds,
        "budget_s": args.budget_s,
        "rows": rows,
    }


def _save(out: str, result: dict) -> None:
    """results.json and results.md (rewritten after every case: a long run keeps what it has)."""
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write(markdown(result))


if __name__ == "__main__":
    raise SystemExit(main())
