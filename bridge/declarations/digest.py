"""The declarations of the KV digest's launchers (ours, not SGLang's; docs/spec.md §16):
:data:`DIGEST_WRITE` (``launch_kv_digest_write``) and :data:`DIGEST_VERIFY`
(``launch_kv_digest_verify``).

Both take their sources as real-KV sources over torch tensors (SGLang's ``RealKvSource``, the
bridge's, or any object with its four fields), any number from 1 to ``MAX_DIGEST_SOURCES``: one per
layer and half of a KV pool (``k_buffer[layer].view(torch.uint8).view(slots, -1)``), each hashed
over all of its ``read_bytes``. A source is handed to the function as the bytes its kernels read
(:func:`~kvcanary_jax.bridge.declarations.shared.named_source_args`, named ``sources[i].tensor``).

Checks, all before anything runs (TypeError / ValueError, our words): the tensors present; the
op's contract (:data:`kvcanary_jax.ops.digest.base.WRITE_CONTRACT` /
:data:`~kvcanary_jax.ops.digest.base.VERIFY_CONTRACT`) on the torch tensors; the sources (a tuple
of 1 to 512 sources, each a 2-D tensor whose rows are packed, SGLang's source contract); one
device; for verify, the context's fields and its ``kernel_kind``. No value check: every value of
``slots``, ``num_valid`` and ``phase`` has a defined meaning (padding and out-of-range slots are
skipped), and the kernels stay in bounds whatever they hold.

In place: a write updates ``digest_buf``; a verify updates the context's ring, write index and
counters (``digest_buf`` is only read). A write with no slot or a 0-slot ``digest_buf`` launches
nothing; a verify always launches (it counts the launch).

Shapes: a write's ``slots`` (a step's written tokens, a number that changes every step) are
lowered at ``bucket(len)`` (:mod:`kvcanary_jax.buckets`) and passed as a per-call copy padded
with -1, a slot the op skips (``Arg.pad``); a verify's arrays are lowered as they are (a serving
loop's plan has one capacity).
"""

from __future__ import annotations

import dataclasses

from kvcanary_jax import buckets, consts
from kvcanary_jax.bridge.checks import require_tensors
from kvcanary_jax.bridge.declarations.shared import (
    Declaration,
    check_distinct_outputs,
    dense,
    hashable,
    impl_for,
    named_source_args,
    platform_of,
    same_device,
)
from kvcanary_jax.context import SOURCE_CONTRACT, DigestContext
from kvcanary_jax.contracts import meta_of
from kvcanary_jax.ops.digest import api as _digest
from kvcanary_jax.ops.digest import base as _digest_base

__all__ = ["DIGEST_WRITE", "DIGEST_VERIFY", "digest_write_fn", "digest_verify_fn",
           "CONTEXT_FIELDS"]

_WRITE_P = "kv-canary: launch_kv_digest_write"
_VERIFY_P = "kv-canary: launch_kv_digest_verify"
_SOURCE_FIELDS = ("tensor", "page_size", "num_bytes_per_token", "read_bytes")
# The context's array fields, as the op's context names them (kernel_kind is static).
CONTEXT_FIELDS = ("digest_buf", "violation_ring", "violation_write_index", "slot_run_counter",
                  "kernel_run_counter")
_VERIFY_ARRAYS = ("slots", "positions", "num_valid", "phase")


def _contiguous(prefix: str, ts: dict, names) -> None:
    """The kernels address these tensors as compact arrays (their pointers on the direct path)."""
    for n in names:
        if not ts[n].is_contiguous():
            raise ValueError(f"{prefix} {n} must be contiguous, got strides "
                             f"{tuple(ts[n].stride())} for shape {tuple(ts[n].shape)}")


# --------------------------------------------------------------------------------------------
# Sources

def _source_tensors(sources) -> dict:
    """The sources' tensors by name (none for a malformed list: the checks then name it)."""
    if not isinstance(sources, (tuple, list)):
        return {}
    return {f"sources[{i}].tensor": getattr(s, "tensor", None) for i, s in enumerate(sources)}


