"""scatter_req_token_ids against SGLang 0.5.23's torch reference (the oracle), byte for byte."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import kvcanary_jax as kc
import _impls
import _races
import _tier
from _impls import implementations, pallas, with_tpu

MARK = -9999
IMPLS = implementations("scatter")
IMPLS_TPU = with_tpu("scatter")


def oracle(sgl, flat, offsets, rpi, pool):
    import torch

    out = torch.from_numpy(pool.copy())
    sgl.scatter_ref.scatter_req_token_ids_torch_reference(
        flat_in=torch.from_numpy(flat),
        offsets=torch.from_numpy(offsets),
        req_pool_indices=torch.from_numpy(rpi),
        pool_out=out,
    )
    return out.numpy()


def _ours(impl, flat, offsets, rpi, pool, **kw):
    kw.setdefault("config", _impls.config("scatter", impl))
    return np.asarray(kc.scatter_req_token_ids(flat_in=flat, offsets=offsets, req_pool_indices=rpi,
                                               pool_out=pool, implementation=impl, **kw))


def _i64(*v):
    return np.array(v, dtype=np.int64)


# Hand-written cases (the spec's golden-vector scenarios); expectations come from the oracle.
HAND_CASES = {
    "basic_three_reqs": (_i64(*range(10, 19)), _i64(0, 3, 5, 9), _i64(1, 3, 2), (4, 6)),
    "empty_segment_in_middle": (_i64(1, 2, 3, 4), _i64(0, 2, 2, 4), _i64(1, 2, 3), (4, 4)),
    "truncate_to_pool_width": (_i64(*range(100, 110)), _i64(0, 10), _i64(2), (3, 4)),
    "int64_to_int32_wraparound": (
        _i64(2**31, 2**32 + 5, -(2**31) - 1, 2**63 - 1, -(2**63)),
        _i64(0, 5),
        _i64(1),
        (2, 8),
    ),
    "padding_row_zero_is_written": (_i64(7, 8, 9), _i64(0, 2, 3), _i64(0, 1), (2, 4)),
    "bs_zero": (np.zeros(0, np.int64), _i64(0), np.zeros(0, np.int64), (2, 4)),
    "num_tokens_zero": (np.zeros(0, np.int64), _i64(0, 0, 0), _i64(1, 2), (3, 4)),
    "shorter_than_row_tail_untouched": (_i64(5, 6), _i64(0, 2), _i64(1), (2, 8)),
    "many_tokens_cross_block": (
        np.arange(3000, dtype=np.int64) * 7 - 5,
        _i64(0, 1100, 1100, 3000),
        _i64(3, 1, 2),
        (4, 2048),
    ),
    "duplicate_rows_last_request_wins_in_reference": (_i64(1, 2, 3, 4, 5), _i64(0, 3, 5), _i64(1, 1), (2, 4)),
}


@pytest.mark.parametrize("impl", IMPLS_TPU)
@pytest.mark.parametrize("name", sorted(HAND_CASES))
def test_hand_cases_match_oracle(sgl, name, impl):
    """Exact, except where requests share a row (the duplicate-rows case) on an implementation
    without request order (the GPU): there each shared cell holds one of its writers' values."""
    flat, offsets, rpi, shape = HAND_CASES[name]
    pool = np.full(shape, MARK, np.int32)
    expected = oracle(sgl, flat, offsets, rpi, pool)
    got = _ours(impl, flat, offsets, rpi, pool)
    writes = _races.scatter_writes(flat, offsets, rpi, pool.shape)
    if _impls.in_reference_order(impl) or not _races.contested_cells(writes, pool.shape):
        np.testing.assert_array_equal(got, expected)
    else:
        _races.assert_scatter_outcome(got, pool, writes)
        _races.assert_scatter_outcome(expected, pool, writes)  # SGLang's order is one outcome
    np.testing.assert_array_equal(
        np.asarray(
            kc.scatter_req_token_ids_reference(
                flat_in=flat, offsets=offsets, req_pool_indices=rpi, pool_out=pool
            )
        ),
        expected,
    )


@pytest.mark.parametrize("impl", IMPLS_TPU)
def test_hand_values(impl):
    """A case checked by hand, independent of the oracle."""
    flat = _i64(10, 11, 12, 2**32 + 5, 14)
    out = _ours(impl, flat, _i64(0, 2, 5), _i64(2, 0), np.full((3, 3), -1, np.int32))
    np.testing.assert_array_equal(out, [[12, 5, 14], [-1, -1, -1], [10, 11, -1]])


