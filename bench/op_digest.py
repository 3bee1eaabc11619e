"""The KV digest (ours, docs/spec.md §16): device time of digest_write and digest_verify over
every layer of a model's KV, against the byte floor (the KV bytes the op must read / the copy
bandwidth).

    python -m bench.op_digest [--quick | --smoke] [--iters N] [--implementations a,b]
                              [--cases i,j] [--layers N] [--config k=v,... ...] [--sweep]
                              [--budget-s S] [--out DIR]

The model: sglang-jax's fused layout, one bf16 ``[slots, 2 * heads * head_dim]`` buffer per
layer (K and V of every head interleaved), one source per layer hashing its whole row: 32 layers
of 8 KV heads of 128 = 4 KiB a slot a layer, 128 KiB a slot. A verify's entries are a decode
batch's cached positions (``bs * ctx``, random slots of the pool, as a paged allocator leaves
them) at a window (64: every slot once in 64 steps; 1: every entry, the cost of re-hashing all
that attention reads); each timed call takes the next phase, so the slots read change from call
to call. A write digests a step's new tokens (a decode batch, a prefill chunk). Device time: the
project's ``bench/timing.py`` (CUPTI on a GPU: every kernel the call launches, XLA's included).

Launch configs of the Pallas kernels (``kvcanary_jax.ops.digest.pallas_triton.Config``):
``--config group_words=1024,block=2`` runs every case with the heuristics' config changed in
those fields (given several times, each such config is timed in turn; ``--config ""`` is the
heuristics' own); ``--cases 0,1`` keeps those cases of the list (by index), ``--layers 4`` a
model of that many layers; ``--sweep`` times, per case, the heuristics' config and a few
variants around it (:func:`variants`: one field moved at a time) and prints the best per case.
Both run the Triton kernels (``pallas_interpret`` without a GPU, for the smoke mode);
``--budget-s`` stops starting variants after that many seconds (each case's heuristic config
always runs).

Correctness, per case and config: a write's digests of a few slots against numpy's
(:func:`kvcanary_jax.hashing.digest_np` of the slots' bytes); a verify after three stored digests
of selected slots were changed reports exactly those three.

Results: ``DIR/digest.json`` (every figure, each row with its config) and the tables on stdout.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

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
    # The TAIL's check when the steps leave the swept slots to the sweep (docs/spec.md §17.2):
    # each request's entries are handed over as -1 but for its last window / 2 (the tokens
    # decoded since the last sweep, on average), whose slots were handed out a step at a time,
    # the batch's slots of a step adjacent (a page-size-1 allocator's free list in order): at
    # bs 64 and window 64 every decoded slot of a request has the same residue, so the entries
    # a phase selects are one request's window / 2, adjacent in the plan.
    dict(function="verify", bs=8, ctx=512, window=64, left_to_sweep=True),
    dict(function="verify", bs=64, ctx=2048, window=64, left_to_sweep=True),
]
QUICK_CASES = [FULL_CASES[0], FULL_CASES[1], FULL_CASES[5]]
SMOKE_CASES = [dict(function="verify", bs=2, ctx=16, window=4),
               dict(function="write", tokens=8),
               dict(function="verify", bs=2, ctx=16, window=4, left_to_sweep=True)]
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
        swept = " left to the sweep" if case.get("left_to_sweep") else ""
        return f"verify bs={case['bs']} ctx={case['ctx']} window={case['window']}{swept}"
    return f"write tokens={case['tokens']}"


def shapes_of(case, model) -> dict:
    """The static shapes a launch config is chosen by (``kvcanary_jax.ops.digest.base.shapes``)
    for ``case`` on ``model``."""
    verify = case["function"] == "verify"
    words = model["layers"] * 2 * model["heads"] * model["head_dim"] * 2 // 8
    return {"verify": int(verify), "num_slots": _pool_slots(case),
            "capacity": case["bs"] * case["ctx"] if verify else case["tokens"],
            "window": case.get("window", 1), "words": words, "sources": model["layers"],
            "buffers": model["layers"]}


def variants(config, *, verify: bool) -> list:
    """``config`` and a few launch configs around it, one field moved at a time: the group of a
    slot's words a program step hashes (halved, doubled), spread over programs or looped over by
    one program, the block, a verify's chunk (four times longer) and its shares (doubled,
    halved), the warps."""
    out = [config]

    def add(**kw):
        try:
            v = dataclasses.replace(config, **kw)
        except ValueError:
            return
        if v not in out:
            out.append(v)

    words = config.group_words or 2048
    add(group_words=max(words // 2, 64))
    add(group_words=words * 2)
    if config.spread:
        add(spread=False, group_words=2048)
    else:
        add(spread=True, group_words=4096)
    add(block=config.block * 2, entries=max(config.entries, config.block * 2))
    if verify:
        add(entries=config.entries * 4)
        add(share=config.share * 2)
        if config.share > 1:
            add(share=config.share // 2)
    add(num_warps=8 if config.num_warps == 4 else 4)
    return out


def parse_config(text: str) -> dict:
    """``k=v,k=v`` (ints; ``spread``: 0/1/true/false) as Config fields."""
    out = {}
    for item in filter(None, (t.strip() for t in text.split(","))):
        key, _, value = item.partition("=")
        if key == "spread":
            out[key] = value.strip().lower() in ("1", "true", "yes")
        else:
            out[key] = int(value)
    return out


def _configs(case, model, *, overrides: list, sweep: bool, interpret: bool) -> list:
    """The launch configs a case is timed with: the heuristics' config with each of
    ``overrides`` applied (``[{}]``: the heuristics' own; a block given without a chunk raises
    the chunk to the block), and with ``sweep`` the variants around the first."""
    from kvcanary_jax.ops.digest import pallas_triton

    base = pallas_triton.heuristics(shapes_of(case, model))
    out = []
    for override in overrides or [{}]:
        if "block" in override and "entries" not in override:  # a chunk holds a block at least
            override = dict(override, entries=max(base.entries, override["block"]))
        cfg = dataclasses.replace(base, **override, interpret=interpret)
        if cfg not in out:
            out.append(cfg)
    if sweep:
        out = variants(out[0], verify=case["function"] == "verify") + out[1:]
    return out


def measure_case(case, model, *, implementation, iters: int, bw_gbs: float,
                 configs=(None,), deadline: float | None = None) -> list[dict]:
    """Rows of ``case``, one per launch config of ``configs`` (None: the implementation's own
    choice); the data is built once. Configs after the first are skipped past ``deadline``
    (``time.monotonic()``)."""
    import jax
    import jax.numpy as jnp

    import kvcanary_jax as kc

    rng = np.random.default_rng(7)
    slots = _pool_slots(case)
    slot_bytes = model["layers"] * 2 * model["heads"] * model["head_dim"] * 2
    base_row = {"op": "digest", "case": _case_name(case),
                "implementation": implementation or "default", "slot_bytes": slot_bytes,
                "pool_slots": slots, "layers": model["layers"]}
    rows = []
    with jax.enable_x64(True):
        kv = _kv(slots, model, seed=1)
        sources = _sources(kv)
        if case["function"] == "write":
            n = case["tokens"]
            targets = jnp.asarray(rng.choice(np.arange(1, slots), n, replace=False), jnp.int64)
            pick = np.asarray(targets)[:4]
            want = _host_digests(kv, pick)
        else:
            entries, window = case["bs"] * case["ctx"], case["window"]
            plan = rng.choice(np.arange(1, slots), entries, replace=False)
            handed = plan
            if case.get("left_to_sweep"):  # each request's last d entries, the rest -1
                bs, ctx, d = case["bs"], case["ctx"], max(1, window // 2)
                j = np.arange(entries) % ctx - (ctx - d)  # the decoded token's step, or < 0
                decoded = slots - d * bs + j * bs + np.arange(entries) // ctx
                handed = np.where(j >= 0, decoded, -1)
            write = jax.jit(lambda b, s, src: kc.digest_write(b, s, src), donate_argnums=0)
            digests = write(jnp.zeros((slots,), jnp.int64), jnp.arange(slots, dtype=jnp.int64),
                            sources)
            picked = handed[(handed > 0) & (handed % window == 0)][:3]
            bad = digests.at[jnp.asarray(picked)].add(1)
            fresh = lambda d: kc.DigestContext.allocate(  # noqa: E731  (donated: one each)
                num_slots=slots, ring_capacity=RING).replace(digest_buf=jnp.array(d))
            s, pos = jnp.asarray(handed, jnp.int64), jnp.arange(entries, dtype=jnp.int64)
            nv = jnp.asarray([entries], jnp.int32)
            phases = [jnp.asarray([p], jnp.int32) for p in range(window)]
            selected = np.mean([((handed > 0) & (handed % window == p)).sum()
                                for p in range(window)])
        for k, config in enumerate(configs):
            if k and deadline is not None and time.monotonic() > deadline:
                break
            row = dict(base_row)
            if config is not None:
                row["config"] = {f.name: getattr(config, f.name)
                                 for f in dataclasses.fields(config)}
            if case["function"] == "write":
                fn = jax.jit(lambda b, s_, src, cfg=config: kc.digest_write(
                    b, s_, src, implementation=implementation, config=cfg), donate_argnums=0)
                bufs = [jnp.zeros((slots,), jnp.int64) for _ in range(2)]
                bufs[0] = fn(bufs[0], targets, sources)
                row["ours_correct"] = bool(np.array_equal(np.asarray(bufs[0])[pick], want))
                row["bytes"] = n * (slot_bytes + 8)

                def run(i, fn=fn, bufs=bufs):
                    bufs[i % 2] = fn(bufs[i % 2], targets, sources)

                sync = lambda bufs=bufs: jax.block_until_ready(bufs)  # noqa: E731
            else:

                def verify(c, s_, p, nv_, ph, src, cfg=config):
                    return kc.digest_verify(c, s_, p, nv_, ph, window=window, sources=src,
                                            implementation=implementation, config=cfg)

                fn = jax.jit(verify, donate_argnums=0)
                out = fn(fresh(bad), s, pos, nv, phases[0], sources)
                n_rows = int(out.violation_write_index[0])
                found = sorted(int(r[1]) for r in np.asarray(out.violation_ring)[:n_rows])
                row["ours_correct"] = found == sorted(int(x) for x in picked) and \
                    int(out.slot_run_counter[0]) == len(handed[(handed > 0) &
                                                                (handed % window == 0)])
                row.update(entries=entries, window=window, selected=float(selected))
                row["bytes"] = int(selected * (slot_bytes + 8) + entries * 16)
                states = [fresh(digests) for _ in range(2)]

                def run(i, fn=fn, states=states):
                    states[i % 2] = fn(states[i % 2], s, pos, nv, phases[i % window], sources)

                sync = lambda states=states: jax.block_until_ready(states)  # noqa: E731
            row["floor_us"] = row["bytes"] / (bw_gbs * 1e3) if bw_gbs == bw_gbs else None
            row["ours"] = timing.device_time(run, sync, iters=iters)
            row["ours_call"] = timing.call_time(run, sync, iters=iters)
            med = row["ours"]["median_us"]
            row["gbs"] = row["bytes"] / (med * 1e3) if med else None
            rows.append(row)
    return rows


def measure(cases, *, iters: int, bw_gbs: float, progress, model=None) -> list[dict]:
    """The ``bench.run`` interface: the cases with the platform's implementation (``common.
    implementation()``)."""
    out = []
    for case in cases:
        progress.set_postfix_str(_case_name(case))
        out += measure_case(case, model or FULL_MODEL, implementation=common.implementation(),
                            iters=iters, bw_gbs=bw_gbs)
        progress.update(1)
    return out


def config_text(config) -> str:
    """A launch config as ``k=v`` fields (what ``--config`` takes), interpret mode left out."""
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    return ",".join(f"{k}={int(v) if isinstance(v, bool) else v}" for k, v in fields.items()
                    if k != "interpret")


def _config_text(row) -> str:
    cfg = row.get("config")
    if not cfg:
        return "-"
    return ",".join(f"{k}={int(v) if isinstance(v, bool) else v}" for k, v in cfg.items()
                    if k != "interpret")


def table(rows) -> str:
    lines = ["| case | implementation | ours (us) | byte floor (us) | ours/floor | GB/s "
             "| kernels | correct | config |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | --- | --- |"]
    for r in rows:
        med, floor = r["ours"]["median_us"], r.get("floor_us")
        ratio = f"{med / floor:.2f}" if floor else "-"
        kernels = sum(r["ours"].get("kernels_per_call", {}).values())
        lines.append(f"| {r['case']} | {r['implementation']} | {med:.1f} | "
                     f"{'-' if floor is None else f'{floor:.1f}'} | {ratio} | "
                     f"{r['gbs']:.0f} | {kernels:g} | {'yes' if r['ours_correct'] else 'NO'} | "
                     f"{_config_text(r)} |")
    return "\n".join(lines)


def best(rows) -> list[dict]:
    """Per case and implementation, the correct row of least median device time."""
    out = {}
    for r in rows:
        key = (r["case"], r["implementation"])
        if r["ours_correct"] and (key not in out or
                                  r["ours"]["median_us"] < out[key]["ours"]["median_us"]):
            out[key] = r
    return list(out.values())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.op_digest",
                                 description=__doc__.splitlines()[0])
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="three cases")
    mode.add_argument("--smoke", action="store_true", help="tiny cases and model (any machine)")
    ap.add_argument("--iters", type=int, default=None, help="timed iterations per case")
    ap.add_argument("--implementations", default="",
                    help="comma list (default: the platform's implementation)")
    ap.add_argument("--config", action="append", default=None,
                    help="k=v,... fields of the Pallas kernels' Config, over the heuristics' "
                         "(repeatable: each config timed in turn)")
    ap.add_argument("--cases", default="", help="indices into the case list (default: all)")
    ap.add_argument("--layers", type=int, default=None, help="the model's layers (default 32)")
    ap.add_argument("--sweep", action="store_true",
                    help="per case, the heuristics' config and variants; the best per case")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="with --sweep: start no variant after this many seconds")
    ap.add_argument("--out", default=os.path.join("bench", "results"),
                    help="output directory (digest.json)")
    args = ap.parse_args(argv)
    smoke = args.smoke or not common.on_gpu()
    if smoke and not args.smoke:
        print("no GPU: running the smoke mode", file=sys.stderr)
    cases = SMOKE_CASES if smoke else QUICK_CASES if args.quick else FULL_CASES
    if args.cases:
        cases = [cases[int(i)] for i in args.cases.split(",")]
    model = SMOKE_MODEL if smoke else FULL_MODEL
    if args.layers is not None:
        if args.layers < 1:
            ap.error(f"--layers must be >= 1, got {args.layers}")
        model = dict(model, layers=args.layers)
    iters = args.iters or (3 if smoke else 30 if args.quick else 50)
    tuned = bool(args.config or args.sweep)
    overrides = [parse_config(text) for text in args.config or []]
    kernels = "pallas_interpret" if not common.on_gpu() else "pallas_triton"
    impls = [i for i in args.implementations.split(",") if i] or [kernels if tuned else None]
    bw = timing.copy_bandwidth_gbs()
    deadline = None if args.budget_s is None else time.monotonic() + args.budget_s
    rows = []
    for impl in impls:
        for c in cases:
            configs = (None,)
            if tuned and impl in ("pallas_triton", "pallas_interpret"):
                configs = _configs(c, model, overrides=overrides, sweep=args.sweep,
                                   interpret=impl == "pallas_interpret")
            rows += measure_case(c, model, implementation=impl, iters=iters, bw_gbs=bw,
                                 configs=configs, deadline=deadline)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "digest.json"), "w") as f:
        json.dump({"mode": "smoke" if smoke else "quick" if args.quick else "full",
                   "iters": iters, "model": model, "copy_bandwidth_gbs": bw,
                   "sweep": args.sweep, "configs": overrides,
                   "environment": common.environment(), "rows": rows}, f, indent=1)
    print(f"copy bandwidth {bw:.0f} GB/s; model {model}")
    print(table(rows))
    if args.sweep:
        print("\nbest per case:")
        print(table(best(rows)))
    return 0 if all(r["ours_correct"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
