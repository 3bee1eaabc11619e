"""Plan offsets: per-request verify/write lengths, their prefix sums, chain seeds and totals.

First half of :func:`kvcanary_jax.canary_plan` (SGLang's ``launch_plan_offsets_kernel``). For each
request ``r`` (``W = swa_window_size``, ``P = prefix_lens[r]``, ``E = extend_seq_lens[r]``,
``rp = req_pool_indices[r]``, ``active = rp != 0``)::

    window_start = max(P - W, 0) if W > 0 else 0
    verify_len   = max(P - window_start, 0) if active else 0
    write_len    = max(E, 0)                 if active else 0
    seed         = xlat(read(rp, P - 1))     if active and P > 0 and write_len > 0 else -1

Outputs: ``verify_offsets[0..bs)`` exclusive prefix sums of ``verify_len`` and
``verify_offsets[bs]`` their total (a fresh ``[bs + 1]`` array, SGLang's scratch);
``write_offsets[0..bs]`` the same for ``write_len`` and 0 for ``(bs, write_req_capacity]``;
``write_seed_slot_indices[0..bs)`` (rest untouched); ``verify_num_valid = min(total, capacity)``;
``enable = total <= capacity``; ``write_num_valid_reqs = bs`` (padding rows included).

Reads of ``req_to_token`` use SGLang's flat address ``rp * row_pitch + col`` with no column bound,
so where SGLang's GPU kernels read inside the table we return exactly what they read (a position
past the row width reads the next row, as on the GPU). A flat address outside the table
``[0, rows * row_pitch)`` — which SGLang's kernels would read out of bounds — is never read: the
cell reads as 0 (``TOKEN_TO_KV_SLOT_PADDING``, what SGLang's masked loads return). ``xlat`` maps a
value ``v >= 0`` through the SWA LUT at ``min(v, lut_len - 1)`` (SGLang's kernels clamp; its torch
reference raises instead) and passes negative values through.

Unlike SGLang (one program, ``bs <= 4096``) there is no cap on ``bs``: up to
:data:`SINGLE_BLOCK_MAX` requests run in one program with one in-register cumsum; larger batches
take a two-kernel path (per-block sums, then each block adds the sum of the blocks before it).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kvcanary_jax import _config
from kvcanary_jax._config import pl, plt
from kvcanary_jax.contracts import Check, Contiguous, DType, NDim, Rule, TensorMeta

__all__ = [
    "OFFSETS_CHECKS",
    "plan_offsets",
    "plan_offsets_reference",
    "row_stride",
    "SINGLE_BLOCK_MAX",
    "MULTI_BLOCK",
    "NUM_WARPS",
]

# One program, one cumsum up to this many requests (SGLang's own block; a 4096-wide int64 cumsum
# lowers and runs on the H200). Above it the batch is split in MULTI_BLOCK-request blocks.
SINGLE_BLOCK_MAX = 4096
MULTI_BLOCK = 4096
# Smallest block of the single-program path: tiny decode batches still fill a warp.
MIN_BLOCK = 32
NUM_WARPS = 8

REQ_POOL_IDX_PADDING = 0
TOKEN_TO_KV_SLOT_PADDING = 0


# --------------------------------------------------------------------------------------------
# Contract: SGLang's offsets-kernel validation (spec §11.3), in its order and words. The scratch
# tensor of SGLang's GPU path is internal here (and its 4097-entry minimum is SGLang's bs cap),
# so its checks are left out; the bs <= 4096 check does not exist (no cap).
# --------------------------------------------------------------------------------------------

_ORDER = (
    ("req_pool_indices", "int64"),
    ("prefix_lens", "int64"),
    ("extend_seq_lens", "int64"),
    ("req_to_token", "int32"),
    ("lut_tensor", "int64"),
    ("out_write_offsets", "int64"),
    ("out_write_seed_slot_indices", "int64"),
    ("out_verify_num_valid", "int32"),
    ("out_verify_enable", "int32"),
    ("out_write_num_valid_reqs", "int32"),
)

_DTYPE_MSG = "kv-canary: {name} must have dtype {expected}, got {dtype}"
_1D_MSG = "kv-canary: {name} must be 1-D, got shape {shape}"


def _len0(m: TensorMeta | None) -> int | None:
    return None if m is None or m.ndim < 1 else m.shape[0]


def _bs(metas) -> int:
    return _len0(metas.get("req_pool_indices")) or 0


def row_stride(m: TensorMeta) -> int:
    """``req_to_token.stride(0)`` as torch reports it; a compact JAX array's row pitch is its
    width, and an empty dimension counts as 1 as in torch's stride convention."""
    if m.framework == "jax" or m.strides is None:
        return max(m.shape[1], 1) if m.ndim >= 2 else 1
    return m.stride(0)


