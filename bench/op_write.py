"""canary_write: ours (Pallas) vs SGLang 0.5.23's CUDA write. Each request continues a chain from
a seeded slot (chain-position assert on) and writes its new tokens at random distinct slots."""

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
        rows_out.append(row)
        progress.update(1)
    return rows_out
