"""Helpers the ops' implementations share: index dtypes, masked gathers and scatters, the
canary's word view, the violation-ring append, the real-KV fold, and the contract checks write and
verify share.

Kernel-side helpers (``gather``, ``scatter``, ``append_rows``, ``fold_real_kv``,
``compiler_params``) run inside ``pallas_call`` bodies (Triton lowering or interpret mode) and
import Pallas's Triton module when first traced, so that the contract checks and word views here
serve every backend, also where that module does not import. The contract helpers are data
(:mod:`kvcanary_jax.contracts`) evaluated at trace time.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvcanary_jax import consts, hashing
from kvcanary_jax.contracts import DType, Rule

__all__ = [
    "compiler_params",
    "index_dtype",
    "gather",
    "scatter",
    "append_rows",
    "fold_real_kv",
    "canary_words",
    "canary_from_words",
    "tensor_guard",
    "context_guard_checks",
    "canary_checks",
    "source_metas",
]


def _plt():
    from jax.experimental.pallas import triton

    return triton


def compiler_params(num_warps: int, num_stages: int = 1):
    """The Triton lowering's launch parameters (passing them is what selects that lowering)."""
    return _plt().CompilerParams(num_warps=num_warps, num_stages=num_stages)


# ---------------------------------------------------------------------------------------------
# Inside kernels


def index_dtype(num_elements: int):
    """Offsets into a buffer of ``num_elements`` elements: int32 while they fit (cheaper address
    arithmetic; the index operands of one ``.at[...]`` must share a dtype), else int64.
    ``num_elements`` counts the one-past-the-end index masked lanes may carry."""
    return jnp.int32 if num_elements < 2**31 else jnp.int64


def gather(ref, idx, ok, other=0):
    """Masked gather from a flat ref: lanes off ``ok`` read ``other`` and are never loaded."""
    idt = index_dtype(ref.shape[0])
    return _plt().load(ref.at[jnp.where(ok, idx, 0).astype(idt)], mask=ok, other=other)


def scatter(ref, idx, vals, mask):
    """Masked scatter into a flat ref. Masked-off lanes get the one-past-the-end index: the GPU
    never touches them, and interpret mode (which writes every lane, old values on masked ones)
    drops them instead of letting them clobber a live lane's element."""
    n = ref.shape[0]
    _plt().store(ref.at[jnp.where(mask, idx, n).astype(index_dtype(n + 1))],
                 vals.astype(ref.dtype), mask=mask)


def append_rows(ring, rows, mask, ring_cap, fields):
    """Writes violation rows ``rows`` (lanes under ``mask``) of the flat ring; rows at or past the
    capacity are dropped (they were counted by the reservation all the same)."""
    ok = mask & (rows < ring_cap)
    base = rows.astype(jnp.int64) * consts.VIOLATION_FIELDS
    for f, vals in enumerate(fields):
        scatter(ring, base + f, vals, ok)


def _word_gather(ref, idx, ok):
    return _plt().load(ref.at[idx], mask=ok, other=0)


def fold_real_kv(slots, mask, source_refs, specs, mode: int):
    """:func:`kvcanary_jax.hashing.fold_real_kv` over kernel refs (masked loads, int32 offsets
    where they fit)."""
    return hashing.fold_real_kv(slots, mask, source_refs, specs, mode, gather=_word_gather,
                                index_dtype=index_dtype)


def canary_words(buf: jax.Array) -> jax.Array:
    """uint8 ``[num_slots, stride]`` -> flat int64 words (a bitcast)."""
    n, sb = buf.shape
    return jax.lax.bitcast_convert_type(buf.reshape(n, sb // 8, 8), jnp.int64).reshape(-1)


def canary_from_words(words: jax.Array, shape) -> jax.Array:
    return jax.lax.bitcast_convert_type(words, jnp.uint8).reshape(shape)


# ---------------------------------------------------------------------------------------------
# Contract checks shared by write and verify


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
