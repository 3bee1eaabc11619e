"""canary_write as a Mosaic TPU kernel (implementation ``"pallas_mosaic_tpu"``).

Semantics and bounds choices: those of the write op (SGLang's ``launch_canary_write_kernel``,
docs/spec.md §9). Requests and tokens are processed strictly in order, as SGLang's reference does:
a slot written twice ends with the later record, a seed written by an earlier request of the
launch is read after that write, and violation rows are appended in reference order (within an
entry: the input-assert row, then the chain-position row), with the ring guard
of docs/spec.md §14.1.

Shape: one kernel instance. A request's chain is serial (each link is a non-linear function of
the previous one), so the chain runs on the scalar unit with 64-bit values as 32-bit pairs; the
rest is batched:

1. *fingerprints* of every token's slot (independent per slot) come from
   :mod:`kvcanary_jax.ops._tpu_fingerprint`, vectorised;
2. *seed hazards*, vectorised: request ``r``'s seed slot is "hazardous" when a token of an earlier
   request writes it in this launch; the seeds' canary tiles are gathered up front, 128
   requests at a time, and the first links (``mix3`` of the seed slot, or the anchor) and last
   positions computed on the vector unit;
3. the *chain*: per token, its fields come from SMEM (token arrays are paged into SMEM in
   1,024-token chunks, the next chunk in flight), and the record ``(token, position, link,
   fingerprint)`` goes into its slot's canary tile. The canary is written in place, as canary
   tiles (:func:`kvcanary_jax.ops._tpu_lib.canary_tiles`), and Mosaic DMAs whole tiles of 128
   slots only, so a write is a read-modify-write of a tile: the *open* tile sits in VMEM, the
   tokens that land in it (a run of consecutive slots: up to 128) update it there in order, and
   a token of another tile writes the open one back (a DMA; up to ``WRITES_IN_FLIGHT`` in
   flight) and reads its own, after any write of that tile still in flight has landed. So each
   token sees every earlier store of the launch, as in SGLang's serial order, and a slot's last
   record wins. A hazardous seed writes everything back and reads its tile then.

Per written token the kernel moves its slot's tile (4 KiB in and out, shared by the tokens of a
run of consecutive slots), 24-40 B of token fields and 8 B of fingerprint, plus the fingerprint
kernel's strip reads.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import ClassVar

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kvcanary_jax import consts
from kvcanary_jax import hashing_u32
from kvcanary_jax.context import VerifyOrWriteContext
from kvcanary_jax.ops import _tpu_fingerprint as fingerprint
from kvcanary_jax.ops import _tpu_lib as tpu
from kvcanary_jax.ops import _tpu_state as tpu_state
from kvcanary_jax.ops.write import base
from kvcanary_jax.ops.write.base import WriteTokens
from kvcanary_jax.plans import WritePlan

__all__ = ["Config", "heuristics", "run", "CHUNK", "WRITES_IN_FLIGHT", "SMEM_BUDGET"]

# Tokens per SMEM chunk of the token arrays (pair rows: 16 rows per field).
CHUNK = 1024
# Canary-tile writes in flight (4 KiB staging tiles in VMEM, one semaphore each).
WRITES_IN_FLIGHT = 8
# SMEM this kernel may use (of 1 MiB per core on v5e / v6e); the request capacity is bounded by it.
SMEM_BUDGET = 768 * 1024

_F = consts.FailReason
# token fields (pair rows), in this order in the stacked token array
_SLOT, _TOK, _POS, _RKV, _ETOK, _EPOS = range(6)


@dataclasses.dataclass(frozen=True)
class Config(tpu.BlockConfig):
    """``block``: entries per block of the fingerprint kernel (a multiple of 512); the rest:
    :class:`kvcanary_jax.ops._tpu_lib.Config`."""

    OP: ClassVar[str] = "canary_write"
    block: int = 1024



def heuristics(shapes) -> Config:
    return Config()


def _state(rc: int, cap_pad: int, nfields: int) -> tpu_state.State:
    """The kernel's scratch (``rc``: request plane rows). Every buffer a DMA fills or drains whole
    is exactly as wide as the rows or tiles it copies: Mosaic refuses a DMA of a window narrower
    than its buffer's rows unless it is a multiple of 512 bytes."""
    tile = (tpu.SLOT_BYTES, tpu.TILE_SLOTS)
    return tpu_state.State(
        # 128 requests' seed tiles, in fetch order
        seed_tiles=tpu_state.vmem((tpu.LANES, *tile), jnp.uint8),
        # each request's seed tile's place there, and its lane
        seed_at=tpu_state.vmem((2, rc, tpu.LANES)),
        # the seed slots' words (word w of plane row j: 8 j + w)
        seed_words=tpu_state.vmem((tpu.SLOT_WORDS * rc, tpu.LANES)),
        init_v=tpu_state.vmem((2, 2 * rc, tpu.LANES)),  # first links, last positions (pair rows)
        init_s=tpu_state.smem((2, 2 * rc, tpu.LANES)),  # the same, read back as scalars
        hz=tpu_state.smem((cap_pad,)),  # 1 where an earlier request writes the seed
        # token chunks, double-buffered
        chunk=tpu_state.smem((2, nfields, CHUNK // 64, tpu.LANES)),
        # the open tile and tiles being written
        stage=tpu_state.vmem((WRITES_IN_FLIGHT, *tile), jnp.uint8),
        # the tile each staged write goes to (-1: none)
        pend=tpu_state.smem((WRITES_IN_FLIGHT,)),
        misc=tpu_state.words(
            chunk_now=1,  # the resident token chunk (-1: none)
            chunk_id=2,  # [s]: the chunk buffer s holds (or is fetching)
            fetching=2,  # [s]: 1 while buffer s's fetch is in flight
            opened=1,  # tiles opened so far (the next staging tile: opened % WRITES_IN_FLIGHT)
            ring=tpu.Ring.WORDS,  # the Ring's state
            written=1,  # canary slots written
            open_tile=1,  # the open tile (-1: none)
            open_at=1,  # the staging tile it is in
        ),
        ring_stage=tpu_state.smem(tpu.RING_STAGE),  # the violation record being appended
        # a hazardous seed's first link (hi, lo), last position (hi, lo)
        seed_chain=tpu_state.smem((4,)),
        sems=tpu_state.semaphores(
            chunk=2,  # [s]: token chunk buffer s
            seed=1,  # seed-tile gathers
            row=1,  # the init round trip, a tile read, a hazardous seed's tile
            ring=1,  # a violation record
            write=WRITES_IN_FLIGHT,  # [q]: the write of staging tile q
        ),
    )


def _pair_lanes(e):
    return tpu.idiv(e, 64), 2 * tpu.irem(e, 64)


def _write_kernel(
    # Prefetch (SMEM): tpu.Status words [STATUS_WORDS]; write offsets and seeds, pair rows
    # [cap_pad // 64, 128]
    st_in, off_s, seed_s,
    # Input: the token fields (_SLOT ...), pair rows [fields, t_pad // 64, 128] (HBM); the seeds
    # and out_cache_loc as pair rows (VMEM); the canary tiles and the ring (HBM, aliased)
    toks_hbm, seed_v, ocl_v, canary_in, ring_in,
    # Output: canary tiles uint8 [S, N'] and the ring [C, 16] (HBM); tpu.Status words (SMEM
    # [STATUS_WORDS]); first links and last positions, pair rows [2, 2 rc, 128] (HBM, a round
    # trip to SMEM)
    canary_hbm, ring_hbm, st_out, init_hbm,
    # Scratch: _state(rc, cap_pad, fields)
    *scratch,
    state, cap, num_tokens, num_slots, ring_cap, kind, check_input, nchunks,
):
    del canary_in, ring_in
    scr = state.bind(scratch)
    init_v, init_s, hz, chunk = scr.init_v, scr.init_s, scr.hz, scr.chunk
    stage, pend, misc, sems = scr.stage, scr.pend, scr.misc, scr.sems
    K = WRITES_IN_FLIGHT
    rc = scr.seed_at.shape[1]  # request plane rows
    rt = ocl_v.shape[0] // 2  # token plane rows
    ring = tpu.Ring(ring_hbm, ring_cap, misc.ring, scr.ring_stage, sems.ring)
    ring.start(st_in[tpu.Status.WRITE_INDEX])
    active = jnp.clip(st_in[tpu.Status.NUM_VALID], 0, cap)
    cpa_on = st_in[tpu.Status.ENABLE] != 0
    zero32 = jnp.uint32(0)

    def offset(r):
        row, col = _pair_lanes(r)
        return tpu.u32(off_s[row, col + 1]), tpu.u32(off_s[row, col])

    def token_range(r):
        lo = tpu.pair_clamp(offset(r), num_tokens)
        hi = tpu.pair_clamp(offset(r + 1), num_tokens)
        return lo, jnp.maximum(hi, lo)

    def seed(r):
        row, col = _pair_lanes(r)
        return tpu.u32(seed_s[row, col + 1]), tpu.u32(seed_s[row, col])

    # -- 1. seed hazards (vector): hz[r] = 1 when an earlier request writes request r's seed.
    # The tokens written so far are carried as int32 0 / 1, not bool: Mosaic cannot carry a
    # mask vector through a loop ("failed to legalize operation 'scf.for'").
    ocl = tpu.planes(ocl_v)
    tok_idx = tpu.entry_index(rt)
    writes = tpu.pair_in_range(ocl, num_slots) & (tok_idx < num_tokens)

    def hazard(r, written):
        lo, hi = token_range(r)
        s = seed(r)
        seed_pair = (jnp.full_like(ocl[0], s[0]), jnp.full_like(ocl[1], s[1]))
        hit = tpu.sum_scalar(jnp.where(hashing_u32.eq(ocl, seed_pair), written, 0))
        hz[r] = jnp.where(tpu.pair_in_range(s, num_slots) & (hit > 0), 1, 0)
        return jnp.where((tok_idx >= lo) & (tok_idx < hi) & writes, 1, written)

    lax.fori_loop(0, active, hazard, jnp.zeros((rt, tpu.LANES), jnp.int32))

    # -- 2. the seeds' slots (vector): the tiles of 128 requests' seeds at a time, each fetched
    # once per run of requests sharing it, the slots picked out in VMEM. Every active request
    # with a seed in range fetches (a hazardous seed's early read is not used).
    seeds = tpu.planes(seed_v)
    req = tpu.entry_index(rc)
    fetched = (req < active) & tpu.pair_in_range(seeds, num_slots)
    seed_i = tpu.i32(seeds[1])
    scr.seed_at[0] = tpu.fetch_places(tpu.idiv(seed_i, tpu.TILE_SLOTS), fetched)
    scr.seed_at[1] = tpu.irem(seed_i, tpu.TILE_SLOTS)

    def seed_copy(tile, k):
        return pltpu.make_async_copy(tpu.tile_window(canary_hbm, tile), scr.seed_tiles.at[k],
                                     sems.seed)

    def seed_row(j, carry):
        """Plane row j: requests [128 j, 128 j + 128)."""

        def one(lane, c):
            n, last = c
            r = j * tpu.LANES + lane
            s = seed(r)
            ok = (r < active) & tpu.pair_in_range(s, num_slots)
            tile = tpu.idiv(tpu.i32(s[1]), tpu.TILE_SLOTS)
            new = ok & (tile != last)

            @pl.when(new)
            def _():
                seed_copy(tile, n).start()

            return n + new.astype(jnp.int32), jnp.where(ok, tile, jnp.int32(-1))

        n, _ = lax.fori_loop(0, tpu.LANES, one, (jnp.int32(0), jnp.int32(-1)))
        tpu.wait_n(seed_copy(0, 0), n)
        scr.seed_words[pl.ds(pl.multiple_of(j * tpu.SLOT_WORDS, tpu.SLOT_WORDS),
                            tpu.SLOT_WORDS), :] = tpu.select_tiles(
            scr.seed_tiles, n, scr.seed_at[0, pl.ds(j, 1), :], scr.seed_at[1, pl.ds(j, 1), :])
        return carry

    lax.fori_loop(0, tpu.idiv(active + tpu.LANES - 1, tpu.LANES), seed_row, 0)
    zero = jnp.zeros((rc, tpu.LANES), jnp.uint32)
    f = [jnp.where(fetched, tpu.u32(scr.seed_words[pl.ds(w, rc, stride=tpu.SLOT_WORDS), :]), zero)
         for w in range(tpu.SLOT_WORDS)]
    s_tok, s_pos, s_link = (f[1], f[0]), (f[3], f[2]), (f[5], f[4])
    h0 = hashing_u32.mix3(s_link, s_tok, s_pos)
    anchor = hashing_u32.const(hashing_u32.join_int(*hashing_u32.ANCHOR_HASH), zero)
    neg = hashing_u32.is_neg(seeds)
    h0 = (jnp.where(neg, anchor[0], h0[0]), jnp.where(neg, anchor[1], h0[1]))
    pos_check = jnp.logical_not(neg) & cpa_on
    last0 = (jnp.where(pos_check, s_pos[0], zero), jnp.where(pos_check, s_pos[1], zero))
    tpu.store_planes(init_v.at[0], *h0)
    tpu.store_planes(init_v.at[1], *last0)
    # VMEM -> HBM -> SMEM: the chain reads them as scalars.
    out = pltpu.make_async_copy(init_v, init_hbm, sems.row)
    out.start()
    out.wait()
    back = pltpu.make_async_copy(init_hbm, init_s, sems.row)
    back.start()
    back.wait()

    # -- 3. the chain (scalar).
    def chunk_copy(k, slot):
        rows = pl.ds(pl.multiple_of(k * (CHUNK // 64), 8), CHUNK // 64)
        return pltpu.make_async_copy(toks_hbm.at[:, rows, :], chunk.at[slot],
                                     sems.chunk[slot])

    misc.chunk_now = jnp.int32(-1)
    for slot in (0, 1):
        misc.chunk_id[slot] = jnp.int32(-1)
        misc.fetching[slot] = jnp.int32(0)
    misc.opened = jnp.int32(0)
    misc.written = jnp.int32(0)
    misc.open_tile = jnp.int32(-1)
    misc.open_at = jnp.int32(0)
    for j in range(K):
        pend[j] = jnp.int32(-1)

    def switch_chunk(k):
        """Makes chunk k resident (buffer k % 2) and starts fetching chunk k + 1."""
        slot = tpu.irem(k, 2)

        @pl.when(misc.chunk_id[slot] != k)
        def _():
            @pl.when(misc.fetching[slot] == 1)
            def _():
                chunk_copy(0, slot).wait()

            chunk_copy(k, slot).start()
            misc.chunk_id[slot] = k
            misc.fetching[slot] = jnp.int32(1)

        @pl.when(misc.fetching[slot] == 1)
        def _():
            chunk_copy(k, slot).wait()
            misc.fetching[slot] = jnp.int32(0)

        nxt = 1 - slot

        @pl.when((k + 1 < nchunks) & (misc.chunk_id[nxt] != k + 1))
        def _():
            @pl.when(misc.fetching[nxt] == 1)
            def _():
                chunk_copy(0, nxt).wait()

            chunk_copy(k + 1, nxt).start()
            misc.chunk_id[nxt] = k + 1
            misc.fetching[nxt] = jnp.int32(1)

        misc.chunk_now = k

    def field(i, f):
        k = tpu.idiv(i, CHUNK)

        @pl.when(misc.chunk_now != k)
        def _():
            switch_chunk(k)

        row, col = _pair_lanes(i - k * CHUNK)
        slot = tpu.irem(k, 2)
        return tpu.u32(chunk[slot, f, row, col + 1]), tpu.u32(chunk[slot, f, row, col])

    def write_copy(q, tile):
        return pltpu.make_async_copy(stage.at[q], tpu.tile_window(canary_hbm, tile),
                                     sems.write[q])

    def settle(j):
        @pl.when(pend[j] != -1)
        def _():
            write_copy(j, 0).wait()
            pend[j] = jnp.int32(-1)

    def close():
        """Starts writing the open tile back."""
        @pl.when(misc.open_tile != -1)
        def _():
            q = misc.open_at
            write_copy(q, misc.open_tile).start()
            pend[q] = misc.open_tile
            misc.open_tile = jnp.int32(-1)

    def drain():
        close()
        for j in range(K):
            settle(j)

    def store(slot32, words):
        tile = tpu.idiv(slot32, tpu.TILE_SLOTS)

        @pl.when(misc.open_tile != tile)
        def _open():
            close()
            for j in range(K):  # a write of this tile still in flight lands first
                @pl.when(pend[j] == tile)
                def _(j=j):
                    settle(j)

            q = tpu.irem(misc.opened, K)
            settle(q)
            c = pltpu.make_async_copy(tpu.tile_window(canary_hbm, tile), stage.at[q],
                                      sems.row)
            c.start()
            c.wait()
            misc.open_tile = tile
            misc.open_at = q
            misc.opened = misc.opened + 1

        q = misc.open_at
        x = tpu.tile_words(stage.at[q])
        word = lax.broadcasted_iota(jnp.int32, x.shape, 0)
        at = lax.broadcasted_iota(jnp.int32, x.shape, 1) == tpu.irem(slot32, tpu.TILE_SLOTS)
        for w, v in enumerate(words):
            x = jnp.where(at & (word == w), v, x)
        stage[q] = pltpu.bitcast(x, jnp.uint8)

    def request(r, carry):
        lo, hi = token_range(r)
        s = seed(r)

        @pl.when((hi > lo) & (hz[r] == 1))
        def _():
            # The seed was written earlier in this launch: read it now.
            drain()
            seed32 = tpu.i32(s[1])
            buf = scr.seed_tiles.at[0]
            c = pltpu.make_async_copy(
                tpu.tile_window(canary_hbm, tpu.idiv(seed32, tpu.TILE_SLOTS)), buf,
                sems.row)
            c.start()
            c.wait()
            x = tpu.tile_words(buf)
            word = lax.broadcasted_iota(jnp.int32, x.shape, 0)
            at = lax.broadcasted_iota(jnp.int32, x.shape, 1) == tpu.irem(seed32, tpu.TILE_SLOTS)
            w = [tpu.u32(tpu.sum_scalar(jnp.where(at & (word == i), x, 0))) for i in range(6)]
            h = hashing_u32.mix3((w[5], w[4]), (w[1], w[0]), (w[3], w[2]))
            last = (jnp.where(cpa_on, w[3], zero32), jnp.where(cpa_on, w[2], zero32))
            for i, v in enumerate((*h, *last)):
                scr.seed_chain[i] = tpu.i32(v)

        row, col = _pair_lanes(r)
        hazardous = hz[r] == 1
        h = tuple(jnp.where(hazardous, tpu.u32(scr.seed_chain[i]),
                            tpu.u32(init_s[0, row, col + 1 - i])) for i in range(2))
        last = tuple(jnp.where(hazardous, tpu.u32(scr.seed_chain[2 + i]),
                               tpu.u32(init_s[1, row, col + 1 - i])) for i in range(2))
        pos_check = jnp.logical_not(hashing_u32.is_neg(s)) & cpa_on

        def token(i, carry):
            h, last = carry
            slot = field(i, _SLOT)
            ok = tpu.pair_in_range(slot, num_slots)
            tok = field(i, _TOK)
            pos = field(i, _POS)
            if check_input:
                etok, epos = field(i, _ETOK), field(i, _EPOS)
                bits = (jnp.where(hashing_u32.ne(tok, etok), int(_F.WRITE_TOKEN_MISMATCH), 0)
                        | jnp.where(hashing_u32.ne(pos, epos), int(_F.WRITE_POSITION_MISMATCH), 0))
                ring.append(tpu.record_words(jnp.int32(kind), [
                    slot, pos, tok, etok, h, epos, (zero32, tpu.u32(bits))]), ok & (bits != 0))
            expected = hashing_u32.add_u32(last, jnp.uint32(1))
            ring.append(tpu.record_words(jnp.int32(kind), [
                slot, pos, tok, tok, h, expected,
                (zero32, jnp.uint32(int(_F.WRITE_POSITION_MISMATCH)))]),
                ok & pos_check & hashing_u32.ne(pos, expected))

            @pl.when(ok)
            def _():
                rkv = field(i, _RKV)
                store(tpu.i32(slot[1]), [tpu.i32(v) for v in (
                    tok[1], tok[0], pos[1], pos[0], h[1], h[0], rkv[1], rkv[0])])
                misc.written = misc.written + 1

            nh = hashing_u32.mix3(h, tok, pos)
            h = tuple(jnp.where(ok, a, b) for a, b in zip(nh, h))
            last = tuple(jnp.where(ok, a, b) for a, b in zip(pos, last))
            return h, last

        lax.fori_loop(lo, hi, token, (h, last))
        return carry

    lax.fori_loop(0, active, request, 0)
    drain()
    for slot in (0, 1):
        @pl.when(misc.fetching[slot] == 1)
        def _(slot=slot):
            chunk_copy(0, slot).wait()

    tpu.finish_status(st_in, st_out, ring=ring, slot_runs=misc.written)


def smem_bytes(capacity: int, check_input: bool) -> int:
    cap_pad = tpu.pad_to(capacity + 1, tpu.PAIR_TILE)
    nfields = 6 if check_input else 4
    return (8 * cap_pad * 2  # offsets, seeds (scalar prefetch)
            + 8 * cap_pad * 2  # first links, last positions
            + 4 * cap_pad  # hazards
            + 2 * nfields * CHUNK * 8  # token chunks
            + 4 * tpu.LANES + 64)  # the ring's stage (a padded row), pend, misc, seed_chain


def run(context: VerifyOrWriteContext, plan: WritePlan, tokens: WriteTokens, *,
        enable_write_input_assert: bool, config: Config) -> VerifyOrWriteContext:
    """The updated context; the canary buffer and the ring are aliased to their inputs."""
    tokens = base.widened(tokens)  # int32 through the array-level run
    mode, kind = int(context.real_kv_hash_mode), int(context.kernel_kind)
    sources = context.bound_sources()
    check_input = bool(enable_write_input_assert)
    cap = int(plan.write_seed_slot_indices.shape[0])
    num_tokens = int(tokens.input_ids.shape[0])
    num_slots = int(context.canary_buf.shape[0])
    ring_cap = int(context.violation_ring.shape[0])
    need = smem_bytes(cap, check_input)
    if need > SMEM_BUDGET:
        raise ValueError(
            f"kv-canary: canary_write (pallas_mosaic_tpu): a write plan of {cap} requests needs "
            f"{need} bytes of SMEM, more than the kernel's budget of {SMEM_BUDGET}; use "
            f"implementation='xla' for plans this large")
    cap_pad = tpu.pad_to(cap + 1, tpu.PAIR_TILE)
    t_pad = tpu.pad_to(num_tokens, CHUNK)
    t_pad = tpu.pad_to(t_pad, config.block)
    zeros = jnp.zeros((1,), jnp.int64)
    rows = lambda x: tpu.to_pair_rows(x if x.shape[0] else zeros, t_pad)  # noqa: E731
    ocl = rows(tokens.out_cache_loc)
    has_rkv = bool(sources) and mode != int(consts.RealKvHashMode.NONE)
    if has_rkv:
        rkv = fingerprint.fingerprints_from_pair_rows(
            ocl, jnp.asarray([num_tokens], jnp.int32), sources, mode=mode, block=config.block,
            interpret=config.interpret or False)
    else:
        rkv = jnp.zeros_like(ocl)
    fields = [ocl, rows(tokens.input_ids), rows(tokens.positions), rkv]
    if check_input:
        fields += [rows(tokens.expected_input_tokens), rows(tokens.expected_input_positions)]
    toks = jnp.stack(fields)
    off = tpu.to_pair_rows(plan.write_offsets, cap_pad)
    seeds = tpu.to_pair_rows(plan.write_seed_slot_indices if cap else zeros, cap_pad)
    canary = tpu.canary_tiles(context.canary_buf)
    ring = tpu.words32(context.violation_ring) if ring_cap else jnp.zeros((1, 16), jnp.int32)
    st = tpu.status_words(plan.write_num_valid_reqs, context.enable_chain_position_assert,
                          context)
    rc = cap_pad // tpu.LANES
    state = _state(rc, cap_pad, len(fields))
    kernel = functools.partial(
        _write_kernel, state=state, cap=cap, num_tokens=num_tokens, num_slots=num_slots,
        ring_cap=ring_cap, kind=kind,
        check_input=check_input, nchunks=t_pad // CHUNK)
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    vmem_spec = pl.BlockSpec(memory_space=pltpu.VMEM)
    nbytes = num_tokens * (8 * len(fields) + 8 + 32) + cap * 48
    tiles, ring32, st_out, _ = tpu.call(
        kernel, st, off, seeds, toks, seeds, ocl, canary, ring,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3, grid=(1,),
            in_specs=[any_spec, vmem_spec, vmem_spec, any_spec, any_spec],
            out_specs=[any_spec, any_spec, pl.BlockSpec(memory_space=pltpu.SMEM), any_spec],
            scratch_shapes=state.scratch_shapes()),
        out_shape=[jax.ShapeDtypeStruct(canary.shape, jnp.uint8),
                   jax.ShapeDtypeStruct(ring.shape, jnp.int32),
                   jax.ShapeDtypeStruct((tpu.STATUS_WORDS,), jnp.int32),
                   jax.ShapeDtypeStruct((2, 2 * rc, tpu.LANES), jnp.int32)],
        input_output_aliases={6: 0, 7: 1},
        compiler_params=tpu.compiler_params(config.vmem_limit_bytes),
        cost_estimate=tpu.cost(bytes_accessed=nbytes, ops=num_tokens * 400 + cap * 300),
        interpret=config.interpret or False,
        name="kvcanary_write_tpu",
    )
    canary_in = context.canary_buf
    return tpu.from_status(
        context, st_out, ring32,
        canary_buf=tpu.canary_from_tiles(tiles, canary_in))
