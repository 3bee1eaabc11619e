"""canary_write: ours (Pallas) vs SGLang 0.5.23's CUDA write. Each request continues a chain from
a seeded slot (chain-position assert on) and writes its new tokens at random distinct slots.

Beside the byte floor, which says nothing for a serial chain, the chain floor: a plain Triton
kernel that computes only each request's dependent splitmix64 chain over the same token ids and
positions (:func:`chain_floor`)."""

from __future__ import annotations

import numpy as np

from kvcanary_jax.bench import common, timing
from kvcanary_jax.consts import CanaryLaunchTag
from kvcanary_jax.testing import cases

FULL_CASES = [(r, t) for r in (1, 64, 1024) for t in (1, 128, 8192)]
QUICK_CASES = [(1, 128), (1, 8192), (64, 1), (1024, 128)]
SMOKE_CASES = [(1, 5), (3, 17)]
BYTES_PER_TOKEN = 56  # id, position, slot read (24) + 32 canary bytes written
RING = 1024


def _inputs(reqs: int, tokens: int, seed: int):
    """The canary buffer, the write plan's arrays (``plan``; its count is ``reqs``) and the
    token arrays (``tokens``), named as the op's fields."""
    rng = np.random.default_rng(seed)
    n = reqs * tokens
    num_slots = n + reqs + 1
    perm = (rng.permutation(num_slots - 1) + 1).astype(np.int64)
    seeds, slots = perm[:reqs], perm[reqs:reqs + n]
    buf = np.zeros((num_slots, 4), np.int64)
    seed_pos = rng.integers(0, 4096, reqs).astype(np.int64)
    buf[seeds, 0] = rng.integers(0, 1 << 20, reqs)
    buf[seeds, 1] = seed_pos
    buf[seeds, 2] = rng.integers(-(2**63), 2**63 - 1, reqs, dtype=np.int64)
    positions = (seed_pos[:, None] + 1 + np.arange(tokens, dtype=np.int64)[None, :]).reshape(-1)
    return dict(canary_buf=buf.view(np.uint8).reshape(num_slots, 32),
                plan=dict(write_offsets=(np.arange(reqs + 1, dtype=np.int64) * tokens),
                          write_seed_slot_indices=seeds),
                tokens=dict(input_ids=rng.integers(0, 1 << 20, n).astype(np.int64),
                            positions=positions, out_cache_loc=slots))


TOKEN_ARRAYS = ("input_ids", "positions", "out_cache_loc")  # the timed calls take them in order

_CHAIN_KERNEL = None


def chain_kernel():
    """A plain Triton kernel with the write's dependent chain and nothing else: one program per
    request folds ``h = mix3(h, token, position)`` (three splitmix64 rounds, as the canary's
    chain hash) over its tokens, from ``h0`` (its seed slot's stored hash), reading the ids and
    positions as the write does, and stores the last ``h`` (so no round is dead). Unsigned 64-bit
    arithmetic: Triton's own lowering takes it (the uint64 limit is Pallas's)."""
    global _CHAIN_KERNEL
    if _CHAIN_KERNEL is None:
        import triton
        import triton.language as tl

        @triton.jit
        def chain_only(ids, positions, offsets, h0, seeds, canary, out, SEEDED: tl.constexpr):
            # splitmix64(splitmix64(splitmix64(h) ^ token) ^ position), the rounds written out
            # (a kernel resolves helpers from module globals; this one is built on first use).
            r = tl.program_id(0)
            start = tl.load(offsets + r)
            end = tl.load(offsets + r + 1)
            if SEEDED:
                # The seed's hash read as the write must: its slot first, then its canary row.
                h = tl.load(canary + tl.load(seeds + r) * 4 + 2).to(tl.uint64, bitcast=True)
            else:
                h = tl.load(h0 + r).to(tl.uint64, bitcast=True)
            for i in range(start, end):
                t = tl.load(ids + i).to(tl.uint64, bitcast=True)
                p = tl.load(positions + i).to(tl.uint64, bitcast=True)
                for k in tl.static_range(3):
                    h = (h ^ (h >> 30)) * 0xBF58476D1CE4E5B9
                    h = (h ^ (h >> 27)) * 0x94D049BB133111EB
                    h = h ^ (h >> 31)
                    if k == 0:
                        h = h ^ t
                    elif k == 1:
                        h = h ^ p
            tl.store(out + r, h.to(tl.int64, bitcast=True))

        _CHAIN_KERNEL = chain_only
    return _CHAIN_KERNEL


