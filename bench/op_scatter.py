"""scatter_req_token_ids: ours (Pallas, in place) vs SGLang 0.5.23 (Triton) vs a 2-D Triton kernel."""

from __future__ import annotations

import numpy as np

from kvcanary_jax.bench import common, timing

FULL_CASES = [(bs, seq) for bs in (1, 8, 64, 256, 511) for seq in (128, 512, 2048, 8192)] + [
    (2048, 512), (2048, 2048)]
QUICK_CASES = [(1, 128), (64, 2048), (256, 8192), (511, 8192), (2048, 512)]
SMOKE_CASES = [(2, 16), (5, 40)]
SGLANG_MAX_BS = 511  # SGLang 0.5.23 refuses bs + 1 > 512


def _inputs(bs: int, seq: int, seed: int):
    rng = np.random.default_rng(seed)
    offsets = (np.arange(bs + 1, dtype=np.int64) * seq)
    flat = rng.integers(0, 2**31 - 1, bs * seq, dtype=np.int64)
    rpi = (rng.permutation(bs) + 1).astype(np.int64)
    pool = np.full((bs + 1, seq), -1, np.int32)
    return flat, offsets, rpi, pool


def measure(cases, *, iters: int, bw_gbs: float, progress) -> list[dict]:
    import jax
    import kvcanary_jax as kc

    rows = []
    gpu = common.on_gpu()
    sgl = common.sglang(cuda_jit=gpu)
    for bs, seq in cases:
        progress.set_postfix_str(f"scatter bs={bs} seq={seq}")
        flat, offsets, rpi, pool = _inputs(bs, seq, seed=bs * 7 + seq)
        nbytes = flat.nbytes + pool.nbytes
        k = timing.num_sets(nbytes)
        tokens = bs * seq
        row = {"op": "scatter", "case": f"bs={bs} seq={seq}", "bs": bs, "seq": seq,
               "tokens": tokens, "bytes": 12 * tokens, "sets": k}
        row["floor_us"] = 12 * tokens / (bw_gbs * 1e3) if bw_gbs == bw_gbs else None

        # Ours: the documented in-place call (jit + donation), rotating among k input sets.
        with jax.enable_x64(True):
            fn = jax.jit(lambda f, o, r, p: kc.scatter_req_token_ids(
                implementation=common.implementation(),
                flat_in=f, offsets=o, req_pool_indices=r, pool_out=p), donate_argnums=3)
            sets = [[common.to_jax(a) for a in _inputs(bs, seq, seed=s)] for s in range(k)]
            # Correctness first, against SGLang's torch reference: a fast wrong kernel is no result.
            ref = common.to_torch(pool)
            sgl.scatter_ref.scatter_req_token_ids_torch_reference(
                flat_in=common.to_torch(flat), offsets=common.to_torch(offsets),
                req_pool_indices=common.to_torch(rpi), pool_out=ref)
            out = np.asarray(fn(*[common.to_jax(a) for a in (flat, offsets, rpi, pool)]))
            row["ours_correct"] = bool((out == ref.cpu().numpy()).all())

            def run_ours(i):
                s = sets[i % k]
                s[3] = fn(s[0], s[1], s[2], s[3])

            def sync_ours():
                common.jax_sync([s[3] for s in sets])

            row["ours"] = timing.device_time(run_ours, sync_ours, iters=iters)
            row["ours_call"] = timing.call_time(run_ours, sync_ours, iters=iters)
            del sets

        if common.time_peers():
            import torch
            from kvcanary_jax.bench.triton_scatter import scatter_2d

            tsets = [[common.to_torch(a) for a in _inputs(bs, seq, seed=s)] for s in range(k)]
            sync_t = torch.cuda.synchronize
            got = common.to_torch(pool)
            scatter_2d(flat_in=common.to_torch(flat), offsets=common.to_torch(offsets),
                       req_pool_indices=common.to_torch(rpi), pool_out=got)
            row["triton_2d_correct"] = bool(torch.equal(got, ref))

            def run_t2d(i):
                f, o, r, p = tsets[i % k]
                scatter_2d(flat_in=f, offsets=o, req_pool_indices=r, pool_out=p)

            row["triton_2d"] = timing.device_time(run_t2d, sync_t, iters=iters)
            if bs <= SGLANG_MAX_BS:
                launch = sgl.scatter.launch_scatter_req_token_ids_kernel
                got = common.to_torch(pool)
                launch(flat_in=common.to_torch(flat), offsets=common.to_torch(offsets),
                       req_pool_indices=common.to_torch(rpi), pool_out=got)
                row["sglang_correct"] = bool(torch.equal(got, ref))

                def run_sgl(i):
                    f, o, r, p = tsets[i % k]
                    launch(flat_in=f, offsets=o, req_pool_indices=r, pool_out=p)

                row["sglang"] = timing.device_time(run_sgl, sync_t, iters=iters)
                row["sglang_call"] = timing.call_time(run_sgl, sync_t, iters=iters)
            del tsets
        rows.append(row)
        progress.update(1)
    return rows