def _source_statics(sources) -> tuple:
    if not isinstance(sources, (tuple, list)):
        return (type(sources),)
    return tuple(tuple(hashable(getattr(s, f, None)) for f in _SOURCE_FIELDS[1:]) + (type(s),)
                 for s in sources)


def _check_sources(prefix: str, sources) -> None:
    """A tuple of 1 to MAX_DIGEST_SOURCES sources, each with the four fields, a torch tensor
    that SGLang's source contract accepts, 2-D with packed rows (the rows the kernels step)."""
    if not isinstance(sources, (tuple, list)):
        raise TypeError(f"{prefix} sources must be a tuple of RealKvSource, got "
                        f"{type(sources).__name__}")
    if not 1 <= len(sources) <= consts.MAX_DIGEST_SOURCES:
        raise ValueError(f"{prefix} sources must hold 1 to {consts.MAX_DIGEST_SOURCES} "
                         f"RealKvSource entries, got {len(sources)}")
    for i, s in enumerate(sources):
        missing = [f for f in _SOURCE_FIELDS if not hasattr(s, f)]
        if missing:
            raise TypeError(f"{prefix} sources[{i}] must be a RealKvSource (tensor, page_size, "
                            f"num_bytes_per_token, read_bytes), got {type(s).__name__} without "
                            f"{', '.join(missing)}")
    require_tensors(prefix, _source_tensors(sources))
    for i, s in enumerate(sources):
        m = meta_of(s.tensor)
        SOURCE_CONTRACT.validate_metas({"tensor": m}, page_size=s.page_size,
                                       num_bytes_per_token=s.num_bytes_per_token,
                                       read_bytes=s.read_bytes)
        if m.ndim != 2 or s.tensor.stride(1) != 1:
            raise ValueError(
                f"{prefix} sources[{i}].tensor must be 2-D with packed rows (stride(-1) == 1), "
                f"got shape {tuple(s.tensor.shape)} strides {tuple(s.tensor.stride())}; pass a "
                "KV layer as its rows of bytes: layer.view(torch.uint8).view(layer.shape[0], -1)")


# --------------------------------------------------------------------------------------------
# launch_kv_digest_write(digest_buf, slots, sources)

def _write_tensors(kw):
    return {"digest_buf": kw["digest_buf"], "slots": kw["slots"],
            **_source_tensors(kw["sources"])}


def _write_validate(kw, ts):
    require_tensors(_WRITE_P, {k: ts[k] for k in ("digest_buf", "slots")})
    _digest_base.WRITE_CONTRACT.validate_metas({k: meta_of(ts[k]) for k in ("digest_buf",
                                                                             "slots")})
    _contiguous(_WRITE_P, ts, ("digest_buf", "slots"))
    _check_sources(_WRITE_P, kw["sources"])
    same_device("kv_digest_write", "digest_buf", ts)


def _write_skip(kw, ts):
    return ts["slots"].numel() == 0 or ts["digest_buf"].numel() == 0


def _bound(named, sources, op: str) -> _digest_base.BoundSources:
    """The sources as the op binds them, over the arrays bound as ``sources[i].tensor``."""
    return _digest_base.bind_sources(
        tuple(dataclasses.replace(s, tensor=named[f"sources[{i}].tensor"])
              for i, s in enumerate(sources)), op)


def digest_write_fn(named, *, sources, platform):
    out = _digest.write(named["digest_buf"], named["slots"],
                        _bound(named, sources, "digest_write"),
                        implementation=impl_for("digest", platform))
    return {"digest_buf": out}


def _write_arguments(kw, ts):
    src_args, statics = named_source_args(kw["sources"], "sources")
    slots = ts["slots"]
    n = int(slots.shape[0])
    b = buckets.bucket(n)
    # A step's written slots change in number every step: lowered at their bucket, the tail
    # -1 (a skipped slot), so a serving loop compiles a logarithmic number of shapes.
    args = [dense("digest_buf", ts["digest_buf"], out=True),
            dense("slots", slots, shape=(b,), pad=-1 if b != n else None), *src_args]
    return args, dict(sources=statics, platform=platform_of(ts["digest_buf"])), ("digest_buf",)


