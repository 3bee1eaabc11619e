"""canary_verify: ours (Pallas) vs SGLang 0.5.23's CUDA verify, on clean chains at random slots
with a few corrupted tokens so both sides append the same violations."""

from __future__ import annotations

import numpy as np

from kvcanary_jax.bench import chains, common, timing
from kvcanary_jax.consts import CanaryLaunchTag
from kvcanary_jax.testing import cases

FULL_CASES = [1 << 10, 1 << 16, 1 << 20, 1 << 22]
QUICK_CASES = [1 << 10, 1 << 20, 1 << 22]
SMOKE_CASES = [64, 256]
CHAIN_LEN = 1024
BYTES_PER_ENTRY = 64  # the entry's four plan fields + its slot's 32 canary bytes
RING = 1024


def _inputs(entries: int, seed: int):
    rng = np.random.default_rng(seed)
    length = min(CHAIN_LEN, entries)
    c = chains.build(entries // length, length, 4 * entries + 1, rng)
    buf = c["canary_buf"].copy()
    rows = buf.view(np.int64).reshape(-1, 4)
    for s in rng.choice(c["entries"]["verify_slot_indices"], 3, replace=False):
        rows[s, 0] ^= 1  # three corrupted tokens
    return dict(canary_buf=buf, entries=c["entries"])


def jax_fresh(entries: int, seed: int) -> list:
    """Our context and plan of one input set (``_inputs``), for a timed call (under x64)."""
    d = _inputs(entries, seed)
    ctx = cases.jax_context(canary_buf=d["canary_buf"], violation_ring=cases.violation_ring(RING),
                            kernel_kind=CanaryLaunchTag.HEAD_K_FULL)
    return [ctx, cases.jax_verify_plan(**d["entries"], verify_num_valid=entries)]


def sglang_fresh(sgl, entries: int, seed: int) -> tuple:
    """SGLang's context and plan of one input set, on the torch device."""
    api, dev = cases.TorchApi.sglang(sgl), common.torch_device()
    d = _inputs(entries, seed)
    ctx = cases.torch_context(api, canary_buf=d["canary_buf"],
                              violation_ring=cases.violation_ring(RING),
                              kernel_kind=CanaryLaunchTag.HEAD_K_FULL, device=dev)
    plan = cases.torch_verify_plan(api, **d["entries"], verify_num_valid=entries, device=dev)
    return ctx, plan


_GATHER_KERNEL = None


def _gather_kernel():
    """A plain Triton kernel with the verify's memory traffic and nothing else: the four plan
    fields of each entry (sequential) and its slot's 32-byte canary row (a random gather, one
    [block, 4] int64 tile), XOR-folded to one word per program so no load is dead."""
    global _GATHER_KERNEL
    if _GATHER_KERNEL is None:
        import triton
        import triton.language as tl

        @triton.jit
        def gather_rows(slots, tokens, positions, prev, canary, out, n, BLOCK: tl.constexpr,
                        PLAN: tl.constexpr):
            k = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
            m = k < n
            s = tl.load(slots + k, mask=m, other=0)
            acc = tl.zeros((BLOCK,), tl.int64)
            if PLAN:
                acc ^= tl.load(tokens + k, mask=m, other=0)
                acc ^= tl.load(positions + k, mask=m, other=0)
                acc ^= tl.load(prev + k, mask=m, other=0)
            row = tl.load(canary + (s * 4)[:, None] + tl.arange(0, 4)[None, :], mask=m[:, None],
                          other=0)
            acc ^= tl.xor_sum(row, axis=1)
            tl.store(out + tl.program_id(0), tl.xor_sum(acc, axis=0))

        _GATHER_KERNEL = gather_rows
    return _GATHER_KERNEL


def gather_floor(entries: int, *, iters: int) -> dict:
    """Device time of the access pattern alone on this GPU, on the verify's inputs: ``triton``
    (plan reads + row gathers, best of a few launch shapes, ``triton_shape``), ``gather_only``
    (the slot reads and row gathers alone) and ``torch_index_select`` of the same canary rows
    (which also writes them out)."""
    import torch

    kern = _gather_kernel()
    probe = _inputs(entries, seed=entries)
    k = timing.num_sets(probe["canary_buf"].nbytes + 32 * entries)
    del probe
    sets = []
    for seed in range(k):
        d = _inputs(entries, seed)
        sets.append([common.to_torch(d["entries"][f]) for f in cases.VERIFY_ENTRY_FIELDS]
                    + [common.to_torch(d["canary_buf"]).view(torch.int64).reshape(-1)])
    res = {}
    for with_plan, key in ((True, "triton"), (False, "gather_only")):
        best = (float("inf"), "")
        for block in (256, 1024):
            for warps in (4, 8):
                grid = (-(-entries // block),)
                out = torch.empty(grid[0], dtype=torch.int64, device=sets[0][0].device)

                def run(i, block=block, warps=warps, out=out, grid=grid, plan=with_plan):
                    kern[grid](*sets[i % k], out, entries, BLOCK=block, PLAN=plan,
                               num_warps=warps)

                t = timing.device_time(run, torch.cuda.synchronize, iters=iters)["median_us"]
                best = min(best, (t, f"{block}x{warps}"))
        res[key], res[key + "_shape"] = best

    def run_torch(i):
        s = sets[i % k]
        s[4].view(-1, 4).index_select(0, s[0])

    res["torch_index_select"] = timing.device_time(run_torch, torch.cuda.synchronize,
                                                   iters=iters)["median_us"]
    del sets
    return res


def _rows(ring, n):
    return sorted(map(tuple, np.asarray(ring)[: min(n, RING)].tolist()))


def measure(cases, *, iters: int, bw_gbs: float, progress) -> list[dict]:
    import jax

    import kvcanary_jax as kc

    gpu = common.on_gpu()
    sgl = common.sglang(cuda_jit=gpu)
    rows_out = []
    for entries in cases:
        progress.set_postfix_str(f"verify entries={entries}")
        inp = _inputs(entries, seed=entries)
        nbytes = inp["canary_buf"].nbytes + 32 * entries
        k = timing.num_sets(nbytes)
        row = {"op": "verify", "case": f"entries={entries}", "entries": entries,
               "bytes": BYTES_PER_ENTRY * entries, "sets": k}
        row["floor_us"] = BYTES_PER_ENTRY * entries / (bw_gbs * 1e3) if bw_gbs == bw_gbs else None

        with jax.enable_x64(True):
            fn = jax.jit(lambda ctx, plan: kc.canary_verify(implementation=common.implementation(),
                                                            context=ctx, plan=plan,
                                                            check_verify_expected_token=True),
                         donate_argnums=0)
            ctx = fn(*jax_fresh(entries, entries))
            ours = (int(ctx.violation_write_index[0]), int(ctx.slot_run_counter[0]),
                    int(ctx.kernel_run_counter[0]), _rows(ctx.violation_ring, int(ctx.violation_write_index[0])))
            sets = [jax_fresh(entries, s) for s in range(k)]

            def run_ours(i):
                s = sets[i % k]
                s[0] = fn(s[0], s[1])

            sync = lambda: common.jax_sync([s[0] for s in sets])  # noqa: E731
            row["ours"] = timing.device_time(run_ours, sync, iters=iters)
            row["ours_call"] = timing.call_time(run_ours, sync, iters=iters)
            del sets

        import torch

        launch = sgl.verify.launch_canary_verify_kernel
        if gpu or entries <= 4096:
            c_t, p_t = sglang_fresh(sgl, entries, entries)
            launch(context=c_t, plan=p_t, check_verify_expected_token=True)
            ref = (int(c_t.violation_write_index[0]), int(c_t.slot_run_counter[0]),
                   int(c_t.kernel_run_counter[0]), _rows(c_t.violation_ring.cpu(), int(c_t.violation_write_index[0])))
            row["ours_correct"] = ours == ref
            row["violations"] = ref[0]
        if common.time_peers():
            tsets = [sglang_fresh(sgl, entries, s) for s in range(k)]

            def run_sgl(i):
                c, p = tsets[i % k]
                launch(context=c, plan=p, check_verify_expected_token=True)

            row["sglang"] = timing.device_time(run_sgl, torch.cuda.synchronize, iters=iters)
            row["sglang_call"] = timing.call_time(run_sgl, torch.cuda.synchronize, iters=iters)
            del tsets
            # What the access pattern itself costs here: the byte floor assumes streaming reads,
            # the verify's slot rows are random 32-byte gathers.
            g = gather_floor(entries, iters=iters)
            row["gather_floor_us"] = g["triton"]
            row["gather_floor_shape"] = g["triton_shape"]
            row["gather_only_us"] = g["gather_only"]
            row["index_select_us"] = g["torch_index_select"]
        rows_out.append(row)
        progress.update(1)
    return rows_out
