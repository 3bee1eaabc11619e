"""canary_write as a Pallas kernel (Triton lowering on CUDA GPUs; interpret mode too).

Parallel shape: one program per request row (grid = write_req_capacity; rows past the valid
count do nothing), one warp each (``num_warps``): a request's chain is serial, and only
its ``mix3`` step has to be. A program takes its tokens in blocks of ``block`` lanes: the block's
slots / ids / positions are vector loads, its real-KV fingerprints (field 3) are folded and
scattered vectorised, and the input assert is checked vectorised. The chain is a scalar loop in
token order whose body loads the token's slot, id and position (L1 hits), stores fields 0-2 with
scalar stores and advances the hash. A block of at least ``unroll`` tokens, all in bounds and all
written (a server's step, but for a skipped slot; decided once from the block's vector loads), runs
the fast chain: ``unroll`` steps per trip (then single steps for the remainder), no per-token
checks, selects or masks, unmasked stores, and the position check done on the block's vectors. Any
other block runs the general chain, one step per trip, with each token's checks and predicated
stores. For sm_90 the fast chain takes about 75 SASS instructions a token, the general one about
110 (what every block ran before the fast chain), the chain floor 64 (``bench.write_sass``). A
block with a violation to record (rare) runs its chain again to collect each lane's link and
expected position, then claims its rows (one compare-and-swap loop under the ring guard of
:mod:`kvcanary_jax.ops._kernel_lib`) and scatters them.

In-request order: fields 0-2 are scalar stores in token order (Triton issues a scalar store from
one thread; with one warp every lane would store the same value in the same instruction anyway),
so the last occurrence of a repeated slot wins with no barrier; field 3 depends on the slot only,
so every duplicate stores the same value. Across requests the programs run concurrently on the
GPU; interpret mode runs them in order and so reproduces the reference. Semantics and bounds:
:mod:`kvcanary_jax.ops.write.base`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from kvcanary_jax import consts, hashing
from kvcanary_jax.context import VerifyOrWriteContext, as_words
from kvcanary_jax.ops import _kernel_lib
from kvcanary_jax.ops._kernel_lib import (
    append_rows,
    canary_from_words,
    canary_words,
    claim_rows,
    scatter,
)
from kvcanary_jax.ops.write.base import WriteTokens
from kvcanary_jax.plans import WritePlan

__all__ = ["Config", "heuristics", "run", "BLOCK", "SMALL_BLOCK", "CHAIN_UNROLL", "NUM_WARPS",
           "FOLD_VEC"]

# Tokens per block of one request: the vector part (loads, real-KV fingerprints, their store,
# the input assert and the per-block violation check) is amortised over the block; the serial
# part is one mix3 and three predicated scalar stores per token.
BLOCK = 128
# mix3 steps per trip of the fast chain's loop: straight-line code lets the next steps' scalar
# loads (L1 hits after the block's vector loads) issue while the current hash is computed.
CHAIN_UNROLL = 8
# A program is one serial chain: more warps would only repeat its scalar work and take residency
# from other requests' programs.
NUM_WARPS = 1
# Real-KV words a lane loads at once for the fingerprints (hashing.fold_real_kv's words, in
# vector loads of up to this many: a 256-byte strip is 8 loads of 32 bytes, not 32 of 8).
FOLD_VEC = 1


@dataclasses.dataclass(frozen=True)
class Config:
    """``block``: tokens per vector block (a power of two); ``unroll``: the fast chain's steps
    per loop trip; ``num_warps`` per program. Results do not depend on them; more than one warp is
    correct only because Triton issues a scalar store from a single thread (the in-request order
    of repeated slots), and is expected to be slower. ``interpret``: Pallas interpret mode (any
    backend; what ``pallas_interpret`` runs). ``fold_vec``: real-KV words a lane loads at once
    (1, 2 or 4)."""

    block: int = BLOCK
    unroll: int = CHAIN_UNROLL
    num_warps: int = NUM_WARPS
    fold_vec: int = FOLD_VEC
    interpret: bool = False

    def __post_init__(self):
        _kernel_lib.check_interpret("canary_write", self.interpret)
        if self.block < 1 or self.block & (self.block - 1) or self.unroll < 1 or \
                self.num_warps < 1 or self.fold_vec not in (1, 2, 4):
            raise ValueError(f"kv-canary: canary_write: bad launch config {self} (block a power "
                             "of two, unroll and num_warps >= 1, fold_vec 1, 2 or 4)")


# The block of a step with no more tokens than requests (a decode step: one token each): the
# real-KV fingerprints are folded on every lane of a block, valid or not (at BLOCK 128 and one
# warp, 4 strips of 32 serial splitmix64 rounds a thread), and a one-token request needs 1 lane.
SMALL_BLOCK = 32


def heuristics(shapes) -> Config:
    """``BLOCK`` tokens a block, ``SMALL_BLOCK`` where the step has no more tokens than requests
    or than ``SMALL_BLOCK`` (no request can have more than ``num_tokens`` of them, so a long one
    pays at most ``num_tokens / SMALL_BLOCK`` blocks; a server that pads a decode step's tokens
    to a bucket above its request rows, as tpu-inference's 16, still takes the small block)."""
    small = shapes.get("num_tokens", BLOCK + 1) <= max(shapes.get("write_capacity", 0),
                                                       SMALL_BLOCK)
    return Config(block=SMALL_BLOCK if small else BLOCK, fold_vec=FOLD_VEC)


def _write_kernel(
    offsets_ref, seeds_ref, nvalid_ref, ids_ref, pos_ref, ocl_ref, etok_ref, epos_ref, cpa_ref,
    *refs, specs, mode, kind, check_input, num_tokens, num_slots, slot_words, ring_cap, block,
    unroll, fold_vec=1,
):
    nsrc = len(specs)
    src_refs = refs[:nsrc]
    canary, ring, widx, sctr, kctr = refs[nsrc + 5:]
    r = pl.program_id(0)
    i64 = jnp.int64
    zero = jnp.zeros((), i64)
    # Masked-off scalar stores aim at slot 0's words: the GPU does not touch them, and interpret
    # mode writes their current value back, so nothing changes there either.
    idt = _kernel_lib.index_dtype(canary.shape[0])

    @pl.when(r == 0)
    def _bump():
        kctr[0] = kctr[0] + 1

    # The request's scalars are loaded unconditionally (every index is in bounds) so that their
    # latencies overlap; a program past the valid count simply gets n = 0.
    nvalid = nvalid_ref[0]
    start = offsets_ref[r]
    end = offsets_ref[r + 1]
    seed = seeds_ref[r]
    cpa = cpa_ref[0]
    n = jnp.where(r < nvalid, jnp.maximum(end - start, 0), zero)  # r < capacity: the clamp
    seed_ok = (seed >= 0) & (seed < num_slots)
    base = jnp.where(seed_ok, seed, 0) * slot_words
    s_tok, s_pos, s_ph = (jnp.where(seed_ok, canary[base + f], zero) for f in (
        consts.CANARY_FIELD_TOKEN, consts.CANARY_FIELD_POSITION, consts.CANARY_FIELD_PREV_HASH))
    pos_check = (seed >= 0) & (cpa != 0)
    last0 = jnp.where(pos_check, s_pos, zero)
    lane = jnp.arange(block, dtype=i64)

    def token(j):
        """Scalar loads of the request's token j (in-request offset); v: it is written."""
        i = start + j
        ok = (j < n) & (i >= 0) & (i < num_tokens)
        ic = jnp.where(ok, i, 0).astype(jnp.int32)
        # int32 or int64 arrays (base.NARROW_TOKENS), widened as they are loaded.
        s, t, p = (r[ic].astype(i64) for r in (ocl_ref, ids_ref, pos_ref))
        return s, t, p, ok & (s >= 0) & (s < num_slots)

    def step(tk, h, last, bad):
        # One link of the chain. Fields 0-2 are scalar stores issued in token order by one
        # thread, so a slot repeated in the request ends with its last occurrence's values.
        s, t, p, v = tk
        row = jnp.where(v, s, 0) * slot_words
        for f, val in ((consts.CANARY_FIELD_TOKEN, t), (consts.CANARY_FIELD_POSITION, p),
                       (consts.CANARY_FIELD_PREV_HASH, h)):
            plt.store(canary.at[(row + f).astype(idt)], val, mask=v)
        bad = bad | (v & (p != last + 1))
        return jnp.where(v, hashing.mix3(h, t, p), h), jnp.where(v, p, last), bad

    def chain(j0, cnt, h, last):
        # One step per trip. A block gets here only with a token skipped or out of bounds (rare
        # in a server's step: see fast_chain), so its code is kept small rather than unrolled
        # (unrolled like fast_chain's, it made triton's compile of the kernel 1.45x longer).
        return jax.lax.fori_loop(zero, cnt, lambda jl, c: step(token(j0 + jl), *c),
                                 (h, last, jnp.zeros((), jnp.bool_)))

    def fast_chain(j0, cnt, h, last, pos):
        """:func:`chain` for a block whose tokens are all in bounds and all written (decided
        once from the block's vector loads, ``pos`` its positions): no per-token bounds checks,
        selects or masks, the token arrays indexed in 32 bits from the block's first token, and
        the position check done on the block's vectors (each lane's position against the lane
        before's, the first against ``last``)."""
        i0 = (start + j0).astype(jnp.int32)  # in [0, num_tokens): every lane is in bounds
        cnt = cnt.astype(jnp.int32)
        full = cnt // unroll
        lane32 = lane.astype(jnp.int32)
        before = plt.load(pos_ref.at[i0 + jnp.maximum(lane32 - 1, 0)],
                          mask=(lane32 > 0) & (lane32 < cnt), other=0).astype(i64)
        want = jnp.where(lane32 == 0, last, before) + 1
        bad = jnp.sum(((lane32 < cnt) & (pos != want)).astype(jnp.int32)) > 0

        def token(jl):
            return tuple(r[i0 + jl].astype(i64) for r in (ocl_ref, ids_ref, pos_ref))

        def step(tk, h, last):
            s, t, p = tk
            row = s.astype(idt) * slot_words  # s in [0, num_slots): the row is in bounds
            for f, val in ((consts.CANARY_FIELD_TOKEN, t), (consts.CANARY_FIELD_POSITION, p),
                           (consts.CANARY_FIELD_PREV_HASH, h)):
                plt.store(canary.at[row + f], val)
            return hashing.mix3(h, t, p), p

        def trip(c, carry):
            # Unrolled: the next steps' loads do not depend on h, so they issue while the
            # current mix3 runs. Every load of the trip comes first in program order: placed
            # after a store they could not be moved above it (the compiler cannot prove the
            # buffers distinct), and in-order issue would then add an L1 latency to every link.
            tks = [token(c * unroll + u) for u in range(unroll)]
            for tk in tks:
                carry = step(tk, *carry)
            return carry

        carry = jax.lax.fori_loop(jnp.int32(0), full, trip, (h, last))
        h, last = jax.lax.fori_loop(full * unroll, cnt, lambda jl, c: step(token(jl), *c),
                                    carry)
        return h, last, bad

    def links(j0, cnt, h, last):
        """Each lane's chain hash and expected position (last + 1) before its token: the chain
        run again, only for a block that has a violation to record."""
        def one(jl, carry):
            h, last, hvec, lp1vec = carry
            _, t, p, v = token(j0 + jl)
            here = lane == jl
            hvec = jnp.where(here, h, hvec)
            lp1vec = jnp.where(here, last + 1, lp1vec)
            return (jnp.where(v, hashing.mix3(h, t, p), h), jnp.where(v, p, last), hvec, lp1vec)

        zeros = jnp.zeros((block,), i64)
        _, _, hvec, lp1vec = jax.lax.fori_loop(zero, cnt, one, (h, last, zeros, zeros))
        return hvec, lp1vec

    def do_block(j0, h, last, written):
        cnt = jnp.clip(n - j0, 0, block)
        i = start + j0 + lane
        inb = (lane < cnt) & (i >= 0) & (i < num_tokens)
        ic = jnp.where(inb, i, 0).astype(jnp.int32)
        # Vector loads: the slots for the fingerprints, and they bring the block's lines into L1
        # for the chain's scalar loads.
        slot = plt.load(ocl_ref.at[ic], mask=inb, other=-1).astype(i64)
        tok = plt.load(ids_ref.at[ic], mask=inb, other=0).astype(i64)
        pos = plt.load(pos_ref.at[ic], mask=inb, other=0).astype(i64)
        valid = inb & (slot >= 0) & (slot < num_slots)
        # Field 3 depends on the slot only: duplicates of a slot store the same value, so this
        # scatter needs no ordering against the block's other stores or another block's.
        rkv = _kernel_lib.fold_real_kv(slot, valid, src_refs, specs, mode,
                                       prefetch=_kernel_lib.write_prefetch(nsrc), vec=fold_vec)
        scatter(canary, slot * slot_words + consts.CANARY_FIELD_REAL_KV_HASH, rkv, valid)
        if h is None:  # first block: the seed's hash, emitted after the block's loads issue
            h = jnp.where(seed < 0, jnp.asarray(hashing.ANCHOR_HASH_I64, i64),
                          hashing.mix3(s_ph, s_tok, s_pos))
        # Whether every token is written: a reduction over the block, paid only where the fast
        # chain's unrolled trips can repay it (a decode step's one-token blocks take the
        # general chain, as fast for one token).
        # (The false branch returns its operand, false there: a constant cannot be yielded.)
        long = cnt >= unroll
        fast = jax.lax.cond(
            long, lambda _: jnp.sum(valid.astype(jnp.int32)) == cnt.astype(jnp.int32),
            lambda no: no, long)
        h_out, last_out, bad = jax.lax.cond(
            fast, fast_chain, lambda j0, cnt, h, last, _: chain(j0, cnt, h, last),
            j0, cnt, h, last, pos)

        F = consts.FailReason
        if check_input:
            etok = plt.load(etok_ref.at[ic], mask=inb, other=0)
            epos = plt.load(epos_ref.at[ic], mask=inb, other=0)
            bits_in = (jnp.where(tok != etok, int(F.WRITE_TOKEN_MISMATCH), 0)
                       | jnp.where(pos != epos, int(F.WRITE_POSITION_MISMATCH), 0))
            has_in = valid & (bits_in != 0)
            need = (pos_check & bad) | (jnp.sum(has_in.astype(jnp.int32)) > 0)
        else:
            need = pos_check & bad

        @pl.when(need)
        def _record():
            hvec, lp1vec = links(j0, cnt, h, last)
            if check_input:
                hin, e_tok, e_pos, b_in = has_in, etok, epos, bits_in.astype(i64)
            else:
                hin = jnp.zeros((block,), jnp.bool_)
                e_tok = e_pos = b_in = jnp.zeros((block,), i64)
            has_ch = valid & pos_check & (pos != lp1vec)
            nrows = hin.astype(jnp.int32) + has_ch.astype(jnp.int32)
            # At most two rows a token: its input assert and its chain position.
            w0 = claim_rows(widx, jnp.sum(nrows, dtype=jnp.int32), 2 * num_tokens)
            # Entry order within the request: a lane's rows follow every earlier lane's, its
            # input-assert row before its chain-position row.
            rel = jnp.cumsum(nrows, dtype=jnp.int32) - nrows
            kind_v = jnp.full((block,), kind, i64)
            append_rows(ring, w0, rel, hin, ring_cap,
                        (kind_v, slot, pos, tok, e_tok, hvec, e_pos, b_in))
            wpm = jnp.full((block,), int(F.WRITE_POSITION_MISMATCH), i64)
            append_rows(ring, w0, rel + hin.astype(jnp.int32), has_ch, ring_cap,
                        (kind_v, slot, pos, tok, tok, hvec, lp1vec, wpm))

        return h_out, last_out, written + jnp.sum(valid.astype(i64))

    # The first block is peeled out of the loop: straight-line code from the scalar loads to the
    # first mix3, and a short request never enters the loop. Not when the kernel folds real KV:
    # the fold's code, unrolled per source, would be there twice (four ALL-mode sources: 6,976
    # TTIR lines and 20 s of triton's compile for sm_90 peeled, half that in the loop alone),
    # and its loads dwarf what the peel saves.
    nblocks = (n + block - 1) // block
    if nsrc and mode != int(consts.RealKvHashMode.NONE):
        h0 = jnp.where(seed < 0, jnp.asarray(hashing.ANCHOR_HASH_I64, i64),
                       hashing.mix3(s_ph, s_tok, s_pos))
        carry, first = (h0, last0, zero), zero
    else:
        carry, first = do_block(zero, None, last0, zero), jnp.ones((), i64)
    _, _, written = jax.lax.fori_loop(
        first, nblocks, lambda b, c: do_block(b * block, *c), carry)

    @pl.when(n > 0)
    def _count():
        plt.atomic_add(sctr, (jnp.int32(0),), written)


def run(context: VerifyOrWriteContext, plan: WritePlan, tokens: WriteTokens, *,
        enable_write_input_assert: bool, config: Config) -> VerifyOrWriteContext:
    """The updated context, its canary, ring and counters aliased to their inputs.
    ``config.interpret``: Pallas interpret mode."""
    interpret = config.interpret
    sources = context.bound_sources()
    specs = tuple(s for _, s in sources)
    mode, kind = int(context.real_kv_hash_mode), int(context.kernel_kind)
    check_input = bool(enable_write_input_assert)
    num_slots, stride_bytes = context.canary_buf.shape
    ring_cap = context.violation_ring.shape[0]
    num_tokens = tokens.input_ids.shape[0]
    capacity = plan.write_seed_slot_indices.shape[0]
    # No empty canary buffer, ring, request or token array gets here
    # (kvcanary_jax.ops.write.base.sized_call). Without the assert the kernel reads its
    # expected operands nowhere: the token arrays stand in for them.
    expected = ((tokens.expected_input_tokens, tokens.expected_input_positions) if check_input
                else (tokens.input_ids, tokens.positions))
    words = [as_words(b) for b, _ in sources]
    canary = canary_words(context.canary_buf)
    ring = context.violation_ring.reshape(-1)
    kernel = functools.partial(
        _write_kernel, specs=specs, mode=mode, kind=kind, check_input=check_input,
        num_tokens=num_tokens, num_slots=num_slots, slot_words=stride_bytes // 8,
        ring_cap=ring_cap, block=config.block, unroll=config.unroll, fold_vec=config.fold_vec,
    )
    ins = [plan.write_offsets, plan.write_seed_slot_indices, plan.write_num_valid_reqs,
           tokens.input_ids, tokens.positions, tokens.out_cache_loc, *expected,
           context.enable_chain_position_assert, *words]
    # The write index is passed as a scalar: the compare-and-swap of the ring guard needs a
    # scalar ref.
    outs = [canary, ring, context.violation_write_index.reshape(()), context.slot_run_counter,
            context.kernel_run_counter]
    k = len(ins)
    canary, ring, widx, sctr, kctr = pl.pallas_call(
        kernel,
        out_shape=[jax.ShapeDtypeStruct(o.shape, o.dtype) for o in outs],
        grid=(capacity,),
        input_output_aliases={k + j: j for j in range(len(outs))},
        interpret=interpret,
        compiler_params=None if interpret else _kernel_lib.compiler_params(config.num_warps),
        name="kvcanary_write",
    )(*ins, *outs)
    return context.replace(canary_buf=canary_from_words(canary, context.canary_buf.shape),
                           violation_ring=ring.reshape(context.violation_ring.shape),
                           violation_write_index=widx.reshape(1), slot_run_counter=sctr,
                           kernel_run_counter=kctr)
