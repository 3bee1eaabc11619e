"""kvcanary_jax.integrations.sglang_jax without sglang-jax: the fused-KV sources of both layouts
against hand-computed fingerprints, the device batch built from cache_loc against hand-laid
tables, the host helpers, and the errors. (The real package: tests/test_sglang_jax.py.)"""

from __future__ import annotations

import dataclasses
import types
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

import kvcanary_jax as kc
from kvcanary_jax.hashing import splitmix64_int, to_i64
from kvcanary_jax.integrations import sglang_jax as ksj
from kvcanary_jax.integrations.sglang_jax import batch as sjb
from kvcanary_jax.testing import cases

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
        plan = cases.jax_write_plan(write_offsets=[0, n], write_seed_slot_indices=[-1],
                                    write_num_valid_reqs=1)
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


def _extend_fb(seq, cache_loc, rows):
    """An extend batch of two requests: 0 has 3 cached + 2 new tokens (103, 104 into slots 11,
    12), 1 has 2 new (200, 201 into 16, 17); sglang-jax's padding rows are -1 / length 0."""
    return types.SimpleNamespace(
        forward_mode=_Mode(decode=False), seq_lens=jnp.asarray(seq),
        req_pool_indices=jnp.array(rows, jnp.int32), cache_loc=jnp.asarray(cache_loc),
        extend_prefix_lens=jnp.array([3, 0, 0, 0], jnp.int32),
        extend_seq_lens=jnp.array([2, 2, 0, 0], jnp.int32),
        input_ids=jnp.array([103, 104, 200, 201, 0, 0], jnp.int32),
        positions=jnp.array([3, 4, 0, 1, 0, 0], jnp.int32),
        out_cache_loc=jnp.array([11, 12, 16, 17, -1, -1], jnp.int32))


def test_extend_batch_from_cache_loc():
    # Two requests and two padding rows (sglang-jax pads req_pool_indices with -1, seq_lens 0):
    # request 0: 3 cached + 2 new tokens (slots 8..12), request 1: 0 cached + 2 new (16, 17).
    seq = np.array([5, 2, 0, 0], np.int32)
    cache_loc = np.zeros((16,), np.int32)
    cache_loc[0:5] = [8, 9, 10, 11, 12]  # segment of request 0: 8 entries (page-aligned)
    cache_loc[8:10] = [16, 17]  # request 1's segment starts at 8
    ids = ksj.expected_tokens([[100, 101, 102, 103, 104], [200, 201]], seq, 16, PAGE)
    assert ids.tolist() == [100, 101, 102, 103, 104, 0, 0, 0, 200, 201] + [0] * 6
    fb = _extend_fb(seq, cache_loc, [0, 3, -1, -1])
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


def test_slot_dimension_sharded_over_data_gives_one_canary_per_rank():
    """sglang-jax 0.1.0rc0's DP layout (slots sharded over ``data``): one canary per DP rank and
    head shard, shard ``i`` of rank ``i // head_shards`` (the step splits the batch per rank:
    tests/test_sglang_jax.py's DP life)."""
    mesh = types.SimpleNamespace(shape={"data": 2, "tensor": 3})  # only its axis sizes are read
    canary = _canary(mesh=mesh, kv_spec=P("data", None, "tensor", None, None))
    assert canary.axes == ("data", "tensor") and canary.dp_axes == ("data",)
    assert (canary.dp_size, canary.head_shards, canary.num_shards) == (2, 3, 6)
    assert [canary.dp_rank(i) for i in range(6)] == [0, 0, 0, 1, 1, 1]
    one = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "tensor"))
    canary = _canary(mesh=one, kv_spec=P("data", None, "tensor", None, None))
    assert canary.axes == ("data", "tensor") and canary.num_shards == 1
    with pytest.raises(ValueError, match=r"names mesh axes \['expert'\] that the mesh"):
        _canary(mesh=mesh, kv_spec=P("expert", None, "tensor", None, None))


