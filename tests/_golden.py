"""Golden cases: inputs and SGLang 0.5.23's outputs for each op, committed as
``tests/golden/<op>.npz``.

They let a run without torch and SGLang (the newest-JAX CI leg) check every implementation
against SGLang's results, not only against our own references. The cases come from the suites'
case builders with fixed seeds (cross-request hazards, ring overflows, real-KV sources of every
layout, SWA LUTs, expected-token pools, corrupted canaries); the torch leg rebuilds them and
reruns SGLang on them (``tests/test_golden.py``), so the files cannot drift from SGLang.

Rewrite the files after changing a case builder: ``python tests/_golden.py`` (needs torch and
``sglang==0.5.23``, as the torch leg).

File layout: one ``.npz`` per op; case ``i`` stores its arrays under ``"{i:03d}.<name>"`` and its
scalars as JSON under ``"{i:03d}.meta"`` (no pickles). Loading needs numpy only; running a case
needs JAX. The stored names of the write and verify cases are the files' own, short ones
(``ocl``, ``etok``, ...): :data:`WRITE_STORED` and friends map them to the ops' field names, the
names the cases are built and run with.
"""

from __future__ import annotations

import json
import os
import zlib

import numpy as np

from kvcanary_jax.testing import cases

import _canary_support as support

DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden")
OPS = ("scatter", "plan", "write", "verify")


# ---------------------------------------------------------------------------------------------
# Storage


def path(op: str) -> str:
    return os.path.join(DIR, f"{op}.npz")


def save(op: str, stored: list[dict]) -> str:
    """Cases are dicts of numpy arrays plus one ``"meta"`` dict of JSON scalars."""
    out = {}
    for i, case in enumerate(stored):
        for k, v in case.items():
            if k == "meta":
                out[f"{i:03d}.meta"] = np.array(json.dumps(v, sort_keys=True))
            else:
                out[f"{i:03d}.{k}"] = np.asarray(v)
    os.makedirs(DIR, exist_ok=True)
    np.savez_compressed(path(op), **out)
    return path(op)


def load(op: str) -> list[dict]:
    with np.load(path(op), allow_pickle=False) as f:
        by_index: dict[int, dict] = {}
        for key in f.files:
            i, name = key.split(".", 1)
            v = f[key]
            by_index.setdefault(int(i), {})[name] = json.loads(str(v)) if name == "meta" else v
    return [by_index[i] for i in sorted(by_index)]


def same(a: list[dict], b: list[dict]) -> list[str]:
    """Where two case lists differ (empty when equal, dtypes and shapes included)."""
    if len(a) != len(b):
        return [f"{len(a)} cases vs {len(b)}"]
    bad = []
    for i, (x, y) in enumerate(zip(a, b)):
        if x.keys() != y.keys():
            bad.append(f"case {i}: keys {sorted(x)} vs {sorted(y)}")
            continue
        for k in x:
            if k == "meta":
                if x[k] != y[k]:
                    bad.append(f"case {i}: meta {x[k]} vs {y[k]}")
            elif x[k].dtype != y[k].dtype or not np.array_equal(x[k], y[k]):
                bad.append(f"case {i}: {k}")
    return bad


# ---------------------------------------------------------------------------------------------
# Canary state, sources, launches <-> flat case fields


def _put_state(case, prefix, st: support.State):
    case[prefix + "canary"], case[prefix + "ring"] = st.canary, st.ring
    case["meta"].update({prefix + "widx": st.widx, prefix + "sctr": st.sctr,
                         prefix + "kctr": st.kctr})


def state(case, prefix) -> support.State:
    m = case["meta"]
    return support.State(case[prefix + "canary"].copy(), case[prefix + "ring"].copy(),
                         m[prefix + "widx"], m[prefix + "sctr"], m[prefix + "kctr"])


def _put_sources(case, sources):
    case["meta"]["sources"] = [dict(page_size=s.page_size, nbpt=s.num_bytes_per_token,
                                    read_bytes=s.read_bytes, dtype=s.dtype, pad=s.offset_bytes)
                               for s in sources]
    for j, s in enumerate(sources):
        case[f"src{j}"] = s.u8