@pytest.mark.parametrize("impl", IMPLS)
def test_array_level_entry_takes_named_inputs(impl):
    """``run`` and the reference take one ScatterInputs pytree (SGLang's names, its leaves in
    that order) with ``max_cols`` as a keyword, and return the pool; under a jit that donates
    the pool it is updated in place. Hand-checked: 2 columns of 3 may be written."""
    from kvcanary_jax.ops.scatter import ScatterInputs, base, run

    with jax.enable_x64(True):
        inputs = ScatterInputs(flat_in=jnp.asarray(_i64(10, 11, 12, 2**32 + 5, 14)),
                               offsets=jnp.asarray(_i64(0, 2, 5)),
                               req_pool_indices=jnp.asarray(_i64(2, 0)),
                               pool_out=jnp.full((3, 3), -1, jnp.int32))
        assert [k[0].name for k, _ in jax.tree_util.tree_flatten_with_path(inputs)[0]] == [
            "flat_in", "offsets", "req_pool_indices", "pool_out"]
        want = [[12, 5, -1], [-1, -1, -1], [10, 11, -1]]
        np.testing.assert_array_equal(base.reference(inputs, max_cols=2), want)
        # The pool is donated on its own: the other leaves are only read.
        step = jax.jit(lambda x, pool: run(dataclasses.replace(x, pool_out=pool), max_cols=2,
                                           implementation=impl,
                                           config=_impls.config("scatter", impl)),
                       donate_argnames="pool")
        pool = jnp.full((3, 3), -1, jnp.int32)
        np.testing.assert_array_equal(step(inputs, pool), want)
        assert pool.is_deleted()


# --- fuzz -----------------------------------------------------------------------------------
# Interpret mode compiles once per shape: each case is padded into a fixed bucket. Padding is
# semantically inert: extra requests have empty ranges at the end of flat_in, and flat_in's tail
# past offsets[bs] is never addressed by well-formed offsets.
BUCKETS = [  # (bs, num_tokens, rows, cols)
    (8, 256, 12, 24),
    (64, 2048, 70, 40),
    (512, 8192, 520, 24),
    (2000, 16384, 2004, 12),
]
CASES_PER_BUCKET = _tier.counts([40, 20, 8, 4], [1400, 450, 120, 40])


