"""Hash primitives and constants against SGLang's ``consts`` (bit-identical int64 patterns)."""

from __future__ import annotations

import functools

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from jax.experimental import pallas as pl

from kvcanary_jax import consts, hashing
from kvcanary_jax.context import SourceSpec
from kvcanary_jax.ops import _kernel_lib

# Pallas kernels run compiled on a GPU, in interpret mode elsewhere.
INTERPRET = jax.default_backend() != "gpu"

U64 = (1 << 64) - 1
EDGES = [0, 1, -1, 2**63 - 1, -(2**63), consts.CANARY_CHAIN_ANCHOR - 2**64, 12345,
         -2414019407054260458]


def _ref_i64(sgl, fn, *xs):
    return hashing.to_i64(fn(*(x & U64 for x in xs)))


def _random_i64(rng, n):
    return rng.integers(-(2**63), 2**63 - 1, n, dtype=np.int64, endpoint=True)


def test_constants_equal_sglangs(sgl):
    names = [n for n in dir(sgl.consts) if n.isupper() and not n.startswith("_")]
    assert names
    for name in names:
        assert getattr(consts, name) == getattr(sgl.consts, name), name
    for ours, theirs in [(consts.FailReason, sgl.consts.FailReason),
                         (consts.RealKvHashMode, sgl.consts.RealKvHashMode),
                         (consts.CanaryLaunchTag, sgl.verify.CanaryLaunchTag)]:
        assert {m.name: int(m) for m in ours} == {m.name: int(m) for m in theirs}
    assert issubclass(consts.FailReason, __import__("enum").IntFlag)
    assert consts.CANARY_SLOT_BYTES == sgl.verify.CANARY_SLOT_BYTES == 32


def test_worked_examples():
    # Hand-checked values (u64 hex as published; int64 as stored).
    assert hashing.splitmix64_int(0) == 0
    assert hashing.splitmix64_int(1) == 0x5692161D100B05E5
    assert hashing.ANCHOR_HASH_I64 == hashing.to_i64(0xDE7FAE23A9A1B716) == -2414019407054260458
    assert hashing.splitmix64_int(-1) == hashing.to_i64(0xB4D055FCF2CBBD7B)
    assert hashing.mix3_int(1, 2, 3) == hashing.to_i64(0xA55BDF37C08724B5)
    assert hashing.mix3_int(-1, -1, -1) == 8462885795267122651
    assert hashing.mix3_int(hashing.ANCHOR_HASH_I64, 100, 0) == -4923688959175860244


def test_splitmix64_edges_and_random(sgl):
    rng = np.random.default_rng(0)
    xs = np.concatenate([np.array(EDGES, np.int64), _random_i64(rng, 100_000)])
    with jax.enable_x64(True):
        got = np.asarray(jax.jit(hashing.splitmix64)(jnp.asarray(xs)))
    want = np.array([_ref_i64(sgl, sgl.consts.splitmix64, int(x)) for x in xs], np.int64)
    np.testing.assert_array_equal(got, want)
    assert [hashing.splitmix64_int(int(x)) for x in xs[:1000]] == list(want[:1000])


def test_mix3_random(sgl):
    rng = np.random.default_rng(1)
    a, b, c = (np.concatenate([np.array(EDGES, np.int64), _random_i64(rng, 20_000)])
               for _ in range(3))
    with jax.enable_x64(True):
        got = np.asarray(jax.jit(hashing.mix3)(jnp.asarray(a), jnp.asarray(b), jnp.asarray(c)))
    want = np.array([_ref_i64(sgl, sgl.consts.splitmix64_mix3, int(x), int(y), int(z))
                     for x, y, z in zip(a, b, c)], np.int64)
    np.testing.assert_array_equal(got, want)


def _hash_kernel(x_ref, o_ref, m_ref):
    x = x_ref[...]
    o_ref[...] = hashing.splitmix64(x)
    m_ref[...] = hashing.mix3(x, x ^ 0x5555, -x)