def case_sources(case):
    """A case's real-KV sources (``cases.KvSource``)."""
    return [cases.KvSource(case[f"src{j}"].copy(), d["page_size"], d["nbpt"], d["read_bytes"],
                           d["dtype"], d["pad"]) for j, d in enumerate(case["meta"]["sources"])]


# Stored name -> the op's field name: a write's arrays and scalars, a verify's.
WRITE_STORED = dict(offsets="write_offsets", seeds="write_seed_slot_indices", ids="input_ids",
                    pos="positions", ocl="out_cache_loc", etok="expected_input_tokens",
                    epos="expected_input_positions")
WRITE_STORED_META = dict(num_valid="write_num_valid_reqs", assert_on="enable_write_input_assert",
                         cpa="enable_chain_position_assert", kind="kernel_kind")
VERIFY_STORED = dict(slots="verify_slot_indices", etok="verify_expected_tokens",
                     epos="verify_expected_positions", prev="verify_prev_slot_indices")
VERIFY_STORED_META = dict(num_valid="verify_num_valid",
                          check_token="check_verify_expected_token", mode="real_kv_hash_mode")


# ---------------------------------------------------------------------------------------------
# Building the cases (torch and SGLang)


def _scatter_cases(sgl):
    import test_scatter

    built = []
    for bucket, n in ((0, 24),):
        bs_cap, tok_cap, rows, cols = test_scatter.BUCKETS[bucket]
        rng = np.random.default_rng(5000 + bucket)
        for _ in range(n):
            flat, offsets, rpi, pool = test_scatter.draw_case(rng, bs_cap, tok_cap, rows, cols)
            args = test_scatter.pad_case(flat, offsets, rpi, bs_cap, tok_cap)
            built.append({"meta": {}, "flat_in": args[0], "offsets": args[1],
                          "req_pool_indices": args[2], "pool_in": pool,
                          "pool_out": test_scatter.oracle(sgl, flat, offsets, rpi, pool)})
    return built


_PLAN_FIELDS = ("rpi", "prefix", "extend", "rtt", "lut", "pool", "vl")


def _plan_cases(sgl):
    import test_plan

    built = []
    for family, buckets in sorted(test_plan.FAMILIES.items()):
        rng = np.random.default_rng(zlib.crc32(b"golden " + family.encode()))
        for i in range(10):
            c = test_plan.gen_case(rng, buckets[i % len(buckets)])
            case = {"meta": {"W": c.W, "vc": c.vc, "wc": c.wc, "k": c.k}}
            case.update({f: getattr(c, f) for f in _PLAN_FIELDS if getattr(c, f) is not None})
            case.update({"out." + k: v for k, v in test_plan.run_oracle(sgl, c).items()})
            built.append(case)
    return built


def _write_cases(sgl):
    import test_write

    built = []
    rng = np.random.default_rng(5100)
    for k in range(24):
        buckets = test_write.WRITE_BUCKETS
        stride, assert_on, mode, layout = buckets[k % len(buckets)]
        st = support.State.zeros(cases.NUM_SLOTS, cases.RING_CAP, stride)
        st.canary_i64[:] = rng.integers(-(2**63), 2**63 - 1, st.canary_i64.shape, dtype=np.int64)
        st.canary_i64[:, 1] = rng.integers(-2, 30, cases.NUM_SLOTS)
        st.widx = int(rng.integers(0, cases.RING_CAP + 4))
        filled = min(st.widx, cases.RING_CAP)
        st.ring[:filled] = rng.integers(-9, 9, (filled, 8))
        launch = cases.random_write_launch(rng, assert_on, kernel_kind=(2, 8, 5, 11)[k % 4],
                                           hazards=True)
        sources = cases.bucket_sources(rng, layout)
        _, ref = support.run_write(sgl, st, **launch, real_kv_sources=sources,
                                   real_kv_hash_mode=mode, ours=False)
        case = {"meta": {"mode": mode, **{k: launch[f] for k, f in WRITE_STORED_META.items()}}}
        case.update({k: np.asarray(launch[f], np.int64) for k, f in WRITE_STORED.items()
                     if launch[f] is not None})
        _put_state(case, "in.", st)
        _put_state(case, "out.", ref)
        _put_sources(case, sources)
        built.append(case)
    return built


