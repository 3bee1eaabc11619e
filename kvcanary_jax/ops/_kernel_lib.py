"""Helpers the ops' implementations share: index dtypes, masked gathers and scatters, the
canary's word view, the violation-ring append (with the ring guard) and the real-KV fold. The
contract rules write and verify share live in :mod:`kvcanary_jax.ops._contract_lib`.

The ring guard (every implementation and reference applies it). Let ``w0`` be
``violation_write_index[0]`` when a launch starts and ``n`` the violations the launch finds:

* ``w0 < 0``: no row is written and the index is left as it is (a negative index is the
  host-visible report: :func:`kvcanary_jax.runtime.violation_count` raises on it);
* otherwise the launch's ``j``-th violation (0-based, in the launch's order) goes to ring row
  ``w0 + j`` iff ``w0 + j < ring_capacity``, computed without wraparound, and the new index is
  ``min(w0 + n, VIOLATION_WRITE_INDEX_MAX)``: an index near 2**31 - 1 saturates instead of
  wrapping to a negative value, so no launch ever writes before the ring or over row 0 again.

SGLang's kernels take rows with an unchecked ``atomicAdd`` (a negative index writes before the
ring; a wrapped one overwrites recorded rows), and its torch reference slices with the index
(Python's negative indexing: it raises or overwrites the ring's last rows). On the GPU the claim is
a compare-and-swap loop (:func:`claim_rows`), run only by blocks that have a violation to record.

Kernel-side helpers (``gather``, ``scatter``, ``claim_rows``, ``append_rows``, ``fold_real_kv``,
``compiler_params``) run inside ``pallas_call`` bodies (Triton lowering or interpret mode) and
import Pallas's Triton module when first traced, so that the word views and the ring append on
plain arrays here serve every backend, also where that module does not import.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kvcanary_jax import consts, hashing

__all__ = [
    "compiler_params",
    "check_interpret",
    "index_dtype",
    "gather",
    "scatter",
    "claim_rows",
    "append_rows",
    "ring_append",
    "fold_real_kv",
    "canary_words",
    "canary_from_words",
]


def _plt():
    from jax.experimental.pallas import triton

    return triton


def compiler_params(num_warps: int, num_stages: int = 1):
    """The Triton lowering's launch parameters (passing them is what selects that lowering)."""
    return _plt().CompilerParams(num_warps=num_warps, num_stages=num_stages)


def check_interpret(where: str, interpret) -> None:
    """A Triton launch config's ``interpret`` field: a bool (True: Pallas interpret mode, the
    kernels emulated by XLA ops on any backend; see :mod:`kvcanary_jax.ops._registry`)."""
    if not isinstance(interpret, bool):
        raise TypeError(f"kv-canary: {where} (pallas_triton): interpret must be a bool (True: "
                        f"Pallas interpret mode), got {type(interpret).__name__} {interpret!r}")


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


def claim_rows(widx, count, most: int):
    """The ring guard's claim of ``count`` (> 0, int32) rows on the scalar int32 ref ``widx``:
    returns the index before the claim, ``w0`` (negative: refused, the launch writes no row and
    the index is left as it is). The new index is ``w0 + count`` saturated at
    ``VIOLATION_WRITE_INDEX_MAX``. ``most`` (static) bounds the rows the whole launch can claim.

    Fast path, SGLang's: one atomic add, taken when a plain load of the index shows it in
    ``[0, MAX - most]``. The index only grows during a launch, and by at most ``most``, so the add
    can neither meet a negative index nor pass the maximum. Otherwise (a hostile or nearly
    saturated index) a compare-and-swap loop, since an atomic add cannot refuse a negative index
    or saturate: the first compare uses the plain load, every retry the value the failed swap
    returned. (The loop alone serialises contending programs: on the H200 a decode write that
    records a violation in each of 64 / 256 programs took 38 / 137 us with it; a violation-free
    one of 64 takes 2.3 us.)
    Interpret mode runs programs one after another, so its first swap always succeeds."""
    top = jnp.int32(consts.VIOLATION_WRITE_INDEX_MAX)

    def retry(carry):
        _, done = carry
        return ~done

    def attempt(carry):
        seen, _ = carry
        # seen >= 0 here, so top - seen cannot overflow.
        got = _plt().atomic_cas(widx, seen, seen + jnp.minimum(count, top - seen))
        return got, (got == seen) | (got < 0)

    seen = widx[()]
    add = _scalar_atomic_add()
    if add is None or most > consts.VIOLATION_WRITE_INDEX_MAX:  # the loop alone
        w0, _ = jax.lax.while_loop(retry, attempt, (seen, seen < 0))
        return w0
    fast = (seen >= 0) & (seen <= consts.VIOLATION_WRITE_INDEX_MAX - most)
    # Unmasked (interpret mode has no masked atomics): the slow path adds 0.
    added = add(widx, jnp.where(fast, count, 0))
    w0, _ = jax.lax.while_loop(retry, attempt, (seen, fast | (seen < 0)))
    return jnp.where(fast, added, w0)


@functools.cache
def _scalar_atomic_add():
    """``add(ref, val) -> old``: an atomic add on a 0-d ref, or None where this JAX lacks the
    pieces. ``plt.atomic_add`` wants an index, which a 0-d ref cannot take, and the compare-and-
    swap above wants the 0-d ref: the primitive is bound with the empty indexer of a 0-d ref,
    which both Triton lowering and interpret mode accept (jax 0.10.2 to 0.12)."""
    try:
        from jax import tree_util
        from jax._src.pallas.triton import primitives as tp
        from jax._src.state import indexing

        whole = indexing.NDIndexer.from_indices_shape((), ())
        rmw, kind = tp.atomic_rmw_p, tp.AtomicOpType.ADD
    except (ImportError, AttributeError, TypeError):  # pragma: no cover (a future JAX)
        return None

    def add(ref, val):
        flat, tree = tree_util.tree_flatten((ref, (whole,), val, None))
        return rmw.bind(*flat, args_tree=tree, atomic_type=kind)

    return add


