"""canary_verify as a Pallas kernel (Triton lowering on CUDA GPUs; interpret mode too).

Parallel shape: a persistent grid of at most ``max_programs`` programs, each taking blocks of
``block`` entries (grid-stride over the active blocks; no loop when one pass covers the plan).
A block is ``group`` column vectors (entry ``r * group + g`` in column g); per column the slot rows
are masked gathers of ``vec`` words per load, and the predecessor's fields are taken from column
g-1 when the plan says the predecessor is the previous entry's slot (chain order), gathered
otherwise. Fingerprints are folded vectorised, and the block's violation rows are reserved with
ONE claim on ``violation_write_index`` (a compare-and-swap loop under the ring guard of
:mod:`kvcanary_jax.ops._kernel_lib`; an entry's row is the claimed base plus the count of
violations before it in the block), so a block's rows are contiguous and in entry order; the
blocks' claims land in the order the atomics ran (a program's in its order: :class:`LaunchGrid`).
Program 0 alone bumps the counters (both are known before any entry is read). Semantics and bounds:
:mod:`kvcanary_jax.ops.verify.base`.
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
from kvcanary_jax.ops._kernel_lib import append_rows, canary_words, claim_rows
from kvcanary_jax.plans import VerifyPlan

__all__ = ["Config", "LaunchGrid", "heuristics", "launch_grid", "run", "BLOCK", "MAX_PROGRAMS",
           "NUM_WARPS", "NUM_STAGES", "GROUP", "VEC", "HOIST", "SMALL_PLANS", "FOLD_VEC"]

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
# Mid-size plans (up to 262,144 entries: a batch's whole context, 64 requests of 2,048-2,352
# cached tokens) take 4-warp programs of 512 entries, one per block: the large-plan shape gives
# most SMs a single 8-warp program there (the H100 sweep of bench/tune_verify.py,
# bench/NOTES.md: 14.27 -> 10.93 us at 150,528 entries, 9.90 -> 9.04 at 131,072).
SMALL_PLANS = ((4096, dict(block=128, num_warps=4, group=1, vec=1)),
               (65536, dict(block=256, num_warps=2, group=1, vec=1, max_programs=264)),
               (1 << 18, dict(block=512, num_warps=4, group=4, vec=2, max_programs=1 << 30)))
# Verifies that fold at least FOLD_MIN_WORDS real-KV words per entry (a TAIL or SWEEP launch)
# do a serial splitmix64 chain per entry, several times the metadata checks' work: (capacity
# limit, config) pairs for them, tried before the shapes above. One entry per lane in one-warp
# programs puts the chains on every SM. The H200 sweep inside sglang-jax's canary-only step
# (bench/tune_tail_verify.py, 32 words a slot; bench/NOTES.md): TAIL verify 10.74 -> 3.82 us at
# 4,240 entries (bs 8 x 512 cached; the small-plan shape above: 17 programs of 2 warps, 4 entries
# a lane), 30.23 -> 28.28 us at 132,864 (bs 64 x 2,048; the large-plan shape).
FOLD_MIN_WORDS = 8
FOLD_PLANS: tuple = ((1 << 18, dict(block=32, num_warps=1, max_programs=1 << 30, group=1, vec=1)),)
# Real-KV words a lane loads at once for the fingerprints (1, 2 or 4): one 8-byte load a word
# fetches a 32-byte sector for 8 bytes of it, and the strip's next words must still be in L1
# when their loads come; 4 words are the whole sector.
FOLD_VEC = 4


@dataclasses.dataclass(frozen=True)
class Config:
    """Launch parameters: ``block`` entries per block (a power of two), ``max_programs`` (the
    persistent grid's cap), ``num_warps``, ``num_stages``, ``group`` column vectors per block (a
    power of two), ``vec`` canary words per gather (1, 2 or 4), ``hoist`` (drop the grid-stride
    loop and issue the plan loads early when one pass covers the plan). Results do not depend on
    them. ``interpret``: Pallas interpret mode (any backend; what ``pallas_interpret`` runs)."""

    block: int = BLOCK
    max_programs: int = MAX_PROGRAMS
    num_warps: int = NUM_WARPS
    num_stages: int = NUM_STAGES
    group: int = GROUP
    vec: int = VEC
    hoist: bool = HOIST
    fold_vec: int = FOLD_VEC
    interpret: bool = False

    def __post_init__(self):
        _kernel_lib.check_interpret("canary_verify", self.interpret)
        pow2 = lambda n: n >= 1 and not n & (n - 1)  # noqa: E731
        if self.vec not in (1, 2, 4) or self.fold_vec not in (1, 2, 4) or \
                not pow2(self.group) or not pow2(self.block) or \
                self.max_programs < 1 or self.num_warps < 1 or self.num_stages < 1:
            raise ValueError(f"kv-canary: canary_verify: bad launch parameters block={self.block} "
                             f"group={self.group} vec={self.vec} fold_vec={self.fold_vec} "
                             "(powers of two; vec and fold_vec 1, 2 or 4)")


def heuristics(shapes) -> Config:
    """The large-plan shape, or the small-plan one for plans of up to 4,096 / 65,536 / 262,144
    entries;
    for a verify that folds real KV, the fold shapes first."""
    if shapes.get("real_kv_words", 0) >= FOLD_MIN_WORDS:
        for limit, fold in FOLD_PLANS:
            if shapes["capacity"] <= limit:
                return Config(**{"fold_vec": FOLD_VEC, **fold})
    for limit, small in SMALL_PLANS:
        if shapes["capacity"] <= limit:
            return Config(**{"fold_vec": FOLD_VEC, **small})
    return Config(fold_vec=FOLD_VEC)


@dataclasses.dataclass(frozen=True)
class LaunchGrid:
    """How a launch covers a plan: ``num_programs`` programs, program ``p`` taking blocks ``p``,
    ``p + num_programs``, ... of ``block`` entries in that order (one block each when ``hoist``),
    each block ``group`` column vectors. A block's violation rows are one claim on the write
    index, in entry order."""

    block: int
    group: int
    num_programs: int
    hoist: bool


def launch_grid(capacity: int, config: Config) -> LaunchGrid:
    """The :class:`LaunchGrid` of a launch with ``config`` over a plan of ``capacity`` entries."""
    block = min(config.block, pl.next_power_of_2(max(capacity, 1)))
    num_programs = max(1, min(config.max_programs, pl.cdiv(capacity, block)))
    # A single pass covers the plan: no grid-stride loop (see the kernel).
    return LaunchGrid(block=block, group=min(config.group, block), num_programs=num_programs,
                      hoist=config.hoist and num_programs * block >= capacity)


def _verify_kernel(
    slots_ref, etok_ref, epos_ref, prev_ref, nvalid_ref, enable_ref, canary, *refs, specs, mode,
    kind, check_token, num_slots, slot_words, ring_cap, block, num_programs, group, vec, hoist,
    fold_vec=1,
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
    cdt = _kernel_lib.index_dtype(canary.shape[0])
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
            exp_rkv = _kernel_lib.fold_real_kv(slot, checked & (slot >= 0), src_refs, specs,
                                               mode, vec=fold_vec)
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
            w0 = claim_rows(widx, total, capacity)  # at most a row an entry
            rel = jnp.cumsum(per_row, dtype=jnp.int32) - per_row
            for (viol, fields), n in zip(cols, counts):
                append_rows(ring, w0, rel, viol, ring_cap, (
                    jnp.full((rows_per_col,), kind, i64), *fields))
                rel = rel + n

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


def run(context: VerifyOrWriteContext, plan: VerifyPlan, *, check_verify_expected_token: bool,
        config: Config) -> VerifyOrWriteContext:
    """The updated context, its ring and counters aliased to their inputs (``canary_buf`` is
    only read). ``config.interpret``: Pallas interpret mode."""
    interpret = config.interpret
    sources = context.bound_sources()
    specs = tuple(s for _, s in sources)
    mode, kind = int(context.real_kv_hash_mode), int(context.kernel_kind)
    check_token = bool(check_verify_expected_token)
    num_slots, stride_bytes = context.canary_buf.shape
    ring_cap = context.violation_ring.shape[0]
    g = launch_grid(plan.verify_slot_indices.shape[0], config)
    block, group, num_programs, hoist = g.block, g.group, g.num_programs, g.hoist
    vec = config.vec
    words = [as_words(b) for b, _ in sources]
    kernel = functools.partial(
        _verify_kernel, specs=specs, mode=mode, kind=kind, check_token=check_token,
        num_slots=num_slots, slot_words=stride_bytes // 8, ring_cap=ring_cap, block=block,
        num_programs=num_programs, group=group, vec=vec, hoist=hoist, fold_vec=config.fold_vec,
    )
    ins = [plan.verify_slot_indices, plan.verify_expected_tokens, plan.verify_expected_positions,
           plan.verify_prev_slot_indices, plan.verify_num_valid, plan.enable,
           canary_words(context.canary_buf), *words]
    # The write index is passed as a scalar: the compare-and-swap of the ring guard needs a
    # scalar ref.
    outs = [context.violation_ring.reshape(-1), context.violation_write_index.reshape(()),
            context.slot_run_counter, context.kernel_run_counter]
    k = len(ins)
    ring, widx, sctr, kctr = pl.pallas_call(
        kernel,
        out_shape=[jax.ShapeDtypeStruct(o.shape, o.dtype) for o in outs],
        grid=(num_programs,),
        input_output_aliases={k + j: j for j in range(len(outs))},
        interpret=interpret,
        compiler_params=None if interpret else _kernel_lib.compiler_params(
            config.num_warps, config.num_stages),
        name="kvcanary_verify",
    )(*ins, *outs)
    return context.replace(violation_ring=ring.reshape(context.violation_ring.shape),
                           violation_write_index=widx.reshape(1), slot_run_counter=sctr,
                           kernel_run_counter=kctr)