def test_inside_a_pallas_kernel(sgl):
    rng = np.random.default_rng(2)
    xs = np.concatenate([np.array(EDGES, np.int64), _random_i64(rng, 1024 - len(EDGES))])
    with jax.enable_x64(True):
        o, m = pl.pallas_call(
            _hash_kernel,
            out_shape=[jax.ShapeDtypeStruct(xs.shape, jnp.int64)] * 2,
            interpret=INTERPRET,
        )(jnp.asarray(xs))
    np.testing.assert_array_equal(
        np.asarray(o), [_ref_i64(sgl, sgl.consts.splitmix64, int(x)) for x in xs])
    np.testing.assert_array_equal(
        np.asarray(m), [_ref_i64(sgl, sgl.consts.splitmix64_mix3, int(x), int(x) ^ 0x5555,
                                 -int(x)) for x in xs])


def _fold_kernel(slots_ref, words_ref, out_ref, *, spec, mode):
    slots = slots_ref[...]
    out_ref[...] = _kernel_lib.fold_real_kv(slots, slots >= 0, (words_ref,), (spec,), mode)


@pytest.mark.parametrize("mode,label,want", [
    (2, "bytes 0..15", -2965813710295743732),
    (1, "bytes 0..31 (PARTIAL reads 16)", -2965813710295743732),
    (2, "bytes 0..31", -5457938474705223623),
])
def test_real_kv_fold_hand_checked(mode, label, want):
    nbytes = 16 if label == "bytes 0..15" else 32
    row = np.arange(nbytes, dtype=np.uint8)
    u8 = np.tile(row, (4, 1))
    words = u8.view(np.int64).reshape(-1)
    spec = SourceSpec(word_offset=0, row_stride_words=nbytes // 8, num_rows=4, page_size=1,
                      nbpt_words=nbytes // 8, read_words=nbytes // 8)
    with jax.enable_x64(True):
        out = pl.pallas_call(
            functools.partial(_fold_kernel, spec=spec, mode=mode),
            out_shape=jax.ShapeDtypeStruct((4,), jnp.int64),
            interpret=INTERPRET,
        )(jnp.array([0, 3, -1, 7], jnp.int64), jnp.asarray(words))
    # slot -1 and slot 7 (row past the source) read zero words: fingerprint 0.
    assert np.asarray(out).tolist() == [want, want, 0, 0]


@pytest.mark.parametrize("prefetch", [1, 3, 8, 64])
def test_real_kv_fold_does_not_depend_on_prefetch(prefetch):
    """Words loaded ahead (``prefetch``, what the GPU kernels use) or one at a time, chunks that
    divide the strip or leave a remainder: the fold is the word-by-word chain
    ``h = splitmix64(h ^ w)`` over the slot's words, here in Python integers."""
    rng = np.random.default_rng(prefetch)
    buf = rng.integers(-2**63, 2**63 - 1, 4000, dtype=np.int64)
    slots = rng.integers(-3, 60, 64)
    mask = rng.random(64) < 0.8
    for words in (2, 5, 8, 13, 32, 33):
        spec = SourceSpec(word_offset=3, row_stride_words=words + 7, num_rows=50, page_size=1,
                          nbpt_words=words, read_words=words)
        want = []
        for s, m in zip(slots.tolist(), mask.tolist()):
            if not (m and 0 <= s < 50):
                want.append(0)
                continue
            h = 0
            for w in range(words):
                h = hashing.splitmix64_int(h ^ int(buf[3 + s * (words + 7) + w]))
            want.append(hashing.splitmix64_int(h))  # acc = splitmix64(0 ^ h), one source
        with jax.enable_x64(True):
            got = hashing.fold_real_kv(jnp.asarray(slots), jnp.asarray(mask), [jnp.asarray(buf)],
                                       [spec], int(consts.RealKvHashMode.ALL), prefetch=prefetch)
        assert np.asarray(got).tolist() == want, words


# --- the 32-bit-pair hash (hashing_u32): what the Mosaic TPU kernels compute --------------------


def _pairs(xs):
    from kvcanary_jax import hashing_u32

    return hashing_u32.from_i64(jnp.asarray(xs, jnp.int64))


def test_pair_hash_splitmix64_edges_and_100k_random(sgl):
    from kvcanary_jax import hashing_u32

    rng = np.random.default_rng(10)
    xs = np.concatenate([np.array(EDGES, np.int64), _random_i64(rng, 100_000)])
    with jax.enable_x64(True):
        got = np.asarray(hashing_u32.to_i64(jax.jit(hashing_u32.splitmix64)(_pairs(xs))))
    want = np.array([_ref_i64(sgl, sgl.consts.splitmix64, int(x)) for x in xs], np.int64)
    np.testing.assert_array_equal(got, want)


def test_pair_hash_mix3_random(sgl):
    from kvcanary_jax import hashing_u32

    rng = np.random.default_rng(11)
    a, b, c = (np.concatenate([np.array(EDGES, np.int64), _random_i64(rng, 20_000)])
               for _ in range(3))
    with jax.enable_x64(True):
        mix3 = jax.jit(hashing_u32.mix3)
        got = np.asarray(hashing_u32.to_i64(mix3(_pairs(a), _pairs(b), _pairs(c))))
    want = np.array([_ref_i64(sgl, sgl.consts.splitmix64_mix3, int(x), int(y), int(z))
                     for x, y, z in zip(a, b, c)], np.int64)
    np.testing.assert_array_equal(got, want)


def test_pair_arithmetic_against_int64():
    """Additions, subtractions, negation, comparisons, shifts and constant products on pairs
    equal int64 arithmetic (two's complement, wrapping) on edges and random values."""
    from kvcanary_jax import hashing_u32

    rng = np.random.default_rng(12)
    x = np.concatenate([np.array(EDGES * 2, np.int64), _random_i64(rng, 5000)])
    y = np.concatenate([np.array(EDGES[::-1] * 2, np.int64), _random_i64(rng, 5000)])
    c = int(rng.integers(-(2**63), 2**63 - 1))
    with jax.enable_x64(True):
        px, py = _pairs(x), _pairs(y)
        i64 = lambda p: np.asarray(hashing_u32.to_i64(p))  # noqa: E731
        np.testing.assert_array_equal(i64(hashing_u32.add(px, py)), x + y)
        np.testing.assert_array_equal(i64(hashing_u32.sub(px, py)), x - y)
        np.testing.assert_array_equal(i64(hashing_u32.neg(px)), -x)
        np.testing.assert_array_equal(i64(hashing_u32.mul_const(px, c)), x * np.int64(c))
        np.testing.assert_array_equal(np.asarray(hashing_u32.lt(px, py)), x < y)
        np.testing.assert_array_equal(np.asarray(hashing_u32.is_neg(px)), x < 0)
        np.testing.assert_array_equal(np.asarray(hashing_u32.eq(px, py)), x == y)
        for n in (1, 27, 30, 31):
            np.testing.assert_array_equal(i64(hashing_u32.shr(px, n)),
                                          (x.view(np.uint64) >> np.uint64(n)).view(np.int64))
        lo = x.astype(np.int32)
        np.testing.assert_array_equal(i64(hashing_u32.from_i32(jnp.asarray(lo))),
                                      lo.astype(np.int64))
    assert hashing_u32.join_int(*hashing_u32.ANCHOR_HASH) == hashing.ANCHOR_HASH_I64


def _pair_hash_kernel(n_ref, x_ref, s_in, o_ref, m_ref, s_ref):
    """splitmix64 and mix3 on the vector unit (lane-dense planes), and splitmix64 of the first
    n entries on the scalar unit (a loop over SMEM), as the TPU kernels run them."""
    from kvcanary_jax import hashing_u32

    hi, lo = x_ref[0].astype(jnp.uint32), x_ref[1].astype(jnp.uint32)
    h = hashing_u32.splitmix64((hi, lo))
    o_ref[0], o_ref[1] = h[0].astype(jnp.int32), h[1].astype(jnp.int32)
    m = hashing_u32.mix3((hi, lo), (hi ^ jnp.uint32(0x5555), lo), hashing_u32.neg((hi, lo)))
    m_ref[0], m_ref[1] = m[0].astype(jnp.int32), m[1].astype(jnp.int32)

    def one(i, c):
        p = hashing_u32.splitmix64((s_in[0, i].astype(jnp.uint32), s_in[1, i].astype(jnp.uint32)))
        s_ref[0, i] = p[0].astype(jnp.int32)
        s_ref[1, i] = p[1].astype(jnp.int32)
        return c

    jax.lax.fori_loop(0, n_ref[0], one, 0)


def _run_pair_kernel(xs, n_scalar, interpret):
    from jax.experimental.pallas import tpu as pltpu

    from kvcanary_jax.ops import _tpu_lib

    w = jax.lax.bitcast_convert_type(jnp.asarray(xs, jnp.int64), jnp.int32)  # [n, 2]: lo, hi
    planes = jnp.stack([w[:, 1], w[:, 0]]).reshape(2, -1, 128)
    scalars = jnp.stack([w[:n_scalar, 1], w[:n_scalar, 0]])
    o, m, s = _tpu_lib.call(
        _pair_hash_kernel, jnp.array([n_scalar], jnp.int32), planes, scalars,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=(1,),
            in_specs=[pl.BlockSpec(memory_space=pltpu.VMEM),
                      pl.BlockSpec(memory_space=pltpu.SMEM)],
            out_specs=[pl.BlockSpec(memory_space=pltpu.VMEM)] * 2 +
            [pl.BlockSpec(memory_space=pltpu.SMEM)]),
        out_shape=[jax.ShapeDtypeStruct(planes.shape, jnp.int32)] * 2 +
        [jax.ShapeDtypeStruct(scalars.shape, jnp.int32)],
        interpret=interpret)
    join = lambda hi, lo: jax.lax.bitcast_convert_type(  # noqa: E731
        jnp.stack([lo.reshape(-1), hi.reshape(-1)], -1), jnp.int64)
    return join(o[0], o[1]), join(m[0], m[1]), join(s[0], s[1])


