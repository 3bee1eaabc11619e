"""The tpu-inference guard's expected-token pool (``integrations/tpu_inference/device.py``:
``apply_delta``, ``_pool`` and ``_owner``) against a hand-written oracle of its rules, on random
steps.

A step's :class:`TokenDelta` comes first: each batch row's ids from ``starts`` on, into its pool
row; a row's valid length becomes ``max(base, starts + counts)``, ``base`` 0 for a new request's
first delta. Then the step's own tokens are adopted at or past each row's valid length, and the
valid lengths raised to cover the tokens the step writes. HEAD does both in one pass
(``_pool`` given the delta); a delta too big for HEAD goes through ``apply_delta`` (a jit of its
own) first, and ``_pool`` then does the second part. The oracle below does it cell by cell,
and both ways must match it. No tpu-inference needed: these run in every leg.
"""

from __future__ import annotations

import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvcanary_jax.integrations.tpu_inference import TokenDelta
from kvcanary_jax.integrations.tpu_inference import device

M, CTX, ROWS, TOKENS, IDS = 6, 24, 9, 20, 30  # batch rows, pool width, pool rows, tokens, ids


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _State:
    expected_tokens: jax.Array  # int32 [ROWS, CTX]
    expected_valid_lens: jax.Array  # int64 [ROWS]


def _oracle(pool, valid, prow, delta, pending, valid_tok, owner, pos, ids):
    pool, valid = pool.copy(), valid.copy()
    if delta is not None:
        starts, counts, dids = delta
        i = 0
        for r in range(M):
            for k in range(counts[r]):
                col = starts[r] + k
                if i < len(dids) and prow[r] > 0 and col < CTX:
                    pool[prow[r], col] = dids[i]
                i += 1
        for r in range(M):
            if prow[r] > 0:
                base = 0 if (pending and starts[r] == 0) else valid[prow[r]]
                valid[prow[r]] = max(base, starts[r] + counts[r])
    row_t = [prow[owner[t]] if valid_tok[t] else 0 for t in range(TOKENS)]
    adopt = [row_t[t] > 0 and pos[t] >= valid[row_t[t]] for t in range(TOKENS)]  # delta's lengths
    for t in range(TOKENS):
        if adopt[t] and pos[t] < CTX:
            pool[row_t[t], pos[t]] = ids[t]
    for t in range(TOKENS):
        if row_t[t] > 0:
            valid[row_t[t]] = max(valid[row_t[t]], pos[t] + 1)
    expected = [pool[row_t[t], min(max(pos[t], 0), CTX - 1)] for t in range(TOKENS)]
    return pool, valid, pool[[0] + list(prow)], np.array(expected, np.int64)


def _laid_out(starts, counts, dids):
    """The delta's ids as the host lays them out (``TokenBook.plan``): ``[IDS, 3]``, each id
    with its batch row and column, in batch-row order; the ids past those sent are padding
    (column ``CTX``)."""
    out = np.zeros((IDS, 3), np.int32)
    out[:, 2] = CTX
    i = 0
    for r in range(M):
        for k in range(counts[r]):
            if i < IDS:
                out[i] = (dids[i], r, starts[r] + k)
            i += 1
    return out


def _case(rng, with_delta):
    pool = rng.integers(0, 1000, (ROWS, CTX)).astype(np.int32)
    valid = rng.integers(0, CTX + 1, ROWS).astype(np.int64)
    valid[0] = 0
    live = rng.integers(0, M + 1)
    prow = np.zeros(M, np.int64)  # distinct pool rows (1..ROWS-1), 0 for padding rows
    prow[:live] = rng.choice(np.arange(1, ROWS), live, replace=False)
    prow[rng.random(M) < 0.15] = 0
    # The step's tokens: each live row's q_len consecutive positions, padding after.
    q = rng.integers(0, 5, M) * (prow > 0)
    while q.sum() > TOKENS:
        q[np.argmax(q)] -= 1
    prefix = rng.integers(0, CTX + 4, M)
    owner = np.zeros(TOKENS, np.int64)
    pos = np.zeros(TOKENS, np.int64)
    valid_tok = np.zeros(TOKENS, bool)
    t = 0
    for r in range(M):
        for k in range(q[r]):
            owner[t], pos[t], valid_tok[t] = r, prefix[r] + k, True
            t += 1
    ids = rng.integers(0, 1000, TOKENS).astype(np.int32)
    delta = None
    if with_delta:
        starts = rng.integers(0, CTX + 2, M)
        counts = rng.integers(0, 6, M)
        dids = rng.integers(0, 1000, IDS).astype(np.int32)
        delta = (starts, counts, dids)
    return (pool, valid, prow, delta, bool(rng.integers(2)), valid_tok, owner, pos, ids,
            prefix, q)