def test_per_rank_host_layouts():
    """With DP every host array is one segment per rank, each laid out as a batch of its own."""
    ids = ksj.expected_tokens([[[5, 6, 7]], [[8, 9]]], [3, 0, 2, 0], 16, PAGE, dp_size=2)
    want = np.zeros(16, np.int32)
    want[:3], want[8:10] = [5, 6, 7], [8, 9]
    assert ids.tolist() == want.tolist()
    table = np.arange(40, dtype=np.int32).reshape(4, 10)
    got = ksj.host_table(table, [1, -1, 3, -1], [2, 0, 3, 0], 10, dp_size=2)
    assert got.shape == (6, 10)
    assert got[1, :2].tolist() == [10, 11] and got[4, :3].tolist() == [30, 31, 32]
    assert not got[[0, 2, 3, 5]].any()
    with pytest.raises(ValueError, match="token_ids is one list per rank"):
        ksj.expected_tokens([[[5, 6, 7]]], [3, 0, 2, 0], 16, PAGE, dp_size=2)
    with pytest.raises(ValueError, match="token_ids\\[d\\] is DP rank d's list of requests"):
        ksj.expected_tokens([[5, 6, 7], [8, 9]], [3, 0, 2, 0], 16, PAGE, dp_size=2)
    with pytest.raises(ValueError, match="seq_lens has 3 entries, not 2 equal segments"):
        ksj.expected_tokens([[[5]], [[8]]], [1, 0, 1], 16, PAGE, dp_size=2)


def _req(rid, prompt, output=()):
    return types.SimpleNamespace(rid=rid, origin_input_ids=list(prompt), output_ids=list(output))


def _mwb(rows, seq, *, extend=None, ntok=4, nloc=16):
    """What a TokenFeed reads of sglang-jax's ModelWorkerBatch (padded: rows -1, lengths 0)."""
    return types.SimpleNamespace(
        forward_mode=_Mode(decode=extend is None), req_pool_indices=np.array(rows, np.int32),
        seq_lens=np.array(seq, np.int32),
        extend_seq_lens=None if extend is None else np.array(extend, np.int32),
        input_ids=np.zeros((ntok,), np.int32), cache_loc=np.zeros((nloc,), np.int32))


class _Steps:
    """The guarded step's host side around steps that ran: each delta as sent to the state, then
    recorded for the state the step returned (a fresh state here: the feed reads only which
    expected-token pool it is, never its contents)."""

    def __init__(self, feed):
        self.feed = feed
        self.state = feed.canary.init_state()

    def run(self, delta, batch, state=None):
        state = self.state if state is None else state
        sent = self.feed.prepare(delta, state, batch)
        self.state = self.feed.canary.init_state()
        self.feed.commit(sent, state, self.state)
        return sent


def test_token_feed_sends_only_what_the_device_lacks():
    canary = _canary(token_rows=5)
    assert canary.config.max_reqs == 6 and canary.config.write_cap == 5
    feed = ksj.TokenFeed(canary)
    steps = _Steps(feed)
    a, b = _req("a", [100, 101, 102, 103, 104]), _req("b", [200, 201])
    # Prefill: both whole. [starts of the 4 batch rows | ids, request after request]; the ids
    # fit the batch's token bucket (8).
    mwb = _mwb([0, 3, -1, -1], [5, 2, 0, 0], extend=[5, 2, 0, 0], ntok=8)
    d = feed.delta([a, b], mwb)
    assert d.array.dtype == np.int32 and d.feed is feed
    assert d.array.tolist() == [0, 0, 0, 0] + [100, 101, 102, 103, 104, 200, 201, 0]
    assert steps.run(d, mwb) is d
    # Decode: one id per request, from the column the device lacks.
    a.output_ids.append(105)
    b.output_ids.append(202)
    mwb = _mwb([0, 3, -1, -1], [6, 3, 0, 0])
    d = feed.delta([a, b], mwb)
    assert d.array.tolist() == [5, 2, 0, 0] + [105, 202, 0, 0]
    steps.run(d, mwb)
    # b finishes; c, a prefix-cache hit of 2 tokens, gets b's row: sent whole (the row held
    # another request's ids), and past the token bucket (4): the cache_loc bucket (16).
    c = _req("c", [300, 301, 302])
    mwb = _mwb([3, -1, -1, -1], [3, 0, 0, 0], extend=[1, 0, 0, 0], ntok=1)
    d = feed.delta([c], mwb)
    assert d.array.tolist() == [0, 0, 0, 0] + [300, 301, 302] + [0] * 13
    steps.run(d, mwb)
    # The same Req back in its own row (after a retraction nobody filled in): only the new id.
    a.output_ids.append(106)
    mwb = _mwb([0, -1, -1, -1], [7, 0, 0, 0], extend=[1, 0, 0, 0])
    d = feed.delta([a], mwb)
    assert d.array.tolist() == [6, 0, 0, 0] + [106, 0, 0, 0]
    steps.run(d, mwb)
    # Another Req object with a's rid in a's row is another request: sent whole.
    a2 = _req("a", [100, 101, 900])
    mwb = _mwb([0, -1, -1, -1], [3, 0, 0, 0], extend=[3, 0, 0, 0])
    d = feed.delta([a2], mwb)
    assert d.array.tolist() == [0, 0, 0, 0] + [100, 101, 900, 0]
    steps.run(d, mwb)
    # After reset: every request whole, once; the new ids always.
    feed.reset()
    c.output_ids.append(303)
    mwb = _mwb([3, -1, -1, -1], [4, 0, 0, 0])
    d = feed.delta([c], mwb)
    assert d.array.tolist() == [0, 0, 0, 0] + [300, 301, 302, 303]
    steps.run(d, mwb)
    d = feed.delta([c], mwb)  # a replay: the new id again
    assert d.array.tolist() == [3, 0, 0, 0] + [303, 0, 0, 0]


