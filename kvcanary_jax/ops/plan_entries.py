"""Plan entries: one verify entry per cached position of each active request.

Second half of :func:`kvcanary_jax.canary_plan` (SGLang's ``launch_plan_entries_kernel``). It
reads the verify offsets (``[bs + 1]``, total at ``bs``) and ``enable`` written by
:mod:`kvcanary_jax.ops.plan_offsets`. Nothing is written when ``enable == 0`` (capacity
overflow) or the total is 0. Otherwise, for each flat entry ``t < total``::

    r    = largest r with verify_offsets[r] <= t         (binary search; empty ranges own nothing)
    rp   = req_pool_indices[r];  P = prefix_lens[r]
    pos  = window_start(P) + (t - verify_offsets[r])
    slot = xlat(read(rp, pos))
    prev = xlat(read(rp, pos - 1)) if pos > 0 else -1      (no chain reset at an SWA window start)
    tok  = pool(rp, pos + k) if pool given and 0 <= pos + k < valid_lens[r] else -1

and ``verify_slot_indices[t], verify_expected_tokens[t], verify_expected_positions[t],
verify_prev_slot_indices[t] = slot, tok, pos, prev``. Entries ``[total, capacity)`` are untouched.

``read`` and ``xlat`` are those of :mod:`kvcanary_jax.ops.plan_offsets` (SGLang's flat address
``rp * row_pitch + col``, in-table reads equal to the GPU's, out-of-table cells read as 0; LUT
index clamped to ``lut_len - 1``). The expected-token pool is addressed the same way
(``rp * pool_pitch + pos + k``, bounded by ``valid_lens`` only, as SGLang's kernel); an address
outside the pool, which SGLang would read out of bounds (its reference raises IndexError), yields
-1, the "skip the token check" sentinel, rather than a made-up token id.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kvcanary_jax import _config
from kvcanary_jax._config import pl, plt
from kvcanary_jax.contracts import Check, Rule
from kvcanary_jax.ops.plan_offsets import _read_cells, _window_start, _xlat

__all__ = [
    "ENTRIES_CHECKS",
    "plan_entries",
    "plan_entries_reference",
    "BLOCK_ENTRIES",
    "MAX_PROGRAMS",
    "NUM_WARPS",
]

# Entries per program iteration: 1024 lanes over 4 warps give each thread 8 independent binary
# searches in flight, which hides the latency of the dependent offset loads.
BLOCK_ENTRIES = 1024
NUM_WARPS = 4
# The grid is sized from the (static) capacity, since the live total is only known on device.
# Up to MAX_PROGRAMS programs each take one block and those past the total exit at once; beyond
# that (capacity > MAX_PROGRAMS * BLOCK_ENTRIES, ~1M entries) the programs loop over blocks with a
# stride of the grid size, so a huge capacity with a small live total does not launch thousands
# of idle programs. 1024 programs = ~8 per SM on an H200 (132 SMs), as SGLang's persistent grid.
MAX_PROGRAMS = 1024

_P = "kv-canary: launch_plan_entries_kernel"


def _rule_valid_lens(metas, scalars):
    if metas.get("req_to_verify_expected_tokens") is not None and metas.get(
        "req_to_verify_expected_tokens_valid_lens"
    ) is None:
        return {}
    return None


def _guard(name, want_ndim, want_dtype, want_len=None):
    """SGLang's C++ tensor-matcher guards (RuntimeError; their wording is not a contract)."""

    def fails(metas, scalars):
        m = metas.get(name)
        if m is None:
            return None
        exp_len = None if want_len is None else want_len(metas, scalars)
        bad = m.ndim != want_ndim or m.dtype != want_dtype or (
            exp_len is not None and m.shape[0] != exp_len
        )
        if not bad:
            return None
        desc = f"{want_ndim}-D {m.fmt_dtype(want_dtype)}"
        if exp_len is not None:
            desc += f" of length {exp_len}"
        return {"name": name, "desc": desc, "shape": m.shape, "dtype": m.fmt_dtype()}

    return Rule(fails, _P + " {name} must be {desc}, got shape {shape} dtype {dtype}",
                exc=RuntimeError)


def _bs(metas, scalars):
    m = metas.get("req_pool_indices")
    return m.shape[0]


def _cap(metas, scalars):
    return scalars["verify_capacity"]