def chain_inputs(reqs: int, tokens: int, seed: int) -> dict:
    """The chain floor's arrays of one input set (:func:`_inputs`'s ids, positions and offsets;
    ``h0``: each request's seed slot's stored hash)."""
    d = _inputs(reqs, tokens, seed)
    rows = d["canary_buf"].view(np.int64).reshape(-1, 4)
    return dict(ids=d["tokens"]["input_ids"], positions=d["tokens"]["positions"],
                offsets=d["plan"]["write_offsets"],
                h0=rows[d["plan"]["write_seed_slot_indices"], 2].copy(),
                seeds=d["plan"]["write_seed_slot_indices"], canary=rows.reshape(-1))


def chain_reference(c: dict) -> np.ndarray:
    """:func:`chain_kernel`'s output computed on the host (bench.chains' numpy splitmix64)."""
    from kvcanary_jax.bench import chains

    out = c["h0"].astype(np.uint64)
    for r in range(out.shape[0]):
        h = out[r:r + 1]
        for i in range(int(c["offsets"][r]), int(c["offsets"][r + 1])):
            h = chains.mix3(h, c["ids"][i:i + 1], c["positions"][i:i + 1])
        out[r] = h[0]
    return out.view(np.int64)


def chain_floor(reqs: int, tokens: int, *, iters: int) -> dict:
    """Device time of the chain alone on this GPU (:func:`chain_kernel`), on the write's inputs,
    rotated as the op's: ``us`` from each seed's hash handed over, ``seeded_us`` with it read
    through the seed slot (two dependent loads, as the write must: what bounds a one-token
    write); ``correct``: both kernels' chains equal the host's on the first set."""
    import torch

    kern = chain_kernel()
    n = reqs * tokens
    k = timing.num_sets(24 * n + 16 * reqs + 32 * (n + reqs + 1))
    fields = ("ids", "positions", "offsets", "h0", "seeds", "canary")
    sets, first = [], None
    for s in range(k):
        c = chain_inputs(reqs, tokens, s)
        if first is None:
            first = c
        sets.append([common.to_torch(c[f]) for f in fields]
                    + [torch.empty(reqs, dtype=torch.int64, device=common.torch_device())])
    res, correct = {}, True
    for seeded, key in ((False, "us"), (True, "seeded_us")):
        def run(i, seeded=seeded):
            kern[(reqs,)](*sets[i % k], SEEDED=seeded, num_warps=1)

        run(0)
        torch.cuda.synchronize()
        if n <= 65536:
            correct &= bool(np.array_equal(sets[0][-1].cpu().numpy(), chain_reference(first)))
        res[key] = timing.device_time(run, torch.cuda.synchronize, iters=iters)["median_us"]
    res["correct"] = correct if n <= 65536 else None
    del sets
    return res


def jax_fresh(reqs: int, tokens: int, seed: int) -> list:
    """Our context, plan and token arrays of one input set (``_inputs``), for a timed call."""
    d = _inputs(reqs, tokens, seed)
    ctx = cases.jax_context(canary_buf=d["canary_buf"], violation_ring=cases.violation_ring(RING),
                            kernel_kind=CanaryLaunchTag.TAIL_K_FULL)
    plan = cases.jax_write_plan(**d["plan"], write_num_valid_reqs=reqs)
    return [ctx, plan, *(cases.jax_i64(d["tokens"][f]) for f in TOKEN_ARRAYS)]


