"""canary_write: stamp (token, position, chain link, real-KV fingerprint) into each written slot.

Semantics (SGLang's ``launch_canary_write_kernel``, spec section 9)::

    kernel_run_counter += 1                                  # always
    for r in [0, clamp(write_num_valid_reqs, 0, write_req_capacity)):
        h = slot_hash(seed)  (anchor hash if seed < 0);  last = seed.position (chain-position check)
        for i in [write_offsets[r], write_offsets[r + 1]):
            slot = out_cache_loc[i];  skip if slot < 0
            input assert (token / position vs expected_*) -> record, chain still on actual values
            chain-position assert (seed >= 0 and flag) -> record when position != last + 1
            canary_buf[slot] = (token, position, h, real_kv_hash(slot))
            h = mix3(h, token, position)
            slot_run_counter += 1

Parallel shape: one program per request row (grid = write_req_capacity, at least 1; rows past
the valid count do nothing), one warp each (``NUM_WARPS``): a request's chain is serial, and only
its ``mix3`` step has to be. A program takes its tokens in blocks of ``block`` lanes: the block's
slots / ids / positions are vector loads, its real-KV fingerprints (field 3) are folded and
scattered vectorised, and the input assert is checked vectorised. The chain is a scalar loop in
token order (``unroll`` steps per trip, then single steps for the remainder) whose body loads the
token's slot, id and position (L1 hits), stores fields 0-2 with predicated scalar stores and
advances the hash. A block with a violation to record (rare) runs its chain again to collect each
lane's link and expected position, then reserves its rows with one atomic add and scatters them.

Guarantees where SGLang's GPU kernel leaves things unspecified or out of bounds:

* Within a request everything is sequential, as in SGLang's reference: when a slot repeats in a
  request the last occurrence's row is stored. Fields 0-2 are scalar stores in token order (Triton
  issues a scalar store from one thread; with one warp every lane would store the same value in
  the same instruction anyway), so the last one wins with no barrier; field 3 depends on the slot
  only, so every duplicate stores the same value. The seed slot is read once, before the request's
  first store. Violation rows of one request are appended in entry order (input-assert row before
  the chain-position row of the same entry).
* Across requests of one launch (a slot written by two requests, a seed written by another
  request) the result is unspecified on the GPU, as in SGLang; interpret mode runs requests in
  order and so reproduces the reference.
* Nothing is read or written out of bounds: a slot at or past ``num_slots`` is skipped like a
  negative one (SGLang writes past the buffer; its reference raises IndexError); a seed at or past
  ``num_slots`` reads as an all-zero slot; a token index outside ``input_ids`` is skipped; a
  real-KV row past a source's rows reads as zero words.
* A negative ``write_num_valid_reqs`` means no request (the reference's clamp; SGLang's GPU reads
  it as huge). Requests are taken from their own ranges: the reference's early exit on
  ``write_offsets[A] <= 0`` differs only for non-monotonic offsets.
* All validation happens at trace time, before anything runs (SGLang's reference bumps
  ``kernel_run_counter`` first and validates only when there is work).

:func:`canary_write_reference` is a pure-jnp, fully sequential version of the same op (requests
and tokens in order), with the same bounds choices.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kvcanary_jax import _config, consts, hashing
from kvcanary_jax._config import pl, plt
from kvcanary_jax.context import (
    SourceAbi,
    SourceCount,
    SourceSpec,
    VerifyOrWriteContext,
    as_words,
    check_extent,
    source_spec,
)
from kvcanary_jax.contracts import Check, Contiguous, Contract, Rule, meta_of
from kvcanary_jax.ops.verify import (
    append_rows,
    canary_checks,
    canary_from_words,
    canary_words,
    context_guard_checks,
    scatter,
    source_metas,
    tensor_guard,
)
from kvcanary_jax.plans import WritePlan

__all__ = [
    "CONTRACT",
    "canary_write",
    "write_impl",
    "canary_write_reference",
    "BLOCK",
    "CHAIN_UNROLL",
    "NUM_WARPS",
]

# Tokens per block of one request: the vector part (loads, real-KV fingerprints, their store,
# the input assert and the per-block violation check) is amortised over the block; the serial
# part is one mix3 and three predicated scalar stores per token.
BLOCK = 128
# mix3 steps per trip of the chain loop: straight-line code lets the next steps' scalar loads
# (L1 hits after the block's vector loads) issue while the current hash is computed.
CHAIN_UNROLL = 8
# A program is one serial chain: more warps would only repeat its scalar work and take residency
# from other requests' programs.
NUM_WARPS = 1

_W = "canary_write"


class _ExpectedPresence(Check):
    """SGLang's flag / expected-tensor consistency (scalar ``enable_write_input_assert``)."""

    def run(self, metas, scalars):
        tok, pos = metas.get("expected_input_tokens"), metas.get("expected_input_positions")
        if scalars["enable_write_input_assert"]:
            if tok is None or pos is None:
                raise ValueError(
                    "kv-canary: expected input tensors are required when "
                    "enable_write_input_assert=True"
                )
        elif tok is not None or pos is not None:
            raise ValueError(
                "kv-canary: expected input tensors must be None when enable_write_input_assert=False"
            )


