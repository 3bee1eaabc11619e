"""Malformed inputs through every GPU kernel, to run under ``compute-sanitizer --tool memcheck``.

Interpret mode clamps out-of-bounds gathers, so CPU tests cannot prove that a kernel stays in
bounds; this script drives the real kernels with hostile offsets, indices and counts, through
JAX and through the torch bridge's direct Triton path (``--bridge-only``: the bridge alone). It
prints one line per op; the sanitizer reports any invalid access.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import numpy as np  # noqa: E402

import jax  # noqa: E402

import kvcanary_jax as kc  # noqa: E402
from kvcanary_jax.testing import cases  # noqa: E402


def scatter_cases(rng):
    bs, n, rows, cols = 64, 5000, 40, 300
    for _ in range(20):
        offsets = rng.integers(-3000, n + 3000, bs + 1).astype(np.int64)
        rpi = rng.integers(-50, rows + 50, bs).astype(np.int64)
        flat = rng.integers(-(2**40), 2**40, n).astype(np.int64)
        pool = np.zeros((rows, cols), np.int32)
        out = kc.scatter_req_token_ids(flat_in=flat, offsets=offsets, req_pool_indices=rpi, pool_out=pool)
        jax.block_until_ready(out)
    print("scatter: 20 hostile launches done")


def plan_cases(rng):
    bs, rows, cols, cap = 48, 30, 64, 4096
    with jax.enable_x64(True):
        for i in range(20):
            swa = int(rng.choice([0, 16]))
            lut = rng.integers(-5, 200, 90).astype(np.int64)  # slots past the LUT: clamped
            vp, wp = kc.canary_plan(
                verify_plan_out=kc.VerifyPlan.allocate(verify_capacity=cap),
                write_plan_out=kc.WritePlan.allocate(write_req_capacity=bs),
                req_pool_indices=rng.integers(-10, rows + 10, bs).astype(np.int64),
                prefix_lens=rng.integers(-5, 3 * cols, bs).astype(np.int64),  # past the row
                extend_seq_lens=rng.integers(-3, 9, bs).astype(np.int64),
                req_to_token=rng.integers(-3, 120, (rows, cols)).astype(np.int32),
                swa_window_size=swa, full_to_swa_index_mapping=lut if swa or i % 2 else None,
                verify_capacity=cap,
                req_to_verify_expected_tokens=rng.integers(0, 99, (rows, cols)).astype(np.int32),
                req_to_verify_expected_tokens_valid_lens=rng.integers(-5, 4 * cols, bs).astype(np.int64),
                kv_token_id_vs_position_offset=int(rng.choice([0, 1, -1])),
            )
            jax.block_until_ready((vp, wp))
    print("plan: 20 hostile launches done")


def write_verify_cases(rng):
    """Seeds, slots and verify indices out of range; counts negative or past capacity."""
    from kvcanary_jax.consts import CanaryLaunchTag, RealKvHashMode

    num_slots, n, cap = 500, 600, 16
    with jax.enable_x64(True):
        kv = jax.numpy.asarray(rng.integers(0, 255, (num_slots // 2, 64), dtype=np.uint8))
        src = kc.RealKvSource(tensor=kv, page_size=2, num_bytes_per_token=32, read_bytes=32)
        for i in range(20):
            ctx = kc.VerifyOrWriteContext.allocate(
                num_slots=num_slots, kernel_kind=CanaryLaunchTag.TAIL_K_FULL, ring_capacity=8,
                real_kv_sources=(src,), real_kv_hash_mode=RealKvHashMode(i % 3))
            offsets = np.sort(rng.integers(-50, n + 50, cap + 1)).astype(np.int64)
            wplan = cases.jax_write_plan(  # the keyword arguments draw in their order
                write_offsets=offsets,
                write_seed_slot_indices=rng.integers(-3 * num_slots, 3 * num_slots, cap),
                write_num_valid_reqs=int(rng.integers(-5, 3 * cap)))
            ctx = kc.canary_write(
                context=ctx, plan=wplan,
                input_ids=rng.integers(0, 9, n).astype(np.int64),
                positions=rng.integers(-5, 9, n).astype(np.int64),
                out_cache_loc=rng.integers(-2 * num_slots, 2 * num_slots, n).astype(np.int64),
                enable_write_input_assert=False, expected_input_tokens=None, expected_input_positions=None)
            m = 700
            vplan = cases.jax_verify_plan(
                verify_slot_indices=rng.integers(-2 * num_slots, 2 * num_slots, m),
                verify_expected_tokens=rng.integers(-1, 9, m),
                verify_expected_positions=rng.integers(0, 9, m),
                verify_prev_slot_indices=rng.integers(-2 * num_slots, 2 * num_slots, m),
                verify_num_valid=int(rng.integers(-5, 3 * m)))
            ctx = kc.canary_verify(context=ctx, plan=vplan, check_verify_expected_token=True)
            jax.block_until_ready(ctx)
    print("write + verify: 20 hostile launches each done")


def bridge_direct_cases(rng, launches=20):
    """The torch bridge's direct Triton path (kernels launched with torch's pointers, no XLA) on
    hostile values, value checks off: offsets past bucketed token arrays (the clamp), rows and
    slots out of range, negative and saturating ring indices, column slices with offsets, views
    8 bytes into a counters array, a strided real-KV source."""
    import torch

    import kvcanary_jax.bridge as bridge

    dev = torch.device("cuda")
    api = cases.TorchApi.bridge()
    t = lambda a, dt=torch.int64: torch.as_tensor(np.asarray(a), dtype=dt, device=dev)  # noqa
    bridge.set_value_checks(False)
    for i in range(launches):
        big = torch.zeros(48, 300, dtype=torch.int32, device=dev)
        pool = big[:, 7:263] if i % 2 else big[:40]  # a column slice at an offset, or rows
        n = int(rng.integers(1, 3000))
        bridge.launch_scatter_req_token_ids_kernel(
            flat_in=t(rng.integers(-(2**40), 2**40, n)),
            offsets=t(rng.integers(-3000, n + 3000, 65)),
            req_pool_indices=t(rng.integers(-50, 90, 64)), pool_out=pool)
    torch.cuda.synchronize()
    print("bridge scatter:", bridge.paths()["launch_scatter_req_token_ids_kernel"])

    bs, rows, cols, cap, num_slots = 48, 30, 64, 4096, 500
    counters = torch.zeros(12, dtype=torch.int64, device=dev)
    kv = torch.randint(0, 255, (num_slots // 2, 96), dtype=torch.uint8, device=dev)
    src = bridge.RealKvSource(tensor=kv[:, 16:80], page_size=2, num_bytes_per_token=32,
                              read_bytes=32)
    for i in range(launches):
        vp = bridge.VerifyPlan.allocate(verify_capacity=cap, device=dev)
        wp = bridge.WritePlan.allocate(write_req_capacity=bs, device=dev)
        swa = int(rng.choice([0, 16]))
        bridge.launch_canary_plan_kernels(
            verify_plan_out=vp, write_plan_out=wp, req_pool_indices=t(rng.integers(-10, rows + 10, bs)),
            prefix_lens=t(rng.integers(-5, 3 * cols, bs)), extend_seq_lens=t(rng.integers(-3, 9, bs)),
            req_to_token=t(rng.integers(-3, 120, (rows, cols)), torch.int32), swa_window_size=swa,
            full_to_swa_index_mapping=t(rng.integers(-5, 200, 90)) if swa or i % 2 else None,
            verify_capacity=cap,
            req_to_verify_expected_tokens=t(rng.integers(0, 99, (rows, cols)), torch.int32),
            req_to_verify_expected_tokens_valid_lens=t(rng.integers(-5, 4 * cols, bs)),
            kv_token_id_vs_position_offset=int(rng.choice([0, 1, -1])))
        ctx = bridge.VerifyOrWriteContext(
            canary_buf=torch.zeros(num_slots, 32, dtype=torch.uint8, device=dev),
            kernel_kind=bridge.CanaryLaunchTag.TAIL_K_FULL,
            violation_ring=torch.zeros(8, 8, dtype=torch.int64, device=dev),
            violation_write_index=t([int(rng.choice([-2, 0, 5, 2**31 - 3]))], torch.int32),
            slot_run_counter=counters[1:2], kernel_run_counter=counters[7:8],
            real_kv_sources=(src,),
            real_kv_hash_mode=bridge.RealKvHashMode.ALL if i % 2 else bridge.RealKvHashMode.NONE,
            enable_chain_position_assert=t([1], torch.int32))
        # Few distinct shapes (each compiles once): hostile values, not shapes, are the point.
        m = 40 if i % 4 < 2 else 600
        wplan = cases.torch_write_plan(  # the keyword arguments draw in their order
            api, write_offsets=np.sort(rng.integers(-50, m + 50, 17)),
            write_seed_slot_indices=rng.integers(-3 * num_slots, 3 * num_slots, 16),
            write_num_valid_reqs=int(rng.integers(-5, 48)), device=dev)
        bridge.launch_canary_write_kernel(
            context=ctx, plan=wplan, input_ids=t(rng.integers(0, 9, m)),
            positions=t(rng.integers(-5, 9, m)),
            out_cache_loc=t(rng.integers(-2 * num_slots, 2 * num_slots, m)),
            enable_write_input_assert=bool(i % 2), expected_input_tokens=t(rng.integers(0, 9, m)) if i % 2 else None,
            expected_input_positions=t(rng.integers(0, 9, m)) if i % 2 else None)
        v = 64 if i % 4 < 2 else 700
        vplan = cases.torch_verify_plan(
            api, verify_slot_indices=rng.integers(-2 * num_slots, 2 * num_slots, v),
            verify_expected_tokens=rng.integers(-1, 9, v),
            verify_expected_positions=rng.integers(0, 9, v),
            verify_prev_slot_indices=rng.integers(-2 * num_slots, 2 * num_slots, v),
            verify_num_valid=int(rng.integers(-5, 3 * v)), device=dev)
        bridge.launch_canary_verify_kernel(context=ctx, plan=vplan, check_verify_expected_token=True)
    torch.cuda.synchronize()
    print("bridge plan/write/verify:", {k: v["path"] for k, v in bridge.paths().items()})
    print(f"bridge direct: {launches} hostile launches of each launcher done")


def main(argv=None):
    import sys

    argv = sys.argv[1:] if argv is None else argv
    rng = np.random.default_rng(0)
    # --launches N: hostile launches per launcher on the bridge's direct path (default 20; every
    # fourth one a new shape, each compiled under the sanitizer, which is slow).
    launches = int(argv[argv.index("--launches") + 1]) if "--launches" in argv else 20
    if "--bridge-only" not in argv:
        scatter_cases(rng)
        for name in ("plan", "write_verify"):
            globals()[f"{name}_cases"](rng)
    bridge_direct_cases(rng, launches)


if __name__ == "__main__":
    main()