@pytest.mark.tpu_interpret
def test_pair_hash_in_a_tpu_kernel_vector_and_scalar_units(sgl):
    """The 100,000 random values of the test above (and the edges) through a Mosaic TPU kernel in
    TPU interpret mode: vector splitmix64 / mix3 on all, scalar splitmix64 on the first 512."""
    from kvcanary_jax.ops import _tpu_lib

    rng = np.random.default_rng(10)
    xs = np.concatenate([np.array(EDGES, np.int64), _random_i64(rng, 100_000)])
    xs = np.concatenate([xs, np.zeros(-len(xs) % 1024, np.int64)])
    with jax.enable_x64(True):
        o, m, s = (np.asarray(v) for v in _run_pair_kernel(xs, 512,
                                                           _tpu_lib.interpret_params()))
    np.testing.assert_array_equal(
        o, [_ref_i64(sgl, sgl.consts.splitmix64, int(x)) for x in xs])
    np.testing.assert_array_equal(s, o[:512])
    np.testing.assert_array_equal(
        m[:5000], [_ref_i64(sgl, sgl.consts.splitmix64_mix3, int(x), int(x) ^ (0x5555 << 32),
                            -int(x)) for x in xs[:5000]])


@pytest.mark.parametrize("device_kind", ["TPU v5 lite", "TPU v6 lite"])
def test_pair_hash_kernel_lowers_for_tpu(device_kind):
    xs = jax.ShapeDtypeStruct((1024,), jnp.int64)
    with jax.enable_x64(True), _tpu_lowering(device_kind):
        text = jax.jit(lambda x: _run_pair_kernel(x, 512, False)).trace(xs).lower(
            lowering_platforms=("tpu",)).as_text()
    assert "tpu_custom_call" in text


def _tpu_lowering(kind):
    from kvcanary_jax.ops import _tpu_lib

    return _tpu_lib.tpu_lowering(kind)