def draw_case(rng, bs_cap, tok_cap, rows, cols):
    bs = int(rng.integers(0, bs_cap + 1))
    mode = rng.integers(0, 3)
    hi = {0: cols // 2 + 1, 1: cols + 1, 2: 2 * cols + 3}[int(mode)]  # lengths to past the row
    lens = rng.integers(0, hi, bs)
    lens[rng.random(bs) < 0.2] = 0
    while lens.sum() > tok_cap:
        lens = lens // 2
    offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    num_tokens = int(offsets[-1])
    flat = rng.integers(-(2**63), 2**63 - 1, num_tokens, dtype=np.int64, endpoint=True)
    # Distinct rows mostly (the GPU order of duplicate rows is unspecified), row 0 (padding) too.
    rpi = rng.permutation(rows)[:bs].astype(np.int64) if bs <= rows else None
    pool = rng.integers(-(2**31), 2**31 - 1, (rows, cols), dtype=np.int32)
    return flat, offsets, rpi, pool


def pad_case(flat, offsets, rpi, bs_cap, tok_cap):
    bs, n = rpi.shape[0], flat.shape[0]
    flat_p = np.concatenate([flat, np.full(tok_cap - n, 77, np.int64)])
    off_p = np.concatenate([offsets, np.full(bs_cap - bs, offsets[-1], np.int64)])
    rpi_p = np.concatenate([rpi, np.zeros(bs_cap - bs, np.int64)])
    return flat_p, off_p, rpi_p


@pytest.mark.fuzz
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("bucket", range(len(BUCKETS)))
def test_fuzz_against_oracle(sgl, bucket, impl):
    bs_cap, tok_cap, rows, cols = BUCKETS[bucket]
    seed = 1234 + bucket
    rng = np.random.default_rng(seed)
    for i in _tier.cases("scatter fuzz", seed, CASES_PER_BUCKET[bucket]):
        with _tier.case("scatter fuzz", seed, i, bucket=bucket):
            flat, offsets, rpi, pool = draw_case(rng, bs_cap, tok_cap, rows, cols)
            expected = oracle(sgl, flat, offsets, rpi, pool)
            got = _ours(impl, *pad_case(flat, offsets, rpi, bs_cap, tok_cap), pool)
            np.testing.assert_array_equal(got, expected)


@pytest.mark.fuzz
@pytest.mark.parametrize("impl", IMPLS)
def test_fuzz_against_jnp_reference(impl):
    """Every implementation against the pure-jnp reference (no SGLang needed)."""
    seed = 4321
    rng = np.random.default_rng(seed)
    for bucket, n in ((0, _tier.n(30, 200)), (1, _tier.n(10, 60))):
        bs_cap, tok_cap, rows, cols = BUCKETS[bucket]
        for i in _tier.cases(f"scatter vs jnp reference, bucket {bucket}", seed, n):
            with _tier.case("scatter vs jnp reference", seed, i, bucket=bucket):
                flat, offsets, rpi, pool = draw_case(rng, bs_cap, tok_cap, rows, cols)
                args = pad_case(flat, offsets, rpi, bs_cap, tok_cap)
                want = np.asarray(kc.scatter_req_token_ids_reference(
                    flat_in=args[0], offsets=args[1], req_pool_indices=args[2], pool_out=pool))
                np.testing.assert_array_equal(_ours(impl, *args, pool), want)


# --- malformed inputs: never out of bounds ------------------------------------------------
GUARD = 2  # guard rows above and below the rows any request may address


@pytest.mark.fuzz
@pytest.mark.parametrize("impl", IMPLS_TPU)
def test_malformed_offsets_stay_in_bounds(impl):
    """Negative, decreasing and past-the-end offsets, out-of-range rows: the kernel agrees with
    the in-bounds semantics of the jnp reference and never touches guard rows."""
    rng = np.random.default_rng(7)
    bs, n, rows, cols = 32, 300, 20, 16
    count = _tier.n(2, 60) if _impls.tpu_interpreted(impl) else _tier.n(40, 300)
    _tier.seeded("scatter malformed offsets", 7, count)
    for _ in range(count):
        offsets = rng.integers(-50, n + 60, bs + 1).astype(np.int64)
        if rng.random() < 0.5:
            offsets = np.sort(offsets)
        rpi = rng.integers(GUARD, rows - GUARD, bs).astype(np.int64)
        rpi[rng.random(bs) < 0.1] = rng.choice([-1, -5, rows, rows + 9])  # out of range: skipped
        # one owner per row, so the GPU/interpret order of duplicate rows cannot matter
        _, first = np.unique(rpi, return_index=True)
        keep = np.zeros(bs, bool)
        keep[first] = True
        offsets_ok = offsets.copy()
        flat = rng.integers(-1000, 1000, n).astype(np.int64)
        pool = np.full((rows, cols), MARK, np.int32)
        rpi = np.where(keep, rpi, rows + 100)
        got = _ours(impl, flat, offsets_ok, rpi, pool)
        ref = np.asarray(
            kc.scatter_req_token_ids_reference(
                flat_in=flat, offsets=offsets_ok, req_pool_indices=rpi, pool_out=pool
            )
        )
        np.testing.assert_array_equal(got, ref)
        assert (got[:GUARD] == MARK).all() and (got[-GUARD:] == MARK).all()
        # every written value comes from flat_in at the right place
        for r in np.nonzero(keep & (rpi >= 0) & (rpi < rows))[0]:
            start, end = offsets_ok[r], offsets_ok[r + 1]
            for j in range(max(0, min(end - start, cols))):
                src = start + j
                if 0 <= src < n:
                    assert got[rpi[r], j] == np.int32(flat[src])


@pytest.mark.fuzz
@pytest.mark.parametrize("impl", IMPLS_TPU)
def test_num_tokens_reads_a_longer_flat_in_as_its_true_length(impl):
    """``run(..., num_tokens=[n])`` over a ``flat_in`` of ``n`` tokens then a tail (a bucket,
    as the torch bridge passes it): the offsets are read as ``min(offsets, n)``, so the tail
    (a value no token has) is never read and the pool equals the reference's over the true
    ``flat_in`` with the offsets clamped to ``n``; malformed offsets (negative, decreasing, past
    the end) included."""
    from kvcanary_jax.ops.scatter import ScatterInputs, run

    TAIL = 5000  # the tokens are drawn from [-1000, 1000)
    rng = np.random.default_rng(29)
    bs, n, tail, rows, cols = 24, 200, 56, 16, 24
    count = _tier.n(2, 20) if _impls.tpu_interpreted(impl) else _tier.n(20, 200)
    _tier.seeded("scatter num_tokens", 29, count)
    for _ in range(count):
        offsets = rng.integers(-20, n + 40, bs + 1).astype(np.int64)
        if rng.random() < 0.7:
            offsets = np.sort(offsets)
        rpi = rng.permutation(rows)[:bs % rows].astype(np.int64)
        rpi = np.concatenate([rpi, np.full(bs - rpi.shape[0], rows + 3, np.int64)])
        flat = rng.integers(-1000, 1000, n).astype(np.int64)
        bucket = np.concatenate([flat, np.full(tail, TAIL, np.int64)])
        pool = np.full((rows, cols), MARK, np.int32)
        want = np.asarray(kc.scatter_req_token_ids_reference(
            flat_in=flat, offsets=np.minimum(offsets, n), req_pool_indices=rpi, pool_out=pool))
        with jax.enable_x64(True):
            got = np.asarray(run(
                ScatterInputs(flat_in=jnp.asarray(bucket), offsets=jnp.asarray(offsets),
                              req_pool_indices=jnp.asarray(rpi), pool_out=jnp.asarray(pool)),
                implementation=impl, config=_impls.config("scatter", impl),
                num_tokens=jnp.asarray(_i64(n))))
        np.testing.assert_array_equal(got, want)
        assert not (got == TAIL).any()


@pytest.mark.parametrize("impl", IMPLS_TPU)
def test_negative_start_differs_from_sglangs_reference_by_design(sgl, impl):
    """Documented difference: SGLang's torch reference slices flat_in[start:end] with Python
    semantics (a negative start wraps around); we never read before flat_in."""
    flat, offsets, rpi = _i64(1, 2, 3, 4), _i64(-2, 2), _i64(1)
    pool = np.full((2, 4), MARK, np.int32)
    got = _ours(impl, flat, offsets, rpi, pool)
    np.testing.assert_array_equal(got[1], [MARK, MARK, 1, 2])  # columns 2, 3 <- flat[0], flat[1]
    want = oracle(sgl, flat, offsets, rpi, pool)
    np.testing.assert_array_equal(want[1], [MARK] * 4)  # flat[-2:2] is empty in Python


@pytest.mark.parametrize("impl", IMPLS)
def test_no_cap_on_requests(sgl, impl):
    bs = 4096
    rng = np.random.default_rng(3)
    lens = rng.integers(0, 5, bs)
    offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    flat = rng.integers(0, 50000, offsets[-1]).astype(np.int64)
    rpi = rng.permutation(bs + 1)[:bs].astype(np.int64)
    pool = np.full((bs + 1, 4), MARK, np.int32)
    np.testing.assert_array_equal(_ours(impl, flat, offsets, rpi, pool),
                                  oracle(sgl, flat, offsets, rpi, pool))


@pytest.mark.fuzz
def test_xla_duplicate_rows_apply_in_request_order(sgl):
    """Several requests writing one row, with and without padding requests (empty ranges) and
    out-of-range rows between them: later requests win on the columns they write, as in
    SGLang's reference (the xla scatter stores rank by rank). Each case is padded into one
    launch shape (12 requests, 120 tokens, a [3, 8] pool): padding requests have empty ranges
    and rows past the case's pool, and ``max_context_len`` keeps writes inside the case's
    columns, so the cases share a handful of compiles (one per width)."""
    seed = 21
    rng = np.random.default_rng(seed)
    for i in _tier.cases("xla duplicate rows", seed, _tier.n(40, 200)):
        bs, rows, cols = int(rng.integers(1, 12)), int(rng.integers(1, 4)), int(rng.integers(1, 9))
        lens = rng.integers(0, cols + 3, bs)
        offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
        flat = rng.integers(-(2**40), 2**40, offsets[-1]).astype(np.int64)
        rpi = rng.integers(0, rows, bs).astype(np.int64)
        pool = rng.integers(-99, 99, (rows, cols)).astype(np.int32)
        want = oracle(sgl, flat, offsets, rpi, pool)
        flat_p = np.concatenate([flat, np.zeros(120 - len(flat), np.int64)])
        off_p = np.concatenate([offsets, np.full(12 - bs, offsets[-1], np.int64)])
        rpi_p = np.concatenate([rpi, np.full(12 - bs, 3, np.int64)])  # past the case's rows
        pool_p = np.full((3, 8), MARK, np.int32)
        pool_p[:rows, :cols] = pool
        with _tier.case("xla duplicate rows", seed, i, bs=bs, rows=rows, cols=cols):
            got = _ours("xla", flat_p, off_p, rpi_p, pool_p, max_context_len=cols)
            np.testing.assert_array_equal(got[:rows, :cols], want)
            assert (got[rows:] == MARK).all() and (got[:, cols:] == MARK).all()


@pytest.mark.fuzz
@pytest.mark.parametrize("impl", IMPLS_TPU)
def test_duplicate_rows_hold_one_writers_value(sgl, impl):
    """The scatter's race, drawn on purpose: requests that target one row. Every cell that two
    or more requests write holds one of their values (the GPU promises no order of requests, nor
    does SGLang's kernel), every other cell is exact; the implementations that keep request
    order give the reference's result exactly."""
    rng = np.random.default_rng(22)
    bs, n, rows, cols = 16, 400, 6, 40
    races = 0
    count = _tier.n(1, 3) if _impls.tpu_interpreted(impl) else 8
    for i in range(count):
        lens = rng.integers(0, cols + 8, bs)
        offsets = np.concatenate([[0], np.cumsum(lens)])
        offsets = np.minimum(offsets, n).astype(np.int64)
        rpi = rng.integers(1, 3, bs).astype(np.int64)  # 16 requests on 2 rows
        flat = rng.integers(-(2**40), 2**40, n).astype(np.int64)
        pool = np.full((rows, cols), MARK, np.int32)
        writes = _races.scatter_writes(flat, offsets, rpi, pool.shape)
        races += _races.contested_cells(writes, pool.shape)
        with _tier.case("scatter duplicate rows", 22, i):
            got = _ours(impl, flat, offsets, rpi, pool)
            _races.assert_scatter_outcome(got, pool, writes)
            want = oracle(sgl, flat, offsets, rpi, pool)
            _races.assert_scatter_outcome(want, pool, writes)  # SGLang's order is one outcome
            if _impls.in_reference_order(impl):
                np.testing.assert_array_equal(got, want)
    assert races > 40 * count


def test_scatter_race_check_accepts_every_order_and_nothing_else():
    """The candidate check itself: every order of the requests passes; a contested cell given a
    value none of its writers has, an uncontested cell changed, or a cell no request writes
    changed, each fails."""
    rng = np.random.default_rng(23)
    flat = rng.integers(-(2**40), 2**40, 60).astype(np.int64)
    offsets = np.array([0, 10, 25, 25, 40, 60], np.int64)
    rpi = np.array([1, 1, 2, 1, 3], np.int64)
    pool = np.full((5, 16), MARK, np.int32)
    writes = _races.scatter_writes(flat, offsets, rpi, pool.shape)
    assert _races.contested_cells(writes, pool.shape) == 15  # row 1: 10 cells x 3, 5 x 2 writers
    for order in ([0, 1, 2, 3, 4], [4, 3, 2, 1, 0], [3, 0, 1, 4, 2]):
        _races.assert_scatter_outcome(_races.apply_scatter(pool, writes, order), pool, writes)
    good = _races.apply_scatter(pool, writes, range(5))
    for cell, value in (((1, 0), 12345), ((3, 5), 7), ((0, 0), 1), ((1, 15), 0)):
        bad = good.copy()
        bad[cell] = value
        with pytest.raises(AssertionError):
            _races.assert_scatter_outcome(bad, pool, writes)


# --- validation: SGLang's classes and messages, in SGLang's order -----------------------------
P = "kv-canary: scatter_req_token_ids"


def _z(shape, dtype):
    return jnp.zeros(shape, dtype)


VALIDATION = [
    # (name, flat_in, offsets, req_pool_indices, pool_out, exc, message)
    ("flat_in_not_1d", ((2, 3), "int64"), ((2,), "int64"), ((1,), "int64"), ((2, 4), "int32"),
     ValueError, P + " flat_in must be 1-D, got shape (2, 3)"),
    ("offsets_not_1d", ((3,), "int64"), ((1, 2), "int64"), ((1,), "int64"), ((2, 4), "int32"),
     ValueError, P + " offsets must be 1-D, got shape (1, 2)"),
    ("rpi_not_1d", ((3,), "int64"), ((2,), "int64"), ((1, 1), "int64"), ((2, 4), "int32"),
     ValueError, P + " req_pool_indices must be 1-D, got shape (1, 1)"),
    ("pool_not_2d", ((3,), "int64"), ((2,), "int64"), ((1,), "int64"), ((8,), "int32"),
     ValueError, P + " pool_out must be 2-D, got shape (8,)"),
    ("flat_in_dtype", ((3,), "int32"), ((2,), "int64"), ((1,), "int64"), ((2, 4), "int32"),
     TypeError, P + " flat_in must be int64, got int32"),
    ("offsets_dtype", ((3,), "int64"), ((2,), "int32"), ((1,), "int64"), ((2, 4), "int32"),
     TypeError, P + " offsets must be int64, got int32"),
    ("rpi_dtype", ((3,), "int64"), ((2,), "int64"), ((1,), "int32"), ((2, 4), "int32"),
     TypeError, P + " req_pool_indices must be int64, got int32"),
    ("pool_dtype", ((3,), "int64"), ((2,), "int64"), ((1,), "int64"), ((2, 4), "int64"),
     TypeError, P + " pool_out must be int32, got int64"),
    ("offsets_len", ((3,), "int64"), ((3,), "int64"), ((1,), "int64"), ((2, 4), "int32"),
     ValueError, P + " offsets length 3 != bs+1 (2)"),
    # Order: dims are checked before dtypes.
    ("dims_before_dtypes", ((3,), "int32"), ((2,), "int64"), ((1,), "int64"), ((8,), "int64"),
     ValueError, P + " pool_out must be 2-D, got shape (8,)"),
]


@pytest.mark.parametrize("case", VALIDATION, ids=[c[0] for c in VALIDATION])
def test_validation_matches_sglang(case):
    _, f, o, r, p, exc, msg = case
    with jax.enable_x64(True):  # a caller with 64-bit types on (the hint below is for x64 off)
        args = dict(flat_in=_z(*f), offsets=_z(*o), req_pool_indices=_z(*r), pool_out=_z(*p))
        with pytest.raises(exc) as info:
            kc.scatter_req_token_ids(**args)
    assert str(info.value) == msg


@pytest.mark.parametrize("case", VALIDATION, ids=[c[0] for c in VALIDATION])
def test_validation_matches_sglang_launcher_text(sgl, case):
    """The same conditions raised by SGLang's own launcher (torch dtypes print as torch.int64)."""
    if sgl.scatter is None:
        pytest.fail("SGLang's scatter launcher did not import (needs triton's Python package)")
    _, f, o, r, p, exc, msg = case
    import torch

    t = lambda spec: torch.zeros(spec[0], dtype=getattr(torch, spec[1]))  # noqa: E731
    with pytest.raises(exc) as info:
        sgl.scatter.launch_scatter_req_token_ids_kernel(
            flat_in=t(f), offsets=t(o), req_pool_indices=t(r), pool_out=t(p)
        )
    assert str(info.value) == msg.replace("got int", "got torch.int")


def test_validation_under_jit():
    f = jax.jit(lambda a, b, c, d: kc.scatter_req_token_ids(flat_in=a, offsets=b, req_pool_indices=c, pool_out=d))
    with jax.enable_x64(True):
        args = (_z((3,), "int64"), _z((2,), "int64"), _z((1,), "int64"), _z((2, 4), "int64"))
        with pytest.raises(TypeError, match="pool_out must be int32, got int64"):
            f(*args)


def test_x64_off_gives_a_hint_not_a_silent_truncation():
    """With x64 off, JAX narrows int64 arrays to int32 before we see them: we refuse them with
    SGLang's message and say how to fix it, instead of silently truncating token ids."""
    assert not jax.config.read("jax_enable_x64")
    f = jax.jit(lambda a, b, c, d: kc.scatter_req_token_ids(flat_in=a, offsets=b, req_pool_indices=c, pool_out=d))
    with pytest.raises(TypeError) as info:
        f(jnp.zeros(3, jnp.int32), jnp.zeros(2, jnp.int32), jnp.zeros(1, jnp.int32), jnp.zeros((2, 4), jnp.int32))
    assert str(info.value).startswith(P + " flat_in must be int64, got int32 (")
    assert "jax_enable_x64" in str(info.value)
    assert not jax.config.read("jax_enable_x64")  # the global flag is untouched


@pytest.mark.parametrize("impl", IMPLS_TPU)
def test_numpy_int64_inputs_keep_64_bits_without_global_x64(impl):
    assert not jax.config.read("jax_enable_x64")
    flat = _i64(2**40 + 3)
    out = _ours(impl, flat, _i64(0, 1), _i64(0), np.zeros((1, 2), np.int32))
    assert out[0, 0] == 3  # low 32 bits of the 64-bit id, not of a pre-narrowed value


# --- jit + donation: in place -----------------------------------------------------------
@pytest.mark.parametrize("impl", IMPLS_TPU)
def test_jit_donation_updates_in_place(impl):
    with jax.enable_x64(True):
        step = jax.jit(
            lambda flat, off, rpi, pool: kc.scatter_req_token_ids(
                flat_in=flat, offsets=off, req_pool_indices=rpi, pool_out=pool,
                implementation=impl, config=_impls.config("scatter", impl),
            ),
            donate_argnames="pool",
        )
        pool = jnp.full((64, 128), MARK, jnp.int32)
        ptr = pool.unsafe_buffer_pointer()
        flat = jnp.arange(100, dtype=jnp.int64)
        out = step(flat, jnp.array([0, 40, 100], jnp.int64), jnp.array([3, 9], jnp.int64), pool)
        assert out.unsafe_buffer_pointer() == ptr  # same buffer: aliased and donated
        assert pool.is_deleted()
        host = np.asarray(out)
    assert (host[3, :40] == np.arange(40)).all() and (host[3, 40:] == MARK).all()
    assert (host[9, :60] == np.arange(40, 100)).all() and (host[9, 60:] == MARK).all()
    untouched = np.delete(host, [3, 9], axis=0)
    assert (untouched == MARK).all()


@pytest.mark.gpu
def test_gpu_matches_oracle(sgl):
    rng = np.random.default_rng(11)
    for bs, seq in [(1, 128), (8, 512), (64, 2048), (256, 8192), (511, 8192), (2048, 512)]:
        lens = rng.integers(0, seq + 64, bs)
        offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
        flat = rng.integers(-(2**62), 2**62, offsets[-1]).astype(np.int64)
        rpi = rng.permutation(bs + 1)[:bs].astype(np.int64)
        pool = rng.integers(-(2**31), 2**31 - 1, (bs + 1, seq), dtype=np.int32)
        got = _ours("pallas_triton", flat, offsets, rpi, pool)
        np.testing.assert_array_equal(got, oracle(sgl, flat, offsets, rpi, pool))


@pytest.mark.parametrize("impl", pallas("scatter"))
def test_small_column_tiles(sgl, impl):
    """A launch config of 8-column tiles: rows span many tiles, tiles past a row exit."""
    from kvcanary_jax.ops.scatter.pallas_triton import Config

    rng = np.random.default_rng(5)
    flat, offsets, rpi, pool = draw_case(rng, 8, 256, 12, 24)
    while rpi is None or flat.shape[0] == 0:
        flat, offsets, rpi, pool = draw_case(rng, 8, 256, 12, 24)
    got = _ours(impl, flat, offsets, rpi, pool, config=Config(block_cols=8, num_warps=2))
    np.testing.assert_array_equal(got, oracle(sgl, flat, offsets, rpi, pool))


# --- every implementation: fuzz with hostile inputs -----------------------------------------------
# Pools 5 to 2,100 columns wide (one short segment, whole 128-column segments, several 2,048-column
# items per row), duplicate target rows (applied in order, as the reference), and hostile inputs:
# offsets negative, decreasing and past the tokens, rows outside the pool, a max_context_len below
# the pool's width (the bridge's column-sliced views). Well-formed cases are checked against
# SGLang's reference; hostile ones against the jnp reference (SGLang's slicing wraps negative
# starts and writes outside the pool). Every case also checks the guard rows stay untouched.
# pallas_mosaic_tpu runs in TPU interpret mode off a TPU.
FUZZ_BUCKETS = [  # (bs, num_tokens, rows, cols)
    (6, 600, 8, 130),
    (12, 3000, 16, 300),
    (4, 5000, 6, 2100),
    (20, 700, 24, 5),
]
# Every implementation runs FUZZ_CASES a bucket (250 with --long); pallas_mosaic_tpu in TPU
# interpret mode its first FUZZ_TPU_INTERPRETED (250 with --tpu-long).
FUZZ_CASES = _tier.n(12, 250)  # per bucket
FUZZ_TPU_INTERPRETED = _tier.n(1, 20)  # per bucket
LONG_CASES = 250


def _hostile_case(rng, bs, n, rows, cols):
    hostile = rng.random() < 0.4
    lens = rng.integers(0, 2 * cols + 3, bs)
    lens[rng.random(bs) < 0.2] = 0
    while lens.sum() > n:
        lens = lens // 2
    offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    rpi = rng.integers(GUARD, rows - GUARD, bs).astype(np.int64)  # duplicates included
    max_cols = None
    if hostile:
        k = rng.random(bs + 1)
        offsets[k < 0.2] = rng.integers(-2 * cols, 0, int((k < 0.2).sum()))
        offsets[k > 0.8] = rng.integers(n - cols, n + 2 * cols, int((k > 0.8).sum()))
        if rng.random() < 0.3:
            offsets = offsets[::-1].copy()
        bad = rng.random(bs) < 0.15
        rpi[bad] = rng.choice([-1, -(2**40), rows, rows + 7, 2**40], int(bad.sum()))
        if rng.random() < 0.3:
            max_cols = int(rng.integers(1, cols + 1))
            if not _tier.LONG:
                # max_context_len is static (one compile each): the fast tier keeps three
                # widths per bucket (one column, half the row, all but one), the long tier every
                # width drawn.
                max_cols = min((1, max(cols // 2, 1), max(cols - 1, 1)),
                               key=lambda w: abs(w - max_cols))
    flat = rng.integers(-(2**63), 2**63 - 1, n, dtype=np.int64, endpoint=True)
    pool = rng.integers(-(2**31), 2**31 - 1, (rows, cols), dtype=np.int32)
    pool[:GUARD] = pool[-GUARD:] = MARK
    return hostile, flat, offsets, rpi, pool, max_cols


def _sglang_defined(flat, offsets, rpi, rows):
    """Whether SGLang's reference is defined on a case: offsets non-decreasing inside the
    tokens (its slicing wraps a negative start) and every row inside the pool (its kernel writes
    outside it)."""
    return bool((offsets[0] >= 0) and (np.diff(offsets) >= 0).all() and offsets[-1] <= len(flat)
                and ((rpi >= 0) & (rpi < rows)).all())


def _hostile_fuzz(sgl, bucket, n_cases, seed, implementation):
    """Ours against the jnp reference on every case, and against SGLang's reference wherever it
    is defined (a ``max_context_len`` below the width given to SGLang as the column-sliced
    pool, as the bridge does), exact where the implementation keeps request order; and on every
    implementation, every cell against its candidate writers (:mod:`_races`): cells that two or
    more requests write (duplicate rows are drawn on purpose) hold one writer's value, all
    others are exact."""
    from kvcanary_jax.ops.scatter import base

    bs, n, rows, cols = FUZZ_BUCKETS[bucket]
    rng = np.random.default_rng(seed)
    # The draw covers each kind of case (a short run: the cases that do, _tier.Coverage).
    cover = _tier.Coverage(f"scatter hostile fuzz, bucket {bucket}", seed, n_cases,
                           ("hostile", "clean", "sglang", "race"))
    for i in cover.draws():
        hostile, flat, offsets, rpi, pool, max_cols = _hostile_case(rng, bs, n, rows, cols)
        writes = _races.scatter_writes(flat, offsets, rpi, pool.shape, max_cols)
        kinds = dict(hostile=hostile, clean=not hostile,
                     sglang=_sglang_defined(flat, offsets, rpi, rows),
                     race=_races.contested_cells(writes, pool.shape) > 0)
        if not cover.wants(**kinds):
            continue
        with _tier.case("scatter hostile fuzz", seed, i, bucket=bucket,
                        implementation=implementation, hostile=hostile, max_cols=max_cols):
            got = _ours(implementation, flat, offsets, rpi, pool, max_context_len=max_cols)
            with jax.enable_x64(True):
                want = np.asarray(base.reference(
                    base.ScatterInputs(flat_in=jnp.asarray(flat), offsets=jnp.asarray(offsets),
                                       req_pool_indices=jnp.asarray(rpi),
                                       pool_out=jnp.asarray(pool)), max_cols=max_cols))
            if kinds["sglang"]:
                w = cols if max_cols is None else max_cols
                sg = pool.copy()
                sg[:, :w] = oracle(sgl, flat, offsets, rpi, np.ascontiguousarray(pool[:, :w]))
                np.testing.assert_array_equal(want, sg)
            _races.assert_scatter_outcome(got, pool, writes)
            if _impls.in_reference_order(implementation):
                np.testing.assert_array_equal(got, want)
            assert (got[:GUARD] == MARK).all() and (got[-GUARD:] == MARK).all()
        cover.ran(**kinds)
    cover.check()
    return cover.runs


@pytest.mark.fuzz
@pytest.mark.parametrize("bucket", range(len(FUZZ_BUCKETS)))
@pytest.mark.parametrize("impl", _impls.with_tpu("scatter"))
def test_hostile_fuzz(sgl, impl, bucket):
    n = FUZZ_TPU_INTERPRETED if _impls.tpu_interpreted(impl) else FUZZ_CASES
    _hostile_fuzz(sgl, bucket, n, 500 + bucket, impl)


def test_short_hostile_fuzz_checks_its_coverage(sgl, monkeypatch):
    """TPU interpret mode's short hostile fuzz (FUZZ_TPU_INTERPRETED cases) runs the coverage
    check too: its cases cover every kind (xla standing in for the interpreter here), and a
    stream that lacks a kind fails it."""
    assert _hostile_fuzz(sgl, 0, FUZZ_TPU_INTERPRETED, 500, "xla") >= 2
    drawn = _hostile_case
    monkeypatch.setitem(globals(), "_hostile_case", lambda *a: (False, *drawn(*a)[1:]))
    with pytest.raises(AssertionError, match="no case of kind"):
        _hostile_fuzz(sgl, 0, FUZZ_TPU_INTERPRETED, 500, "xla")


@pytest.mark.slow
@pytest.mark.tpu_interpret
@pytest.mark.parametrize("bucket", range(len(FUZZ_BUCKETS)))
def test_hostile_fuzz_tpu_interpreted_long(sgl, bucket):
    _hostile_fuzz(sgl, bucket, LONG_CASES, 600 + bucket, _impls.TPU)


@pytest.mark.slow
@pytest.mark.tpu_interpret
def test_tpu_more_requests_than_sglang_allows(sgl):
    """SGLang 0.5.23 refuses bs > 511; the TPU kernel keeps a batch's offsets in SMEM (16 bytes a
    request) and takes thousands."""
    rng = np.random.default_rng(4)
    bs = 600
    lens = rng.integers(0, 5, bs)
    offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    flat = rng.integers(0, 50000, offsets[-1]).astype(np.int64)
    rpi = rng.permutation(bs + 1)[:bs].astype(np.int64)
    pool = np.full((bs + 1, 4), MARK, np.int32)
    np.testing.assert_array_equal(_ours(_impls.TPU, flat, offsets, rpi, pool),
                                  oracle(sgl, flat, offsets, rpi, pool))