def test_token_feed_errors_record_nothing():
    canary = _canary(token_rows=5)
    feed = ksj.TokenFeed(canary)
    steps = _Steps(feed)
    a, b = _req("a", [1, 2, 3, 4]), _req("b", [5, 6])
    mwb = _mwb([1, -1, -1, -1], [4, 0, 0, 0], extend=[4, 0, 0, 0])
    steps.run(feed.delta([a], mwb), mwb)
    bad = [
        (([a], _mwb([1, 2, -1, -1], [4, 2, 0, 0])), ValueError,
         r"seq_lens\[1\] is 2 but reqs has 1 requests"),
        (([a, b], _mwb([1, 5, -1, -1], [4, 2, 0, 0])), ValueError,
         r"req_pool_indices\[1\] must be a row in \[0, 5\) \(token_rows\), got 5"),
        (([a, b], _mwb([1, 1, -1, -1], [4, 2, 0, 0])), ValueError,
         r"requests 0 and 1 of the batch are both in row 1"),
        (([a, b], _mwb([1, 2, -1, -1], [4, 3, 0, 0])), ValueError,
         r"request 1 has 2 token ids for seq_len 3"),
        (([a, b], _mwb([1, 2, -1, -1], [11, 2, 0, 0])), ValueError,
         r"seq_lens\[0\] must be in \[0, 10\] \(context_len\), got 11"),
        (([a, 7], _mwb([1, 2, -1, -1], [4, 2, 0, 0])), TypeError, r"reqs\[1\] must be an sglang-jax Req"),
        (([a, b], _mwb([1, 2, -1], [4, 2, 0, 0])), ValueError,
         r"req_pool_indices \(3\) and seq_lens \(4\) must have one entry per request"),
        (([a, b], _mwb([1, 2, -1, -1], [4, 2, 0, 0], ntok=2, nloc=2)), ValueError,
         r"3 token ids to send do not fit the cache_loc bucket of 2"),
    ]
    for args, exc, match in bad:
        with pytest.raises(exc, match=match):
            feed.delta(*args)
    # Nothing was recorded by the refused batches: a's row still holds 4 ids, b's none.
    a.output_ids.append(9)
    b.output_ids.append(8)
    d = feed.delta([a, b], _mwb([1, 2, -1, -1], [5, 3, 0, 0], ntok=8))
    assert d.array.tolist() == [4, 0, 0, 0] + [9, 5, 6, 8, 0, 0, 0, 0]