def _same_length(metas, scalars):
    n = metas["input_ids"].shape[0]
    for name in ("positions", "out_cache_loc", "expected_input_tokens", "expected_input_positions"):
        m = metas.get(name)
        if m is not None and m.shape != (n,):
            return {"name": name, "shape": m.shape, "n": n}
    return None


def _offsets_length(metas, scalars):
    c = metas["plan.write_seed_slot_indices"].shape[0]
    n = metas["plan.write_offsets"].shape[0]
    return None if n == c + 1 else {"c1": c + 1, "n": n}


# SGLang's launcher order: source count (every path); contiguity of the plan / token tensors;
# flag consistency and the expected tensors' contiguity; contiguity of the sinks; per-source
# ABI checks; then what SGLang's C++ guards check (dtypes, shapes: RuntimeError, wording ours)
# and the canary stride (the reference's ValueError).
CONTRACT = Contract(
    op=_W,
    checks=(
        SourceCount(),
        *(Contiguous(n) for n in (
            "canary_buf", "plan.write_offsets", "plan.write_seed_slot_indices",
            "plan.write_num_valid_reqs", "input_ids", "positions", "out_cache_loc")),
        _ExpectedPresence(),
        Contiguous("expected_input_tokens"),
        Contiguous("expected_input_positions"),
        *(Contiguous(n) for n in (
            "violation_ring", "violation_write_index", "slot_run_counter",
            "kernel_run_counter", "enable_chain_position_assert")),
        SourceAbi(),
        *tensor_guard(_W, "plan.write_offsets", "int64", 1),
        *tensor_guard(_W, "plan.write_seed_slot_indices", "int64", 1),
        *tensor_guard(_W, "plan.write_num_valid_reqs", "int32", (1,)),
        Rule(
            _offsets_length,
            "kv-canary: canary_write: write_offsets.size(0) must equal write_req_capacity + 1 "
            "({c1}), got {n}",
            RuntimeError,
        ),
        *tensor_guard(_W, "input_ids", "int64", 1),
        *tensor_guard(_W, "positions", "int64", 1),
        *tensor_guard(_W, "out_cache_loc", "int64", 1),
        *tensor_guard(_W, "expected_input_tokens", "int64", 1),
        *tensor_guard(_W, "expected_input_positions", "int64", 1),
        Rule(
            _same_length,
            "kv-canary: canary_write: {name} must have the length of input_ids ({n}), "
            "got shape {shape}",
            RuntimeError,
        ),
        *context_guard_checks(_W),
        *tensor_guard(_W, "enable_chain_position_assert", "int32", (1,)),
        *canary_checks(),
    ),
)


