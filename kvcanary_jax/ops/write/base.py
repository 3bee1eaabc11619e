"""canary_write: stamp (token, position, chain link, real-KV fingerprint) into each written slot.

Semantics (SGLang's ``launch_canary_write_kernel``, docs/spec.md §9)::

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

Guarantees where SGLang's GPU kernel leaves things unspecified or out of bounds (every
implementation):

* Within a request everything is sequential, as in SGLang's reference: when a slot repeats in a
  request the last occurrence's row is stored; the seed slot is read once, before the request's
  first store; violation rows of one request are appended in entry order (input-assert row
  before the chain-position row of the same entry).
* Across requests of one launch (a slot written by two requests, a seed written by another
  request) the result follows request order in the reference, ``xla`` and ``pallas_interpret``;
  on the GPU (``pallas_triton``) it is unspecified, as in SGLang, and the ring rows of different
  requests are in the order their atomics ran.
* Nothing is read or written out of bounds: a slot at or past ``num_slots`` is skipped like a
  negative one (SGLang writes past the buffer; its reference raises IndexError); a seed at or past
  ``num_slots`` reads as an all-zero slot; a token index outside ``input_ids`` is skipped; a
  real-KV row past a source's rows reads as zero words.
* A negative ``write_num_valid_reqs`` means no request (the reference's clamp; SGLang's GPU reads
  it as huge). Requests are taken from their own ranges: the reference's early exit on
  ``write_offsets[A] <= 0`` differs only for non-monotonic offsets.
* All validation happens at trace time, before anything runs (SGLang's reference bumps
  ``kernel_run_counter`` first and validates only when there is work).
* The violation ring is appended to under the ring guard of :mod:`kvcanary_jax.ops._kernel_lib`
  (a negative write index writes nothing and stays; the index saturates at 2**31 - 1).

Zero sizes are handled here, once for every implementation (:func:`sized_call`). A launch with no
request rows, no tokens or a 0-slot canary buffer writes nothing (every token is skipped as out
of range) and only bumps ``kernel_run_counter``: SGLang's reference does the same when there is no
work (with work on a 0-slot buffer it raises IndexError, and its GPU kernel writes outside the
buffer). A 0-row ring counts violations in ``violation_write_index`` and stores none (as SGLang's
reference); a real-KV source of 0 rows reads as zero words (SGLang's reference raises from
``index_select``).

This module holds the op's contract, its static shapes (the keys of tuned launch configs) and
:func:`reference`, a pure-jnp, fully sequential version of the op (requests and tokens in order)
with the same bounds choices: the test oracle of every implementation.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from kvcanary_jax import _config, consts, hashing

from kvcanary_jax.context import (
    SourceAbi,
    SourceCount,
    VerifyOrWriteContext,
    as_words,
    nonempty_source,
)
from kvcanary_jax.contracts import Check, Contiguous, Contract, Rule, meta_of
from kvcanary_jax.ops._contract_lib import (
    canary_checks,
    context_guard_checks,
    int64_stand_in,
    source_metas,
    tensor_guard,
)
from kvcanary_jax.ops._kernel_lib import canary_from_words, canary_words
from kvcanary_jax.plans import WritePlan

__all__ = ["CONTRACT", "OUTPUTS", "WriteTokens", "validate", "shapes", "sized_call", "reference",
           "canary_write_reference"]

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


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class WriteTokens:
    """The batch's token arrays a write reads (SGLang's launcher arguments): int64 ``[n]``
    ``input_ids``, ``positions``, ``out_cache_loc``, and the expected tokens and positions,
    present exactly when ``enable_write_input_assert`` is on (else None)."""

    input_ids: jax.Array
    positions: jax.Array
    out_cache_loc: jax.Array
    expected_input_tokens: jax.Array | None = None
    expected_input_positions: jax.Array | None = None


# The token arrays the array-level :func:`~kvcanary_jax.ops.write.api.run` also takes as int32
# (the public op keeps SGLang's int64 contract): the runtime hands an integration's batch over as
# it comes (sglang-jax's arrays are int32), and each implementation widens them as it reads them
# (the Triton kernel as it loads them), sparing a convert kernel per array and step.
NARROW_TOKENS = ("input_ids", "positions", "out_cache_loc")


def widened(tokens: WriteTokens) -> WriteTokens:
    """``tokens`` with :data:`NARROW_TOKENS` as int64."""
    return dataclasses.replace(tokens, **{f: getattr(tokens, f).astype(jnp.int64)
                                          for f in NARROW_TOKENS})


def checked_as(tokens: WriteTokens) -> WriteTokens:
    """What :func:`validate` checks of ``tokens`` for the array-level run: an int32 array of
    :data:`NARROW_TOKENS` seen as its int64 widening (every other dtype as it is)."""
    return dataclasses.replace(tokens, **{f: int64_stand_in(getattr(tokens, f))
                                          for f in NARROW_TOKENS})


# The context fields a launch updates (the others come back as they went in).
OUTPUTS = ("canary_buf", "violation_ring", "violation_write_index", "slot_run_counter",
           "kernel_run_counter")


def validate(context, plan, tokens: WriteTokens, enable_write_input_assert: bool) -> None:
    """:data:`CONTRACT` on the op's arguments (raises at trace time)."""
    tensors = {k: v for k, v in context.arrays("write").items()
               if not k.startswith("real_kv_sources")}
    tensors.update({f"plan.{f.name}": getattr(plan, f.name)
                    for f in dataclasses.fields(WritePlan)})
    tensors.update({f.name: getattr(tokens, f.name) for f in dataclasses.fields(WriteTokens)})
    metas = {k: (None if v is None else meta_of(v)) for k, v in tensors.items()}
    metas.update(source_metas(context.real_kv_sources))
    CONTRACT.validate_metas(
        metas, num_sources=len(context.real_kv_sources),
        enable_write_input_assert=bool(enable_write_input_assert),
    )


