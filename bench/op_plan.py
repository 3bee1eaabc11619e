"""canary_plan: ours (Pallas offsets + entries, in place) vs SGLang 0.5.23 (Triton offsets + CUDA
entries). Decode batches with prefixes drawn up to 2,048 tokens and the expected-token pool on."""

from __future__ import annotations

import numpy as np

from kvcanary_jax.bench import common, timing

FULL_CASES = [1, 64, 256, 1024, 4096, 16384]
QUICK_CASES = [1, 256, 4096, 16384]
SMOKE_CASES = [1, 5]
MAX_PREFIX = 2048
SGLANG_MAX_BS = 4096
BYTES_PER_ENTRY = 40  # req_to_token cell 4 + pool cell 4 read, four int64 written


def _inputs(bs: int, seed: int, max_prefix: int):
    rng = np.random.default_rng(seed)
    cols = max_prefix + 1
    prefix = rng.integers(1, max_prefix + 1, bs).astype(np.int64)
    if bs == 1:
        prefix[:] = max_prefix
    rpi = (rng.permutation(bs) + 1).astype(np.int64)
    extend = np.ones(bs, np.int64)
    rtt = rng.integers(1, 1 << 30, (bs + 1, cols), dtype=np.int32)
    pool = rng.integers(0, 1 << 31, (bs + 1, cols), dtype=np.int64).astype(np.int32)
    valid = prefix + 1
    return dict(req_pool_indices=rpi, prefix_lens=prefix, extend_seq_lens=extend, req_to_token=rtt,
                req_to_verify_expected_tokens=pool, req_to_verify_expected_tokens_valid_lens=valid)


def measure(cases, *, iters: int, bw_gbs: float, progress) -> list[dict]:
    import jax

    import kvcanary_jax as kc

    gpu = common.on_gpu()
    sgl = common.sglang(cuda_jit=gpu)
    max_prefix = MAX_PREFIX if gpu else 16
    rows = []
    for bs in cases:
        progress.set_postfix_str(f"plan bs={bs}")
        inp = _inputs(bs, seed=bs, max_prefix=max_prefix)
        total = int(inp["prefix_lens"].sum())
        cap = bs * max_prefix
        nbytes = sum(a.nbytes for a in inp.values()) + cap * 32
        k = timing.num_sets(nbytes)
        row = {"op": "plan", "case": f"bs={bs}", "bs": bs, "entries": total,
               "bytes": BYTES_PER_ENTRY * total, "sets": k, "verify_capacity": cap}
        row["floor_us"] = BYTES_PER_ENTRY * total / (bw_gbs * 1e3) if bw_gbs == bw_gbs else None
        kw = dict(swa_window_size=0, full_to_swa_index_mapping=None, verify_capacity=cap,
                  kv_token_id_vs_position_offset=0)
        with jax.enable_x64(True):
            fn = jax.jit(lambda vp, wp, a: kc.canary_plan(
                verify_plan_out=vp, write_plan_out=wp, **a, **kw,
                implementation=common.implementation()),
                         donate_argnums=(0, 1))

            def fresh(seed):
                return [kc.VerifyPlan.allocate(verify_capacity=cap), kc.WritePlan.allocate(write_req_capacity=bs),
                        {n: common.to_jax(a) for n, a in _inputs(bs, seed, max_prefix).items()}]

            vp, wp = fn(*fresh(bs))
            ours = {"vs": np.asarray(vp.verify_slot_indices)[:total], "vt": np.asarray(vp.verify_expected_tokens)[:total],
                    "vpos": np.asarray(vp.verify_expected_positions)[:total],
                    "vprev": np.asarray(vp.verify_prev_slot_indices)[:total],
                    "nv": np.asarray(vp.verify_num_valid), "en": np.asarray(vp.enable),
                    "wo": np.asarray(wp.write_offsets), "seed": np.asarray(wp.write_seed_slot_indices),
                    "nr": np.asarray(wp.write_num_valid_reqs)}
            sets = [fresh(s) for s in range(k)]

            def run_ours(i):
                s = sets[i % k]
                s[0], s[1] = fn(s[0], s[1], s[2])

            def sync_ours():
                common.jax_sync([s[:2] for s in sets])

            row["ours"] = timing.device_time(run_ours, sync_ours, iters=iters)
            row["ours_call"] = timing.call_time(run_ours, sync_ours, iters=iters)
            del sets

        import torch

        dev = common.torch_device()
        use_kernel = gpu and bs <= SGLANG_MAX_BS

        def sgl_fresh(seed):
            return [sgl.verify.VerifyPlan.allocate(verify_capacity=cap, device=dev),
                    sgl.write.WritePlan.allocate(write_req_capacity=bs, device=dev),
                    {n: common.to_torch(a) for n, a in _inputs(bs, seed, max_prefix).items()}]

        launch = (sgl.plan_api.launch_canary_plan_kernels if use_kernel
                  else sgl.plan_ref.launch_canary_plan_kernels_torch_reference)
        if use_kernel or bs <= 1024:  # the torch reference is a host loop: keep it small
            vp_t, wp_t, a_t = sgl_fresh(bs)
            launch(verify_plan_out=vp_t, write_plan_out=wp_t, **a_t, **kw)
            ref = {"vs": vp_t.verify_slot_indices[:total], "vt": vp_t.verify_expected_tokens[:total],
                   "vpos": vp_t.verify_expected_positions[:total], "vprev": vp_t.verify_prev_slot_indices[:total],
                   "nv": vp_t.verify_num_valid, "en": vp_t.enable, "wo": wp_t.write_offsets,
                   "seed": wp_t.write_seed_slot_indices, "nr": wp_t.write_num_valid_reqs}
            row["ours_correct"] = all(np.array_equal(ours[n], ref[n].cpu().numpy()) for n in ours)
        if use_kernel and common.time_peers():
            tsets = [sgl_fresh(s) for s in range(k)]

            def run_sgl(i):
                v, w, a = tsets[i % k]
                launch(verify_plan_out=v, write_plan_out=w, **a, **kw)

            row["sglang"] = timing.device_time(run_sgl, torch.cuda.synchronize, iters=iters)
            row["sglang_call"] = timing.call_time(run_sgl, torch.cuda.synchronize, iters=iters)
            del tsets
        rows.append(row)
        progress.update(1)
    return rows