def sglang_fresh(sgl, reqs: int, tokens: int, seed: int) -> tuple:
    """SGLang's context, plan and token tensors of one input set, on the torch device."""
    api, dev = cases.TorchApi.sglang(sgl), common.torch_device()
    d = _inputs(reqs, tokens, seed)
    ctx = cases.torch_context(api, canary_buf=d["canary_buf"],
                              violation_ring=cases.violation_ring(RING),
                              kernel_kind=CanaryLaunchTag.TAIL_K_FULL, device=dev)
    plan = cases.torch_write_plan(api, **d["plan"], write_num_valid_reqs=reqs, device=dev)
    return (ctx, plan, *(cases.torch_i64(d["tokens"][f], dev) for f in TOKEN_ARRAYS))


def measure(cases, *, iters: int, bw_gbs: float, progress) -> list[dict]:
    import jax

    import kvcanary_jax as kc

    gpu = common.on_gpu()
    sgl = common.sglang(cuda_jit=gpu)
    rows_out = []
    for reqs, tokens in cases:
        progress.set_postfix_str(f"write reqs={reqs} tokens={tokens}")
        n = reqs * tokens
        inp = _inputs(reqs, tokens, seed=n)
        k = timing.num_sets(inp["canary_buf"].nbytes + 24 * n)
        row = {"op": "write", "case": f"reqs={reqs} tokens={tokens}", "reqs": reqs, "tokens": tokens,
               "bytes": BYTES_PER_TOKEN * n, "sets": k}
        row["floor_us"] = BYTES_PER_TOKEN * n / (bw_gbs * 1e3) if bw_gbs == bw_gbs else None
        call_kw = dict(enable_write_input_assert=False, expected_input_tokens=None,
                       expected_input_positions=None)

        with jax.enable_x64(True):
            fn = jax.jit(lambda ctx, plan, ids, pos, loc: kc.canary_write(
                implementation=common.implementation(),
                context=ctx, plan=plan, input_ids=ids, positions=pos, out_cache_loc=loc, **call_kw),
                donate_argnums=0)
            ctx = fn(*jax_fresh(reqs, tokens, n))
            ours = [np.asarray(ctx.canary_buf), np.asarray(ctx.violation_ring),
                    int(ctx.violation_write_index[0]), int(ctx.slot_run_counter[0]),
                    int(ctx.kernel_run_counter[0])]
            sets = [jax_fresh(reqs, tokens, s) for s in range(k)]

            def run_ours(i):
                s = sets[i % k]
                s[0] = fn(*s)

            sync = lambda: common.jax_sync([s[0] for s in sets])  # noqa: E731
            row["ours"] = timing.device_time(run_ours, sync, iters=iters)
            row["ours_call"] = timing.call_time(run_ours, sync, iters=iters)
            del sets

        import torch

        launch = sgl.write.launch_canary_write_kernel
        if gpu or n <= 4096:
            c_t, p_t, ids, pos, loc = sglang_fresh(sgl, reqs, tokens, n)
            launch(context=c_t, plan=p_t, input_ids=ids, positions=pos, out_cache_loc=loc, **call_kw)
            ref = [c_t.canary_buf.cpu().numpy(), c_t.violation_ring.cpu().numpy(),
                   int(c_t.violation_write_index[0]), int(c_t.slot_run_counter[0]), int(c_t.kernel_run_counter[0])]
            row["ours_correct"] = all(np.array_equal(a, b) for a, b in zip(ours, ref))
        if common.time_peers():
            tsets = [sglang_fresh(sgl, reqs, tokens, s) for s in range(k)]

            def run_sgl(i):
                c, p, ids, pos, loc = tsets[i % k]
                launch(context=c, plan=p, input_ids=ids, positions=pos, out_cache_loc=loc, **call_kw)

            row["sglang"] = timing.device_time(run_sgl, torch.cuda.synchronize, iters=iters)
            row["sglang_call"] = timing.call_time(run_sgl, torch.cuda.synchronize, iters=iters)
            del tsets
            # What the serial chain itself costs here: the byte floor assumes the bytes bound it.
            c = chain_floor(reqs, tokens, iters=iters)
            row["chain_floor_us"] = c["us"]
            row["seeded_chain_floor_us"] = c["seeded_us"]
            if c["correct"] is not None:
                row["chain_floor_correct"] = c["correct"]
        rows_out.append(row)
        progress.update(1)
    return rows_out
