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
