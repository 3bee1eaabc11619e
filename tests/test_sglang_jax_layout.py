"""kvcanary_jax.integrations.sglang_jax without sglang-jax: the fused-KV sources of both layouts
against hand-computed fingerprints, the device batch built from cache_loc against hand-laid
tables, the host helpers, and the errors. (The real package: tests/test_sglang_jax.py.)"""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

import kvcanary_jax as kc
from kvcanary_jax.hashing import splitmix64_int, to_i64
from kvcanary_jax.integrations import sglang_jax as ksj

HEADS, HEAD_DIM, SLOTS, PAGE = 2, 8, 12, 4  # bf16: one K strip is 16 bytes, two 8-byte words


def _fused_buffer() -> np.ndarray:
    """0.0.2 layout [slots, heads * 2, head_dim], distinct bf16 values everywhere."""
    vals = np.arange(SLOTS * 2 * HEADS * HEAD_DIM, dtype=np.float32).reshape(SLOTS, 2 * HEADS,
                                                                               HEAD_DIM)
    return np.asarray(jnp.asarray(vals * 0.25 - 7.0, jnp.bfloat16))


def _head_layout(buf: np.ndarray) -> np.ndarray:
    """The same bytes in sglang-jax HEAD's layout [pages, page_size, heads*2/2, 2, head_dim]."""
    return buf.reshape(SLOTS // PAGE, PAGE, HEADS, 2, HEAD_DIM)


def _hand_fingerprint(buf3: np.ndarray, slot: int, k_heads: int) -> int:
    """Spec 2.4 in ALL mode over sources = K strips of heads 0 .. k_heads-1 (fused row 2h)."""
    acc = 0
    for h in range(k_heads):
        strip = np.ascontiguousarray(buf3[slot, 2 * h]).view(np.uint64)
        inner = 0
        for w in strip.tolist():
            inner = splitmix64_int(inner ^ w)
        acc = splitmix64_int(acc ^ inner)
    return to_i64(acc)


def _written_fingerprints(buffer, k_heads: int) -> np.ndarray:
    """Write one chain over every slot but 0 with the buffer's sources; field 3 of each slot."""
    with jax.enable_x64(True):
        ctx = kc.VerifyOrWriteContext.allocate(
            num_slots=SLOTS, kernel_kind=kc.CanaryLaunchTag.TAIL_K_FULL,
            real_kv_sources=ksj.fused_kv_sources(jnp.asarray(buffer), k_heads=k_heads),
            real_kv_hash_mode=kc.RealKvHashMode.ALL)
        n = SLOTS - 1
        plan = kc.WritePlan(write_offsets=jnp.array([0, n], jnp.int64),
                            write_seed_slot_indices=jnp.array([-1], jnp.int64),
                            write_num_valid_reqs=jnp.array([1], jnp.int32))
        ctx = kc.canary_write(context=ctx, plan=plan, input_ids=jnp.arange(n, dtype=jnp.int64),
                              positions=jnp.arange(n, dtype=jnp.int64),
                              out_cache_loc=jnp.arange(1, SLOTS, dtype=jnp.int64),
                              enable_write_input_assert=False, expected_input_tokens=None,
                              expected_input_positions=None)
        return np.asarray(ctx.canary_buf).view(np.int64)[:, 3]


@pytest.mark.parametrize("k_heads", [1, 2])
def test_both_layouts_fingerprint_exactly_the_k_strips(k_heads):
    buf = _fused_buffer()
    want = [0] + [_hand_fingerprint(buf, s, k_heads) for s in range(1, SLOTS)]
    assert _written_fingerprints(buf, k_heads).tolist() == want
    assert _written_fingerprints(_head_layout(buf), k_heads).tolist() == want

    # V strips, and K strips of heads not fingerprinted, do not enter the fingerprint.
    other = buf.copy()
    other[:, 1::2] = 0  # every V strip
    if k_heads == 1:
        other[:, 2] = 0  # K of head 1
    assert _written_fingerprints(other, k_heads).tolist() == want
    # One bit of a fingerprinted K strip does.
    flipped = buf.copy()
    flipped.view(np.uint16)[5, 2 * (k_heads - 1), 3] ^= 1
    got = _written_fingerprints(flipped, k_heads)
    assert got[5] != want[5] and np.delete(got, 5).tolist() == np.delete(want, 5).tolist()


def test_sources_are_views_of_the_buffer_itself():
    buf = jnp.asarray(_head_layout(_fused_buffer()))
    srcs = ksj.fused_kv_sources(buf, k_heads=2)
    assert [s.tensor is buf for s in srcs] == [True, True]
    assert [(s.page_size, s.num_bytes_per_token, s.read_bytes, s.offset_bytes) for s in srcs] == [
        (1, 16, 16, 0), (1, 16, 16, 32)]
    assert srcs[1].view.shape == (SLOTS, HEAD_DIM) and srcs[1].view.strides == (2 * HEADS * HEAD_DIM, 1)


def test_source_errors():
    with pytest.raises(ValueError, match=r"fused KV buffer is .* got shape \(12, 32\)"):
        ksj.fused_kv_sources(jnp.zeros((12, 32), jnp.bfloat16))
    with pytest.raises(ValueError, match=r"k_heads must be in \[1, 2\] .* got 3"):
        ksj.fused_kv_sources(jnp.zeros((12, 4, 8), jnp.bfloat16), k_heads=3)
    with pytest.raises(ValueError, match=r"k_heads must be in \[1, 4\] .* got 5"):
        ksj.fused_kv_sources(jnp.zeros((12, 16, 8), jnp.bfloat16), k_heads=5)


class _Mode:
    """sglang-jax's ForwardMode predicates, for a hand-built batch."""

    def __init__(self, decode: bool):
        self.decode = decode

    def is_decode(self):
        return self.decode

    def is_extend(self):
        return not self.decode


def _canary(**kw):
    return ksj.SglangJaxCanary(num_slots=64, page_size=PAGE, context_len=10, max_bs=4, **kw)


def test_extend_batch_from_cache_loc():
    # Two requests and two padding rows (sglang-jax pads req_pool_indices with -1, seq_lens 0):
    # request 0: 3 cached + 2 new tokens (slots 8..12), request 1: 0 cached + 2 new (16, 17).
    seq = np.array([5, 2, 0, 0], np.int32)
    cache_loc = np.zeros((16,), np.int32)
    cache_loc[0:5] = [8, 9, 10, 11, 12]  # segment of request 0: 8 entries (page-aligned)
    cache_loc[8:10] = [16, 17]  # request 1's segment starts at 8
    ids = ksj.expected_tokens([[100, 101, 102, 103, 104], [200, 201]], seq, 16, PAGE)
    assert ids.tolist() == [100, 101, 102, 103, 104, 0, 0, 0, 200, 201] + [0] * 6
    fb = types.SimpleNamespace(
        forward_mode=_Mode(decode=False), seq_lens=jnp.asarray(seq),
        req_pool_indices=jnp.array([0, 3, -1, -1], jnp.int32), cache_loc=jnp.asarray(cache_loc),
        extend_prefix_lens=jnp.array([3, 0, 0, 0], jnp.int32),
        extend_seq_lens=jnp.array([2, 2, 0, 0], jnp.int32),
        input_ids=jnp.array([103, 104, 200, 201, 0, 0], jnp.int32),
        positions=jnp.array([3, 4, 0, 1, 0, 0], jnp.int32),
        out_cache_loc=jnp.array([11, 12, 16, 17, -1, -1], jnp.int32))
    with jax.enable_x64(True):
        batch, table = ksj.canary_batch(_canary(), fb, expected=jnp.asarray(ids))
        table = np.asarray(table)
        assert table.shape == (5, 10)
        assert table[0].tolist() == [0] * 10
        assert table[1].tolist() == [8, 9, 10, 11, 12] + [0] * 5
        assert table[2].tolist() == [16, 17] + [0] * 8
        assert not table[3:].any()
        assert np.asarray(batch.req_pool_indices).tolist() == [1, 2, 0, 0]
        assert np.asarray(batch.prefix_lens).tolist() == [3, 0, 0, 0]
        assert np.asarray(batch.extend_seq_lens).tolist() == [2, 2, 0, 0]
        assert np.asarray(batch.all_ids_offsets).tolist() == [0, 5, 7, 7, 7]
        assert np.asarray(batch.all_ids_flat)[:7].tolist() == [100, 101, 102, 103, 104, 200, 201]
        assert np.asarray(batch.expected_input_tokens)[:4].tolist() == [103, 104, 200, 201]
        assert np.asarray(batch.expected_input_positions)[:4].tolist() == [3, 4, 0, 1]
        assert np.asarray(batch.out_cache_loc).dtype == np.int64


def test_decode_batch_from_cache_loc_and_host_table():
    seq = np.array([6, 1, 0], np.int32)  # decode: the new token is the last position
    cache_loc = np.zeros((12,), np.int32)
    cache_loc[0:6] = [20, 21, 22, 23, 24, 25]
    cache_loc[8] = 32
    fb = types.SimpleNamespace(
        forward_mode=_Mode(decode=True), seq_lens=jnp.asarray(seq),
        cache_loc=jnp.asarray(cache_loc), extend_prefix_lens=None, extend_seq_lens=None,
        input_ids=jnp.array([7, 9, 0], jnp.int32), positions=jnp.array([5, 0, 0], jnp.int32),
        out_cache_loc=jnp.array([25, 32, -1], jnp.int32))
    with jax.enable_x64(True):
        batch, table = ksj.canary_batch(_canary(token_checks=False), fb)
        assert np.asarray(batch.prefix_lens).tolist() == [5, 0, 0]
        assert np.asarray(batch.extend_seq_lens).tolist() == [1, 1, 0]
        assert np.asarray(batch.req_pool_indices).tolist() == [1, 2, 0]
    req_to_token = np.zeros((6, 10), np.int32)
    req_to_token[4, :6] = [20, 21, 22, 23, 24, 25]
    req_to_token[0, :1] = [32]  # sglang-jax's row 0 is a real row
    host = ksj.host_table(req_to_token, [4, 0, -1], seq, 10)
    assert host.tolist() == np.asarray(table).tolist()


def test_batch_errors():
    fb = types.SimpleNamespace(forward_mode=_Mode(decode=True), seq_lens=jnp.zeros((5,), jnp.int32))
    with jax.enable_x64(True), pytest.raises(ValueError, match="batch of 5 rows exceeds max_bs=4"):
        ksj.canary_batch(_canary(), fb)
    fb = types.SimpleNamespace(
        forward_mode=_Mode(decode=True), seq_lens=jnp.ones((2,), jnp.int32),
        cache_loc=jnp.ones((8,), jnp.int32), input_ids=jnp.ones((2,), jnp.int32),
        positions=jnp.zeros((2,), jnp.int32), out_cache_loc=jnp.ones((2,), jnp.int32))
    with jax.enable_x64(True), pytest.raises(ValueError, match="token_checks needs `expected`"):
        ksj.canary_batch(_canary(), fb)
    with pytest.raises(ValueError, match="request 0 has 1 token ids for seq_len 2"):
        ksj.expected_tokens([[5]], [2], 8, PAGE)


def test_slot_dimension_sharded_over_data_is_refused():
    mesh = types.SimpleNamespace(shape={"data": 2, "tensor": 1})  # only its axis sizes are read
    with pytest.raises(NotImplementedError, match=r"slot dimension is sharded over \['data'\]"):
        _canary(mesh=mesh, kv_spec=P("data", None, "tensor", None, None))
    one = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "tensor"))
    canary = _canary(mesh=one, kv_spec=P("data", None, "tensor", None, None))
    assert canary.axes == ("tensor",) and canary.num_shards == 1
