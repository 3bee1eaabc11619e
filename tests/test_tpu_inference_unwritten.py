"""KV written before the tpu-inference guard's canary started (an install over a warm prefix
cache, a second install, a restart after a failed step) has no canary: the guard leaves those
slots unchecked instead of reporting them (``integrations/tpu_inference/host.py``:
:class:`Unwritten`; ``device.py``: ``step_batch``'s ``unwritten``), hand-checked on small
cases. No tpu-inference needed: these run in every leg. The real runner's life over a warm
cache is ``_tpu_inference_life.py``'s trust run."""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np

from kvcanary_jax.integrations.tpu_inference import device
from kvcanary_jax.integrations.tpu_inference.host import Unwritten

BS, BLOCKS = 4, 8


def _runner(**reqs):
    """A runner as the books read it: ``requests[id].block_ids[0]`` and
    ``num_computed_tokens``."""
    return types.SimpleNamespace(requests={
        name: types.SimpleNamespace(block_ids=[list(blocks)], num_computed_tokens=done)
        for name, (blocks, done) in reqs.items()})


def test_a_fresh_start_knows_no_block_and_learns_what_the_steps_write():
    u = Unwritten(dp_size=1, num_blocks=BLOCKS, block_size=BS)
    assert (u.first == BS).all()
    # A prefill of 6 tokens into blocks 1 and 2 reads nothing: nothing old is read.
    assert u.observe(_runner(a=([1, 2], 0)), [["a"]]) is False
    assert u.first[0].tolist() == [4, 0, 0, 4, 4, 4, 4, 4]
    # Its decode then reads blocks 1 and 2, both written since the start.
    assert u.observe(_runner(a=([1, 2], 6)), [["a"]]) is False


def test_a_hit_on_a_block_written_before_reads_old_slots_and_a_partial_block_keeps_its_head():
    u = Unwritten(dp_size=2, num_blocks=BLOCKS, block_size=BS)
    # Rank 0: a prefix-cache hit on block 1 (written before), a new block 3 after it.
    # Rank 1: a request running when the canary started: block 5 full, block 6 holds 2 tokens,
    # block 7 ahead of it.
    runner = _runner(hit=([1, 3], 4), running=([5, 6, 7], 6))
    assert u.observe(runner, [["hit"], ["running"]]) is True
    assert u.first[0].tolist() == [4, 4, 4, 0, 4, 4, 4, 4]
    assert u.first[1].tolist() == [4, 4, 4, 4, 4, 4, 2, 0]
    # The sweep's table of a chain: slots written before are the padding slot 0.
    assert u.tables([1, 3], 0).tolist() == [0, 0, 0, 0, 12, 13, 14, 15]
    assert u.tables([5, 6], 1).tolist() == [0, 0, 0, 0, 0, 0, 26, 27]
    # The same request's next step reads the two old slots of block 6 still.
    assert u.observe(_runner(running=([5, 6, 7], 9)), [[], ["running"]]) is True
    assert u.first[1].tolist() == [4, 4, 4, 4, 4, 4, 2, 0]
    # A block handed out again is written from its first slot: all of it is known.
    assert u.observe(_runner(new=([6, 5], 0)), [[], ["new"]]) is False
    assert u.first[1].tolist() == [4, 4, 4, 4, 4, 0, 0, 0]


def test_a_block_id_out_of_range_is_skipped():
    u = Unwritten(dp_size=1, num_blocks=BLOCKS, block_size=BS)
    assert u.observe(_runner(a=([2, 99, -1, 3], 5)), [["a"]]) is True  # block 2 is old
    assert u.first[0].tolist() == [4, 4, 4, 0, 4, 4, 4, 4]


def test_the_step_s_table_hides_the_old_read_slots_and_keeps_its_own_writes():
    """``step_batch``: request 0 reads positions 0-5 (blocks 1 and 6: block 1 all old, block 6
    old below offset 1) and writes positions 6-7 (block 6, offsets 2-3: kept whatever the
    mask says); request 1 reads block 3, written since the start."""
    canary = types.SimpleNamespace(max_reqs=2, max_blocks=2, context_len=2 * BS,
                                   layout=types.SimpleNamespace(block_size=BS))
    md = (jnp.asarray([8, 4], jnp.int32),  # seq_lens
          jnp.asarray([0, 2, 3], jnp.int32),  # query_start_loc: 2 new tokens, then 1
          jnp.asarray([1, 6, 3, 0], jnp.int32),  # block tables, 2 columns a request
          jnp.asarray([0, 0, 2], jnp.int32))  # request_distribution
    ids = jnp.asarray([5, 6, 7, 0], jnp.int32)
    pos = jnp.asarray([6, 7, 3, 0], jnp.int32)
    first = jnp.asarray([4, 4, 4, 0, 4, 4, 1, 4], jnp.int32)
    with jax.enable_x64(True):
        plain = device.step_batch(canary, md, ids, pos)
        masked = device.step_batch(canary, md, ids, pos, first)
    want_plain = [[4, 5, 6, 7, 24, 25, 26, 27], [12, 13, 14, 15, 0, 0, 0, 0]]
    assert np.asarray(plain["table"])[1:].tolist() == want_plain
    # Request 0's prefix is 6: slots 4-7 (block 1) and 24 (block 6, offset 0) are old;
    # 25 (offset 1) is not; 26 and 27 are the step's writes. Request 1 reads 12-14, writes 15.
    assert np.asarray(masked["table"])[1:].tolist() == [[0, 0, 0, 0, 0, 25, 26, 27],
                                                        [12, 13, 14, 15, 0, 0, 0, 0]]
    assert np.asarray(masked["slot"]).tolist() == np.asarray(plain["slot"]).tolist() == \
        [26, 27, 15, -1]


def test_a_broken_block_table_entry_is_never_masked():
    """A block-table entry naming the null block 0 or a block past the pool, in a step that
    reads KV written before: its slots stay in the table (the checks report them), however
    the clamped gather would read the offsets (block 0 is never written: its offset stays the
    block size)."""
    canary = types.SimpleNamespace(max_reqs=1, max_blocks=2, context_len=2 * BS,
                                   layout=types.SimpleNamespace(block_size=BS))
    first = jnp.asarray([4, 4, 4, 0, 4, 4, 1, 4], jnp.int32)
    with jax.enable_x64(True):
        for broken, slots in ((0, [0, 1, 2, 3]), (99, [396, 397, 398, 399]),
                              (-5, [-20, -19, -18, -17])):
            md = (jnp.asarray([8], jnp.int32), jnp.asarray([0, 2], jnp.int32),
                  jnp.asarray([broken, 3], jnp.int32), jnp.asarray([0, 0, 1], jnp.int32))
            got = device.step_batch(canary, md, jnp.asarray([5, 6], jnp.int32),
                                    jnp.asarray([6, 7], jnp.int32), first)
            assert np.asarray(got["table"])[1].tolist() == slots + [12, 13, 14, 15], broken
