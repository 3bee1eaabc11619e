"""canary_write as plain XLA (``implementation="xla"``: CPU, TPU, GPU).

The semantics and out-of-range choices of :mod:`kvcanary_jax.ops.write.base` (slots outside
``[0, num_slots)`` skipped, a seed past the buffer read as an all-zero slot, tokens outside
``input_ids`` skipped, a negative ``write_num_valid_reqs`` meaning no request), in SGLang's
reference order: requests one after another, tokens in order. So the result is the sequential
reference's byte for byte, across the requests of one launch too: a slot written by several
requests (or repeated in one) ends with the last write's row, a seed slot that an earlier request
of the launch wrote is read as that request left it, and violation rows come in (request, token)
order, a token's input-assert row before its chain-position row. The ring guard of
:mod:`kvcanary_jax.ops._xla_lib` applies.

Shape of the computation. The real-KV fingerprints (field 3), the input assert and the
chain-position check are elementwise over tokens. Only the hash chain is serial: requests are
lanes, and a ``while`` loop walks the token index of every lane at once, ``unroll`` links per
trip, recording each token's link (the hash stored into its slot) in a per-token vector. Then:

* stores: the tokens are sorted by (slot, token); the last token of each slot group makes the
  last write to that slot, and one scatter stores fields 0-3 of those tokens;
* seeds written earlier in the launch: a binary search of the same sorted keys finds the last
  write to a request's seed slot before the request's first token. That write's link feeds the
  request's chain, so the chain pass repeats until the seeds' links stop changing: one pass when
  no request seeds from a slot the launch writes, one more per level of such dependencies;
* violation rows: a token's position check needs the position of the previous written token of
  its request (a running maximum of token indices); rows are numbered by a cumsum over tokens,
  and each ring row the launch may fill finds its record by binary search (cumsum compaction).

Token order is request order when the requests' token ranges follow one another (offsets
non-decreasing over the requests that have tokens, as a well-formed plan's are). Requests are
therefore taken in windows: up to ``lanes`` consecutive requests whose ranges follow one another.
A well-formed launch of up to ``lanes`` requests is one window; a range that overlaps or precedes
an earlier one (malformed offsets) starts a new window, and windows apply one after another.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

import jax
import jax.numpy as jnp

from kvcanary_jax import consts, hashing
from kvcanary_jax.context import VerifyOrWriteContext
from kvcanary_jax.ops import _xla_lib
from kvcanary_jax.ops.write import base
from kvcanary_jax.ops.write.base import WriteTokens
from kvcanary_jax.plans import WritePlan

__all__ = ["Config", "heuristics", "run"]


@dataclasses.dataclass(frozen=True)
class Config:
    """``lanes``: requests walked side by side (a window); ``unroll``: chain links per loop trip
    (both positive). ``branch``: skip the ring update behind a conditional when a window
    records nothing."""

    lanes: int = 256
    unroll: int = 1
    branch: bool = True

    def __post_init__(self):
        for name in ("lanes", "unroll"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"kv-canary: write xla {name} must be a positive int, got {v!r}")


def heuristics(shapes: Mapping[str, int], backend: str | None = None) -> Config:
    """Up to 256 requests side by side. One link per loop trip (fastest on CPU at every shape
    of bench/NOTES.md), except on GPUs, where XLA reads a loop's (and a conditional's)
    predicate back to the host: 8 links per trip there, and no conditional."""
    lanes = min(256, 1 << max(shapes["write_capacity"] - 1, 0).bit_length())
    if (backend or jax.default_backend()) == "gpu":
        return Config(lanes=lanes, unroll=8, branch=False)
    return Config(lanes=lanes, unroll=1)


def _first(mask, default):
    """Index of the first set lane (int64), ``default`` when none is."""
    i = jnp.arange(mask.shape[0], dtype=jnp.int64)
    return jnp.min(jnp.where(mask, i, default))


def run(context: VerifyOrWriteContext, plan: WritePlan, tokens: WriteTokens, *,
        enable_write_input_assert: bool, config: Config) -> VerifyOrWriteContext:
    """The updated context (no validation)."""
    # The chains below index these many times: short names, as in the docstring.
    canary_buf, ring = context.canary_buf, context.violation_ring
    widx = context.violation_write_index
    cpa = context.enable_chain_position_assert
    offsets, seeds, nvalid = (plan.write_offsets, plan.write_seed_slot_indices,
                              plan.write_num_valid_reqs)
    tokens = base.widened(tokens)  # int32 through the array-level run
    ids, pos, ocl = tokens.input_ids, tokens.positions, tokens.out_cache_loc
    check_input = bool(enable_write_input_assert)
    etok, epos = ((tokens.expected_input_tokens, tokens.expected_input_positions) if check_input
                  else (None, None))
    sources = context.bound_sources()
    source_bufs, specs = tuple(b for b, _ in sources), tuple(s for _, s in sources)
    mode, kind = int(context.real_kv_hash_mode), int(context.kernel_kind)
    lanes, unroll, branch = config.lanes, config.unroll, config.branch
    i64 = jnp.int64
    num_slots = canary_buf.shape[0]
    n = ids.shape[0]
    cap = seeds.shape[0]
    kctr = context.kernel_run_counter + 1
    if n == 0 or cap == 0 or num_slots == 0:
        return context.replace(kernel_run_counter=kctr)
    if (num_slots + 1) * (n + 1) >= 2**62:
        raise ValueError(f"kv-canary: canary_write (xla): {num_slots} slots x {n} tokens is "
                         "too large for its int64 sort keys")
    words = _xla_lib.source_arrays(source_bufs, specs)
    F = consts.FailReason
    anchor = jnp.asarray(hashing.ANCHOR_HASH_I64, i64)
    g_all = jnp.arange(n, dtype=i64)

    # Per token, whatever request holds it.
    stores = (ocl >= 0) & (ocl < num_slots)
    rkv = hashing.fold_real_kv(ocl, stores, words, specs, mode, gather=_xla_lib.source_word)
    if check_input:
        bits_in = (jnp.where(ids != etok, int(F.WRITE_TOKEN_MISMATCH), 0)
                   | jnp.where(pos != epos, int(F.WRITE_POSITION_MISMATCH), 0)).astype(i64)
    else:
        bits_in = jnp.zeros((n,), i64)

    # Per request: its in-range tokens [lo, hi).
    r_all = jnp.arange(cap, dtype=i64)
    active = r_all < jnp.clip(nvalid[0].astype(i64), 0, cap)
    lo_all = jnp.clip(offsets[:cap], 0, n)
    hi_all = jnp.where(active, jnp.maximum(lo_all, jnp.clip(offsets[1:], 0, n)), lo_all)
    busy = hi_all > lo_all
    pos_check_all = (seeds >= 0) & (cpa[0] != 0)
    lanes = min(lanes, cap)
    lane = jnp.arange(lanes, dtype=i64)

    def window(carry):
        a, cb, ring, done, written = carry
        # Lanes [a0, a0 + lanes) hold the window [a, b): requests whose ranges follow each other.
        a0 = jnp.minimum(a, cap - lanes)
        r = a0 + lane
        sl = lambda x: jax.lax.dynamic_slice(x, (a0,), (lanes,))  # noqa: E731
        lo, hi, seed, pos_check = sl(lo_all), sl(hi_all), sl(seeds), sl(pos_check_all)
        mine = sl(busy) & (r >= a)
        prev_end = jax.lax.cummax(jnp.where(mine, hi, -1))
        prev_end = jnp.concatenate([jnp.full((1,), -1, i64), prev_end[:-1]])
        cut = _first(mine & (lo < prev_end), lanes)
        w = mine & (lane < cut)

        # Token -> owning lane: a mark at each range's first token, carried by a running max.
        mark = jnp.full((n,), -1, jnp.int32).at[jnp.where(w, lo, n)].max(
            lane.astype(jnp.int32), mode="drop")
        held = jax.lax.cummax(mark)
        owner = jnp.maximum(held, 0)
        mine_tok = (held >= 0) & w[owner] & (g_all < hi[owner])
        tv = mine_tok & stores

        # Tokens sorted by (slot, token): slot groups, the last write of each slot, and the last
        # write of a seed slot before a request's first token.
        key = jnp.where(tv, ocl, num_slots) * (n + 1) + g_all
        skey = jnp.sort(key)
        s_slot, s_tok = skey // (n + 1), skey % (n + 1)
        seed_ok = (seed >= 0) & (seed < num_slots)
        q = _xla_lib.count_below(skey, jnp.where(seed_ok, seed, 0) * (n + 1) + lo) - 1
        found = w & seed_ok & (q >= 0) & (s_slot[jnp.maximum(q, 0)] == seed)
        gs = jnp.where(found, s_tok[jnp.maximum(q, 0)], 0)
        c_tok, c_pos, c_ph, _ = _xla_lib.canary_fields(cb, seed, seed_ok)
        h_canary = jnp.where(seed < 0, anchor, hashing.mix3(c_ph, c_tok, c_pos))
        last0 = jnp.where(pos_check, jnp.where(found, pos[gs], c_pos), 0)

        span = jnp.max(jnp.where(w, hi - lo, 0))

        def chain(h0, links):
            def trip(c):
                i, h, links = c
                g = lo[None, :] + i + jnp.arange(unroll, dtype=i64)[:, None]  # [unroll, lanes]
                inr = w[None, :] & (g < hi[None, :])
                gc = jnp.where(inr, g, 0)
                v, t, p = tv[gc] & inr, ids[gc], pos[gc]
                hs = []
                for u in range(unroll):
                    hs.append(h)
                    h = jnp.where(v[u], hashing.mix3(h, t[u], p[u]), h)
                links = links.at[jnp.where(inr, g, n)].set(jnp.stack(hs), mode="drop")
                return i + unroll, h, links

            return jax.lax.while_loop(lambda c: c[0] < span, trip,
                                      (jnp.zeros((), i64), h0, links))[2]

        def seeds_from(links):
            return jnp.where(found, hashing.mix3(links[gs], ids[gs], pos[gs]), h_canary)

        def rerun(c):
            h0, links, _ = c
            links = chain(h0, links)
            h1 = seeds_from(links)
            return h1, links, jnp.any(h1 != h0)

        _, links, _ = jax.lax.while_loop(lambda c: c[2], rerun,
                                         (h_canary, jnp.zeros((n,), i64), jnp.ones((), bool)))

        # Stores: fields 0-3 of the last write of every slot.
        last_write = (s_slot < num_slots) & (s_slot != jnp.roll(s_slot, -1)) | (
            (g_all == n - 1) & (s_slot < num_slots))
        gw = jnp.where(last_write, s_tok, 0)
        cb = _xla_lib.canary_store(cb, s_slot,
                                   jnp.stack([ids[gw], pos[gw], links[gw], rkv[gw]], axis=1),
                                   last_write)

        # Violation rows, (request, token, kind) order = token order inside the window.
        pv = jax.lax.cummax(jnp.where(tv, g_all, -1))
        pv = jnp.concatenate([jnp.full((1,), -1, i64), pv[:-1]])
        same = pv >= lo[owner]
        expect = jnp.where(same, pos[jnp.maximum(pv, 0)], last0[owner]) + 1
        rec_in = tv & (bits_in != 0)
        rec_ch = tv & pos_check[owner] & (pos != expect)
        incl = jnp.cumsum(rec_in.astype(i64) + rec_ch.astype(i64))
        count = incl[-1]

        def rows(j, ok):
            g, k = _xla_lib.record_of(incl, jnp.where(ok, j - done, 0))
            is_in = (k == 0) & rec_in[g]
            t, p = ids[g], pos[g]
            wpm = int(F.WRITE_POSITION_MISMATCH)
            return jnp.stack([
                jnp.full(g.shape, kind, i64), ocl[g], p, t,
                jnp.where(is_in, etok[g] if check_input else 0, t), links[g],
                jnp.where(is_in, epos[g] if check_input else 0, expect[g]),
                jnp.where(is_in, bits_in[g], wpm)], axis=1)

        ring = _xla_lib.ring_fill(ring, widx[0], done, count, rows, branch=branch)
        nxt = _first(busy & (r_all >= a0 + cut), cap)
        return nxt, cb, ring, done + count, written + jnp.sum(tv.astype(i64))

    init = (_first(busy, cap), canary_buf, ring, jnp.zeros((), i64), jnp.zeros((), i64))
    _, canary_buf, ring, done, written = jax.lax.while_loop(lambda c: c[0] < cap, window, init)
    return context.replace(canary_buf=canary_buf, violation_ring=ring,
                           violation_write_index=_xla_lib.ring_index(widx, done),
                           slot_run_counter=context.slot_run_counter + written,
                           kernel_run_counter=kctr)
