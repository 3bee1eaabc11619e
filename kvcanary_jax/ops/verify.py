"""canary_verify: check that written slots still hold what the write op stamped.

Semantics (SGLang's ``launch_canary_verify_kernel``, spec section 10)::

    kernel_run_counter += 1                                   # always, even when enable == 0
    if enable[0] == 0: return
    A = clamp(verify_num_valid[0], 0, verify_capacity);  slot_run_counter += A
    for k in [0, A):  (entries with slot 0 are skipped, still counted)
        (tok, pos, ph, rkv) = canary_buf[s];  p = prev slot
        exp_chain = anchor hash if p < 0, slot_hash(p) if p > 0, ph (check skipped) if p == 0
        bits = 1 chain | 32 token (when asked, expected != -1) | 2 position | 4 real-KV
        if bits: record(s, pos, tok, exp_tok, ph, exp_chain, bits)

Parallel shape: a persistent grid of at most ``max_programs`` programs, each taking blocks of
``block`` entries (grid-stride over the active blocks; no loop when one pass covers the plan).
A block is ``group`` column vectors (entry ``r * group + g`` in column g); per column the slot rows
are masked gathers of ``vec`` words per load, and the predecessor's fields are taken from column
g-1 when the plan says the predecessor is the previous entry's slot (chain order), gathered
otherwise. Fingerprints are folded vectorised, and the block's violation rows are reserved with
ONE atomic add on ``violation_write_index`` (an entry's row is that base plus the count of
violations before it in the block), so rows keep entry order within a block; the order across
blocks is the atomics' (as SGLang's GPU, compare as a multiset). Program 0 alone bumps the
counters (both are known before any entry is read).

Out-of-range indices never cause an out-of-bounds access (SGLang's GPU reads outside the buffer):

* a negative slot ``-num_slots <= s < 0`` reads row ``s + num_slots``, as SGLang's reference
  does (Python indexing); its real-KV fingerprint is computed from zero words (the reference
  raises there), i.e. expected 0;
* a slot outside ``[-num_slots, num_slots)`` reads as an all-zero row (its record carries the raw
  slot index);
* a predecessor at or past ``num_slots`` reads as an all-zero row (expected link mix3(0,0,0) = 0);
* a negative ``verify_num_valid`` means no entry (the reference's clamp).

This module also holds the helpers both ops share (canary word view, context guard checks).
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
from kvcanary_jax.contracts import Contiguous, Contract, DType, Rule, meta_of
from kvcanary_jax.plans import VerifyPlan

__all__ = [
    "CONTRACT",
    "canary_verify",
    "verify_impl",
    "canary_verify_reference",
    "BLOCK",
    "MAX_PROGRAMS",
    "NUM_WARPS",
    "NUM_STAGES",
    "GROUP",
    "VEC",
    "HOIST",
    "launch_config",
]

# Entries per block (one grid-stride step of a program), persistent grid cap (SGLang: 64 blocks x
# 512 threads; the grid is smaller for small plans) and warps: the fastest of the H200 sweep
# (bench/tune_verify.py, bench/NOTES.md): 187 us at 4M entries against 197 for 512 x 4 warps.
BLOCK = 1024
MAX_PROGRAMS = 528
NUM_WARPS = 8
NUM_STAGES = 1
# A block is ``GROUP`` columns of ``BLOCK // GROUP`` entries, entry r * GROUP + g in column g: in
# a chain-ordered plan an entry's predecessor is the previous entry's slot, whose fields column
# g-1 has just loaded, so only column 0 (and entries whose predecessor is elsewhere) gathers the
# predecessor row. Triton has no lane shuffle; separate column vectors need none.
GROUP = 4
# Canary words per gather instruction (1, 2 or 4): a slot's 4 fields are one 32-byte row, so a
# [rows, VEC] tile load becomes vector loads and one cache-line lookup per row instead of four.
VEC = 4
# When one block per program covers the plan, drop the grid-stride loop and issue the plan
# loads before ``enable`` / ``verify_num_valid`` arrive (one dependent round trip fewer).
HOIST = True
# Small plans (the H200 sweep of bench/tune_verify.py, bench/NOTES.md): the large-plan shape
# leaves most SMs idle (a 1,024-entry plan is one 8-warp program: 4.2 us), and at these sizes the
# per-entry latency matters more than the load count, so the plain one-entry-per-lane structure
# in small blocks wins: 2.4 us at 1k entries (128-entry blocks, 4 warps), 6.2 us at 64k
# (256-entry blocks, 2 warps).
SMALL_PLANS = ((4096, dict(block=128, num_warps=4, group=1, vec=1)),
               (65536, dict(block=256, num_warps=2, group=1, vec=1, max_programs=264)))


def launch_config(capacity: int) -> dict:
    """The launch parameters used for a plan of ``capacity`` entries when none are given."""
    cfg = dict(block=BLOCK, max_programs=MAX_PROGRAMS, num_warps=NUM_WARPS,
               num_stages=NUM_STAGES, group=GROUP, vec=VEC, hoist=HOIST)
    for limit, small in SMALL_PLANS:
        if capacity <= limit:
            return {**cfg, **small}
    return cfg



# ---------------------------------------------------------------------------------------------
# Shared by write and verify.


def tensor_guard(op: str, name: str, dtype: str, shape):
    """dtype then shape of ``name`` (absent tensors pass): SGLang's C++ tensor matchers, which
    raise RuntimeError (their text is not a contract). ``shape`` is an ndim or an exact shape."""

    def bad_shape(metas, scalars):
        m = metas.get(name)
        if m is None:
            return None
        ok = m.ndim == shape if isinstance(shape, int) else m.shape == tuple(shape)
        return None if ok else {"shape": m.shape}

    want = f"{shape}-D" if isinstance(shape, int) else f"of shape {tuple(shape)}"
    return (
        DType(name, dtype, f"kv-canary: {op}: {{name}} must be {{expected}}, got {{dtype}}",
              RuntimeError),
        Rule(bad_shape, f"kv-canary: {op}: {name} must be {want}, got shape {{shape}}",
             RuntimeError),
    )


def _ring_bad(metas, scalars):
    m = metas["violation_ring"]
    ok = m.ndim == 2 and m.shape[1] == consts.VIOLATION_FIELDS
    return None if ok else {"shape": m.shape}


def context_guard_checks(op: str):
    return (
        *tensor_guard(op, "canary_buf", "uint8", 2),
        DType("violation_ring", "int64",
              f"kv-canary: {op}: {{name}} must be {{expected}}, got {{dtype}}", RuntimeError),
        Rule(_ring_bad, f"kv-canary: {op}: violation_ring must be of shape "
             f"(ring_capacity, {consts.VIOLATION_FIELDS}), got shape {{shape}}", RuntimeError),
        *tensor_guard(op, "violation_write_index", "int32", (1,)),
        *tensor_guard(op, "slot_run_counter", "int64", (1,)),
        *tensor_guard(op, "kernel_run_counter", "int64", (1,)),
    )


def _stride_not_words(metas, scalars):
    n = metas["canary_buf"].shape[1]
    return None if n % 8 == 0 else {"n": n}


def _stride_too_small(metas, scalars):
    n = metas["canary_buf"].shape[1] // 8
    return None if n >= consts.CANARY_FIELDS_PER_SLOT else {"n": n}


def canary_checks():
    """The canary slot stride: whole int64 fields (the reference's int64 view needs it; ours), and
    at least 4 of them (the reference's ValueError; raised whether or not there is work)."""
    return (
        Rule(_stride_not_words,
             "kv-canary: canary_buf slot stride must be a multiple of 8 bytes, got {n}"),
        Rule(_stride_too_small,
             "kv-canary: canary_buf slot stride must hold at least 4 int64 fields, got {n}"),
    )


def source_metas(sources) -> dict:
    return {f"real_kv_sources[{i}].tensor": s.meta for i, s in enumerate(sources)}


def canary_words(buf: jax.Array) -> jax.Array:
    """uint8 ``[num_slots, stride]`` -> flat int64 words (a bitcast)."""
    n, sb = buf.shape
    return jax.lax.bitcast_convert_type(buf.reshape(n, sb // 8, 8), jnp.int64).reshape(-1)


def canary_from_words(words: jax.Array, shape) -> jax.Array:
    return jax.lax.bitcast_convert_type(words, jnp.uint8).reshape(shape)


def _idx(ref):
    return jnp.int32 if ref.shape[0] < 2**31 else jnp.int64


def scatter(ref, idx, vals, mask):
    """Masked scatter into a flat ref. Masked-off lanes get the one-past-the-end index: the GPU
    never touches them, and interpret mode (which writes every lane, old values on masked ones)
    drops them instead of letting them clobber a live lane's element."""
    n = ref.shape[0]
    dt = jnp.int32 if n + 1 < 2**31 else jnp.int64
    plt.store(ref.at[jnp.where(mask, idx, n).astype(dt)], vals.astype(ref.dtype), mask=mask)


def append_rows(ring, rows, mask, ring_cap, fields):
    """Writes violation rows ``rows`` (lanes under ``mask``) of the flat ring; rows at or past the
    capacity are dropped (they were counted by the reservation all the same)."""
    ok = mask & (rows < ring_cap)
    base = rows.astype(jnp.int64) * consts.VIOLATION_FIELDS
    for f, vals in enumerate(fields):
        scatter(ring, base + f, vals, ok)


# ---------------------------------------------------------------------------------------------

_V = "canary_verify"

# SGLang's launcher order: source count (every path); contiguity (canary, plan, sinks);
# per-source ABI checks; then its C++ guards (RuntimeError, wording ours) and the stride check.
CONTRACT = Contract(
    op=_V,
    checks=(
        SourceCount(),
        *(Contiguous(n) for n in (
            "canary_buf", "plan.verify_slot_indices", "plan.verify_expected_tokens",
            "plan.verify_expected_positions", "plan.verify_prev_slot_indices",
            "plan.verify_num_valid", "plan.enable", "violation_ring", "violation_write_index",
            "slot_run_counter", "kernel_run_counter")),
        SourceAbi(),
        *tensor_guard(_V, "plan.verify_slot_indices", "int64", 1),
        *(
            c
            for n in ("plan.verify_expected_tokens", "plan.verify_expected_positions",
                      "plan.verify_prev_slot_indices")
            for c in tensor_guard(_V, n, "int64", 1)
        ),
        Rule(
            lambda metas, s: next(
                ({"name": n, "shape": metas[n].shape, "c": metas["plan.verify_slot_indices"].shape}
                 for n in ("plan.verify_expected_tokens", "plan.verify_expected_positions",
                           "plan.verify_prev_slot_indices")
                 if metas[n].shape != metas["plan.verify_slot_indices"].shape),
                None,
            ),
            "kv-canary: canary_verify: {name} must have the shape of plan.verify_slot_indices "
            "{c}, got {shape}",
            RuntimeError,
        ),
        *tensor_guard(_V, "plan.verify_num_valid", "int32", (1,)),
        *tensor_guard(_V, "plan.enable", "int32", (1,)),
        *context_guard_checks(_V),
        *canary_checks(),
    ),
)


def _verify_kernel(
    slots_ref, etok_ref, epos_ref, prev_ref, nvalid_ref, enable_ref, canary, *refs, specs, mode,
    kind, check_token, num_slots, slot_words, ring_cap, block, num_programs, group, vec, hoist,
):
    nsrc = len(specs)
    src_refs = refs[:nsrc]
    ring, widx, sctr, kctr = refs[nsrc + 4:]
    p = pl.program_id(0)
    capacity = slots_ref.shape[0]
    i64 = jnp.int64
    enabled = enable_ref[0] != 0
    active = jnp.clip(nvalid_ref[0], 0, capacity).astype(i64)

    @pl.when(p == 0)
    def _counters():
        kctr[0] = kctr[0] + 1
        sctr[0] = sctr[0] + jnp.where(enabled, active, 0)

    rows_per_col = block // group
    lane = jnp.arange(rows_per_col, dtype=i64)
    cdt = _idx(canary)
    # Row-aligned word index: the multiply by the static stride lets Triton prove the alignment
    # that vector loads of ``vec`` words need.
    def row_base(s, ok):
        return jnp.where(ok, s, 0).astype(cdt) * slot_words

    def gather(base, ok, nfields):
        """Loads fields [0, nfields) of the rows at ``base``, ``vec`` words per load; returns
        the raw loads (see ``fields``)."""
        if vec == 1:
            return [plt.load(canary.at[base + f], mask=ok, other=0) for f in range(nfields)]
        col = jnp.arange(vec, dtype=cdt)[None, :]
        m = jnp.broadcast_to(ok[:, None], (rows_per_col, vec))
        return [plt.load(canary.at[base[:, None] + (col + f0)], mask=m, other=0)
                for f0 in range(0, nfields, vec)]

    def fields(loads, nfields):
        if vec == 1:
            return loads
        out = []
        for tile in loads:
            out.extend(t.reshape(rows_per_col) for t in jax.lax.split(tile, (1,) * vec, axis=1))
        return out[:nfields]

    F = consts.FailReason
    anchor = jnp.asarray(hashing.ANCHOR_HASH_I64, i64)

    def block_body(b, act_limit):
        # Entry k = b * block + r * group + g sits in column g: column g-1 holds its chain
        # predecessor in plans laid out in chain order, so its fields are reused, not gathered.
        # Warps issue in order and stall at a load's first use: every column's loads are issued
        # (plan fields, then all gathers) before any loaded value is used, so one block costs
        # two memory round trips whatever ``group`` is.
        plan = []
        for g in range(group):
            k = b * block + lane * group + g
            act = k < act_limit
            in_plan = (k < capacity) if hoist else act
            kc = jnp.where(in_plan, k, 0).astype(jnp.int32)
            slot = plt.load(slots_ref.at[kc], mask=in_plan, other=0)
            epos = plt.load(epos_ref.at[kc], mask=in_plan, other=0)
            prev = plt.load(prev_ref.at[kc], mask=in_plan, other=0)
            if check_token:
                etok = plt.load(etok_ref.at[kc], mask=in_plan, other=-1)
            else:
                etok = jnp.full((rows_per_col,), -1, i64)
            plan.append((act, slot, epos, prev, etok))

        loads = []
        for g, (act, slot, epos, prev, etok) in enumerate(plan):
            checked = act & (slot != consts.TOKEN_TO_KV_SLOT_PADDING)
            s_eff = jnp.where(slot < 0, slot + num_slots, slot)
            s_ok = checked & (s_eff >= 0) & (s_eff < num_slots)
            p_ok = checked & (prev > 0) & (prev < num_slots)
            # The previous column's row is this entry's predecessor row exactly when the indices
            # agree (that entry is active and its slot > 0 is in range, so it is loaded).
            reuse = None if g == 0 else p_ok & (prev == plan[g - 1][1])
            need = p_ok if reuse is None else p_ok & ~reuse
            loads.append((checked, reuse, gather(row_base(s_eff, s_ok), s_ok, 4),
                          gather(row_base(prev, need), need, 3)))

        cols = []
        prev_col = None
        for (act, slot, epos, prev, etok), (checked, reuse, row, prow) in zip(plan, loads):
            tok, pos, ph, rkv = fields(row, 4)
            p_tok, p_pos, p_ph = fields(prow, 3)
            if reuse is not None:
                p_tok = jnp.where(reuse, prev_col[0], p_tok)
                p_pos = jnp.where(reuse, prev_col[1], p_pos)
                p_ph = jnp.where(reuse, prev_col[2], p_ph)
            prev_col = (tok, pos, ph)

            chain_checked = prev != consts.TOKEN_TO_KV_SLOT_PADDING
            exp_chain = jnp.where(prev < 0, anchor, hashing.mix3(p_ph, p_tok, p_pos))
            exp_aux = jnp.where(chain_checked, exp_chain, ph)
            exp_rkv = hashing.fold_real_kv(slot, checked & (slot >= 0), src_refs, specs, mode)
            bits = (
                jnp.where(chain_checked & (ph != exp_chain), int(F.VERIFY_CHAIN_HASH_MISMATCH), 0)
                | jnp.where(pos != epos, int(F.VERIFY_POSITION_MISMATCH), 0)
                | jnp.where(rkv != exp_rkv, int(F.VERIFY_REAL_KV_HASH_MISMATCH), 0)
            )
            if check_token:
                bits = bits | jnp.where((etok != -1) & (tok != etok),
                                        int(F.VERIFY_TOKEN_MISMATCH), 0)
            viol = checked & (bits != 0)
            cols.append((viol, (slot, pos, tok, etok, ph, exp_aux, bits.astype(i64))))

        # Rows keep entry order within the block: entry (r, g) follows every entry of rows < r
        # and the columns < g of row r.
        counts = [c[0].astype(jnp.int32) for c in cols]
        per_row = functools.reduce(jnp.add, counts)
        total = jnp.sum(per_row, dtype=jnp.int32)

        @pl.when(total > 0)
        def _record():
            first = plt.atomic_add(widx, (jnp.int32(0),), total)
            row = first + jnp.cumsum(per_row, dtype=jnp.int32) - per_row
            for (viol, fields), n in zip(cols, counts):
                append_rows(ring, row, viol, ring_cap, (
                    jnp.full((rows_per_col,), kind, i64), *fields))
                row = row + n

    limit = jnp.where(enabled, active, 0)
    if hoist:
        # One block per program covers the plan: no loop, and the plan loads need neither
        # ``enable`` nor ``verify_num_valid``, so all three are in flight together.
        block_body(p.astype(i64), limit)
        return

    nblocks = (limit + block - 1) // block
    trips = jnp.maximum(nblocks - p + num_programs - 1, 0) // num_programs

    def loop_body(t, carry):
        block_body(p.astype(i64) + t.astype(i64) * num_programs, active)
        return carry

    jax.lax.fori_loop(0, trips, loop_body, 0)


@functools.partial(
    jax.jit,
    static_argnames=("specs", "mode", "kind", "check_token", "block", "max_programs", "num_warps",
                     "num_stages", "group", "vec", "hoist", "interpret"),
)
def _verify_jit(canary_buf, violation_ring, violation_write_index, slot_run_counter,
                kernel_run_counter, verify_slot_indices, verify_expected_tokens,
                verify_expected_positions, verify_prev_slot_indices, verify_num_valid, enable,
                source_bufs, *, specs, mode, kind, check_token, block, max_programs, num_warps,
                num_stages, group, vec, hoist, interpret):
    num_slots, stride_bytes = canary_buf.shape
    ring_cap = violation_ring.shape[0]
    capacity = verify_slot_indices.shape[0]
    if vec not in (1, 2, 4) or group < 1 or group & (group - 1) or block < 1 or block & (block - 1):
        raise ValueError(f"kv-canary: canary_verify: bad launch parameters block={block} "
                         f"group={group} vec={vec} (powers of two; vec 1, 2 or 4)")
    block = min(block, pl.next_power_of_2(max(capacity, 1)))
    group = min(group, block)
    num_programs = max(1, min(max_programs, pl.cdiv(capacity, block)))
    # A single pass covers the plan: no grid-stride loop (see the kernel).
    hoist = bool(hoist) and num_programs * block >= capacity
    words = [as_words(b) for b in source_bufs]
    for i, (w, spec) in enumerate(zip(words, specs)):
        check_extent(w, spec, i)
    kernel = functools.partial(
        _verify_kernel, specs=specs, mode=mode, kind=kind, check_token=check_token,
        num_slots=num_slots, slot_words=stride_bytes // 8, ring_cap=ring_cap, block=block,
        num_programs=num_programs, group=group, vec=vec, hoist=hoist,
    )
    ins = [verify_slot_indices, verify_expected_tokens, verify_expected_positions,
           verify_prev_slot_indices, verify_num_valid, enable, canary_words(canary_buf), *words]
    outs = [violation_ring.reshape(-1), violation_write_index, slot_run_counter,
            kernel_run_counter]
    k = len(ins)
    ring, widx, sctr, kctr = pl.pallas_call(
        kernel,
        out_shape=[jax.ShapeDtypeStruct(o.shape, o.dtype) for o in outs],
        grid=(num_programs,),
        input_output_aliases={k + j: j for j in range(len(outs))},
        interpret=interpret,
        compiler_params=None if interpret else _config.compiler_params(num_warps, num_stages),
        name="kvcanary_verify",
    )(*ins, *outs)
    return ring.reshape(violation_ring.shape), widx, sctr, kctr


@_config.with_x64
def verify_impl(
    *, canary_buf, violation_ring, violation_write_index, slot_run_counter, kernel_run_counter,
    verify_slot_indices, verify_expected_tokens, verify_expected_positions,
    verify_prev_slot_indices, verify_num_valid, enable,
    sources: tuple[tuple[jax.Array, SourceSpec], ...], kernel_kind: int, real_kv_hash_mode: int,
    check_verify_expected_token: bool, block: int | None = None,
    max_programs: int | None = None, num_warps: int | None = None,
    num_stages: int | None = None, group: int | None = None, vec: int | None = None,
    hoist: bool | None = None, interpret: bool | None = None,
):
    """Array-level entry (no validation): each source is ``(buffer, SourceSpec)``. Returns
    ``(violation_ring, violation_write_index, slot_run_counter, kernel_run_counter)``; donate
    those four for an in-place update (``canary_buf`` is only read). Launch parameters left
    ``None`` come from :func:`launch_config` for the plan's capacity."""
    if interpret is None:
        interpret = _config.default_interpret()
    auto = launch_config(int(verify_slot_indices.shape[0]))
    block = auto["block"] if block is None else block
    max_programs = auto["max_programs"] if max_programs is None else max_programs
    num_warps = auto["num_warps"] if num_warps is None else num_warps
    num_stages = auto["num_stages"] if num_stages is None else num_stages
    group = auto["group"] if group is None else group
    vec = auto["vec"] if vec is None else vec
    hoist = auto["hoist"] if hoist is None else hoist
    return _verify_jit(
        canary_buf, violation_ring, violation_write_index, slot_run_counter, kernel_run_counter,
        verify_slot_indices, verify_expected_tokens, verify_expected_positions,
        verify_prev_slot_indices, verify_num_valid, enable, tuple(b for b, _ in sources),
        specs=tuple(s for _, s in sources), mode=int(real_kv_hash_mode), kind=int(kernel_kind),
        check_token=bool(check_verify_expected_token), block=block, max_programs=max_programs,
        num_warps=num_warps, num_stages=num_stages, group=group, vec=vec, hoist=bool(hoist),
        interpret=interpret,
    )


def validate(context: VerifyOrWriteContext, plan: VerifyPlan) -> None:
    tensors = {
        "canary_buf": context.canary_buf,
        "plan.verify_slot_indices": plan.verify_slot_indices,
        "plan.verify_expected_tokens": plan.verify_expected_tokens,
        "plan.verify_expected_positions": plan.verify_expected_positions,
        "plan.verify_prev_slot_indices": plan.verify_prev_slot_indices,
        "plan.verify_num_valid": plan.verify_num_valid,
        "plan.enable": plan.enable,
        "violation_ring": context.violation_ring,
        "violation_write_index": context.violation_write_index,
        "slot_run_counter": context.slot_run_counter,
        "kernel_run_counter": context.kernel_run_counter,
    }
    metas = {k: meta_of(v) for k, v in tensors.items()}
    metas.update(source_metas(context.real_kv_sources))
    CONTRACT.validate_metas(metas, num_sources=len(context.real_kv_sources))


@_config.with_x64
def canary_verify(
    *,
    context: VerifyOrWriteContext,
    plan: VerifyPlan,
    check_verify_expected_token: bool,
    block: int | None = None,
    max_programs: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    group: int | None = None,
    vec: int | None = None,
    hoist: bool | None = None,
    interpret: bool | None = None,
) -> VerifyOrWriteContext:
    """Verify the plan's entries against ``context.canary_buf``; returns the updated context.

    Arguments as SGLang's ``launch_canary_verify_kernel``. The returned context carries the new
    ``violation_ring``, ``violation_write_index``, ``slot_run_counter`` and
    ``kernel_run_counter``; ``canary_buf`` and the sources are the input's. Under
    ``jax.jit(..., donate_argnames="context")`` the update is in place.

    Raises at trace time: SGLang's ValueErrors (more than 4 sources; per-source ABI checks;
    canary slot stride below 4 int64 fields); RuntimeError for dtype / shape mismatches.
    """
    validate(context, plan)
    sources = tuple((s.tensor, source_spec(s)) for s in context.real_kv_sources)
    ring, widx, sctr, kctr = verify_impl(
        canary_buf=context.canary_buf, violation_ring=context.violation_ring,
        violation_write_index=context.violation_write_index,
        slot_run_counter=context.slot_run_counter, kernel_run_counter=context.kernel_run_counter,
        verify_slot_indices=plan.verify_slot_indices,
        verify_expected_tokens=plan.verify_expected_tokens,
        verify_expected_positions=plan.verify_expected_positions,
        verify_prev_slot_indices=plan.verify_prev_slot_indices,
        verify_num_valid=plan.verify_num_valid, enable=plan.enable, sources=sources,
        kernel_kind=int(context.kernel_kind), real_kv_hash_mode=int(context.real_kv_hash_mode),
        check_verify_expected_token=check_verify_expected_token, block=block,
        max_programs=max_programs, num_warps=num_warps, num_stages=num_stages, group=group,
        vec=vec, hoist=hoist, interpret=interpret,
    )
    return context.replace(violation_ring=ring, violation_write_index=widx,
                           slot_run_counter=sctr, kernel_run_counter=kctr)


# ---------------------------------------------------------------------------------------------
# Pure-jnp reference (entries in order, rows appended in entry order; same bounds choices).


@functools.partial(jax.jit, static_argnames=("specs", "mode", "kind", "check_token"))
def _verify_reference_jit(canary_buf, ring, widx, sctr, kctr, slots, etok, epos, prev, nvalid,
                          enable, source_bufs, *, specs, mode, kind, check_token):
    i64 = jnp.int64
    num_slots = canary_buf.shape[0]
    c = canary_words(canary_buf).reshape(num_slots, -1)
    cap = slots.shape[0]
    enabled = enable[0] != 0
    active = jnp.where(enabled, jnp.clip(nvalid[0], 0, cap), 0).astype(i64)
    k = jnp.arange(cap, dtype=i64)
    checked = (k < active) & (slots != consts.TOKEN_TO_KV_SLOT_PADDING)

    def row(idx, ok):
        return jnp.where(ok[:, None], c[jnp.where(ok, idx, 0), :4], 0)

    s_eff = jnp.where(slots < 0, slots + num_slots, slots)
    tok, pos, ph, rkv = row(s_eff, checked & (s_eff >= 0) & (s_eff < num_slots)).T
    p_tok, p_pos, p_ph, _ = row(prev, checked & (prev > 0) & (prev < num_slots)).T
    chain_checked = prev != consts.TOKEN_TO_KV_SLOT_PADDING
    exp_chain = jnp.where(prev < 0, jnp.asarray(hashing.ANCHOR_HASH_I64, i64),
                          hashing.mix3(p_ph, p_tok, p_pos))
    exp_tok = etok if check_token else jnp.full((cap,), -1, i64)
    words = [as_words(b) for b in source_bufs]
    exp_rkv = hashing.fold_real_kv(slots, checked & (slots >= 0), words, specs, mode,
                                   gather=hashing.array_gather)
    F = consts.FailReason
    bits = (jnp.where(chain_checked & (ph != exp_chain), int(F.VERIFY_CHAIN_HASH_MISMATCH), 0)
            | jnp.where(pos != epos, int(F.VERIFY_POSITION_MISMATCH), 0)
            | jnp.where(rkv != exp_rkv, int(F.VERIFY_REAL_KV_HASH_MISMATCH), 0))
    if check_token:
        bits = bits | jnp.where((exp_tok != -1) & (tok != exp_tok), int(F.VERIFY_TOKEN_MISMATCH), 0)
    viol = checked & (bits != 0)
    n = viol.astype(i64)
    rows = widx[0].astype(i64) + jnp.cumsum(n) - n
    vals = jnp.stack([jnp.full((cap,), kind, i64), slots, pos, tok, exp_tok, ph,
                      jnp.where(chain_checked, exp_chain, ph), bits.astype(i64)], axis=1)
    ring = ring.at[jnp.where(viol, rows, ring.shape[0])].set(vals, mode="drop")
    return (ring, widx + jnp.sum(n).astype(jnp.int32), sctr + active, kctr + 1)


@_config.with_x64
def canary_verify_reference(*, context: VerifyOrWriteContext, plan: VerifyPlan,
                            check_verify_expected_token: bool) -> VerifyOrWriteContext:
    """Pure-jnp reference of :func:`canary_verify` (rows in entry order)."""
    validate(context, plan)
    ring, widx, sctr, kctr = _verify_reference_jit(
        context.canary_buf, context.violation_ring, context.violation_write_index,
        context.slot_run_counter, context.kernel_run_counter, plan.verify_slot_indices,
        plan.verify_expected_tokens, plan.verify_expected_positions,
        plan.verify_prev_slot_indices, plan.verify_num_valid, plan.enable,
        tuple(s.tensor for s in context.real_kv_sources),
        specs=tuple(source_spec(s) for s in context.real_kv_sources),
        mode=int(context.real_kv_hash_mode), kind=int(context.kernel_kind),
        check_token=bool(check_verify_expected_token),
    )
    return context.replace(violation_ring=ring, violation_write_index=widx,
                           slot_run_counter=sctr, kernel_run_counter=kctr)
