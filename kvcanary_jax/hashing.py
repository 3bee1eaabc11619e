"""The canary's hash primitives on int64, usable in jnp code and inside Pallas kernels.

SGLang hashes on uint64. uint64 arithmetic crashes the Pallas GPU (Triton) lowering, so every
function here works on int64 bit patterns: multiplies wrap mod 2^64 identically on signed and
unsigned types, xor is bitwise, and ``>>`` is :func:`jax.lax.shift_right_logical`. The results are
the same 64 bits as SGLang's ``consts.splitmix64`` / ``splitmix64_mix3``, read as two's complement,
i.e. exactly the int64 values stored in the canary buffer.

Python-int twins (``*_int``) serve constants and tests.

The per-slot KV digest (ours, docs/spec.md §16) is defined here three times, by independent code:
on int64 (:func:`digest_term`, what the kernels and the jnp references compute), on Python ints
(:func:`digest_int`, checkable by hand) and on numpy ``uint64`` (:func:`digest_np`, the tests'
oracle). ``digest(s) = sum over sources j, words i of splitmix64(w + salt(j, i)) mod 2**64`` with
``salt(j, i) = (j * 2**32 + i) * DIGEST_GAMMA mod 2**64``.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from kvcanary_jax import consts

__all__ = [
    "to_i64",
    "to_u64",
    "splitmix64",
    "mix3",
    "splitmix64_int",
    "SPLITMIX64_MULTIPLIERS",
    "mix3_int",
    "ANCHOR_HASH_I64",
    "fold_real_kv",
    "array_gather",
    "DIGEST_GAMMA",
    "digest_salt_int",
    "digest_int",
    "digest_salt",
    "digest_term",
    "splitmix64_np",
    "digest_np",
]

_U64 = (1 << 64) - 1


def to_i64(value: int) -> int:
    """The int64 reading of a 64-bit pattern."""
    value &= _U64
    return value - (1 << 64) if value >= (1 << 63) else value


def to_u64(value: int) -> int:
    return value & _U64


# SplitMix64's two finaliser multipliers (also used by the 32-bit-pair hash, hashing_u32).
SPLITMIX64_MULTIPLIERS: tuple[int, int] = (0xBF58476D1CE4E5B9, 0x94D049BB133111EB)
_M1 = np.int64(to_i64(SPLITMIX64_MULTIPLIERS[0]))
_M2 = np.int64(to_i64(SPLITMIX64_MULTIPLIERS[1]))


def _srl(x, n: int):
    return jax.lax.shift_right_logical(x, jnp.full_like(x, n))


def splitmix64(x):
    """SplitMix64's finaliser on int64 bit patterns (no golden-gamma step: splitmix64(0) = 0)."""
    x = jnp.asarray(x, jnp.int64)
    x = (x ^ _srl(x, 30)) * _M1
    x = (x ^ _srl(x, 27)) * _M2
    return x ^ _srl(x, 31)


def mix3(a, b, c):
    """``splitmix64(splitmix64(splitmix64(a) ^ b) ^ c)``: the chain step (a = previous hash)."""
    h = splitmix64(a)
    h = splitmix64(h ^ jnp.asarray(b, jnp.int64))
    return splitmix64(h ^ jnp.asarray(c, jnp.int64))


def splitmix64_int(value: int) -> int:
    """Python-int splitmix64 returning the int64 reading."""
    x = value & _U64
    x = ((x ^ (x >> 30)) * SPLITMIX64_MULTIPLIERS[0]) & _U64
    x = ((x ^ (x >> 27)) * SPLITMIX64_MULTIPLIERS[1]) & _U64
    return to_i64(x ^ (x >> 31))


def mix3_int(a: int, b: int, c: int) -> int:
    h = splitmix64_int(a)
    h = splitmix64_int(h ^ (b & _U64))
    return splitmix64_int(h ^ (c & _U64))


# The link a chain head stores (predecessor < 0): splitmix64 of the fixed anchor.
ANCHOR_HASH_I64: int = splitmix64_int(consts.CANARY_CHAIN_ANCHOR)


def array_gather(arr, idx, ok):
    """:func:`fold_real_kv`'s gather for plain arrays (pure jnp, outside kernels)."""
    return jnp.where(ok, arr[jnp.where(ok, idx, 0)], 0)


