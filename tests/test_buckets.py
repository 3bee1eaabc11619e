"""Shape buckets for JAX serving loops (``kvcanary_jax.buckets``): padding a token array to its
bucket and clamping the offsets that index it gives the unpadded op's result, byte for byte."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvcanary_jax as kc
from kvcanary_jax import buckets


def test_bucket_and_pad():
    assert [buckets.bucket(n, floor=8) for n in (1, 8, 9, 17)] == [8, 8, 16, 32]
    with jax.enable_x64(True):
        x = buckets.pad(jnp.arange(5, dtype=jnp.int64), 8, fill=-1)
        assert x.tolist() == [0, 1, 2, 3, 4, -1, -1, -1]
    with pytest.raises(ValueError, match="cannot pad length 5 down to 4"):
        buckets.pad(np.arange(5), 4)


def test_padded_scatter_with_clamped_offsets_equals_the_unpadded_op():
    rng = np.random.default_rng(0)
    with jax.enable_x64(True):
        for n in (3, 50, 64, 100):
            flat = rng.integers(-(2**40), 2**40, n)
            offsets = np.sort(rng.integers(-3, n + 20, 5))  # some past the end
            rows = rng.permutation(6)[:4]
            pool = rng.integers(-9, 9, (6, 32)).astype(np.int32)
            want = kc.scatter_req_token_ids(flat_in=flat, offsets=offsets, req_pool_indices=rows,
                                            pool_out=pool)
            got = kc.scatter_req_token_ids(
                flat_in=buckets.pad(flat, buckets.bucket(n), fill=12345),
                offsets=jnp.minimum(offsets, n), req_pool_indices=rows, pool_out=pool)
            assert np.array_equal(np.asarray(got), np.asarray(want)), n
