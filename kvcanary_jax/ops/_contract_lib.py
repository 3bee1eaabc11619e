"""The contract rules canary_write and canary_verify share, as data
(:mod:`kvcanary_jax.contracts`) evaluated at trace time, before anything runs: SGLang's C++ tensor
guards on the context's arrays (RuntimeError, their text not a contract), the canary slot stride
(whole int64 fields, at least four of them: the reference's ValueError), and the contract metas
of the real-KV sources. Kept apart from :mod:`kvcanary_jax.ops._kernel_lib` (the kernels'
helpers) so that validation reads without any kernel code.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvcanary_jax import consts
from kvcanary_jax.contracts import DType, Rule

__all__ = ["tensor_guard", "context_guard_checks", "canary_checks", "source_metas"]


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


def int64_stand_in(x):
    """What a contract checks of an int32 index or token array that an internal caller hands an
    array-level run, which widens it itself: an int64 ``ShapeDtypeStruct`` of its shape
    (anything else, ``None`` included, as it is)."""
    if x is not None and jnp.dtype(x.dtype) == jnp.dtype(jnp.int32):
        return jax.ShapeDtypeStruct(x.shape, jnp.int64)
    return x
