"""canary_verify: ours (Pallas) vs SGLang 0.5.23's CUDA verify, on clean chains at random slots
with a few corrupted tokens so both sides append the same violations."""

from __future__ import annotations

import numpy as np

from bench import chains, common, timing

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
    for s in rng.choice(c["slots"], 3, replace=False):  # three corrupted tokens
        rows[s, 0] ^= 1
    return dict(canary_buf=buf, slots=c["slots"], tokens=c["tokens"], positions=c["positions"],
                prev=c["prev"])


def _rows(ring, n):
    return sorted(map(tuple, np.asarray(ring)[: min(n, RING)].tolist()))


def measure(cases, *, iters: int, bw_gbs: float, progress) -> list[dict]:
    import jax
    import jax.numpy as jnp

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
            def fresh(seed):
                d = _inputs(entries, seed)
                ctx = common.jax_context(d["canary_buf"], "HEAD_K_FULL", RING)
                plan = kc.VerifyPlan(
                    verify_slot_indices=common.to_jax(d["slots"]),
                    verify_expected_tokens=common.to_jax(d["tokens"]),
                    verify_expected_positions=common.to_jax(d["positions"]),
                    verify_prev_slot_indices=common.to_jax(d["prev"]),
                    verify_num_valid=jnp.array([entries], jnp.int32), enable=jnp.ones(1, jnp.int32))
                return [ctx, plan]

            fn = jax.jit(lambda ctx, plan: kc.canary_verify(context=ctx, plan=plan,
                                                            check_verify_expected_token=True),
                         donate_argnums=0)
            ctx = fn(*fresh(entries))
            ours = (int(ctx.violation_write_index[0]), int(ctx.slot_run_counter[0]),
                    int(ctx.kernel_run_counter[0]), _rows(ctx.violation_ring, int(ctx.violation_write_index[0])))
            sets = [fresh(s) for s in range(k)]

            def run_ours(i):
                s = sets[i % k]
                s[0] = fn(s[0], s[1])

            sync = lambda: common.jax_sync([s[0] for s in sets])  # noqa: E731
            row["ours"] = timing.device_time(run_ours, sync, iters=iters)
            row["ours_call"] = timing.call_time(run_ours, sync, iters=iters)
            del sets

        import torch

        dev = common.torch_device()

        def sgl_fresh(seed):
            d = _inputs(entries, seed)
            t = common.to_torch
            ctx = common.sglang_context(sgl, d["canary_buf"], "HEAD_K_FULL", RING)
            plan = sgl.verify.VerifyPlan(
                verify_slot_indices=t(d["slots"]), verify_expected_tokens=t(d["tokens"]),
                verify_expected_positions=t(d["positions"]), verify_prev_slot_indices=t(d["prev"]),
                verify_num_valid=torch.tensor([entries], dtype=torch.int32, device=dev),
                enable=torch.ones(1, dtype=torch.int32, device=dev))
            return ctx, plan

        launch = sgl.verify.launch_canary_verify_kernel
        if gpu or entries <= 4096:
            c_t, p_t = sgl_fresh(entries)
            launch(context=c_t, plan=p_t, check_verify_expected_token=True)
            ref = (int(c_t.violation_write_index[0]), int(c_t.slot_run_counter[0]),
                   int(c_t.kernel_run_counter[0]), _rows(c_t.violation_ring.cpu(), int(c_t.violation_write_index[0])))
            row["ours_correct"] = ours == ref
            row["violations"] = ref[0]
        if gpu:
            tsets = [sgl_fresh(s) for s in range(k)]

            def run_sgl(i):
                c, p = tsets[i % k]
                launch(context=c, plan=p, check_verify_expected_token=True)

            row["sglang"] = timing.device_time(run_sgl, torch.cuda.synchronize, iters=iters)
            row["sglang_call"] = timing.call_time(run_sgl, torch.cuda.synchronize, iters=iters)
            del tsets
        rows_out.append(row)
        progress.update(1)
    return rows_out