@pytest.mark.parametrize("with_delta, one_pass", [(True, True), (True, False), (False, False)])
def test_the_pool_follows_the_delta_then_the_steps_own_tokens(with_delta, one_pass):
    canary = types.SimpleNamespace(max_reqs=M, context_len=CTX)
    with jax.enable_x64(True):
        def step(st, b, delta, pending, ids):
            rows = None
            if delta is not None and one_pass:  # HEAD's pass: the delta always pending
                return device._pool(canary, st, b, delta.rows, ids, delta)
            if delta is not None:
                pool, valid = device.apply_delta(canary, st.expected_tokens,
                                                 st.expected_valid_lens, delta, pending)
                st = dataclasses.replace(st, expected_tokens=pool, expected_valid_lens=valid)
                rows = delta.rows
            return device._pool(canary, st, b, rows, ids)

        fn = jax.jit(step)
        rng = np.random.default_rng(7 + with_delta)
        checked = adopted = 0
        for _ in range(150):
            (pool, valid, prow, delta, pending, valid_tok, owner, pos, ids, prefix,
             q) = _case(rng, with_delta)
            pending = pending or one_pass
            st = _State(jnp.asarray(pool), jnp.asarray(valid))
            b = {"valid_tok": jnp.asarray(valid_tok), "owner": jnp.asarray(owner),
                 "pos": jnp.asarray(pos), "prefix": jnp.asarray(prefix), "q_len": jnp.asarray(q)}
            td = None
            if with_delta:
                starts, counts, dids = delta
                td = TokenDelta(rows=jnp.asarray(prow, jnp.int32),
                                starts=jnp.asarray(starts, jnp.int32),
                                counts=jnp.asarray(counts, jnp.int32),
                                ids=jnp.asarray(_laid_out(starts, counts, dids)))
            else:
                prow = np.zeros(M, np.int64)  # no delta: every batch row is padding to the pool
            got_st, got_rows, got_expected = fn(st, b, td, jnp.asarray(pending), jnp.asarray(ids))
            want_pool, want_valid, want_rows, want_expected = _oracle(
                pool, valid, prow, delta, pending, valid_tok, owner, pos, ids)
            np.testing.assert_array_equal(np.asarray(got_st.expected_tokens), want_pool)
            np.testing.assert_array_equal(np.asarray(got_st.expected_valid_lens), want_valid)
            np.testing.assert_array_equal(np.asarray(got_rows), want_rows)
            np.testing.assert_array_equal(np.asarray(got_expected), want_expected)
            checked += 1
            adopted += int(np.any(np.asarray(got_st.expected_tokens) != pool))
    assert checked == 150
    if with_delta:
        assert adopted > 100  # the cases write the pool, not only read it


@pytest.mark.parametrize("pairs", [1 << 16, 0], ids=["compared", "searched"])
def test_each_token_is_owned_by_the_row_whose_range_holds_it(monkeypatch, pairs):
    """``_owner`` (every index compared with every entry, or an unrolled binary search past
    ``_OWNER_PAIRS``): for exclusive prefix sums ``offsets`` [n + 1], the row ``r`` with
    ``offsets[r] <= i < offsets[r + 1]``, the last row for indices past the end, empty rows
    never owning anything."""
    monkeypatch.setattr(device, "_OWNER_PAIRS", pairs)
    rng = np.random.default_rng(3)
    with jax.enable_x64(True):
        for n in (1, 2, 5, 16, 17):
            counts = rng.integers(0, 4, n)
            counts[rng.random(n) < 0.3] = 0
            offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
            idx = np.arange(offsets[-1] + 3, dtype=np.int64)
            got = np.asarray(device._owner(jnp.asarray(offsets), jnp.asarray(idx), n))
            want = [next((r for r in range(n) if offsets[r] <= i < offsets[r + 1]), n - 1)
                    for i in idx]
            np.testing.assert_array_equal(got, want)


def test_the_host_lays_out_each_id_with_its_batch_row_and_column():
    """``TokenBook.plan``: each id the device lacks, with its batch row and its column in the
    request's pool row, padding at column ``context_len``; ``head_delta``: a delta of at most
    the step's tokens rides in HEAD as it is, a bigger one leaves HEAD no ids and each row
    starting at what the delta's own jit leaves it holding. Hand-checked."""
    from kvcanary_jax.integrations.tpu_inference import host

    book = host.TokenBook(pool_rows=4, max_reqs=3, dp_size=1, context_len=10)
    tokens = np.zeros((2, 10), np.int64)
    tokens[0, :4], tokens[1, :2] = [5, 6, 7, 11], [8, 9]
    batch = types.SimpleNamespace(req_id_to_index={"a": 0, "b": 1}, token_ids_cpu=tokens,
                                  num_tokens_no_spec=np.array([3, 2]))
    runner = types.SimpleNamespace(input_batch=batch)
    first = book.plan(runner, [["a", "b"]])
    assert first.rows.tolist() == [1, 2, 0]
    assert (first.starts.tolist(), first.counts.tolist()) == ([0, 0, 0], [3, 2, 0])
    pad = [0, 0, 10]
    assert first.ids.tolist() == [[5, 0, 0], [6, 0, 1], [7, 0, 2], [8, 1, 0], [9, 1, 1]] + [
        pad] * 11  # the id bucket: 16
    rows, starts, counts, ids, fits = host.head_delta(first, 1, 8, 10)
    assert fits and ids.tolist() == first.ids[:8].tolist()
    assert (rows.tolist(), starts.tolist(), counts.tolist()) == ([1, 2, 0], [0, 0, 0], [3, 2, 0])
    rows, starts, counts, ids, fits = host.head_delta(first, 1, 4, 10)  # 5 ids: too many
    assert not fits and ids.tolist() == [pad] * 4
    assert (starts.tolist(), counts.tolist()) == ([3, 2, 0], [0, 0, 0])
    book.commit(first)
    batch.num_tokens_no_spec = np.array([4, 2])  # "a" sampled 11; "b" nothing new
    second = book.plan(runner, [["a", "b"]])
    assert (second.starts.tolist(), second.counts.tolist()) == ([3, 2, 0], [1, 0, 0])
    assert second.ids.tolist() == [[11, 0, 3]] + [pad] * 15