def fold_real_kv(slots, mask, source_refs: Sequence, specs: Sequence, mode: int, *,
                 gather=array_gather, index_dtype=None, prefetch: int = 1, gather_words=None):
    """Real-KV fingerprints of a vector of slots.

    ``source_refs[i]`` is source i's bytes as a flat int64 word ref; ``specs[i]`` its static
    :class:`kvcanary_jax.context.SourceSpec`. Per source, words ``[0, E/8)`` of the slot's strip
    (E = 16 in PARTIAL mode, ``read_bytes`` in ALL) are folded ``h = splitmix64(h ^ w)``; sources
    are combined ``acc = splitmix64(acc ^ h)``. Lanes off ``mask``, and lanes whose row lies past
    the source's rows (SGLang reads out of bounds there), read zero words and are never loaded.
    ``gather(ref, idx, ok)`` loads words (:func:`array_gather` for plain arrays; kernels pass a
    masked load, see :func:`kvcanary_jax.ops._kernel_lib.fold_real_kv`); ``index_dtype(n)`` is
    the dtype of word offsets into a buffer of ``n`` words (default int64).

    ``prefetch``: words loaded before any of them is folded. The fold is one serial chain per
    slot; a GPU issues in order, so loading each word just before its fold step exposes a load
    latency per word. Loading ``prefetch`` words first exposes one per group. The result does
    not depend on it (same words, same order).

    ``gather_words(ref, base, first, count, ok)``, when given, loads words ``first .. first +
    count - 1`` of each lane's strip at once (a list of ``count`` word vectors; kernels pass
    vector loads of several contiguous words a lane) in place of ``count`` calls of ``gather``.
    """
    zero = jnp.zeros(slots.shape, jnp.int64)
    if mode == int(consts.RealKvHashMode.NONE) or not specs:
        return zero
    acc = zero
    for ref, spec in zip(source_refs, specs):
        idt = jnp.int64 if index_dtype is None else index_dtype(ref.shape[0])
        s = jnp.where(mask, slots, 0).astype(jnp.int64)
        row = s // spec.page_size
        col = s % spec.page_size
        ok = mask & (slots >= 0) & (row < spec.num_rows)
        base = spec.word_offset + row * spec.row_stride_words + col * spec.nbpt_words
        base = jnp.where(ok, base, 0).astype(idt)
        words = 2 if mode == int(consts.RealKvHashMode.PARTIAL) else spec.read_words
        group = max(1, min(prefetch, words))

        def fold(first, count, h, base=base, ok=ok, ref=ref):
            # ``count`` loads issued, then folded in order: word ``first + j`` is step j.
            if gather_words is not None:
                loaded = gather_words(ref, base, first, count, ok)
            else:
                loaded = [gather(ref, base + (first + j).astype(idt), ok) for j in range(count)]
            for word in loaded:
                h = splitmix64(h ^ word)
            return h

        full, rest = divmod(words, group)
        if words <= 8:
            h = fold(jnp.asarray(0, idt), words, zero)
        else:
            h = jax.lax.fori_loop(
                0, full, lambda c, h: fold(c.astype(idt) * group, group, h), zero)
            if rest:
                h = fold(jnp.asarray(full * group, idt), rest, h)
        acc = splitmix64(acc ^ h)
    return acc


# ---------------------------------------------------------------------------------------------
# The per-slot KV digest (ours, docs/spec.md §16).

# The salt's multiplier: 2**64 / golden ratio, odd (SplitMix64's own increment), so that
# ``(j * 2**32 + i) -> salt`` is a bijection of 64-bit patterns: no two (source, word) positions
# share a salt.
DIGEST_GAMMA = 0x9E3779B97F4A7C15
_GAMMA_I64 = np.int64(to_i64(DIGEST_GAMMA))
_WORD_INDEX_LIMIT = 1 << 32


def digest_salt_int(source: int, word: int) -> int:
    """``salt(j, i) = (j * 2**32 + i) * DIGEST_GAMMA mod 2**64`` (int64 reading) for source ``j``
    and word ``i`` of its strip (``0 <= i < 2**32``)."""
    if source < 0 or not 0 <= word < _WORD_INDEX_LIMIT:
        raise ValueError(f"kv-canary: digest salt of source {source}, word {word}: the source "
                         f"must be >= 0 and the word in [0, 2**32)")
    return to_i64(((source << 32) + word) * DIGEST_GAMMA)


def digest_int(sources: Sequence[Sequence[int]]) -> int:
    """The digest of one slot whose source ``j`` holds the 64-bit words ``sources[j]`` (Python
    ints, any sign: their 64-bit patterns), as its int64 reading."""
    total = 0
    for j, words in enumerate(sources):
        for i, w in enumerate(words):
            term = splitmix64_int(to_u64(w) + to_u64(digest_salt_int(j, i)))
            total += to_u64(term)
    return to_i64(total)


def digest_salt(source: int, word):
    """``salt(source, word)`` for a static ``source`` and int64 word indices ``word`` (jnp, in
    kernels too): ``salt(j, 0) + i * DIGEST_GAMMA``, which is ``(j * 2**32 + i) * DIGEST_GAMMA``
    mod 2**64."""
    base = jnp.asarray(digest_salt_int(source, 0), jnp.int64)
    return jnp.asarray(word, jnp.int64) * _GAMMA_I64 + base


def digest_term(word, source: int, index):
    """One word's term of the digest: ``splitmix64(word + salt(source, index))`` on int64."""
    return splitmix64(jnp.asarray(word, jnp.int64) + digest_salt(source, index))


def splitmix64_np(x) -> np.ndarray:
    """splitmix64 on numpy ``uint64`` (wrapping products; an array of any shape)."""
    x = np.array(x, dtype=np.uint64, ndmin=1)
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(SPLITMIX64_MULTIPLIERS[0])
        x = (x ^ (x >> np.uint64(27))) * np.uint64(SPLITMIX64_MULTIPLIERS[1])
    return x ^ (x >> np.uint64(31))


def digest_np(strips: Sequence[np.ndarray]) -> np.ndarray:
    """The digests of ``n`` slots: ``strips[j]`` is source ``j``'s bytes of every slot, uint8
    ``[n, E_j]`` (``E_j`` a multiple of 8; read as little-endian 64-bit words). Returns int64
    ``[n]``."""
    total = None
    for j, strip in enumerate(strips):
        strip = np.ascontiguousarray(strip, dtype=np.uint8)
        n, nbytes = strip.shape
        if nbytes % 8:
            raise ValueError(f"kv-canary: a digest strip is whole 8-byte words, got {nbytes} bytes")
        words = strip.view("<u8").reshape(n, nbytes // 8).astype(np.uint64)
        i = np.arange(nbytes // 8, dtype=np.uint64)
        with np.errstate(over="ignore"):
            salt = (np.uint64(j) << np.uint64(32) | i) * np.uint64(DIGEST_GAMMA)
            terms = splitmix64_np(words + salt[None, :]).reshape(n, -1)
            part = terms.sum(axis=1, dtype=np.uint64)
            total = part if total is None else total + part
    if total is None:
        raise ValueError("kv-canary: a digest needs at least one source")
    return total.view(np.int64)