def _write_kernel(
    offsets_ref, seeds_ref, nvalid_ref, ids_ref, pos_ref, ocl_ref, etok_ref, epos_ref, cpa_ref,
    *refs, specs, mode, kind, check_input, num_tokens, num_slots, slot_words, ring_cap, block,
    unroll,
):
    nsrc = len(specs)
    src_refs = refs[:nsrc]
    canary, ring, widx, sctr, kctr = refs[nsrc + 5:]
    r = pl.program_id(0)
    i64 = jnp.int64
    zero = jnp.zeros((), i64)
    # Masked-off scalar stores aim at slot 0's words: the GPU does not touch them, and interpret
    # mode writes their current value back, so nothing changes there either.
    idt = jnp.int32 if canary.shape[0] < 2**31 else i64

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
    if num_slots:
        base = jnp.where(seed_ok, seed, 0) * slot_words
        s_tok, s_pos, s_ph = (jnp.where(seed_ok, canary[base + f], zero) for f in (
            consts.CANARY_FIELD_TOKEN, consts.CANARY_FIELD_POSITION, consts.CANARY_FIELD_PREV_HASH))
    else:
        s_tok = s_pos = s_ph = zero
    pos_check = (seed >= 0) & (cpa != 0)
    last0 = jnp.where(pos_check, s_pos, zero)
    lane = jnp.arange(block, dtype=i64)

    def token(j):
        """Scalar loads of the request's token j (in-request offset); v: it is written."""
        i = start + j
        ok = (j < n) & (i >= 0) & (i < num_tokens)
        ic = jnp.where(ok, i, 0).astype(jnp.int32)
        s, t, p = ocl_ref[ic], ids_ref[ic], pos_ref[ic]
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
        # Unrolled trips: the next steps' loads do not depend on h, so they issue while the
        # current mix3 runs. The remainder runs one step per trip (a 1-token request pays for
        # one mix3, not `unroll`).
        full = cnt // unroll

        def trip(c, carry):
            j = j0 + c.astype(i64) * unroll
            # Every load of the trip comes first in program order: placed after a store they
            # could not be moved above it (the compiler cannot prove the buffers distinct), and
            # in-order issue would then add an L1 latency to every link of the chain.
            tks = [token(j + u) for u in range(unroll)]
            for tk in tks:
                carry = step(tk, *carry)
            return carry

        carry = jax.lax.fori_loop(zero, full, trip, (h, last, jnp.zeros((), jnp.bool_)))
        return jax.lax.fori_loop(full * unroll, cnt, lambda jl, c: step(token(j0 + jl), *c),
                                 carry)

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
        slot = plt.load(ocl_ref.at[ic], mask=inb, other=-1)
        tok = plt.load(ids_ref.at[ic], mask=inb, other=0)
        pos = plt.load(pos_ref.at[ic], mask=inb, other=0)
        valid = inb & (slot >= 0) & (slot < num_slots)
        # Field 3 depends on the slot only: duplicates of a slot store the same value, so this
        # scatter needs no ordering against the block's other stores or another block's.
        rkv = hashing.fold_real_kv(slot, valid, src_refs, specs, mode)
        scatter(canary, slot * slot_words + consts.CANARY_FIELD_REAL_KV_HASH, rkv, valid)
        if h is None:  # first block: the seed's hash, emitted after the block's loads issue
            h = jnp.where(seed < 0, jnp.asarray(hashing.ANCHOR_HASH_I64, i64),
                          hashing.mix3(s_ph, s_tok, s_pos))
        h_out, last_out, bad = chain(j0, cnt, h, last)

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
            first = plt.atomic_add(widx, (jnp.int32(0),), jnp.sum(nrows, dtype=jnp.int32))
            # Entry order within the request: a lane's rows follow every earlier lane's, its
            # input-assert row before its chain-position row.
            row_in = first + jnp.cumsum(nrows, dtype=jnp.int32) - nrows
            kind_v = jnp.full((block,), kind, i64)
            append_rows(ring, row_in, hin, ring_cap,
                        (kind_v, slot, pos, tok, e_tok, hvec, e_pos, b_in))
            wpm = jnp.full((block,), int(F.WRITE_POSITION_MISMATCH), i64)
            append_rows(ring, row_in + hin.astype(jnp.int32), has_ch, ring_cap,
                        (kind_v, slot, pos, tok, tok, hvec, lp1vec, wpm))

        return h_out, last_out, written + jnp.sum(valid.astype(i64))

    # The first block is peeled out of the loop: straight-line code from the scalar loads to the
    # first mix3, and a short request never enters the loop.
    carry = do_block(zero, None, last0, zero)
    nblocks = (n + block - 1) // block
    _, _, written = jax.lax.fori_loop(
        jnp.ones((), i64), nblocks, lambda b, c: do_block(b * block, *c), carry)

    @pl.when(n > 0)
    def _count():
        plt.atomic_add(sctr, (jnp.int32(0),), written)


