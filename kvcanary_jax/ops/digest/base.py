"""The per-slot KV digest (ours, not SGLang's; docs/spec.md §16): ``digest_write`` and
``digest_verify``.

Every byte of every source's strip of a slot is hashed into one int64 per slot::

    digest(s) = sum over sources j, words i of splitmix64(w_{j,i}(s) + salt(j, i))   (mod 2**64)
    salt(j, i) = (j * 2**32 + i) * 0x9E3779B97F4A7C15                              (mod 2**64)

``w_{j,i}(s)`` is the little-endian 64-bit word ``i`` of the ``read_bytes`` of source ``j``'s strip
of slot ``s`` (the real-KV addressing of docs/spec.md §2.4: row ``s // page_size``, bytes from
``(s % page_size) * num_bytes_per_token``; a source's strided ``view`` and ``offset_bytes`` as for
the canary). A slot whose row lies past a source's rows reads zero words from that source (its
terms are still summed: ``splitmix64(salt(j, i))``). Every term is independent of the others, so
a change confined to one word changes exactly one term through a bijection, and the sum changes:
one flipped bit anywhere in the strips is detected with certainty.

Semantics::

    digest_write(digest_buf, slots, sources):
        for e in [0, len(slots)):  s = slots[e]
            if 0 <= s < num_slots: digest_buf[s] = digest(s)      # negative / past: skipped

    digest_verify(context, slots, positions, num_valid, phase, window, sources):
        kernel_run_counter += 1
        A = clamp(num_valid[0], 0, capacity);  p = phase[0] mod window   (floor: in [0, window))
        for e in [0, A):  s = slots[e]
            selected = 0 < s < num_slots and s % window == p         # slot 0 is the padding slot
            if selected:
                slot_run_counter += 1
                if digest(s) != digest_buf[s]:
                    record(kernel_kind, s, positions[e], 0, 0, digest_buf[s], digest(s),
                           KV_DIGEST_MISMATCH)

A phase outside ``[0, window)`` is taken modulo ``window`` (never a silent "nothing selected").
Duplicate slots in a write store the same value (the same bytes); in a verify each entry is
checked and recorded on its own. No index, whatever its value, makes an implementation read or
write outside an array: slots outside ``[0, num_slots)`` are skipped, masked lanes read nothing.

Records go to the violation ring under the ring guard of :mod:`kvcanary_jax.ops._kernel_lib`
(a negative write index records nothing and stays; past the capacity only the index grows,
saturating at 2**31 - 1). The reference, ``xla``, ``pallas_interpret`` and ``pallas_mosaic_tpu``
append in entry order; ``pallas_triton`` keeps entry order within a block of selected entries and
the order across blocks is its atomics' (compare as a multiset).

Cost: a verify's work follows the selected entries (about ``1/window`` of them), not the
capacity: ``xla`` and ``pallas_mosaic_tpu`` compact the selected entries first (:func:`selection`,
:func:`compact`: a prefix sum over the mask), ``pallas_triton`` selects in its kernels (the same
predicate, chunk by chunk); each reads KV bytes only for the selected entries.

Zero sizes: no entry, or a 0-slot ``digest_buf``, does nothing but count the launch (verify); a
0-row ring counts violations in ``violation_write_index`` and stores none; a source of 0 rows
reads as zero words.

This module holds the contracts, the binding of sources to distinct buffers
(:class:`BoundSources`), the selection shared by the implementations and :func:`reference_write`
/ :func:`reference_verify`, the pure-jnp versions (entries in order), the oracle of every
implementation besides the numpy one of the tests.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from kvcanary_jax import _config, consts, hashing
from kvcanary_jax.context import (
    DigestContext,
    RealKvSource,
    SourceSpec,
    as_words,
    check_extent,
    nonempty_source,
    source_spec,
)
from kvcanary_jax.contracts import Check, Contract, DType, Rule, meta_of
from kvcanary_jax.ops._kernel_lib import ring_append
from kvcanary_jax.ops._xla_lib import record_of, take
from kvcanary_jax.ops._xla_lib import ring_append as xla_ring_append

__all__ = ["BoundSources", "bind_sources", "validate_write", "validate_verify", "shapes",
           "selection", "compact", "slot_digests", "reference_write", "reference_verify",
           "digest_write_reference", "digest_verify_reference", "OUTPUTS", "sized_verify",
           "finish_verify"]

_W, _V = "digest_write", "digest_verify"


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BoundSources:
    """The sources as the implementations take them: each distinct buffer once (``buffers``, a
    tuple of arrays) and, per source in order, ``(buffer index, SourceSpec)`` (``specs``,
    static). Views of one buffer (a fused K/V layer's head strips) share it: one argument of the
    kernels, however many sources read it."""

    buffers: tuple
    specs: tuple = dataclasses.field(metadata=dict(static=True))

    def words_per_slot(self) -> int:
        return sum(spec.read_words for _, spec in self.specs)


def bind_sources(sources, op: str) -> BoundSources:
    """``sources`` (a tuple or list of :class:`~kvcanary_jax.RealKvSource`, 1 to
    :data:`~kvcanary_jax.consts.MAX_DIGEST_SOURCES`) bound to their distinct buffers (by
    identity), each checked to hold the rows its spec addresses. Raises TypeError / ValueError
    naming ``op``."""
    if not isinstance(sources, (tuple, list)):
        raise TypeError(f"kv-canary {op}: sources must be a tuple of RealKvSource, got "
                        f"{type(sources).__name__}")
    if not 1 <= len(sources) <= consts.MAX_DIGEST_SOURCES:
        raise ValueError(f"kv-canary {op}: sources must hold 1 to {consts.MAX_DIGEST_SOURCES} "
                         f"RealKvSource entries, got {len(sources)}")
    buffers, index, specs = [], {}, []
    for i, src in enumerate(sources):
        if not isinstance(src, RealKvSource):
            raise TypeError(f"kv-canary {op}: sources[{i}] must be a RealKvSource, got "
                            f"{type(src).__name__}")
        src = nonempty_source(src)
        spec = source_spec(src)
        check_extent(_words_shape(src.tensor), spec, i)
        key = id(src.tensor)
        if key not in index:
            index[key] = len(buffers)
            buffers.append(src.tensor)
        specs.append((index[key], spec))
    return BoundSources(buffers=tuple(buffers), specs=tuple(specs))


def _words_shape(buf) -> jax.ShapeDtypeStruct:
    """The shape of ``buf``'s bytes as int64 words (the error of
    :func:`kvcanary_jax.context.as_words` for a buffer that is not whole words), without
    touching its data."""
    return jax.eval_shape(as_words, jax.ShapeDtypeStruct(jnp.shape(buf), jnp.result_type(buf)))


@dataclasses.dataclass(frozen=True)
class _Window(Check):
    """The static ``window`` (scalar): an int >= 1."""

    def run(self, metas, scalars):
        w = scalars["window"]
        if isinstance(w, bool) or not isinstance(w, int):
            raise TypeError(f"kv-canary {_V}: window must be a static int >= 1, got "
                            f"{type(w).__name__} {w!r}")
        if w < 1:
            raise ValueError(f"kv-canary {_V}: window must be >= 1, got {w}")


def _guard(op: str, name: str, dtype: str, shape):
    """dtype (TypeError) then shape (ValueError) of ``name``; ``shape``: an ndim, an exact shape
    or ``"ring"`` (``[capacity, 8]``)."""

    def bad(metas, scalars):
        m = metas[name]
        if shape == "ring":
            ok = m.ndim == 2 and m.shape[1] == consts.VIOLATION_FIELDS
        else:
            ok = m.ndim == shape if isinstance(shape, int) else m.shape == tuple(shape)
        return None if ok else {"shape": m.shape}

    want = {"ring": f"of shape (ring_capacity, {consts.VIOLATION_FIELDS})"}.get(
        shape, f"{shape}-D" if isinstance(shape, int) else f"of shape {tuple(shape)}")
    return (DType(name, dtype, f"kv-canary {op}: {{name}} must be {{expected}}, got {{dtype}}"),
            Rule(bad, f"kv-canary {op}: {name} must be {want}, got shape {{shape}}"))


def _same_shape(metas, scalars):
    a, b = metas["slots"].shape, metas["positions"].shape
    return None if a == b else {"a": a, "b": b}


WRITE_CONTRACT = Contract(op=_W, checks=(
    *_guard(_W, "digest_buf", "int64", 1),
    *_guard(_W, "slots", "int64", 1),
))

VERIFY_CONTRACT = Contract(op=_V, checks=(
    _Window(),
    *_guard(_V, "digest_buf", "int64", 1),
    *_guard(_V, "slots", "int64", 1),
    *_guard(_V, "positions", "int64", 1),
    Rule(_same_shape, f"kv-canary {_V}: positions must have the shape of slots {{a}}, got {{b}}"),
    *_guard(_V, "num_valid", "int32", (1,)),
    *_guard(_V, "phase", "int32", (1,)),
    *_guard(_V, "violation_ring", "int64", "ring"),
    *_guard(_V, "violation_write_index", "int32", (1,)),
    *_guard(_V, "slot_run_counter", "int64", (1,)),
    *_guard(_V, "kernel_run_counter", "int64", (1,)),
))


def validate_write(digest_buf, slots, sources) -> BoundSources:
    """:data:`WRITE_CONTRACT`, then the sources bound (raises at trace time)."""
    WRITE_CONTRACT.validate_metas({"digest_buf": meta_of(digest_buf), "slots": meta_of(slots)})
    return bind_sources(sources, _W)


def validate_verify(context: DigestContext, slots, positions, num_valid, phase, window,
                    sources) -> BoundSources:
    """:data:`VERIFY_CONTRACT`, then the sources bound (raises at trace time)."""
    if not isinstance(context, DigestContext):
        raise TypeError(f"kv-canary {_V}: context must be a DigestContext, got "
                        f"{type(context).__name__}")
    arrays = dict(digest_buf=context.digest_buf, slots=slots, positions=positions,
                  num_valid=num_valid, phase=phase, violation_ring=context.violation_ring,
                  violation_write_index=context.violation_write_index,
                  slot_run_counter=context.slot_run_counter,
                  kernel_run_counter=context.kernel_run_counter)
    VERIFY_CONTRACT.validate_metas({k: meta_of(v) for k, v in arrays.items()}, window=window)
    return bind_sources(sources, _V)


def shapes(num_slots: int, capacity: int, sources: BoundSources, *, verify: bool,
           window: int = 1) -> dict[str, int]:
    """The static sizes a launch configuration may depend on: ``verify`` (0 write, 1 verify),
    ``words`` (64-bit words hashed per slot), ``sources``, ``buffers``."""
    return {"verify": int(verify), "num_slots": int(num_slots), "capacity": int(capacity),
            "window": int(window), "words": sources.words_per_slot(),
            "sources": len(sources.specs), "buffers": len(sources.buffers)}


# ---------------------------------------------------------------------------------------------
# Selection and compaction (every implementation's first step of a verify).


def selection(slots, num_valid, phase, *, window: int, num_slots: int):
    """The entries a verify checks (bool ``[capacity]``): ``e < clamp(num_valid, 0, capacity)``,
    ``0 < slot < num_slots``, ``slot % window == phase mod window``."""
    cap = slots.shape[0]
    active = jnp.clip(num_valid[0].astype(jnp.int64), 0, cap)
    p = jnp.remainder(phase[0].astype(jnp.int64), window)  # floor mod: in [0, window)
    valid = (slots > consts.TOKEN_TO_KV_SLOT_PADDING) & (slots < num_slots)
    picked = jnp.remainder(jnp.where(valid, slots, 0), window) == p
    return (jnp.arange(cap, dtype=jnp.int64) < active) & valid & picked


def compact(selected):
    """``(order, count)``: ``order`` int32 ``[capacity]``, the selected entries' indices in entry
    order then zeros; ``count`` int32 ``[1]`` of them (an exclusive prefix sum over the mask, and
    one scatter)."""
    cap = selected.shape[0]
    flags = selected.astype(jnp.int32)
    incl = jnp.cumsum(flags, dtype=jnp.int32)
    at = jnp.where(selected, incl - flags, cap)
    order = jnp.zeros((cap,), jnp.int32).at[at].set(jnp.arange(cap, dtype=jnp.int32),
                                                    mode="drop")
    return order, incl[-1:]


def finish_verify(context: DigestContext, slots, positions, order, count, digests):
    """The shared end of a verify whose selected entries were compacted (``order``, ``count``)
    and digested (``digests[k]``: compacted entry k's digest, for ``k < count``): compare with
    the stored digests, record mismatches in entry order, count. Plain XLA (the end of the xla and
    pallas_mosaic_tpu implementations)."""
    i64 = jnp.int64
    cap = slots.shape[0]
    k = jnp.arange(cap, dtype=i64)
    live = k < count[0]
    slot = take(slots, order, live)
    stored = take(context.digest_buf, slot, live)
    viol = live & (stored != digests)
    incl = jnp.cumsum(viol.astype(i64))

    def rows(j, ok):
        e = record_of(incl, j)[0]
        s, d, st = slot[e], digests[e], stored[e]
        pos = take(positions, order[e], ok)
        zero = jnp.zeros(j.shape, i64)
        return jnp.stack([jnp.full(j.shape, context.kernel_kind, i64), s, pos, zero, zero, st, d,
                          jnp.full(j.shape, consts.KV_DIGEST_MISMATCH, i64)], axis=-1)

    ring, widx = xla_ring_append(context.violation_ring, context.violation_write_index,
                                 incl[-1], rows, branch=False)
    return context.replace(violation_ring=ring, violation_write_index=widx,
                           slot_run_counter=context.slot_run_counter + count.astype(i64),
                           kernel_run_counter=context.kernel_run_counter + 1)


# ---------------------------------------------------------------------------------------------
# Pure-jnp digests and references.


def _strip_words(words, spec: SourceSpec, slots, ok):
    """int64 ``[n, read_words]``: the words of the slots' strips (zero where ``ok`` is off or the
    row lies past the source's rows); masked lanes read nothing."""
    n, w = slots.shape[0], spec.read_words
    if spec.num_rows == 0:
        return jnp.zeros((n, w), jnp.int64)
    s = jnp.where(ok, slots, 0).astype(jnp.int64)
    row = s // spec.page_size
    ok = ok & (row < spec.num_rows)
    base = spec.word_offset + row * spec.row_stride_words + (s % spec.page_size) * spec.nbpt_words
    idx = jnp.where(ok, base, 0)[:, None] + jnp.arange(w, dtype=jnp.int64)[None, :]
    return take(words, idx, ok[:, None])


def slot_digests(slots, ok, sources: BoundSources):
    """The digests (int64 ``[n]``) of ``slots`` where ``ok`` (pure jnp; 0 elsewhere)."""
    words = [as_words(b) for b in sources.buffers]
    acc = jnp.zeros(slots.shape, jnp.int64)
    for j, (b, spec) in enumerate(sources.specs):
        strip = _strip_words(words[b], spec, slots, ok)
        i = jnp.arange(spec.read_words, dtype=jnp.int64)[None, :]
        acc = acc + jnp.sum(hashing.digest_term(strip, j, i), axis=1)
    return jnp.where(ok, acc, 0)


@jax.jit
def _reference_write(digest_buf, slots, sources):
    num_slots = digest_buf.shape[0]
    ok = (slots >= 0) & (slots < num_slots)
    d = slot_digests(slots, ok, sources)
    return digest_buf.at[jnp.where(ok, slots, num_slots)].set(d, mode="drop")


def reference_write(digest_buf, slots, sources: BoundSources):
    """The array-level reference of a write (no validation)."""
    if slots.shape[0] == 0 or digest_buf.shape[0] == 0:
        return digest_buf
    return _reference_write(digest_buf, slots, sources)


# The context fields a verify updates (the others come back as they went in).
OUTPUTS = ("violation_ring", "violation_write_index", "slot_run_counter", "kernel_run_counter")


def sized_verify(fn, context: DigestContext, *args) -> DigestContext:
    """``fn(context, *args)`` (an implementation's verify, or the reference) with the zero sizes
    of the module docstring handled first: no implementation sees an empty plan, digest buffer
    or ring. ``args[0]`` is the slots."""
    if args[0].shape[0] == 0 or context.digest_buf.shape[0] == 0:
        return context.replace(kernel_run_counter=context.kernel_run_counter + 1)
    ring = context.violation_ring
    if ring.shape[0] == 0:
        # Violations are counted, never stored: a scratch row takes what is written.
        scratch = jnp.zeros((1, consts.VIOLATION_FIELDS), ring.dtype)
        return fn(context.replace(violation_ring=scratch), *args).replace(violation_ring=ring)
    return fn(context, *args)


@functools.partial(jax.jit, static_argnames=("window", "kind"))
def _reference_verify(digest_buf, ring, widx, sctr, kctr, slots, positions, num_valid, phase,
                      sources, *, window, kind):
    i64 = jnp.int64
    num_slots = digest_buf.shape[0]
    cap = slots.shape[0]
    checked = selection(slots, num_valid, phase, window=window, num_slots=num_slots)
    got = slot_digests(slots, checked, sources)
    stored = take(digest_buf, slots, checked)
    viol = checked & (stored != got)
    n = viol.astype(i64)
    zero = jnp.zeros((cap,), i64)
    vals = jnp.stack([jnp.full((cap,), kind, i64), slots, positions, zero, zero, stored, got,
                      jnp.full((cap,), consts.KV_DIGEST_MISMATCH, i64)], axis=1)
    ring, widx = ring_append(ring, widx, viol, jnp.cumsum(n) - n, jnp.sum(n), vals)
    return ring, widx, sctr + jnp.sum(checked.astype(i64)), kctr + 1


def reference_verify(context: DigestContext, slots, positions, num_valid, phase,
                     sources: BoundSources, *, window: int) -> DigestContext:
    """The array-level reference of a verify (no validation)."""

    def run(context, slots, positions, num_valid, phase):
        ring, widx, sctr, kctr = _reference_verify(
            context.digest_buf, context.violation_ring, context.violation_write_index,
            context.slot_run_counter, context.kernel_run_counter, slots, positions, num_valid,
            phase, sources, window=window, kind=int(context.kernel_kind))
        return context.replace(violation_ring=ring, violation_write_index=widx,
                               slot_run_counter=sctr, kernel_run_counter=kctr)

    return sized_verify(run, context, slots, positions, num_valid, phase)


@_config.with_x64
def digest_write_reference(digest_buf, slots, sources) -> Any:
    """Pure-jnp reference of :func:`kvcanary_jax.digest_write` (same validation)."""
    return reference_write(digest_buf, slots, validate_write(digest_buf, slots, sources))


@_config.with_x64
def digest_verify_reference(context: DigestContext, slots, positions, num_valid, phase, *,
                            window: int, sources) -> DigestContext:
    """Pure-jnp reference of :func:`kvcanary_jax.digest_verify` (rows in entry order; same
    validation)."""
    bound = validate_verify(context, slots, positions, num_valid, phase, window, sources)
    return reference_verify(context, slots, positions, num_valid, phase, bound, window=window)
