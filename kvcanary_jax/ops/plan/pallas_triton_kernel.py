"""The plan's two Pallas kernels (Triton lowering on CUDA GPUs; interpret mode too).

Offsets (:func:`plan_offsets`): up to ``single_block_max`` requests run in one program with one
in-register cumsum of the verify and write lengths; larger batches take a two-kernel path
(per-block sums, then each block adds the sum of the blocks before it, read by every program
itself: cheaper than a third launch). Unlike SGLang (one program, ``bs <= 4096``) there is no cap
on ``bs``. The program that owns index ``bs`` of ``write_offsets`` stores the totals and the
scalars; programs past ``bs`` zero-fill ``write_offsets`` up to the write capacity.

Entries (:func:`plan_entries`): one lane per verify entry; a lane finds its request by a
vectorised binary search of the verify offsets (``ceil(log2(bs))`` dependent gathers whatever the
data). The grid is sized from the (static) capacity, since the live total is only known on
device: up to ``max_programs`` programs each take one block and exit when it lies past the total;
beyond that the programs loop over blocks with a stride of the grid size.

Batch size as an operand (``num_reqs``, :func:`kvcanary_jax.ops.plan.base.batch_lanes`): the
request vectors may be padded to a bucket ``bs``; the offsets kernels then read the true count
from a one-element array and treat lanes at or past it as outside the batch (their loads are
masked, so a caller may hand over vectors shorter than ``bs`` whose tail is never read). The
entries kernel needs nothing: the offsets are flat from the count on.

Every data-dependent access is masked (see :mod:`kvcanary_jax.ops.plan.base` for the values
out-of-table reads take). Semantics: :mod:`kvcanary_jax.ops.plan.base`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from kvcanary_jax import consts
from kvcanary_jax.ops import _kernel_lib
from kvcanary_jax.ops.plan.base import (VERIFY_ARRAYS, PlanInputs, PlanOffsets, lens,
                                        window_start)
from kvcanary_jax.plans import VerifyPlan, WritePlan

__all__ = [
    "plan_offsets",
    "plan_entries",
    "SINGLE_BLOCK_MAX",
    "MULTI_BLOCK",
    "MIN_BLOCK",
    "OFFSETS_NUM_WARPS",
    "BLOCK_ENTRIES",
    "MAX_PROGRAMS",
    "ENTRIES_NUM_WARPS",
]

# One program, one cumsum up to this many requests; above it the batch is split in
# MULTI_BLOCK-request blocks, after a launch of per-block sums. SGLang's one program takes up to
# 4,096 requests: compiled for sm_90 it needs 255 registers a thread and spills, and took 21 us
# at bs 4,096 on an H100, against 5.1 for blocks of 256 at 4 warps and their sums' launch
# (bench/NOTES.md; `python -m bench.tune_plan`).
SINGLE_BLOCK_MAX = 512
MULTI_BLOCK = 256
# Smallest block of the single-program path: tiny decode batches still fill a warp.
MIN_BLOCK = 32
OFFSETS_NUM_WARPS = 4

# Entries per program iteration: 512 lanes over 4 warps, 4 binary searches in flight a thread at
# 48 registers (1,024 lanes needed 72): the kernel waits on memory, and more programs an SM hide
# more of it (on an H100, 73-75% of the time of 1,024 lanes at bs 4,096 and 16,384:
# bench/NOTES.md).
BLOCK_ENTRIES = 512
ENTRIES_NUM_WARPS = 4
# Up to MAX_PROGRAMS programs each take one block and those past the total exit at once; beyond
# that (capacity > MAX_PROGRAMS * BLOCK_ENTRIES, 512K entries) the programs loop over blocks with a
# stride of the grid size, so a huge capacity with a small live total does not launch thousands
# of idle programs. 1024 programs = ~8 per SM on an H200 (132 SMs), as SGLang's persistent grid.
# (No cap was faster at bs 1,024 and 4,096 on an H100 and slower at 16,384.)
MAX_PROGRAMS = 1024


# --------------------------------------------------------------------------------------------
# Offsets
# --------------------------------------------------------------------------------------------


def _load_block(rpi_ref, prefix_ref, extend_ref, start, block, n):
    """Requests ``[start, start + block)``; lanes at or past ``n`` (the batch's request count:
    static ``bs``, or the ``num_reqs`` operand) are masked, never loaded."""
    idx = start + jnp.arange(block, dtype=jnp.int32)
    in_bs = idx < n
    rpi = plt.load(rpi_ref.at[pl.ds(start, block)], mask=in_bs, other=consts.REQ_POOL_IDX_PADDING)
    prefix = plt.load(prefix_ref.at[pl.ds(start, block)], mask=in_bs, other=0)
    extend = plt.load(extend_ref.at[pl.ds(start, block)], mask=in_bs, other=0)
    return idx, in_bs, rpi, prefix, extend


def _xlat(raw, lut_ref, *, lut_len):
    """SWA LUT translation with SGLang's kernel clamp; negative values pass through."""
    neg = raw < 0
    safe = jnp.clip(raw, 0, lut_len - 1).astype(jnp.int32)
    return jnp.where(neg, raw, plt.load(lut_ref.at[safe], mask=~neg, other=0))