@functools.partial(
    jax.jit,
    static_argnames=("specs", "mode", "kind", "check_input", "block", "unroll", "num_warps",
                     "interpret"),
)
def _write_jit(canary_buf, violation_ring, violation_write_index, slot_run_counter,
               kernel_run_counter, enable_chain_position_assert, write_offsets,
               write_seed_slot_indices, write_num_valid_reqs, input_ids, positions, out_cache_loc,
               expected_input_tokens, expected_input_positions, source_bufs, *, specs, mode, kind,
               check_input, block, unroll, num_warps, interpret):
    num_slots, stride_bytes = canary_buf.shape
    ring_cap = violation_ring.shape[0]
    num_tokens = input_ids.shape[0]
    capacity = write_seed_slot_indices.shape[0]
    if num_tokens == 0:  # keep every scalar load in bounds; the masks use the true length
        pad = lambda x: jnp.zeros((1,), jnp.int64)  # noqa: E731
        input_ids, positions, out_cache_loc = pad(0), pad(0), pad(0)
        if check_input:
            expected_input_tokens, expected_input_positions = pad(0), pad(0)
    if not check_input:
        expected_input_tokens, expected_input_positions = input_ids, positions
    if capacity == 0:  # one program still runs, to bump kernel_run_counter (SGLang: grid >= 1)
        write_offsets = jnp.zeros((2,), jnp.int64)
        write_seed_slot_indices = jnp.full((1,), -1, jnp.int64)
        capacity = 1
    words = [as_words(b) for b in source_bufs]
    for i, (w, spec) in enumerate(zip(words, specs)):
        check_extent(w, spec, i)
    canary = canary_words(canary_buf)
    ring = violation_ring.reshape(-1)
    kernel = functools.partial(
        _write_kernel, specs=specs, mode=mode, kind=kind, check_input=check_input,
        num_tokens=num_tokens, num_slots=num_slots, slot_words=stride_bytes // 8,
        ring_cap=ring_cap, block=block, unroll=unroll,
    )
    ins = [write_offsets, write_seed_slot_indices, write_num_valid_reqs, input_ids, positions,
           out_cache_loc, expected_input_tokens, expected_input_positions,
           enable_chain_position_assert, *words]
    outs = [canary, ring, violation_write_index, slot_run_counter, kernel_run_counter]
    k = len(ins)
    canary, ring, widx, sctr, kctr = pl.pallas_call(
        kernel,
        out_shape=[jax.ShapeDtypeStruct(o.shape, o.dtype) for o in outs],
        grid=(capacity,),
        input_output_aliases={k + j: j for j in range(len(outs))},
        interpret=interpret,
        compiler_params=None if interpret else _config.compiler_params(num_warps),
        name="kvcanary_write",
    )(*ins, *outs)
    return canary_from_words(canary, canary_buf.shape), ring.reshape(violation_ring.shape), \
        widx, sctr, kctr


def validate(context, plan, input_ids, positions, out_cache_loc, enable_write_input_assert,
             expected_input_tokens, expected_input_positions):
    tensors = {
        "canary_buf": context.canary_buf,
        "plan.write_offsets": plan.write_offsets,
        "plan.write_seed_slot_indices": plan.write_seed_slot_indices,
        "plan.write_num_valid_reqs": plan.write_num_valid_reqs,
        "input_ids": input_ids,
        "positions": positions,
        "out_cache_loc": out_cache_loc,
        "expected_input_tokens": expected_input_tokens,
        "expected_input_positions": expected_input_positions,
        "violation_ring": context.violation_ring,
        "violation_write_index": context.violation_write_index,
        "slot_run_counter": context.slot_run_counter,
        "kernel_run_counter": context.kernel_run_counter,
        "enable_chain_position_assert": context.enable_chain_position_assert,
    }
    metas = {k: (None if v is None else meta_of(v)) for k, v in tensors.items()}
    metas.update(source_metas(context.real_kv_sources))
    CONTRACT.validate_metas(
        metas, num_sources=len(context.real_kv_sources),
        enable_write_input_assert=bool(enable_write_input_assert),
    )


@_config.with_x64
def write_impl(
    *, canary_buf, violation_ring, violation_write_index, slot_run_counter, kernel_run_counter,
    enable_chain_position_assert, write_offsets, write_seed_slot_indices, write_num_valid_reqs,
    input_ids, positions, out_cache_loc, expected_input_tokens, expected_input_positions,
    sources: tuple[tuple[jax.Array, SourceSpec], ...], kernel_kind: int, real_kv_hash_mode: int,
    enable_write_input_assert: bool, block: int = BLOCK, unroll: int = CHAIN_UNROLL,
    num_warps: int = NUM_WARPS, interpret: bool | None = None,
):
    """Array-level entry (no validation): each source is ``(buffer, SourceSpec)`` where the
    buffer is any compact array holding the source's bytes. Returns ``(canary_buf,
    violation_ring, violation_write_index, slot_run_counter, kernel_run_counter)``; donate the
    first five arguments' buffers for an in-place update.

    Launch parameters (GPU): ``block`` tokens per vector block (a power of two), ``unroll``
    chain steps per loop trip, ``num_warps`` per program. Results do not depend on them; more
    than one warp is correct only because Triton issues a scalar store from a single thread (the
    in-request order of repeated slots), and is expected to be slower."""
    if interpret is None:
        interpret = _config.default_interpret()
    return _write_jit(
        canary_buf, violation_ring, violation_write_index, slot_run_counter, kernel_run_counter,
        enable_chain_position_assert, write_offsets, write_seed_slot_indices,
        write_num_valid_reqs, input_ids, positions, out_cache_loc, expected_input_tokens,
        expected_input_positions, tuple(b for b, _ in sources),
        specs=tuple(s for _, s in sources), mode=int(real_kv_hash_mode), kind=int(kernel_kind),
        check_input=bool(enable_write_input_assert), block=block, unroll=unroll,
        num_warps=num_warps, interpret=interpret,
    )