def append_rows(ring, w0, rel, mask, ring_cap, fields):
    """Writes violation rows of the flat ring: lane ``i`` under ``mask`` is the launch's violation
    ``rel[i]`` past the claim ``w0`` (:func:`claim_rows`), so it goes to row ``w0 + rel[i]``
    (int64: no wraparound) iff ``w0 >= 0`` and the row is below ``ring_cap``; the rest are
    dropped (they were counted by the claim all the same)."""
    rows = w0.astype(jnp.int64) + rel.astype(jnp.int64)
    ok = mask & (w0 >= 0) & (rows < ring_cap)
    base = rows * consts.VIOLATION_FIELDS
    for f, vals in enumerate(fields):
        scatter(ring, base + f, vals, ok)


def ring_append(ring, widx, mask, rel, count, vals):
    """The ring guard on plain arrays (the jnp references): rows ``vals [m, 8]`` of the lanes
    under ``mask``, lane ``i`` being the launch's violation ``rel[i]`` (int64) of ``count``.
    Returns the new ring and ``violation_write_index``."""
    w0 = widx[0].astype(jnp.int64)
    cap = ring.shape[0]
    rows = w0 + rel
    at = jnp.where(mask & (w0 >= 0) & (rows < cap), rows, cap)
    new = jnp.minimum(w0 + count, consts.VIOLATION_WRITE_INDEX_MAX).astype(jnp.int32)
    return (ring.at[at].set(vals.astype(jnp.int64), mode="drop"),
            jnp.where(w0 < 0, widx, new.reshape(1)))


def _word_gather(ref, idx, ok):
    return _plt().load(ref.at[idx], mask=ok, other=0)


# Real-KV words each lane loads before folding them (hashing.fold_real_kv's ``prefetch``). On the
# H200 (bench/NOTES.md, "the real-KV fold's loads issued ahead"), sglang-jax's canary-only step
# with a 256-byte K strip per slot: TAIL verify 12.95 -> 10.75 us and TAIL write 8.59 -> 7.20 us
# at bs 8 / 512 cached (4 and 32 words: 11.05 / 7.77 and 14.38 / 6.55 us). The verify keeps 8
# (thousands of slots in flight: 32 words each cost registers), the write, a few slots per
# program, takes the whole strip at once.
#
# The write's group is shared by its sources: each source's fold is unrolled group words wide,
# twice (the peeled first block and the loop), so 32 words for each of SGLang's four ALL-mode
# sources made a 13,888-line kernel that triton took 110 s to compile for sm_90 (one source:
# 4,303 lines, 8.5 s), on every new bucket of the first steps. With more sources each keeps
# REAL_KV_PREFETCH_WRITE // sources words ahead, never fewer than the verify's 8 (the kernel's
# size stays about the one-source kernel's; the hash is the same whatever the group).
REAL_KV_PREFETCH = 8
REAL_KV_PREFETCH_WRITE = 32


def write_prefetch(num_sources: int) -> int:
    """Words each source's fold loads ahead in the write kernel, for ``num_sources`` sources."""
    return max(REAL_KV_PREFETCH, REAL_KV_PREFETCH_WRITE // max(num_sources, 1))


def _words_gather(vec: int):
    """``hashing.fold_real_kv``'s ``gather_words`` for kernels: a lane's contiguous words in
    loads of up to ``vec`` words (a ``[lanes, n]`` tile, n a power of two: one vector load a lane
    where Triton can prove the alignment, as the strips' static strides let it; scalar loads
    otherwise, same words), split back into word vectors in order."""

    def load(ref, base, first, count, ok):
        out, j = [], 0
        while j < count:
            n = min(vec, 1 << ((count - j).bit_length() - 1))
            if n == 1:
                out.append(_word_gather(ref, base + (first + j).astype(base.dtype), ok))
            else:
                cols = jnp.arange(n, dtype=base.dtype)[None, :] + (first + j).astype(base.dtype)
                m = jnp.broadcast_to(ok[:, None], (ok.shape[0], n))
                tile = _plt().load(ref.at[base[:, None] + cols], mask=m, other=0)
                out.extend(t.reshape(ok.shape[0]) for t in jax.lax.split(tile, (1,) * n, axis=1))
            j += n
        return out

    return load


def fold_real_kv(slots, mask, source_refs, specs, mode: int, *, prefetch: int | None = None,
                 vec: int = 1):
    """:func:`kvcanary_jax.hashing.fold_real_kv` over kernel refs (masked loads, int32 offsets
    where they fit); ``prefetch`` defaults to :data:`REAL_KV_PREFETCH`; ``vec``: words a lane
    loads at once (1, 2 or 4; the result does not depend on it)."""
    return hashing.fold_real_kv(slots, mask, source_refs, specs, mode, gather=_word_gather,
                                index_dtype=index_dtype,
                                prefetch=REAL_KV_PREFETCH if prefetch is None else prefetch,
                                gather_words=_words_gather(vec) if vec > 1 else None)


def canary_words(buf: jax.Array) -> jax.Array:
    """uint8 ``[num_slots, stride]`` -> flat int64 words (a bitcast)."""
    n, sb = buf.shape
    return jax.lax.bitcast_convert_type(buf.reshape(n, sb // 8, 8), jnp.int64).reshape(-1)


def canary_from_words(words: jax.Array, shape) -> jax.Array:
    return jax.lax.bitcast_convert_type(words, jnp.uint8).reshape(shape)