def shapes(context: VerifyOrWriteContext, plan: WritePlan, tokens: WriteTokens
           ) -> dict[str, int]:
    """The static sizes a launch configuration may depend on."""
    return {"num_slots": int(context.canary_buf.shape[0]),
            "write_capacity": int(plan.write_seed_slot_indices.shape[0]),
            "num_tokens": int(tokens.input_ids.shape[0])}


def sized_call(fn, context: VerifyOrWriteContext, plan: WritePlan, tokens: WriteTokens,
               **statics) -> VerifyOrWriteContext:
    """``fn(context, plan, tokens, **statics)`` (an implementation's ``run``, or the
    reference), with the zero sizes of the module docstring handled before any implementation
    sees them: the implementations never get an empty canary buffer, ring, request or token
    array, or source buffer. Returns the updated context; what was swapped in for a zero size
    is the caller's again."""
    if 0 in (context.canary_buf.shape[0], plan.write_seed_slot_indices.shape[0],
             tokens.input_ids.shape[0]):
        return context.replace(kernel_run_counter=context.kernel_run_counter + 1)
    swapped = {}
    if context.violation_ring.shape[0] == 0:
        # Violations are counted, never stored: a scratch row takes what is written, the empty
        # ring is returned (the guard's index update does not depend on the capacity).
        swapped["violation_ring"] = jnp.zeros((1, consts.VIOLATION_FIELDS),
                                              context.violation_ring.dtype)
    out = fn(context.replace(**swapped, real_kv_sources=tuple(
        nonempty_source(s) for s in context.real_kv_sources)), plan, tokens, **statics)
    return out.replace(**{k: getattr(context, k) for k in swapped},
                       real_kv_sources=context.real_kv_sources)


# ---------------------------------------------------------------------------------------------
# Pure-jnp reference: requests and tokens strictly in order (so cross-request hazards resolve as
# in SGLang's reference), with the same bounds choices as the kernels.


