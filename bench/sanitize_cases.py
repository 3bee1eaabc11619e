"""Malformed inputs through every GPU kernel, to run under ``compute-sanitizer --tool memcheck``.

Interpret mode clamps out-of-bounds gathers, so CPU tests cannot prove that a kernel stays in
bounds; this script drives the real kernels with hostile offsets, indices and counts. It prints
one line per op; the sanitizer reports any invalid access.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import numpy as np  # noqa: E402

import jax  # noqa: E402

import kvcanary_jax as kc  # noqa: E402


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


def main():
    rng = np.random.default_rng(0)
    scatter_cases(rng)
    for name in ("plan", "write", "verify"):
        fn = globals().get(f"{name}_cases")
        if fn is not None:
            fn(rng)


if __name__ == "__main__":
    main()