def test_token_feed_records_only_the_steps_that_ran():
    canary = _canary(token_rows=5)
    feed = ksj.TokenFeed(canary)
    steps = _Steps(feed)
    a = _req("a", [100, 101, 102])
    pre = _mwb([2, -1, -1, -1], [3, 0, 0, 0], extend=[3, 0, 0, 0])
    d_pre = feed.delta([a], pre)
    a.output_ids.append(103)
    dec = _mwb([2, -1, -1, -1], [4, 0, 0, 0])
    d_dec = feed.delta([a], dec)  # made ahead, on what the prefill leaves
    assert d_dec.array.tolist() == [3, 0, 0, 0] + [103, 0, 0, 0]
    # Run in step order, each is sent as made.
    assert steps.run(d_pre, pre) is d_pre and steps.run(d_dec, dec) is d_dec
    # b, a prefix-cache hit of 3 on a's prompt: its prefill's first delta never runs.
    b = _req("b", [100, 101, 102, 200])
    hit = _mwb([0, -1, -1, -1], [4, 0, 0, 0], extend=[1, 0, 0, 0])
    assert feed.delta([b], hit).array.tolist() == [0, 0, 0, 0] + [100, 101, 102, 200]
    # The next delta of that batch is made on what the one never run would have left ...
    d = feed.delta([b], hit)
    assert d.array.tolist() == [3, 0, 0, 0] + [200, 0, 0, 0]
    # ... and its step sends what the state lacks: b whole.
    assert steps.run(d, hit).array.tolist() == [0, 0, 0, 0] + [100, 101, 102, 200]
    b.output_ids.append(201)
    dec = _mwb([0, -1, -1, -1], [5, 0, 0, 0])
    d = feed.delta([b], dec)
    assert steps.run(d, dec) is d and d.array.tolist() == [4, 0, 0, 0] + [201, 0, 0, 0]
    # A delta made before the one sent last, sent after it, still sends what the state lacks.
    b.output_ids.append(202)
    dec2 = _mwb([0, -1, -1, -1], [6, 0, 0, 0])
    d2 = feed.delta([b], dec2)
    assert steps.run(d2, dec2) is d2
    assert steps.run(d, dec) is d  # the state holds b's first 5 ids: position 4 again


def test_token_feed_sends_whole_to_a_state_it_did_not_feed():
    canary = _canary(token_rows=5)
    feed = ksj.TokenFeed(canary)
    steps = _Steps(feed)
    a = _req("a", [100, 101, 102], [103])
    pre = _mwb([2, -1, -1, -1], [3, 0, 0, 0], extend=[3, 0, 0, 0])
    steps.run(feed.delta([a], pre), pre)
    live = steps.state
    dec = _mwb([2, -1, -1, -1], [4, 0, 0, 0])
    d = feed.delta([a], dec)
    assert d.array.tolist() == [3, 0, 0, 0] + [103, 0, 0, 0]
    # A fresh state (or a copy, a fork): the delta goes whole, and the feed follows that state.
    fresh = canary.init_state()
    copy = jax.tree.map(jnp.copy, live)
    for other in (fresh, copy):
        assert steps.run(d, dec, state=other).array.tolist() == [0, 0, 0, 0] + [100, 101, 102, 103]
    # The state fed before is now the one the feed did not feed last.
    assert steps.run(d, dec, state=live).array.tolist() == [0, 0, 0, 0] + [100, 101, 102, 103]
    assert steps.run(d, dec) is d


def test_token_feed_keeps_each_row_s_request_itself():
    """A row's owner is its Req object, compared with ``is`` and kept while the row is recorded:
    a finished request's address (``id()``) cannot be handed to a new one meanwhile."""

    class Req:  # a plain class, as sglang-jax's (weak references allowed)
        def __init__(self, rid, prompt):
            self.rid, self.origin_input_ids, self.output_ids = rid, list(prompt), []

    canary = _canary(token_rows=5)
    feed = ksj.TokenFeed(canary)
    steps = _Steps(feed)
    old = Req("r", [1, 2, 3])
    pre = _mwb([1, -1, -1, -1], [3, 0, 0, 0], extend=[3, 0, 0, 0])
    steps.run(feed.delta([old], pre), pre)
    gone = weakref.ref(old)
    del old
    assert gone() is not None  # the feed keeps it while its row is recorded
    new = Req("r", [1, 2, 7, 8])  # the same rid in the same row: another request
    hit = _mwb([1, -1, -1, -1], [4, 0, 0, 0], extend=[2, 0, 0, 0])
    d = feed.delta([new], hit)
    assert steps.run(d, hit).array.tolist() == [0, 0, 0, 0] + [1, 2, 7, 8]
    assert gone() is None  # released once another request holds the row