@functools.partial(jax.jit, static_argnames=("specs", "mode", "kind", "check_input"))
def _reference(canary_buf, ring, widx, sctr, kctr, cpa, offsets, seeds, nvalid, ids,
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

    # The ring guard (kvcanary_jax.ops._kernel_lib): ``w`` counts from the launch's first index
    # in int64 (no wraparound); nothing is written, and the index is kept, when that is negative.
    w0 = widx[0].astype(i64)

    def append(ring, w, fields, when):
        at = jnp.where(when & (w0 >= 0) & (w < ring_cap), w, ring_cap)
        return ring.at[at].set(jnp.stack(fields).astype(i64), mode="drop"), w + when

    def request(r, st):
        c, ring, w, written = st
        start, end = offsets[r], offsets[r + 1]
        seed = seeds[r]
        seed_ok = (seed >= 0) & (seed < num_slots)
        srow = jnp.where(seed_ok, c[jnp.where(seed_ok, seed, 0), :4], 0)
        h0 = jnp.where(seed < 0, jnp.asarray(hashing.ANCHOR_HASH_I64, i64),
                       hashing.mix3(srow[2], srow[0], srow[1]))
        pos_check = (seed >= 0) & (cpa[0] != 0)

        def token(i, st):
            c, ring, w, written, h, last = st
            ok = (r < active) & (i >= 0) & (i < num_tokens)
            slot, t, p = safe(ocl, i), safe(ids, i), safe(pos, i)
            v = ok & (slot >= 0) & (slot < num_slots)
            rkv = hashing.fold_real_kv(slot[None], v[None], words, specs, mode,
                                       gather=hashing.array_gather)[0]
            if check_input:
                et, ep = safe(etok, i), safe(epos, i)
                bits = (jnp.where(t != et, int(consts.FailReason.WRITE_TOKEN_MISMATCH), 0)
                        | jnp.where(p != ep, int(consts.FailReason.WRITE_POSITION_MISMATCH), 0))
                ring, w = append(ring, w, [kind, slot, p, t, et, h, ep, bits],
                                 v & (bits != 0))
            ring, w = append(ring, w, [kind, slot, p, t, t, h, last + 1,
                                       int(consts.FailReason.WRITE_POSITION_MISMATCH)],
                             v & pos_check & (p != last + 1))
            c = c.at[jnp.where(v, slot, num_slots), :4].set(jnp.stack([t, p, h, rkv]),
                                                             mode="drop")
            return (c, ring, w, written + v, jnp.where(v, hashing.mix3(h, t, p), h),
                    jnp.where(v, p, last))

        # Tokens outside the arrays are skipped, so the loop runs over the in-range part only.
        lo = jnp.clip(start, 0, num_tokens)
        hi = jnp.where(r < active, jnp.clip(end, 0, num_tokens), lo)
        c, ring, w, written, _, _ = jax.lax.fori_loop(
            lo, hi, token, (c, ring, w, written, h0, jnp.where(pos_check, srow[1], 0)))
        return c, ring, w, written

    c, ring, w, written = jax.lax.fori_loop(
        0, capacity, request, (c, ring, w0, jnp.zeros((), i64)))
    new = jnp.minimum(w, consts.VIOLATION_WRITE_INDEX_MAX).astype(jnp.int32).reshape(1)
    return (canary_from_words(c.reshape(-1), canary_buf.shape), ring,
            jnp.where(w0 < 0, widx, new), sctr + written, kctr + 1)


def reference(context: VerifyOrWriteContext, plan: WritePlan, tokens: WriteTokens, *,
              enable_write_input_assert: bool) -> VerifyOrWriteContext:
    """The array-level reference: the arguments and result of an implementation's ``run``, no
    validation."""

    def run(context, plan, tokens):
        sources = context.bound_sources()
        ids = tokens.input_ids
        etok, epos = tokens.expected_input_tokens, tokens.expected_input_positions
        canary, ring, widx, sctr, kctr = _reference(
            context.canary_buf, context.violation_ring, context.violation_write_index,
            context.slot_run_counter, context.kernel_run_counter,
            context.enable_chain_position_assert, plan.write_offsets,
            plan.write_seed_slot_indices, plan.write_num_valid_reqs, ids, tokens.positions,
            tokens.out_cache_loc, ids if etok is None else etok, ids if epos is None else epos,
            tuple(b for b, _ in sources), specs=tuple(s for _, s in sources),
            mode=int(context.real_kv_hash_mode), kind=int(context.kernel_kind),
            check_input=bool(enable_write_input_assert),
        )
        return context.replace(canary_buf=canary, violation_ring=ring, violation_write_index=widx,
                               slot_run_counter=sctr, kernel_run_counter=kctr)

    return sized_call(run, context, plan, tokens)


@_config.with_x64
def canary_write_reference(*, context: VerifyOrWriteContext, plan: WritePlan, input_ids,
                           positions, out_cache_loc, enable_write_input_assert: bool,
                           expected_input_tokens, expected_input_positions
                           ) -> VerifyOrWriteContext:
    """Pure-jnp reference of :func:`kvcanary_jax.canary_write` (fully sequential; same
    validation)."""
    tokens = WriteTokens(input_ids=input_ids, positions=positions, out_cache_loc=out_cache_loc,
                         expected_input_tokens=expected_input_tokens,
                         expected_input_positions=expected_input_positions)
    validate(context, plan, tokens, enable_write_input_assert)
    return reference(context, plan, jax.tree.map(jnp.asarray, tokens),
                     enable_write_input_assert=bool(enable_write_input_assert))