def _read_cells(flat_ref, rp, col, ok, *, pitch, n_cells):
    """``req_to_token`` cells at SGLang's flat address ``rp * pitch + col``; addresses outside the
    table read as 0 (never dereferenced)."""
    flat = rp * pitch + col
    ok = ok & (flat >= 0) & (flat < n_cells)
    vals = plt.load(flat_ref.at[jnp.where(ok, flat, 0).astype(_kernel_lib.index_dtype(n_cells))],
                    mask=ok, other=0)
    return vals.astype(jnp.int64)


def _num_reqs(n_ref, bs):
    """The batch's request count: ``n_ref[0]`` clamped to ``[0, bs]``, or the static ``bs``."""
    if n_ref is None:
        return bs
    return jnp.clip(n_ref[0], 0, bs).astype(jnp.int32)


def _block_sums_kernel(*refs, block, bs, swa_window_size, has_n):
    if has_n:
        rpi_ref, prefix_ref, extend_ref, n_ref, vsum_ref, wsum_ref = refs
    else:
        (rpi_ref, prefix_ref, extend_ref, vsum_ref, wsum_ref), n_ref = refs, None
    pid = pl.program_id(0)
    _, in_bs, rpi, prefix, extend = _load_block(rpi_ref, prefix_ref, extend_ref, pid * block,
                                                 block, _num_reqs(n_ref, bs))
    _, vlen, wlen = lens(rpi, prefix, extend, in_bs, swa_window_size)
    vsum_ref[pid] = jnp.sum(vlen)
    wsum_ref[pid] = jnp.sum(wlen)