def _stride0(metas, scalars) -> int | None:
    s = scalars.get("req_to_token_stride0")
    if s is not None:
        return int(s)
    m = metas.get("req_to_token")
    return None if m is None or m.ndim < 2 else row_stride(m)


def _rule_write_offsets_positive(metas, scalars):
    n = _len0(metas.get("out_write_offsets"))
    return None if n is None or n > 0 else {"n": n}


def _rule_verify_capacity(metas, scalars):
    c = scalars["verify_capacity"]
    return None if c >= 0 else {"n": c}


def _rule_stride_positive(metas, scalars):
    s = _stride0(metas, scalars)
    return None if s is None or s > 0 else {"n": s}


def _rule_lut_nonempty(metas, scalars):
    m = metas.get("full_to_swa_index_mapping")
    return None if m is None or (m.shape[0] if m.ndim else 1) > 0 else {}


def _len_rule(name, expected_fn):
    def fails(metas, scalars):
        m = metas.get(name)
        if m is None:
            return None
        exp = expected_fn(metas, scalars)
        return None if m.shape[0] == exp else {"name": name, "exp": exp, "n": m.shape[0]}

    return fails


def _rule_lut_min_len(metas, scalars):
    m = metas.get("lut_tensor")
    if m is None:
        return None
    lut = metas.get("full_to_swa_index_mapping")
    lut_len = 0 if lut is None else (lut.shape[0] if lut.ndim else 1)
    need = max(lut_len, 1)
    return None if m.shape[0] >= need else {"need": need, "n": m.shape[0]}


def _rule_write_offsets_len(metas, scalars):
    wo, seeds = metas.get("out_write_offsets"), metas.get("out_write_seed_slot_indices")
    if wo is None or seeds is None:
        return None
    n, c = wo.shape[0], seeds.shape[0]
    return None if n == c + 1 else {"n": n, "c": c}


def _rule_bs_capacity(metas, scalars):
    seeds = metas.get("out_write_seed_slot_indices")
    if seeds is None:
        return None
    bs, c = _bs(metas), seeds.shape[0]
    return None if bs <= c else {"bs": bs, "c": c}


def _rule_stride_match(metas, scalars):
    a = scalars.get("req_to_token_stride0")
    m = metas.get("req_to_token")
    if a is None or m is None:
        return None
    b = row_stride(m)
    return None if int(a) == b else {"a": int(a), "b": b}


def _rule_same_device(metas, scalars):
    # SGLang allocates its scratch on the verify plan's device and checks everything against it.
    anchor = metas.get("out_verify_slot_indices")
    if anchor is None or anchor.device is None:
        return None
    for name, _ in _ORDER:
        m = metas.get(name)
        if m is not None and m.device is not None and m.device != anchor.device:
            return {"name": name, "dev": anchor.device, "dev2": m.device}
    return None


def _ndim_then_len(name: str, expected_fn) -> tuple[Check, ...]:
    return (
        NDim(name, 1, _1D_MSG),
        Rule(_len_rule(name, expected_fn), "kv-canary: {name} length must be {exp}, got {n}"),
    )


OFFSETS_CHECKS: tuple[Check, ...] = (
    *(Contiguous(name) for name, _ in _ORDER),
    *(DType(name, dt, _DTYPE_MSG, exc=ValueError) for name, dt in _ORDER),
    Rule(_rule_write_offsets_positive, "kv-canary: write_offsets_len must be positive, got {n}"),
    Rule(_rule_verify_capacity, "kv-canary: verify_capacity must be non-negative, got {n}"),
    Rule(_rule_stride_positive, "kv-canary: req_to_token_stride0 must be positive, got {n}"),
    Rule(_rule_lut_nonempty, "kv-canary: lut_len must be positive when has_swa_lut is True"),
    *_ndim_then_len("req_pool_indices", lambda m, s: _bs(m)),
    *_ndim_then_len("prefix_lens", lambda m, s: _bs(m)),
    *_ndim_then_len("extend_seq_lens", lambda m, s: _bs(m)),
    NDim("req_to_token", 2, "kv-canary: {name} must be 2-D, got shape {shape}"),
    NDim("lut_tensor", 1, _1D_MSG),
    Rule(_rule_lut_min_len, "kv-canary: lut_tensor length must be >= {need}, got {n}"),
    *_ndim_then_len("out_write_offsets", lambda m, s: m["out_write_offsets"].shape[0]),
    *_ndim_then_len(
        "out_write_seed_slot_indices", lambda m, s: m["out_write_seed_slot_indices"].shape[0]
    ),
    *_ndim_then_len("out_verify_num_valid", lambda m, s: 1),
    *_ndim_then_len("out_verify_enable", lambda m, s: 1),
    *_ndim_then_len("out_write_num_valid_reqs", lambda m, s: 1),
    Rule(
        _rule_write_offsets_len,
        "kv-canary: write_offsets_len must equal write_req_capacity + 1, got {n} and {c}",
    ),
    Rule(_rule_bs_capacity, "kv-canary: bs={bs} exceeds write_req_capacity={c}"),
    Rule(
        _rule_stride_match,
        "kv-canary: req_to_token_stride0={a} does not match req_to_token.stride(0)={b}",
    ),
    Rule(
        _rule_same_device,
        "kv-canary: {name} must be on out_verify_offsets_scratch's device {dev}, got {dev2}",
    ),
)


# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------


def _window_start(prefix, swa_window_size):
    if swa_window_size > 0:
        return jnp.maximum(prefix - swa_window_size, 0)
    return jnp.zeros_like(prefix)


def _lens(rpi, prefix, extend, in_bs, swa_window_size):
    active = in_bs & (rpi != REQ_POOL_IDX_PADDING)
    vlen = jnp.where(active, jnp.maximum(prefix - _window_start(prefix, swa_window_size), 0), 0)
    wlen = jnp.where(active, jnp.maximum(extend, 0), 0)
    return active, vlen, wlen


def _load_block(rpi_ref, prefix_ref, extend_ref, start, block, bs):
    idx = start + jnp.arange(block, dtype=jnp.int32)
    in_bs = idx < bs
    rpi = plt.load(rpi_ref.at[pl.ds(start, block)], mask=in_bs, other=REQ_POOL_IDX_PADDING)
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
    idx_t = jnp.int32 if n_cells < 2**31 else jnp.int64
    vals = plt.load(flat_ref.at[jnp.where(ok, flat, 0).astype(idx_t)], mask=ok, other=0)
    return vals.astype(jnp.int64)


def _block_sums_kernel(rpi_ref, prefix_ref, extend_ref, vsum_ref, wsum_ref, *, block, bs,
                       swa_window_size):
    pid = pl.program_id(0)
    _, in_bs, rpi, prefix, extend = _load_block(rpi_ref, prefix_ref, extend_ref, pid * block,
                                                 block, bs)
    _, vlen, wlen = _lens(rpi, prefix, extend, in_bs, swa_window_size)
    vsum_ref[pid] = jnp.sum(vlen)
    wsum_ref[pid] = jnp.sum(wlen)


def _offsets_kernel(*refs, block, bs, num_sum_blocks, swa_window_size, has_lut, lut_len, pitch,
                    n_cells, verify_capacity, write_capacity):
    """Program p owns request indices ``[p*block, (p+1)*block)``: it computes its requests'
    offsets and seeds (when any fall below bs) and zero-fills its part of ``write_offsets`` past
    bs. Program 0 also stores the totals and the scalars."""
    multi = num_sum_blocks > 1
    if multi:
        (rpi_ref, prefix_ref, extend_ref, rtt_ref, lut_ref, vsum_ref, wsum_ref,
         _wo_in, _seed_in, _nv_in, _en_in, _wn_in,
         voff_ref, wo_ref, seed_ref, nv_ref, en_ref, wn_ref) = refs
    else:
        (rpi_ref, prefix_ref, extend_ref, rtt_ref, lut_ref,
         _wo_in, _seed_in, _nv_in, _en_in, _wn_in,
         voff_ref, wo_ref, seed_ref, nv_ref, en_ref, wn_ref) = refs
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
        wo_ref[bs] = total_w
        overflow = total_v > verify_capacity
        nv_ref[0] = jnp.where(overflow, verify_capacity, total_v).astype(jnp.int32)
        en_ref[0] = jnp.where(overflow, 0, 1).astype(jnp.int32)
        wn_ref[0] = jnp.int32(bs)

    @pl.when(start < bs)
    def _requests():
        idx, in_bs, rpi, prefix, extend = _load_block(rpi_ref, prefix_ref, extend_ref, start,
                                                      block, bs)
        active, vlen, wlen = _lens(rpi, prefix, extend, in_bs, swa_window_size)
        vinc = jnp.cumsum(vlen)
        winc = jnp.cumsum(wlen)
        vexcl, wexcl = vinc - vlen, winc - wlen
        if multi:
            vexcl, wexcl = vexcl + base_v, wexcl + base_w
        plt.store(voff_ref.at[pl.ds(start, block)], vexcl, mask=in_bs)
        plt.store(wo_ref.at[pl.ds(start, block)], wexcl, mask=in_bs)

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


