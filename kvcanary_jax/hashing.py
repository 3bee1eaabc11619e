"""The canary's hash primitives on int64, usable in jnp code and inside Pallas kernels.

SGLang hashes on uint64. uint64 arithmetic crashes the Pallas GPU (Triton) lowering, so every
function here works on int64 bit patterns: multiplies wrap mod 2^64 identically on signed and
unsigned types, xor is bitwise, and ``>>`` is :func:`jax.lax.shift_right_logical`. The results are
the same 64 bits as SGLang's ``consts.splitmix64`` / ``splitmix64_mix3``, read as two's complement,
i.e. exactly the int64 values stored in the canary buffer.

Python-int twins (``*_int``) serve constants and tests.
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
                 gather=array_gather, index_dtype=None, prefetch: int = 1):
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