def test_token_delta_for_another_batch_is_refused():
    canary = _canary(token_rows=5)
    feed = ksj.TokenFeed(canary)
    steps = _Steps(feed)
    a, b = _req("a", [1, 2, 3]), _req("b", [4, 5])
    made = _mwb([1, 2, -1, -1], [3, 2, 0, 0], extend=[3, 2, 0, 0], ntok=8)
    d = feed.delta([a, b], made)
    other = [
        (_mwb([1, 2, -1], [3, 2, 0], extend=[3, 2, 0], ntok=8), r"rows \(bs\) 4, this batch's is 3"),
        (_mwb([1, 2, -1, -1], [3, 2, 0, 0], extend=[3, 2, 0, 0], ntok=4),
         r"token bucket 8, this batch's is 4"),
        (_mwb([1, 2, -1, -1], [3, 2, 0, 0], extend=[3, 2, 0, 0], ntok=8, nloc=32),
         r"cache_loc bucket 16, this batch's is 32"),
        (_mwb([1, 2, -1, -1], [3, 2, 0, 0], ntok=8), r"decode mode False, this batch's is True"),
        (_mwb([2, 1, -1, -1], [3, 2, 0, 0], extend=[3, 2, 0, 0], ntok=8),
         r"req_pool_indices \[1, 2, -1, -1\], this batch's are \[2, 1, -1, -1\]"),
        (_mwb([1, 2, -1, -1], [3, 3, 0, 0], extend=[3, 2, 0, 0], ntok=8),
         r"seq_lens \[3, 2, 0, 0\], this batch's are \[3, 3, 0, 0\]"),
        (_mwb([1, 2, -1, -1], [3, 2, 0, 0], extend=[2, 2, 0, 0], ntok=8),
         r"extend_seq_lens \[3, 2, 0, 0\], this batch's are \[2, 2, 0, 0\]"),
    ]
    for batch, match in other:
        with pytest.raises(ValueError, match=r"the TokenDelta was made for another batch \(" + match):
            steps.run(d, batch)
    # Device arrays are read back; sglang-jax's batch id, when both carry it, stands for them.
    on_device = _mwb([1, 2, -1, -1], [3, 2, 0, 0], extend=[3, 2, 0, 0], ntok=8)
    for name in ("req_pool_indices", "seq_lens", "extend_seq_lens"):
        setattr(on_device, name, jnp.asarray(getattr(on_device, name)))
    assert feed.prepare(d, steps.state, on_device) is d
    made.bid = on_device.bid = 7
    d = feed.delta([a, b], made)
    on_device.seq_lens = jnp.zeros((4,), jnp.int32)  # never read: the ids match
    assert feed.prepare(d, steps.state, on_device) is d
    on_device.bid = 8
    with pytest.raises(ValueError, match=r"seq_lens \[3, 2, 0, 0\], this batch's are \[0, 0, 0, 0\]"):
        feed.prepare(d, steps.state, on_device)
    # Nothing was recorded by the refusals: both requests still go whole.
    assert steps.run(d, made).array.tolist() == [0, 0, 0, 0] + [1, 2, 3, 4, 5, 0, 0, 0]


def test_sweep_keeps_the_state_s_expected_token_pool():
    """A sweep leaves the expected-token pool alone: the state it returns holds the very array
    (a TokenFeed still knows the state after a sweep)."""
    canary = _canary(token_rows=5)
    state = canary.init_state()
    pool = state.expected_tokens
    kv = jnp.zeros((canary.num_slots, 2 * HEADS, HEAD_DIM), jnp.bfloat16)
    state = ksj.sweep(canary, state, kv, [[1, 2, 3]])
    assert state.expected_tokens is pool and not pool.is_deleted()
    # It ran: the three slots were never written, and it reports each.
    assert ksj.violation_counts(state).tolist() == [3]