DIGEST_WRITE = Declaration(
    name="launch_kv_digest_write", anchor="digest_buf", outputs=("digest_buf",),
    tensors=_write_tensors, statics=lambda kw: _source_statics(kw["sources"]),
    validate=_write_validate, skip=_write_skip, check_values=lambda kw, ts: None,
    arguments=_write_arguments, fn=digest_write_fn,
)


# --------------------------------------------------------------------------------------------
# launch_kv_digest_verify(context, slots, positions, num_valid, phase, *, window, sources)

def _verify_tensors(kw):
    c = kw["context"]
    out = {k: getattr(c, k, None) for k in CONTEXT_FIELDS}
    out.update({k: kw[k] for k in _VERIFY_ARRAYS})
    out.update(_source_tensors(kw["sources"]))
    return out


def _verify_statics(kw):
    return (hashable(getattr(kw["context"], "kernel_kind", None)), hashable(kw["window"]),
            _source_statics(kw["sources"]))


def _check_context(context) -> int:
    missing = [f for f in (*CONTEXT_FIELDS, "kernel_kind") if not hasattr(context, f)]
    if missing:
        raise TypeError(f"{_VERIFY_P} context must be a DigestContext (digest_buf, kernel_kind, "
                        f"violation_ring, violation_write_index, slot_run_counter, "
                        f"kernel_run_counter), got {type(context).__name__} without "
                        f"{', '.join(missing)}")
    kind = context.kernel_kind
    if isinstance(kind, bool) or not isinstance(kind, int) or not 0 <= kind < 2**31:
        raise TypeError(f"{_VERIFY_P} context.kernel_kind must be an int in [0, 2**31), got "
                        f"{type(kind).__name__} {kind!r}")
    return int(kind)


def _verify_validate(kw, ts):
    _check_context(kw["context"])
    require_tensors(_VERIFY_P, {k: ts[k] for k in (*CONTEXT_FIELDS, *_VERIFY_ARRAYS)})
    _digest_base.VERIFY_CONTRACT.validate_metas(
        {k: meta_of(ts[k]) for k in (*CONTEXT_FIELDS, *_VERIFY_ARRAYS)}, window=kw["window"])
    _contiguous(_VERIFY_P, ts, (*CONTEXT_FIELDS, *_VERIFY_ARRAYS))
    _check_sources(_VERIFY_P, kw["sources"])
    same_device("kv_digest_verify", "digest_buf", ts)
    check_distinct_outputs({k: ts[k] for k in _digest_base.OUTPUTS})


def digest_verify_fn(named, *, sources, kind, window, platform):
    context = DigestContext(kernel_kind=kind, **{k: named[k] for k in CONTEXT_FIELDS})
    out = _digest.verify(context, *(named[k] for k in _VERIFY_ARRAYS),
                         _bound(named, sources, "digest_verify"), window=window,
                         implementation=impl_for("digest", platform))
    return {k: getattr(out, k) for k in _digest_base.OUTPUTS}


def _verify_arguments(kw, ts):
    outputs = _digest_base.OUTPUTS
    src_args, statics = named_source_args(kw["sources"], "sources")
    args = [dense(k, ts[k], out=k in outputs) for k in (*CONTEXT_FIELDS, *_VERIFY_ARRAYS)]
    args += src_args
    static = dict(sources=statics, kind=int(kw["context"].kernel_kind), window=int(kw["window"]),
                  platform=platform_of(ts["digest_buf"]))
    return args, static, outputs


DIGEST_VERIFY = Declaration(
    name="launch_kv_digest_verify", anchor="digest_buf", outputs=_digest_base.OUTPUTS,
    tensors=_verify_tensors, statics=_verify_statics, validate=_verify_validate,
    skip=lambda kw, ts: False, check_values=lambda kw, ts: None,
    arguments=_verify_arguments, fn=digest_verify_fn,
)