def _offsets_kernel(*refs, block, bs, num_sum_blocks, swa_window_size, has_lut, lut_len, pitch,
                    n_cells, verify_capacity, write_capacity, has_n):
    """Program p owns request indices ``[p*block, (p+1)*block)``: it computes its requests'
    offsets and seeds (when any fall below bs) and zero-fills its part of ``write_offsets`` past
    bs. Program 0 also stores the totals and the scalars. With ``has_n``, lanes at or past the
    ``num_reqs`` operand are outside the batch (module docstring)."""
    multi = num_sum_blocks > 1
    refs = list(refs)
    rpi_ref, prefix_ref, extend_ref, rtt_ref, lut_ref = refs[:5]
    del refs[:5]
    vsum_ref = wsum_ref = n_ref = None
    if multi:
        vsum_ref, wsum_ref = refs[:2]
        del refs[:2]
    if has_n:
        n_ref = refs.pop(0)
    _wo_in, _seed_in, _nv_in, _en_in, _wn_in, voff_ref, wo_ref, seed_ref, nv_ref, en_ref, \
        wn_ref = refs
    n = _num_reqs(n_ref, bs)
    pid = pl.program_id(0)
    start = pid * block

    if multi:
        # Every program scans the (few) block sums itself: cheaper than a third launch.
        nsp = pl.next_power_of_2(num_sum_blocks)
        j = jnp.arange(nsp, dtype=jnp.int32)
        jm = j < num_sum_blocks
        vs = plt.load(vsum_ref.at[pl.ds(0, nsp)], mask=jm, other=0)
        ws = plt.load(wsum_ref.at[pl.ds(0, nsp)], mask=jm, other=0)
        base_v = jnp.sum(jnp.where(j < pid, vs, 0))
        base_w = jnp.sum(jnp.where(j < pid, ws, 0))
        total_v = jnp.sum(vs)
        total_w = jnp.sum(ws)
    else:
        base_v = base_w = total_v = total_w = None

    def store_scalars(total_v, total_w):
        voff_ref[bs] = total_v
        # write_offsets[bs] is the total when the batch fills every lane, else past the count.
        wo_ref[bs] = total_w if not has_n else jnp.where(n == bs, total_w, 0)
        overflow = total_v > verify_capacity
        nv_ref[0] = jnp.where(overflow, verify_capacity, total_v).astype(jnp.int32)
        en_ref[0] = jnp.where(overflow, 0, 1).astype(jnp.int32)
        wn_ref[0] = jnp.int32(bs) if not has_n else n

    @pl.when(start < bs)
    def _requests():
        idx, in_bs, rpi, prefix, extend = _load_block(rpi_ref, prefix_ref, extend_ref, start,
                                                      block, n)
        active, vlen, wlen = lens(rpi, prefix, extend, in_bs, swa_window_size)
        vinc = jnp.cumsum(vlen)
        winc = jnp.cumsum(wlen)
        vexcl, wexcl = vinc - vlen, winc - wlen
        if multi:
            vexcl, wexcl = vexcl + base_v, wexcl + base_w
        # Every lane below bs: verify_offsets is flat from the count on (the entries kernel's
        # search needs it so); write_offsets holds the total at the count and 0 past it.
        lanes = idx < bs
        plt.store(voff_ref.at[pl.ds(start, block)], vexcl, mask=lanes)
        if has_n:
            wexcl = jnp.where(idx <= n, wexcl, 0)
        plt.store(wo_ref.at[pl.ds(start, block)], wexcl, mask=lanes)

        has_prefix = active & (prefix > 0)
        raw = _read_cells(rtt_ref, rpi, prefix - 1, has_prefix, pitch=pitch, n_cells=n_cells)
        seed = _xlat(raw, lut_ref, lut_len=lut_len) if has_lut else raw
        seed = jnp.where(has_prefix & (wlen > 0), seed, -1)
        plt.store(seed_ref.at[pl.ds(start, block)], seed, mask=in_bs)
        if not multi:
            store_scalars(jnp.sum(vlen), jnp.sum(wlen))

    # SGLang's API zero-fills write_offsets before its kernel; here the tail past bs is written
    # by the programs that own it (the entry at bs holds the total).
    tail_idx = start + jnp.arange(block, dtype=jnp.int32)
    tail = (tail_idx > bs) & (tail_idx <= write_capacity)

    @pl.when(start + block > bs + 1)
    def _zero_tail():
        plt.store(wo_ref.at[pl.ds(start, block)], jnp.zeros((block,), jnp.int64), mask=tail)

    if multi:
        @pl.when(pid == 0)
        def _scalars():
            store_scalars(total_v, total_w)


def _dummy(dtype):
    return jnp.zeros((1,), dtype)


