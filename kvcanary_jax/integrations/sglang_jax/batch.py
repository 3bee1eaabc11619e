"""sglang-jax's ``ForwardBatch`` as the canary's batch and slot table, on the device.

**Plans from the batch.** The device sees, per step, ``cache_loc`` (every request's slots for
positions ``[0, seq_len)``, each request's segment padded to a multiple of ``page_size`` and the
segments concatenated in batch order, the rest padding), ``out_cache_loc`` (slots written this
step, ``-1`` = padding token), ``positions``, ``input_ids``, ``seq_lens`` and, in extend mode,
``extend_prefix_lens`` / ``extend_seq_lens`` (decode: prefix ``seq_len - 1``, one new token).
:func:`canary_batch` turns them, on the device, into the runtime's batch and a slot table whose
row ``r + 1`` holds request ``r``'s slots (row 0 is the canary's padding row; a request is padding
when ``seq_len == 0``, whatever its ``req_pool_indices`` entry says, since sglang-jax pads with
``-1`` and its row 0 is a real row). The plan therefore verifies the very slots the attention
reads: a stale or wrong ``cache_loc`` entry is checked, not hidden. A caller who prefers the host
``req_to_token`` passes ``table=host_table(...)`` (the batch's rows only, uploaded); that plan then
checks what the table says, and a wrong ``cache_loc`` goes unseen.

**Slot 0 / page 0** is sglang-jax's padding (its allocators hand out slots, or pages, from 1;
padding tokens carry ``out_cache_loc == -1`` and write nothing). As in SGLang, verify never checks
canary slot 0. A real token written to slot 0 (or anywhere but the slot its table names) is
reported the way SGLang reports it: the slot the request's table names was never stamped, so the
next verify of that position flags that slot (its stored position and token are not the
request's) and the next write seeded from it fails the chain-position check; the bytes written to
slot 0 are never fingerprinted.

:func:`canary_batch` is the public form; :func:`device_batch` also returns, with ``token_rows``,
the delta's device form, which :func:`fed_pool` applies to a shard's expected-token pool.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

import kvcanary_jax as kc
from kvcanary_jax.integrations.sglang_jax.layout import SglangJaxCanary
from kvcanary_jax.ops._xla_lib import count_below

__all__ = [
    "canary_batch",
    "device_batch",
    "fed_pool",
]


def _lengths(canary: SglangJaxCanary, fb):
    seq = fb.seq_lens.astype(jnp.int64)
    bs = seq.shape[0]
    if bs > canary.max_bs:
        raise ValueError(f"kv-canary sglang-jax: batch of {bs} rows exceeds max_bs={canary.max_bs}")
    active = seq > 0
    mode = fb.forward_mode
    if mode.is_decode():
        prefix, extend = seq - 1, jnp.ones_like(seq)
    elif mode.is_extend():
        prefix = fb.extend_prefix_lens.astype(jnp.int64)
        extend = fb.extend_seq_lens.astype(jnp.int64)
    else:
        raise ValueError(f"kv-canary sglang-jax: no canary step for forward mode {mode!r}")
    prefix = jnp.where(active, prefix, 0)
    extend = jnp.where(active, extend, 0)
    ps = canary.page_size
    aligned = (seq + ps - 1) // ps * ps
    seg = jnp.cumsum(aligned) - aligned  # each request's cache_loc segment start
    rows = jnp.where(active, jnp.arange(1, bs + 1, dtype=jnp.int64), 0)
    return seq, prefix, extend, seg, rows


# The batch's token arrays the runtime takes as they come, int32 (sglang-jax's) or int64: the
# kernels widen them as they read them (a convert kernel each, per step, spared).
_SERVER_ARRAYS = ("input_ids", "positions", "out_cache_loc")


def _as_read(x: jax.Array) -> jax.Array:
    """``x`` as the runtime takes it: int32 and int64 as they are, any other dtype widened."""
    keep = jnp.dtype(x.dtype) in (jnp.dtype(jnp.int32), jnp.dtype(jnp.int64))
    return x if keep else x.astype(jnp.int64)


def _owner(offsets: jax.Array, idx: jax.Array, bs: int) -> jax.Array:
    """For exclusive prefix sums ``offsets`` [bs + 1], the row whose range holds each index
    (``searchsorted`` right, unrolled: no loop in the step's program)."""
    return jnp.clip(count_below(offsets[1:], idx, inclusive=True), 0, max(bs - 1, 0))


def _gather(values: jax.Array, idx: jax.Array) -> jax.Array:
    # A clamped gather: masked lanes may compute any index; none reads out of bounds.
    return values[jnp.clip(idx, 0, max(values.shape[0] - 1, 0))]


def canary_batch(canary: SglangJaxCanary, forward_batch, *, expected: jax.Array | None = None):
    """sglang-jax ``ForwardBatch`` -> (:class:`kvcanary_jax.ForwardBatch`, slot table), jittable.

    The table is int32 ``[bs + 1, context_len]``: row ``r + 1`` holds ``cache_loc``'s segment of
    request ``r`` up to its ``seq_len``, zeros after; row 0 is zeros. ``expected`` is required
    iff ``canary.token_checks``: int32 parallel to ``cache_loc`` (:func:`expected_tokens`), or,
    with ``canary.token_rows``, a :class:`TokenDelta`'s ``array`` (the batch's
    ``all_ids_flat`` is then a placeholder: the ids are in the state's pool, which the guarded
    step updates). The batch's arrays are int64. Trace under 64-bit types.
    """
    batch, table, _ = device_batch(canary, forward_batch, expected)
    return dataclasses.replace(batch, **{f: getattr(batch, f).astype(jnp.int64)
                                         for f in _SERVER_ARRAYS}), table


def device_batch(canary: SglangJaxCanary, forward_batch, expected):
    """:func:`canary_batch`, and with ``token_rows`` the delta's device form for
    :func:`fed_pool` (None otherwise); the batch's token arrays as sglang-jax gave them (int32:
    the runtime reads them as they are)."""
    fb = forward_batch
    seq, prefix, extend, seg, rows = _lengths(canary, fb)
    bs = seq.shape[0]
    cache_loc = fb.cache_loc.astype(jnp.int32)
    cols = jnp.arange(canary.context_len, dtype=jnp.int64)
    table = jnp.where(cols[None, :] < seq[:, None], _gather(cache_loc, seg[:, None] + cols[None, :]), 0)
    table = jnp.concatenate([jnp.zeros((1, canary.context_len), jnp.int32), table.astype(jnp.int32)])

    zero = jnp.zeros((1,), jnp.int64)
    coff = jnp.concatenate([zero, jnp.cumsum(seq)])  # compact offsets: valid_lens = seq_lens
    woff = jnp.concatenate([zero, jnp.cumsum(extend)])
    ntok = fb.input_ids.shape[0]
    tok = jnp.arange(ntok, dtype=jnp.int64)
    owner = _owner(woff, tok, bs)
    exp_pos = prefix[owner] + tok - woff[owner]
    fed = None
    if canary.token_checks and expected is None:
        raise ValueError("kv-canary sglang-jax: token_checks needs `expected` every step "
                         "(expected_tokens(...), or a TokenFeed's delta with token_rows), or "
                         "build the canary with token_checks=False")
    if canary.token_rows is not None:  # implies token_checks
        if expected.ndim != 1 or expected.shape[0] <= bs:
            raise ValueError(f"kv-canary sglang-jax: with token_rows, expected is a TokenDelta's "
                             f"array, int32 [bs + n] (bs={bs}), got shape {expected.shape}")
        starts = expected[:bs].astype(jnp.int64)
        ids = expected[bs:]
        dlen = jnp.where(rows != 0, seq - starts, 0)
        doff = jnp.concatenate([zero, jnp.cumsum(dlen)])
        exp_tok = _gather(ids, doff[owner] + exp_pos - starts[owner]).astype(jnp.int64)
        flat = jnp.zeros((1,), jnp.int64)
        prow = jnp.where(rows != 0, fb.req_pool_indices.astype(jnp.int64) + 1, 0)
        fed = (prow, starts, doff, ids)
    elif canary.token_checks:
        if expected.shape != cache_loc.shape:
            raise ValueError(f"kv-canary sglang-jax: expected {expected.shape} must be parallel "
                             f"to cache_loc {cache_loc.shape}")
        ids = expected.astype(jnp.int64)
        t = jnp.arange(ids.shape[0], dtype=jnp.int64)
        r = _owner(coff, t, bs)
        flat = jnp.where(t < coff[bs], _gather(ids, seg[r] + t - coff[r]), 0)
        exp_tok = _gather(ids, seg[owner] + exp_pos)
    else:
        flat = jnp.zeros((1,), jnp.int64)
        exp_tok = jnp.zeros((ntok,), jnp.int64)
    batch = kc.ForwardBatch(
        req_pool_indices=rows,
        prefix_lens=prefix,
        extend_seq_lens=extend,
        all_ids_flat=flat,
        all_ids_offsets=coff,
        **{f: _as_read(getattr(fb, f)) for f in _SERVER_ARRAYS},
        expected_input_tokens=exp_tok,
        expected_input_positions=exp_pos,
    )
    return batch, table, fed


def fed_pool(canary: SglangJaxCanary, st, seq, fed):
    """One shard's state with a :class:`TokenDelta` applied to its expected-token pool (rows =
    sglang-jax rows + 1, kept between steps), and the batch's rows of it for the plan
    (``[bs + 1, context_len]``, row ``r + 1`` = request ``r``'s, row 0 the padding row's)."""
    prow, starts, doff, ids = fed
    bs = prow.shape[0]
    i = jnp.arange(ids.shape[0], dtype=jnp.int64)
    r = _owner(doff, i, bs)
    live = (i < doff[bs]) & (prow[r] > 0)
    # Entries past the delta's ids (and any of a padding row) go to a column past the pool's
    # width: dropped, never written anywhere.
    col = jnp.where(live, starts[r] + i - doff[r], canary.context_len)
    pool = st.expected_tokens.at[prow[r], col].set(ids, mode="drop")
    rows_b = jnp.concatenate([jnp.zeros((1,), jnp.int64), prow])
    # The state's expected_valid_lens is not kept here: nothing reads it, the plan takes this
    # step's seq_lens, and its scatter would be one more launch per step.
    return dataclasses.replace(st, expected_tokens=pool), pool[rows_b]
