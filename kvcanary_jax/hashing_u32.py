"""The canary's 64-bit hash on pairs of 32-bit words, for code that has no 64-bit integers.

Mosaic TPU kernels have no 64-bit types at all. Here a 64-bit value is a pair ``(hi, lo)`` of
``uint32`` arrays (or scalars) holding its upper and lower 32 bits; every function below computes
exactly the 64 bits that :mod:`kvcanary_jax.hashing` (and SGLang's ``consts.splitmix64``) compute
on int64 / uint64, for every input:

* xor is word-wise; a logical right shift by ``0 < n < 32`` moves ``hi``'s low ``n`` bits into
  ``lo``'s top;
* ``x * c mod 2**64`` for a 64-bit constant ``c`` is ``lo(x)*lo(c)`` in full (its upper half from
  four 16 x 16-bit partial products, each exact in 32 bits) plus the two cross products' lower
  halves added to the upper word (everything else overflows past bit 63);
* additions carry from ``lo`` into ``hi`` (``lo + b < lo`` unsigned).

The functions take and return pairs and use only 32-bit unsigned ``jnp`` / ``lax`` operations
(``*``, ``+``, ``^``, ``&``, ``|``, ``<<``, logical ``>>``, unsigned comparisons), so the same
code runs on vectors (TPU VPU), on scalars (the TPU scalar unit) and in plain jnp. Constants are
Python ints folded in at trace time.

Boundary helpers turn int64 arrays into pairs and back (``lax.bitcast_convert_type``: word 0 is
the low word, as in memory on every JAX backend).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from kvcanary_jax import hashing

__all__ = [
    "Pair",
    "const",
    "split_int",
    "join_int",
    "xor",
    "shr",
    "add",
    "add_u32",
    "neg",
    "sub",
    "mul_const",
    "eq",
    "ne",
    "is_neg",
    "lt",
    "from_i32",
    "splitmix64",
    "mix3",
    "ANCHOR_HASH",
    "from_i64",
    "to_i64",
    "pair_from_words",
]

Pair = tuple  # (hi, lo), both uint32 arrays or scalars of one shape

_MASK32 = 0xFFFFFFFF
_M1, _M2 = hashing.SPLITMIX64_MULTIPLIERS


def split_int(value: int) -> tuple[int, int]:
    """``(hi, lo)`` of a Python int's 64-bit two's-complement pattern."""
    value &= (1 << 64) - 1
    return value >> 32, value & _MASK32


def join_int(hi: int, lo: int) -> int:
    """The int64 reading of ``(hi, lo)``."""
    v = ((int(hi) & _MASK32) << 32) | (int(lo) & _MASK32)
    return v - (1 << 64) if v >= 1 << 63 else v


def const(value: int, like=None) -> Pair:
    """A 64-bit constant as a pair of uint32 scalars (broadcast against ``like`` if given)."""
    hi, lo = split_int(value)
    h, l_ = jnp.uint32(hi), jnp.uint32(lo)
    if like is not None:
        h = jnp.full(jnp.shape(like), h, jnp.uint32)
        l_ = jnp.full(jnp.shape(like), l_, jnp.uint32)
    return h, l_


def xor(a: Pair, b: Pair) -> Pair:
    return a[0] ^ b[0], a[1] ^ b[1]


def _srl(x, n: int):
    return lax.shift_right_logical(x, jnp.asarray(n, jnp.uint32))


def _sll(x, n: int):
    return lax.shift_left(x, jnp.asarray(n, jnp.uint32))


def shr(a: Pair, n: int) -> Pair:
    """Logical right shift by a static ``0 < n < 32``."""
    assert 0 < n < 32
    hi, lo = a
    return _srl(hi, n), _srl(lo, n) | _sll(hi, 32 - n)


def add(a: Pair, b: Pair) -> Pair:
    """``a + b mod 2**64``."""
    lo = a[1] + b[1]
    carry = (lo < a[1]).astype(jnp.uint32)
    return a[0] + b[0] + carry, lo


def neg(a: Pair) -> Pair:
    """``-a mod 2**64``."""
    return add_u32((~a[0], ~a[1]), jnp.uint32(1))


def sub(a: Pair, b: Pair) -> Pair:
    """``a - b mod 2**64``."""
    return add(a, neg(b))


def add_u32(a: Pair, b) -> Pair:
    """``a + b mod 2**64`` for a uint32 ``b`` (zero-extended)."""
    lo = a[1] + b
    return a[0] + (lo < a[1]).astype(jnp.uint32), lo


def _mulhi_const(x, c: int):
    """Upper 32 bits of the 64-bit product of uint32 ``x`` and the constant ``c < 2**32``."""
    c0, c1 = c & 0xFFFF, c >> 16
    x0 = x & jnp.uint32(0xFFFF)
    x1 = _srl(x, 16)
    p00 = x0 * jnp.uint32(c0)
    p01 = x0 * jnp.uint32(c1)
    p10 = x1 * jnp.uint32(c0)
    p11 = x1 * jnp.uint32(c1)
    mid = _srl(p00, 16) + (p01 & jnp.uint32(0xFFFF)) + (p10 & jnp.uint32(0xFFFF))
    return p11 + _srl(p01, 16) + _srl(p10, 16) + _srl(mid, 16)


def mul_const(a: Pair, c: int) -> Pair:
    """``a * c mod 2**64`` for a Python-int constant ``c``."""
    ch, cl = split_int(c)
    hi, lo = a
    new_hi = _mulhi_const(lo, cl) + lo * jnp.uint32(ch) + hi * jnp.uint32(cl)
    return new_hi, lo * jnp.uint32(cl)


def eq(a: Pair, b: Pair):
    return (a[0] == b[0]) & (a[1] == b[1])


def ne(a: Pair, b: Pair):
    return (a[0] != b[0]) | (a[1] != b[1])


def lt(a: Pair, b: Pair):
    """``a < b`` for pairs read as int64 (signed)."""
    ha = a[0].astype(jnp.int32)
    hb = b[0].astype(jnp.int32)
    return (ha < hb) | ((a[0] == b[0]) & (a[1] < b[1]))


def from_i32(x) -> Pair:
    """An int32 (scalar or array) sign-extended to a pair."""
    x = jnp.asarray(x, jnp.int32)
    lo = x.astype(jnp.uint32)
    return jnp.where(x < 0, jnp.uint32(0xFFFFFFFF), jnp.uint32(0)), lo


def is_neg(a: Pair):
    """Whether the pair read as int64 is negative (its top bit)."""
    return _srl(a[0], 31) != jnp.uint32(0)


def splitmix64(a: Pair) -> Pair:
    """SplitMix64's finaliser (no golden-gamma step: splitmix64(0) = 0), bit-identical to
    :func:`kvcanary_jax.hashing.splitmix64`."""
    x = mul_const(xor(a, shr(a, 30)), _M1)
    x = mul_const(xor(x, shr(x, 27)), _M2)
    return xor(x, shr(x, 31))


def mix3(a: Pair, b: Pair, c: Pair) -> Pair:
    """``splitmix64(splitmix64(splitmix64(a) ^ b) ^ c)``: the chain step (a = previous hash)."""
    h = splitmix64(a)
    h = splitmix64(xor(h, b))
    return splitmix64(xor(h, c))


# The link a chain head stores (predecessor < 0), as (hi, lo) Python ints.
ANCHOR_HASH: tuple[int, int] = split_int(hashing.ANCHOR_HASH_I64)


# ---------------------------------------------------------------------------------------------
# Boundary helpers (outside kernels; int64 needs x64).


def from_i64(x: jax.Array) -> Pair:
    """An int64 array as ``(hi, lo)`` uint32 arrays of the same shape."""
    w = lax.bitcast_convert_type(x, jnp.uint32)  # [..., 2]: word 0 is the low word
    return w[..., 1], w[..., 0]


def to_i64(p: Pair) -> jax.Array:
    """``(hi, lo)`` uint32 (or int32) arrays as one int64 array."""
    hi, lo = (lax.bitcast_convert_type(v, jnp.uint32) if v.dtype == jnp.int32 else v for v in p)
    return lax.bitcast_convert_type(jnp.stack([lo, hi], axis=-1), jnp.int64)


def pair_from_words(lo, hi) -> Pair:
    """A pair from two int32 / uint32 words (e.g. the low and high words of a stored int64)."""
    cast = lambda v: v.astype(jnp.uint32) if hasattr(v, "astype") else jnp.uint32(v)  # noqa
    return cast(hi), cast(lo)