def plan_offsets(inputs: PlanInputs, vp: VerifyPlan, wp: WritePlan, *, swa_window_size,
                 verify_capacity, interpret, num_warps=OFFSETS_NUM_WARPS,
                 single_block_max=SINGLE_BLOCK_MAX, multi_block=MULTI_BLOCK) -> PlanOffsets:
    """Launch the offsets kernel(s) (call inside a jit, after validation; the offsets half of
    :func:`kvcanary_jax.ops.plan.base.compose`). ``inputs.req_to_token`` is the ``[rows,
    row_pitch]`` table (a compact base whose pitch may exceed the logical width);
    ``inputs.num_reqs``: None, or a one-element int32 array, the batch's request count (module
    docstring). The write plan and the verify plan's two scalars alias their inputs."""
    rpi, prefix, extend = inputs.req_pool_indices, inputs.prefix_lens, inputs.extend_seq_lens
    req_to_token, lut, num_reqs = (inputs.req_to_token, inputs.full_to_swa_index_mapping,
                                   inputs.num_reqs)
    bs = rpi.shape[0]
    write_capacity = wp.write_seed_slot_indices.shape[0]
    rows, pitch = req_to_token.shape
    n_cells = rows * pitch
    rtt_flat = req_to_token.reshape(-1) if n_cells > 0 else _dummy(jnp.int32)
    has_lut = lut is not None
    lut_len = lut.shape[0] if has_lut else 0
    lut_arr = lut if has_lut else _dummy(jnp.int64)
    params = None if interpret else _kernel_lib.compiler_params(num_warps)
    has_n = num_reqs is not None
    n_inputs = (num_reqs.reshape(1).astype(jnp.int32),) if has_n else ()

    if bs <= single_block_max:
        block = max(MIN_BLOCK, pl.next_power_of_2(max(bs, 1)))
        sum_inputs = ()
        num_sum_blocks = 1
    else:
        block = multi_block
        num_sum_blocks = pl.cdiv(bs, block)
        # Allocated at the offsets kernel's padded load (jax 0.12 refuses a static slice past an
        # array's end); the tail is never written and the load masks it.
        padded = pl.next_power_of_2(num_sum_blocks)
        sum_inputs = pl.pallas_call(
            functools.partial(_block_sums_kernel, block=block, bs=bs,
                              swa_window_size=swa_window_size, has_n=has_n),
            out_shape=(jax.ShapeDtypeStruct((padded,), jnp.int64),) * 2,
            grid=(num_sum_blocks,),
            interpret=interpret,
            compiler_params=params,
            name="kvcanary_plan_offsets_block_sums",
        )(rpi, prefix, extend, *n_inputs)

    grid = pl.cdiv(write_capacity + 1, block)
    kernel = functools.partial(
        _offsets_kernel, block=block, bs=bs, num_sum_blocks=num_sum_blocks,
        swa_window_size=swa_window_size, has_lut=has_lut, lut_len=max(lut_len, 1), pitch=pitch,
        n_cells=n_cells, verify_capacity=verify_capacity, write_capacity=write_capacity,
        has_n=has_n,
    )
    aliased = (wp.write_offsets, wp.write_seed_slot_indices, vp.verify_num_valid, vp.enable,
               wp.write_num_valid_reqs)
    operands = (rpi, prefix, extend, rtt_flat, lut_arr, *sum_inputs, *n_inputs, *aliased)
    first_alias = len(operands) - len(aliased)
    voff, wo, seeds, nv, en, wn = pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((bs + 1,), jnp.int64),
                   *(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in aliased)),
        grid=(grid,),
        input_output_aliases={first_alias + i: 1 + i for i in range(len(aliased))},
        interpret=interpret,
        compiler_params=params,
        name="kvcanary_plan_offsets",
    )(*operands)
    return PlanOffsets(verify_offsets=voff, verify_num_valid=nv, enable=en,
                       write_plan=WritePlan(write_offsets=wo, write_seed_slot_indices=seeds,
                                            write_num_valid_reqs=wn))


# --------------------------------------------------------------------------------------------
# Entries
# --------------------------------------------------------------------------------------------


def _owner(voff_ref, t, *, bs):
    """Largest r in [0, bs) with voff[r] <= t, vectorised: one probe per power of two below bs,
    so ceil(log2(bs)) dependent gathers whatever the data."""
    r = jnp.zeros(t.shape, jnp.int32)
    step = pl.next_power_of_2(bs) // 2 if bs > 1 else 0
    while step >= 1:
        cand = r + step
        ok = cand < bs
        v = plt.load(voff_ref.at[jnp.where(ok, cand, 0)], mask=ok, other=0)
        r = jnp.where(ok & (v <= t), cand, r)
        step //= 2
    return r


