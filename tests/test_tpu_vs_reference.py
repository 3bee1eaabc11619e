"""The Mosaic TPU kernels (in TPU interpret mode) against the pure-jnp references, without torch
or SGLang, so they run wherever TPU interpret mode does (CI runs TPU interpret mode in the
Python 3.11 leg only; ``python -m pytest tests/test_tpu_vs_reference.py`` checks them on the
newest JAX line). Their comparisons with SGLang's references are in the per-op suites, which need
torch.

Random cases with hostile values among them (slots and seeds past the buffer or negative,
offsets past the arrays or decreasing, rows outside the table, prefixes past the row width),
write indices where the ring guard acts, and canaries written by the reference so that verify
sees real chains, corrupted in places."""

from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import kvcanary_jax as kc
from kvcanary_jax import consts
from kvcanary_jax.ops.scatter import base as scatter_base
from kvcanary_jax.testing import cases

import _impls
import _tier

pytestmark = [pytest.mark.tpu_interpret, pytest.mark.fuzz]

TPU = _impls.TPU
N, RING, TOKENS, REQS, CAP = 48, 8, 40, 4, 64
CASES = _tier.n(1, 12)  # --long: 12
MAX = consts.VIOLATION_WRITE_INDEX_MAX


def _ctx(rng, canary, w0, sources=(), mode=0):
    # The keyword arguments draw in the order they are written.
    return cases.jax_context(
        canary_buf=canary, kernel_kind=consts.CanaryLaunchTag(3),
        violation_ring=rng.integers(-9, 9, (RING, 8)), violation_write_index=w0,
        slot_run_counter=rng.integers(0, 2**40), kernel_run_counter=rng.integers(0, 2**40),
        real_kv_sources=sources, real_kv_hash_mode=mode,
        enable_chain_position_assert=rng.integers(0, 2))


def _w0(rng):
    u = rng.random()
    if u < 0.15:
        return int(rng.choice([-1, -(2**31)]))
    if u < 0.3:
        return MAX - int(rng.integers(0, 3))
    return int(rng.integers(0, RING + 3))