ENTRIES_CHECKS: tuple[Check, ...] = (
    Rule(
        _rule_valid_lens,
        _P + " requires req_to_verify_expected_tokens_valid_lens when "
        "req_to_verify_expected_tokens is set",
    ),
    _guard("out_verify_slot_indices", 1, "int64", _cap),
    _guard("out_verify_expected_tokens", 1, "int64", _cap),
    _guard("out_verify_expected_positions", 1, "int64", _cap),
    _guard("out_verify_prev_slot_indices", 1, "int64", _cap),
    _guard("req_to_verify_expected_tokens", 2, "int32"),
    _guard("req_to_verify_expected_tokens_valid_lens", 1, "int64", _bs),
)


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
        rstart = plt.load(voff_ref.at[r])
        rp = plt.load(rpi_ref.at[r])
        prefix = plt.load(prefix_ref.at[r])
        pos = _window_start(prefix, swa_window_size) + (t - rstart)
        slot = _read_cells(rtt_ref, rp, pos, mask, pitch=pitch, n_cells=n_cells)
        has_prev = mask & (pos > 0)
        prev = _read_cells(rtt_ref, rp, pos - 1, has_prev, pitch=pitch, n_cells=n_cells)
        if has_lut:
            slot = _xlat(slot, lut_ref, lut_len=lut_len)
            prev = _xlat(prev, lut_ref, lut_len=lut_len)
        prev = jnp.where(pos > 0, prev, -1)
        if has_pool:
            sot = pos + k
            vl = plt.load(vl_ref.at[r])
            flat = rp * pool_pitch + sot
            ok = mask & (sot >= 0) & (sot < vl) & (flat >= 0) & (flat < n_pool)
            idx_t = jnp.int32 if n_pool < 2**31 else jnp.int64
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


def plan_entries(rpi, prefix, req_to_token, lut, verify_offsets, enable, pool, valid_lens,
                 slots, tokens, positions, prevs, *, swa_window_size,
                 kv_token_id_vs_position_offset, interpret, block_entries=BLOCK_ENTRIES, max_programs=MAX_PROGRAMS,
                 num_warps=NUM_WARPS):
    """Launch the entries kernel (inside a jit, after validation, bs >= 1). ``req_to_token`` and
    ``pool`` are ``[rows, row_pitch]`` tables. Returns the four verify arrays (aliased)."""
    bs = rpi.shape[0]
    capacity = slots.shape[0]
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
    inputs = (
        rpi, prefix,
        req_to_token.reshape(-1) if n_cells else jnp.zeros((1,), jnp.int32),
        lut if has_lut else dummy64,
        verify_offsets, enable,
        pool.reshape(-1) if has_pool and n_pool else jnp.zeros((1,), jnp.int32),
        valid_lens if has_pool else dummy64,
        slots, tokens, positions, prevs,
    )
    return pl.pallas_call(
        kernel,
        out_shape=tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in inputs[8:]),
        grid=(num_programs,),
        input_output_aliases={8 + i: i for i in range(4)},
        interpret=interpret,
        compiler_params=None if interpret else _config.compiler_params(num_warps),
        name="kvcanary_plan_entries",
    )(*inputs)


def plan_entries_reference(rpi, prefix, req_to_token, lut, verify_offsets, enable, pool,
                           valid_lens, slots, tokens, positions, prevs, *, swa_window_size,
                           kv_token_id_vs_position_offset):
    """Pure-jnp :func:`plan_entries` (same arguments, results and documented choices)."""
    bs = rpi.shape[0]
    capacity = slots.shape[0]
    total = verify_offsets[bs]
    live = jnp.where(enable[0] != 0, jnp.minimum(total, capacity), 0)
    t = jnp.arange(capacity, dtype=jnp.int64)
    r = jnp.clip(jnp.searchsorted(verify_offsets[:bs], t, side="right") - 1, 0, bs - 1)
    rp = rpi[r]
    pos = _window_start(prefix[r], swa_window_size) + (t - verify_offsets[r])

    def read(table, col, ok, other):
        n = table.size
        flat = rp * table.shape[1] + col
        ok = ok & (flat >= 0) & (flat < n)
        if n == 0:
            return jnp.full(t.shape, other, jnp.int64)
        v = table.reshape(-1)[jnp.clip(flat, 0, n - 1)].astype(jnp.int64)
        return jnp.where(ok, v, other)

    def xl(v):
        if lut is None:
            return v
        return jnp.where(v < 0, v, lut[jnp.clip(v, 0, lut.shape[0] - 1)])

    slot = xl(read(req_to_token, pos, True, 0))
    prev = jnp.where(pos > 0, xl(read(req_to_token, pos - 1, pos > 0, 0)), -1)
    if pool is not None:
        sot = pos + int(kv_token_id_vs_position_offset)
        tok = read(pool, sot, (sot >= 0) & (sot < valid_lens[r]), -1)
    else:
        tok = jnp.full(t.shape, -1, jnp.int64)
    m = t < live
    return (jnp.where(m, slot, slots), jnp.where(m, tok, tokens), jnp.where(m, pos, positions),
            jnp.where(m, prev, prevs))