def _entries_kernel(rpi_ref, prefix_ref, rtt_ref, lut_ref, voff_ref, en_ref, pool_ref, vl_ref,
                    _s_in, _t_in, _p_in, _v_in, slot_ref, tok_ref, pos_ref, prev_ref, *,
                    block, num_programs, loop, bs, capacity, swa_window_size, has_lut, lut_len,
                    pitch, n_cells, has_pool, pool_pitch, n_pool, k):
    pid = pl.program_id(0)
    total = voff_ref[bs]
    # Overflow (enable == 0) leaves every entry untouched; the clamp to capacity only keeps a
    # broken offsets/enable pair in bounds.
    live = jnp.where(en_ref[0] != 0, jnp.minimum(total, capacity), 0)

    def do_block(b):
        start = b * block
        t32 = start + jnp.arange(block, dtype=jnp.int32)
        t = t32.astype(jnp.int64)
        mask = t < live
        r = _owner(voff_ref, t, bs=bs)
        # A lane past the live total may find a request lane at or past num_reqs, which a
        # caller need not have allocated (module docstring): only live lanes load.
        rstart = plt.load(voff_ref.at[r], mask=mask, other=0)
        rp = plt.load(rpi_ref.at[r], mask=mask, other=0)
        prefix = plt.load(prefix_ref.at[r], mask=mask, other=0)
        pos = window_start(prefix, swa_window_size) + (t - rstart)
        slot = _read_cells(rtt_ref, rp, pos, mask, pitch=pitch, n_cells=n_cells)
        has_prev = mask & (pos > 0)
        prev = _read_cells(rtt_ref, rp, pos - 1, has_prev, pitch=pitch, n_cells=n_cells)
        if has_lut:
            slot = _xlat(slot, lut_ref, lut_len=lut_len)
            prev = _xlat(prev, lut_ref, lut_len=lut_len)
        prev = jnp.where(pos > 0, prev, -1)
        if has_pool:
            sot = pos + k
            vl = plt.load(vl_ref.at[r], mask=mask, other=0)
            flat = rp * pool_pitch + sot
            ok = mask & (sot >= 0) & (sot < vl) & (flat >= 0) & (flat < n_pool)
            idx_t = _kernel_lib.index_dtype(n_pool)
            tok = plt.load(pool_ref.at[jnp.where(ok, flat, 0).astype(idx_t)], mask=ok, other=-1)
            tok = tok.astype(jnp.int64)
        else:
            tok = jnp.full((block,), -1, jnp.int64)
        plt.store(slot_ref.at[pl.ds(start, block)], slot, mask=mask)
        plt.store(tok_ref.at[pl.ds(start, block)], tok, mask=mask)
        plt.store(pos_ref.at[pl.ds(start, block)], pos, mask=mask)
        plt.store(prev_ref.at[pl.ds(start, block)], prev, mask=mask)

    if loop:
        n_blocks = (live + block - 1) // block
        n_iter = jnp.maximum((n_blocks - pid + num_programs - 1) // num_programs, 0)

        def body(i, carry):
            do_block(pid + i * num_programs)
            return carry

        jax.lax.fori_loop(0, n_iter.astype(jnp.int32), body, 0)
    else:
        @pl.when(pid * block < live)
        def _one():
            do_block(pid)


def plan_entries(inputs: PlanInputs, vp: VerifyPlan, verify_offsets, *, swa_window_size,
                 kv_token_id_vs_position_offset, interpret, block_entries=BLOCK_ENTRIES,
                 max_programs=MAX_PROGRAMS, num_warps=ENTRIES_NUM_WARPS) -> VerifyPlan:
    """Launch the entries kernel (inside a jit, after validation, bs >= 1; the entries half of
    :func:`kvcanary_jax.ops.plan.base.compose`). ``inputs.req_to_token`` and the pool are
    ``[rows, row_pitch]`` tables. Returns ``vp`` with its four arrays filled (aliased)."""
    rpi, prefix, req_to_token = inputs.req_pool_indices, inputs.prefix_lens, inputs.req_to_token
    lut, pool = inputs.full_to_swa_index_mapping, inputs.req_to_verify_expected_tokens
    valid_lens = inputs.req_to_verify_expected_tokens_valid_lens
    bs = rpi.shape[0]
    capacity = vp.verify_slot_indices.shape[0]
    rows, pitch = req_to_token.shape
    n_cells = rows * pitch
    has_lut = lut is not None
    has_pool = pool is not None
    if has_pool:
        prow, pool_pitch = pool.shape
        n_pool = prow * pool_pitch
    else:
        pool_pitch = n_pool = 0
    block = min(block_entries, pl.next_power_of_2(max(capacity, 1)))
    need = pl.cdiv(capacity, block)
    num_programs = min(need, max_programs)
    kernel = functools.partial(
        _entries_kernel, block=block, num_programs=num_programs, loop=need > num_programs,
        bs=bs, capacity=capacity, swa_window_size=swa_window_size, has_lut=has_lut,
        lut_len=lut.shape[0] if has_lut else 1, pitch=pitch, n_cells=n_cells,
        has_pool=has_pool, pool_pitch=pool_pitch, n_pool=n_pool,
        k=int(kv_token_id_vs_position_offset),
    )
    dummy64 = jnp.zeros((1,), jnp.int64)
    read = (
        rpi, prefix,
        req_to_token.reshape(-1) if n_cells else jnp.zeros((1,), jnp.int32),
        lut if has_lut else dummy64,
        verify_offsets, vp.enable,
        pool.reshape(-1) if has_pool and n_pool else jnp.zeros((1,), jnp.int32),
        valid_lens if has_pool else dummy64,
    )
    aliased = tuple(getattr(vp, f) for f in VERIFY_ARRAYS)
    filled = pl.pallas_call(
        kernel,
        out_shape=tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in aliased),
        grid=(num_programs,),
        input_output_aliases={len(read) + i: i for i in range(len(aliased))},
        interpret=interpret,
        compiler_params=None if interpret else _kernel_lib.compiler_params(num_warps),
        name="kvcanary_plan_entries",
    )(*read, *aliased)
    return dataclasses.replace(vp, **dict(zip(VERIFY_ARRAYS, filled)))