def _same(a, b):
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _write_args(rng, context, hostile):
    lens = rng.integers(0, TOKENS // REQS + 1, REQS)
    offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    ocl = rng.integers(1, N, TOKENS)  # slots repeat, across requests too
    ocl[rng.random(TOKENS) < 0.1] = -1
    seeds = rng.choice([-1, 0, 3, int(rng.integers(1, N))], REQS).astype(np.int64)
    pos = rng.integers(0, 5, TOKENS).cumsum()
    if hostile:
        ocl[rng.random(TOKENS) < 0.1] = N + 2
        seeds[rng.random(REQS) < 0.3] = rng.choice([N, 2**40, -(2**40)])
        if rng.random() < 0.5:
            offsets = rng.integers(-5, TOKENS + 5, REQS + 1).astype(np.int64)
    ids = rng.integers(0, 90, TOKENS)
    num_valid = rng.integers(-1, REQS + 2)
    return cases.jax_write_args(
        context=context, write_offsets=offsets, write_seed_slot_indices=seeds,
        write_num_valid_reqs=num_valid, input_ids=ids, positions=pos, out_cache_loc=ocl,
        enable_write_input_assert=True,
        expected_input_tokens=np.where(rng.random(TOKENS) < 0.2, ids + 1, ids),
        expected_input_positions=pos)


def _sources(rng):
    kv = jnp.asarray(rng.integers(0, 256, (N // 2, 2 * 32), dtype=np.uint8))
    return (kc.RealKvSource(tensor=kv, page_size=2, num_bytes_per_token=32, read_bytes=32),)


def test_write_against_the_jnp_reference():
    rng = np.random.default_rng(1)
    with jax.enable_x64(True):
        for k in range(CASES):
            canary = rng.integers(0, 256, (N, 32), dtype=np.uint8)
            mode = k % 3
            ctx = _ctx(rng, canary, _w0(rng), _sources(rng) if mode else (), mode)
            args = _write_args(rng, ctx, hostile=k % 2 == 1)
            want = kc.canary_write_reference(**args)
            got = kc.canary_write(**args, implementation=TPU, config=_impls.config("write", TPU))
            _same(got, want)


def test_verify_against_the_jnp_reference():
    rng = np.random.default_rng(2)
    with jax.enable_x64(True):
        for k in range(CASES):
            mode = k % 3
            sources = _sources(rng) if mode else ()
            ctx = _ctx(rng, np.zeros((N, 32), np.uint8), 0, sources, mode)
            written = kc.canary_write_reference(**_write_args(rng, ctx, hostile=False))
            canary = np.asarray(written.canary_buf).copy()
            words = canary.view(np.int64)
            for s in rng.integers(1, N, 3):  # corruptions
                words[s, rng.integers(0, 4)] ^= np.int64(1) << np.int64(rng.integers(64))
            slots = rng.integers(0, N, CAP)
            prev = np.where(rng.random(CAP) < 0.5, np.roll(slots, 1), -1)
            if k % 2:
                slots[rng.random(CAP) < 0.2] = rng.choice([-1, -N, -N - 1, N, 2**40])
                prev[rng.random(CAP) < 0.2] = rng.choice([N, -7, 2**40])
            plan = cases.jax_verify_plan(  # the keyword arguments draw in their order
                verify_slot_indices=slots, verify_expected_tokens=rng.integers(-1, 90, CAP),
                verify_expected_positions=rng.integers(0, 60, CAP), verify_prev_slot_indices=prev,
                verify_num_valid=rng.integers(-2, CAP + 3), enable=int(rng.random() > 0.1))
            ctx = _ctx(rng, canary, _w0(rng), sources, mode)
            want = kc.canary_verify_reference(context=ctx, plan=plan,
                                              check_verify_expected_token=bool(k % 3))
            got = kc.canary_verify(context=ctx, plan=plan, check_verify_expected_token=bool(k % 3),
                                   implementation=TPU, config=_impls.config("verify", TPU))
            _same(got, want)


def test_scatter_against_the_jnp_reference():
    rng = np.random.default_rng(3)
    with jax.enable_x64(True):
        for k in range(CASES):
            rows, cols, bs, n = 6, int(rng.choice([5, 130, 300])), 5, 400
            offsets = np.concatenate([[0], np.cumsum(rng.integers(0, 2 * cols, bs))])
            if k % 2:
                offsets = rng.integers(-20, n + 20, bs + 1)
            rpi = rng.integers(-1, rows + 1, bs)
            flat = jnp.asarray(rng.integers(-(2**62), 2**62, n), jnp.int64)
            pool = jnp.asarray(rng.integers(-99, 99, (rows, cols)), jnp.int32)
            args = (flat, jnp.asarray(offsets, jnp.int64), jnp.asarray(rpi, jnp.int64), pool)
            want = scatter_base.reference(scatter_base.ScatterInputs(
                flat_in=args[0], offsets=args[1], req_pool_indices=args[2], pool_out=args[3]))
            got = kc.scatter_req_token_ids(flat_in=args[0], offsets=args[1],
                                           req_pool_indices=args[2], pool_out=args[3],
                                           implementation=TPU,
                                           config=_impls.config("scatter", TPU))
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_plan_against_the_jnp_reference():
    rng = np.random.default_rng(4)
    bs, rows, width, vcap = 5, 7, 9, 24
    with jax.enable_x64(True):
        for k in range(CASES):
            rpi = rng.integers(0, rows, bs)
            prefix = rng.integers(-1, width + 1, bs)
            if k % 2:
                rpi[rng.random(bs) < 0.3] = rng.choice([rows, -2])
                prefix[rng.random(bs) < 0.3] = 2 * width + 1
            lut = jnp.asarray(rng.integers(-1, 2**40, 40), jnp.int64) if k % 3 else None
            pool = jnp.asarray(rng.integers(-5, 1000, (rows, 6)), jnp.int32) if k % 4 else None
            marked = -9999  # in every output cell: what the plan does not write stays
            vp = cases.jax_verify_plan(**{f: [marked] * vcap for f in cases.VERIFY_ENTRY_FIELDS},
                                       verify_num_valid=marked, enable=marked)
            wp = cases.jax_write_plan(write_offsets=[marked] * (bs + 3),
                                      write_seed_slot_indices=[marked] * (bs + 2),
                                      write_num_valid_reqs=marked)
            kw = dict(verify_plan_out=vp, write_plan_out=wp, req_pool_indices=jnp.asarray(rpi),
                      prefix_lens=jnp.asarray(prefix),
                      extend_seq_lens=jnp.asarray(rng.integers(-1, 4, bs)),
                      req_to_token=jnp.asarray(rng.integers(-1, 40, (rows, width)), jnp.int32),
                      swa_window_size=int(rng.choice([0, 3])) if lut is not None else 0,
                      full_to_swa_index_mapping=lut, verify_capacity=vcap,
                      req_to_verify_expected_tokens=pool,
                      req_to_verify_expected_tokens_valid_lens=None if pool is None else
                      jnp.asarray(rng.integers(-1, 12, bs)),
                      kv_token_id_vs_position_offset=int(k % 2))
            want = kc.canary_plan_reference(**kw)
            got = kc.canary_plan(**kw, implementation=TPU, config=_impls.config("plan", TPU))
            _same(got, want)