def plan_offsets(rpi, prefix, extend, req_to_token, lut, write_offsets, seeds, verify_num_valid,
                 enable, write_num_valid_reqs, *, swa_window_size, verify_capacity, interpret,
                 num_warps=NUM_WARPS, single_block_max=SINGLE_BLOCK_MAX,
                 multi_block=MULTI_BLOCK):
    """Launch the offsets kernel(s) (call inside a jit, after validation). ``req_to_token`` is the
    ``[rows, row_pitch]`` table (a compact base whose pitch may exceed the logical width).

    Returns ``(verify_offsets[bs + 1], write_offsets, seeds, verify_num_valid, enable,
    write_num_valid_reqs)``; the last five alias their inputs."""
    bs = rpi.shape[0]
    write_capacity = seeds.shape[0]
    rows, pitch = req_to_token.shape
    n_cells = rows * pitch
    rtt_flat = req_to_token.reshape(-1) if n_cells > 0 else _dummy(jnp.int32)
    has_lut = lut is not None
    lut_len = lut.shape[0] if has_lut else 0
    lut_arr = lut if has_lut else _dummy(jnp.int64)
    params = None if interpret else _config.compiler_params(num_warps)

    if bs <= single_block_max:
        block = max(MIN_BLOCK, pl.next_power_of_2(max(bs, 1)))
        sum_inputs = ()
        num_sum_blocks = 1
    else:
        block = multi_block
        num_sum_blocks = pl.cdiv(bs, block)
        sum_inputs = pl.pallas_call(
            functools.partial(_block_sums_kernel, block=block, bs=bs,
                              swa_window_size=swa_window_size),
            out_shape=(jax.ShapeDtypeStruct((num_sum_blocks,), jnp.int64),) * 2,
            grid=(num_sum_blocks,),
            interpret=interpret,
            compiler_params=params,
            name="kvcanary_plan_offsets_block_sums",
        )(rpi, prefix, extend)

    grid = pl.cdiv(write_capacity + 1, block)
    kernel = functools.partial(
        _offsets_kernel, block=block, bs=bs, num_sum_blocks=num_sum_blocks,
        swa_window_size=swa_window_size, has_lut=has_lut, lut_len=max(lut_len, 1), pitch=pitch,
        n_cells=n_cells, verify_capacity=verify_capacity, write_capacity=write_capacity,
    )
    inputs = (rpi, prefix, extend, rtt_flat, lut_arr, *sum_inputs,
              write_offsets, seeds, verify_num_valid, enable, write_num_valid_reqs)
    first_alias = len(inputs) - 5
    out_shape = (
        jax.ShapeDtypeStruct((bs + 1,), jnp.int64),
        *(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in inputs[first_alias:]),
    )
    return pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(grid,),
        input_output_aliases={first_alias + i: 1 + i for i in range(5)},
        interpret=interpret,
        compiler_params=params,
        name="kvcanary_plan_offsets",
    )(*inputs)


def plan_offsets_reference(rpi, prefix, extend, req_to_token, lut, write_offsets, seeds,
                           verify_num_valid, enable, write_num_valid_reqs, *, swa_window_size,
                           verify_capacity):
    """Pure-jnp :func:`plan_offsets` (same arguments and results, same documented choices)."""
    del verify_num_valid, enable, write_num_valid_reqs
    bs = rpi.shape[0]
    cap = seeds.shape[0]
    _, vlen, wlen = _lens(rpi, prefix, extend, jnp.ones((bs,), bool), swa_window_size)
    voff = jnp.concatenate([jnp.zeros((1,), jnp.int64), jnp.cumsum(vlen)])
    wcum = jnp.concatenate([jnp.zeros((1,), jnp.int64), jnp.cumsum(wlen)])
    new_wo = jnp.zeros_like(write_offsets).at[: bs + 1].set(wcum)
    total_v = voff[bs]
    rows, pitch = req_to_token.shape
    has_prefix = (rpi != REQ_POOL_IDX_PADDING) & (prefix > 0)
    flat = rpi * pitch + (prefix - 1)
    ok = has_prefix & (flat >= 0) & (flat < rows * pitch)
    cells = req_to_token.reshape(-1)
    raw = jnp.where(ok, cells[jnp.clip(flat, 0, max(rows * pitch - 1, 0))] if rows * pitch else 0,
                    0).astype(jnp.int64)
    if lut is not None:
        raw = jnp.where(raw < 0, raw, lut[jnp.clip(raw, 0, lut.shape[0] - 1)])
    seed = jnp.where(has_prefix & (wlen > 0), raw, -1)
    new_seeds = seeds.at[:bs].set(seed) if bs else seeds
    overflow = total_v > verify_capacity
    nv = jnp.where(overflow, verify_capacity, total_v).astype(jnp.int32).reshape(1)
    en = jnp.where(overflow, 0, 1).astype(jnp.int32).reshape(1)
    wn = jnp.full((1,), bs, jnp.int32)
    del cap
    return voff, new_wo, new_seeds, nv, en, wn