def test_token_feed_modes_are_not_mixed():
    with pytest.raises(ValueError, match="a TokenFeed needs a canary built with token_rows"):
        ksj.TokenFeed(_canary())
    with pytest.raises(ValueError, match="token_rows keeps expected token ids .* token_checks=False"):
        _canary(token_rows=4, token_checks=False)
    with pytest.raises(ValueError, match="token_rows must be positive, got 0"):
        _canary(token_rows=0)
    fed, full = _canary(token_rows=5), _canary()
    delta = ksj.TokenFeed(fed).delta([_req("a", [1])], _mwb([0, -1, -1, -1], [1, 0, 0, 0],
                                                              extend=[1, 0, 0, 0]))

    def model(fb, pool):
        return None, [pool], None

    def step(canary):
        return ksj.guard_model_step(canary, model, batch_argnum=0, pool_argnum=1,
                                    fused_kv=lambda out, pool: out[1][0])

    # Refused before anything is traced or run (the state is never read).
    with pytest.raises(TypeError, match="give each step a TokenFeed's delta, got ndarray"):
        step(fed)(None, None, None, expected=np.zeros((16,), np.int32))
    with pytest.raises(TypeError, match="a TokenDelta needs a canary with token_rows"):
        step(full)(None, None, None, expected=delta)
    with pytest.raises(ValueError, match="the TokenDelta comes from the feed of another canary"):
        step(_canary(token_rows=6))(None, None, None, expected=delta)


def test_extend_batch_with_a_token_delta():
    """canary_batch with token_rows: the write's expected input ids come from the delta."""
    seq = np.array([5, 2, 0, 0], np.int32)
    cache_loc = np.zeros((16,), np.int32)
    cache_loc[0:5] = [8, 9, 10, 11, 12]
    cache_loc[8:10] = [16, 17]
    canary = _canary(token_rows=5)
    feed = ksj.TokenFeed(canary)
    a, b = _req("a", [100, 101, 102]), _req("b", [200, 201])
    feed.delta([a], _mwb([2, -1, -1, -1], [3, 0, 0, 0], extend=[3, 0, 0, 0]))  # a's prefill
    a.output_ids += [103, 104]
    delta = feed.delta([a, b], _mwb([2, 0, -1, -1], [5, 2, 0, 0], extend=[2, 2, 0, 0], ntok=6))
    assert delta.array.tolist() == [3, 0, 0, 0] + [103, 104, 200, 201, 0, 0]
    fb = _extend_fb(seq, cache_loc, [2, 0, -1, -1])
    with jax.enable_x64(True):
        batch, fed = sjb.device_batch(canary, fb, jnp.asarray(delta.array))[::2]
        assert np.asarray(batch.expected_input_tokens)[:4].tolist() == [103, 104, 200, 201]
        assert np.asarray(batch.all_ids_offsets).tolist() == [0, 5, 7, 7, 7]
        prow, starts, doff, _ = (np.asarray(x) for x in fed)
        assert prow.tolist() == [3, 1, 0, 0]  # sglang-jax rows + 1; padding rows 0
        assert starts.tolist() == [3, 0, 0, 0] and doff.tolist() == [0, 2, 4, 4, 4]
        # The kept pool after the delta: a's first 3 ids were sent by the prefill's delta.
        state = kc.init_state(canary.config)
        pool = state.expected_tokens.at[3, :3].set(jnp.array([100, 101, 102], jnp.int32))
        state = dataclasses.replace(state, expected_tokens=pool)
        seq64 = jnp.asarray(seq, jnp.int64)
        state, rows = sjb.fed_pool(canary, state, seq64, fed)
        kept = np.asarray(state.expected_tokens)
        assert kept[3, :5].tolist() == [100, 101, 102, 103, 104] and kept[1, :2].tolist() == [200, 201]
        assert not np.delete(kept, [1, 3], axis=0).any() and not kept[3, 5:].any()
        assert np.asarray(rows).tolist() == [kept[0].tolist(), kept[3].tolist(), kept[1].tolist(),
                                             kept[0].tolist(), kept[0].tolist()]
        assert not np.asarray(state.expected_valid_lens).any()  # not kept with token_rows