def _verify_cases(sgl):
    import test_verify

    built = []
    for mode in (0, 1, 2):
        rng = np.random.default_rng(5200 + mode)
        for k in range(8):
            trip = cases.make_trip(rng, mode, k % len(cases.BUCKETS))
            st = support.run_trip(sgl, rng, trip)
            entries = cases.verify_entries(rng, trip.chains)
            kind = test_verify.KINDS[k % len(test_verify.KINDS)]
            if any(trip.chains) and (trip.real_kv_sources or kind != "real_kv_byte"):
                entries = test_verify.corrupt(rng, kind, trip, st, entries) or entries
            plan = cases.padded_verify_plan(entries)
            verify = dict(plan, check_verify_expected_token=trip.check_verify_expected_token,
                          real_kv_hash_mode=mode)
            _, ref = support.run_verify(sgl, st, **verify, real_kv_sources=trip.real_kv_sources,
                                        ours=False)
            case = {"meta": {k: verify[f] for k, f in VERIFY_STORED_META.items()}}
            case.update({k: plan[f] for k, f in VERIFY_STORED.items()})
            _put_state(case, "in.", st)
            _put_state(case, "out.", ref)
            _put_sources(case, trip.real_kv_sources)
            built.append(case)
    return built


BUILDERS = {"scatter": _scatter_cases, "plan": _plan_cases, "write": _write_cases,
            "verify": _verify_cases}


def build(op: str, sgl) -> list[dict]:
    """The golden cases of ``op``, inputs from the suites' builders, outputs from SGLang."""
    return BUILDERS[op](sgl)


# ---------------------------------------------------------------------------------------------
# Running a case (numpy and JAX only)


def write_launch(case: dict) -> dict:
    """A stored write case's launch: a write case with its kernel_kind and chain check (as
    :func:`kvcanary_jax.testing.cases.random_write_launch` draws them)."""
    launch = {f: case.get(k) for k, f in WRITE_STORED.items()}
    launch.update({f: case["meta"][k] for k, f in WRITE_STORED_META.items()})
    return launch


def verify_launch(case: dict) -> dict:
    """A stored verify case: its plan, token check and real-KV sources and hash mode."""
    launch = {f: case[k] for k, f in VERIFY_STORED.items()}
    launch.update({f: case["meta"][k] for k, f in VERIFY_STORED_META.items()})
    launch["real_kv_sources"] = case_sources(case)
    return launch


def run(op: str, case: dict, implementation: str) -> tuple[dict, dict]:
    """``(ours, expected)``: the outputs of ``implementation`` on the case and SGLang's, as
    dicts of numpy arrays / ints with the same keys."""
    import jax

    import kvcanary_jax as kc

    m = case["meta"]
    if op == "scatter":
        with jax.enable_x64(True):
            got = kc.scatter_req_token_ids(
                flat_in=case["flat_in"], offsets=case["offsets"],
                req_pool_indices=case["req_pool_indices"], pool_out=case["pool_in"],
                implementation=implementation)
        return {"pool_out": np.asarray(got)}, {"pool_out": case["pool_out"]}
    if op == "plan":
        import test_plan

        c = test_plan.Case(*(case.get(f) for f in ("rpi", "prefix", "extend", "rtt")), W=m["W"],
                           lut=case.get("lut"), vc=m["vc"], wc=m["wc"], pool=case.get("pool"),
                           vl=case.get("vl"), k=m["k"])
        want = {k.removeprefix("out."): v for k, v in case.items() if k.startswith("out.")}
        return test_plan.run_ours(c, implementation), want
    st = state(case, "in.")
    if op == "write":
        got, _ = support.run_write(None, st, **write_launch(case),
                                   real_kv_sources=case_sources(case),
                                   real_kv_hash_mode=m["mode"], reference=False,
                                   implementation=implementation)
    else:
        got, _ = support.run_verify(None, st, **verify_launch(case), reference=False,
                                    implementation=implementation)
    return got, state(case, "out.")


if __name__ == "__main__":
    from kvcanary_jax import oracle

    sgl = oracle.load()
    for op in OPS:
        print("wrote", save(op, build(op, sgl)))