@_config.with_x64
def canary_write(
    *,
    context: VerifyOrWriteContext,
    plan: WritePlan,
    input_ids: jax.Array,
    positions: jax.Array,
    out_cache_loc: jax.Array,
    enable_write_input_assert: bool,
    expected_input_tokens: jax.Array | None,
    expected_input_positions: jax.Array | None,
    block: int = BLOCK,
    unroll: int = CHAIN_UNROLL,
    num_warps: int = NUM_WARPS,
    interpret: bool | None = None,
) -> VerifyOrWriteContext:
    """Write canary records for the batch's written tokens; returns the updated context.

    Arguments as SGLang's ``launch_canary_write_kernel`` (keyword-only; int64 token tensors of one
    length, a :class:`~kvcanary_jax.plans.WritePlan`). The returned context carries the new
    ``canary_buf``, ``violation_ring``, ``violation_write_index``, ``slot_run_counter`` and
    ``kernel_run_counter``; its other fields are the input's. Under
    ``jax.jit(..., donate_argnames="context")`` the update is in place (the kernel aliases those
    buffers; the sources' arrays come back unchanged and aliased).

    Raises at trace time: SGLang's ValueErrors (more than 4 sources; expected tensors present iff
    the assert is on; per-source ABI checks; canary slot stride below 4 int64 fields);
    RuntimeError for dtype / shape mismatches (SGLang's C++ guards).
    """
    validate(context, plan, input_ids, positions, out_cache_loc, enable_write_input_assert,
              expected_input_tokens, expected_input_positions)
    sources = tuple((s.tensor, source_spec(s)) for s in context.real_kv_sources)
    canary, ring, widx, sctr, kctr = write_impl(
        canary_buf=context.canary_buf, violation_ring=context.violation_ring,
        violation_write_index=context.violation_write_index,
        slot_run_counter=context.slot_run_counter, kernel_run_counter=context.kernel_run_counter,
        enable_chain_position_assert=context.enable_chain_position_assert,
        write_offsets=plan.write_offsets, write_seed_slot_indices=plan.write_seed_slot_indices,
        write_num_valid_reqs=plan.write_num_valid_reqs, input_ids=input_ids, positions=positions,
        out_cache_loc=out_cache_loc, expected_input_tokens=expected_input_tokens,
        expected_input_positions=expected_input_positions, sources=sources,
        kernel_kind=int(context.kernel_kind), real_kv_hash_mode=int(context.real_kv_hash_mode),
        enable_write_input_assert=enable_write_input_assert, block=block, unroll=unroll,
        num_warps=num_warps, interpret=interpret,
    )
    return context.replace(canary_buf=canary, violation_ring=ring, violation_write_index=widx,
                           slot_run_counter=sctr, kernel_run_counter=kctr)



# ---------------------------------------------------------------------------------------------
# Pure-jnp reference: requests and tokens strictly in order (so cross-request hazards resolve as
# in SGLang's reference), with the same bounds choices as the kernel.


@functools.partial(jax.jit, static_argnames=("specs", "mode", "kind", "check_input"))
def _write_reference_jit(canary_buf, ring, widx, sctr, kctr, cpa, offsets, seeds, nvalid, ids,
                         pos, ocl, etok, epos, source_bufs, *, specs, mode, kind, check_input):
    i64 = jnp.int64
    num_slots, stride = canary_buf.shape
    num_tokens = ids.shape[0]
    c = canary_words(canary_buf).reshape(num_slots, -1)
    ring_cap = ring.shape[0]
    words = [as_words(b) for b in source_bufs]
    capacity = seeds.shape[0]
    active = jnp.clip(nvalid[0], 0, capacity)
    safe = lambda a, i: a[jnp.clip(i, 0, max(num_tokens - 1, 0))] if num_tokens else i * 0  # noqa

    def append(ring, widx, fields, when):
        at = jnp.where(when & (widx < ring_cap), widx, ring_cap)
        return ring.at[at].set(jnp.stack(fields).astype(i64), mode="drop"), widx + when

    def request(r, st):
        c, ring, widx, written = st
        start, end = offsets[r], offsets[r + 1]
        seed = seeds[r]
        seed_ok = (seed >= 0) & (seed < num_slots)
        srow = jnp.where(seed_ok, c[jnp.where(seed_ok, seed, 0), :4], 0)
        h0 = jnp.where(seed < 0, jnp.asarray(hashing.ANCHOR_HASH_I64, i64),
                       hashing.mix3(srow[2], srow[0], srow[1]))
        pos_check = (seed >= 0) & (cpa[0] != 0)

        def token(i, st):
            c, ring, widx, written, h, last = st
            ok = (r < active) & (i >= 0) & (i < num_tokens)
            slot, t, p = safe(ocl, i), safe(ids, i), safe(pos, i)
            v = ok & (slot >= 0) & (slot < num_slots)
            rkv = hashing.fold_real_kv(slot[None], v[None], words, specs, mode,
                                       gather=hashing.array_gather)[0]
            if check_input:
                et, ep = safe(etok, i), safe(epos, i)
                bits = (jnp.where(t != et, int(consts.FailReason.WRITE_TOKEN_MISMATCH), 0)
                        | jnp.where(p != ep, int(consts.FailReason.WRITE_POSITION_MISMATCH), 0))
                ring, widx = append(ring, widx, [kind, slot, p, t, et, h, ep, bits],
                                    v & (bits != 0))
            ring, widx = append(ring, widx, [kind, slot, p, t, t, h, last + 1,
                                             int(consts.FailReason.WRITE_POSITION_MISMATCH)],
                                v & pos_check & (p != last + 1))
            c = c.at[jnp.where(v, slot, num_slots), :4].set(jnp.stack([t, p, h, rkv]),
                                                             mode="drop")
            return (c, ring, widx, written + v, jnp.where(v, hashing.mix3(h, t, p), h),
                    jnp.where(v, p, last))

        # Tokens outside the arrays are skipped, so the loop runs over the in-range part only.
        lo = jnp.clip(start, 0, num_tokens)
        hi = jnp.where(r < active, jnp.clip(end, 0, num_tokens), lo)
        c, ring, widx, written, _, _ = jax.lax.fori_loop(
            lo, hi, token, (c, ring, widx, written, h0, jnp.where(pos_check, srow[1], 0)))
        return c, ring, widx, written

    c, ring, widx1, written = jax.lax.fori_loop(
        0, capacity, request, (c, ring, widx[0], jnp.zeros((), i64)))
    return (canary_from_words(c.reshape(-1), canary_buf.shape), ring,
            widx1.reshape(1).astype(jnp.int32), sctr + written, kctr + 1)


@_config.with_x64
def canary_write_reference(*, context: VerifyOrWriteContext, plan: WritePlan, input_ids,
                           positions, out_cache_loc, enable_write_input_assert: bool,
                           expected_input_tokens, expected_input_positions
                           ) -> VerifyOrWriteContext:
    """Pure-jnp reference of :func:`canary_write` (fully sequential)."""
    validate(context, plan, input_ids, positions, out_cache_loc, enable_write_input_assert,
             expected_input_tokens, expected_input_positions)
    ids = jnp.asarray(input_ids)
    canary, ring, widx, sctr, kctr = _write_reference_jit(
        context.canary_buf, context.violation_ring, context.violation_write_index,
        context.slot_run_counter, context.kernel_run_counter,
        context.enable_chain_position_assert, plan.write_offsets, plan.write_seed_slot_indices,
        plan.write_num_valid_reqs, ids, jnp.asarray(positions), jnp.asarray(out_cache_loc),
        ids if expected_input_tokens is None else jnp.asarray(expected_input_tokens),
        ids if expected_input_positions is None else jnp.asarray(expected_input_positions),
        tuple(s.tensor for s in context.real_kv_sources),
        specs=tuple(source_spec(s) for s in context.real_kv_sources),
        mode=int(context.real_kv_hash_mode), kind=int(context.kernel_kind),
        check_input=bool(enable_write_input_assert),
    )
    return context.replace(canary_buf=canary, violation_ring=ring, violation_write_index=widx,
                           slot_run_counter=sctr, kernel_run_counter=kctr)
