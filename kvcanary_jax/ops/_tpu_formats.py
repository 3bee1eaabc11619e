"""The formats at the Mosaic TPU kernels' boundary, built and read back outside the kernels.

The wrappers of the Mosaic TPU kernels (implementation ``"pallas_mosaic_tpu"``) hand the kernels
int32 arrays only, built with ``lax.bitcast_convert_type``, reshapes and zero padding (plain jnp;
int64 needs x64). The kernels read them with :mod:`kvcanary_jax.ops._tpu_lib`, which re-exports
everything here (the kernels import that one module).

* an int64 vector of ``n`` entries -> *pair rows*, int32 ``[n_pad // 64, 128]``: entry ``e``'s low
  word at ``[e // 64, 2 * (e % 64)]``, its high word in the next lane. ``n_pad`` is a multiple of
  :data:`PAIR_TILE` (whole 8 x 128 tiles). A block of pair rows is DMA'd into SMEM (scalar reads,
  e.g. the slots that address row DMAs) and into VMEM, where
  :func:`kvcanary_jax.ops._tpu_lib.planes` splits it into lane-dense *planes* ``[R, 128]`` (entry
  ``e`` of the block at ``[e // 128, e % 128]``) of high and low words with two strided sublane
  loads and two in-register lane gathers;
* ``canary_buf`` uint8 ``[N, S]`` -> *canary tiles*, its transpose uint8 ``[S, N']``
  (:func:`canary_tiles`; ``N'``: ``N`` rounded up to whole 128-slot tiles). XLA lays a uint8
  ``[N, 32]`` array out slot-minor (``{0,1:T(32,128)(4,1)}``: 4 bytes of a slot packed in a
  32-bit word, 128 slots along the lanes), so the transpose is a bitcast and the kernels read and
  write SGLang's canary bytes in place: no conversion, no temporary. A *tile* is the ``[32, 128]``
  window of slots ``[128 t, 128 t + 128)``, one 4 KiB DMA at a 128-aligned lane offset (Mosaic
  refuses a slot's 32-byte window, and any window at an unaligned lane offset);
  ``pltpu.bitcast`` turns it into int32 ``[8, 128]`` in VMEM, word ``w`` of slot ``128 t + l``
  at ``[w, l]`` (token lo/hi, position lo/hi, link lo/hi, fingerprint lo/hi).
  :func:`kvcanary_jax.ops._tpu_lib.select_tiles` picks entries' slots out of gathered tiles;
* ``violation_ring`` int64 ``[C, 8]`` -> int32 ``[C, 16]`` (:func:`words32`);
* a verify or write launch's scalars -> the status words
  (:class:`kvcanary_jax.ops._tpu_lib.Status`; a 64-bit counter as two words, :func:`i64_words`);
* a real-KV source -> its *strips* int32 ``[rows * page_size, E / 4]``: row ``s`` holds the ``E``
  bytes of slot ``s``'s strip that the fingerprint reads (``E`` = 16 in PARTIAL mode, else
  ``read_bytes``), so a slot's strip is one row DMA (:func:`source_strips`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from kvcanary_jax import consts

__all__ = [
    "LANES",
    "PAIR_TILE",
    "pad_to",
    "to_pair_rows",
    "from_pair_rows",
    "words32",
    "from_words32",
    "SLOT_WORDS",
    "SLOT_BYTES",
    "TILE_SLOTS",
    "canary_tiles",
    "canary_from_tiles",
    "i64_words",
    "flat_words32",
    "strip_words",
    "source_strips",
]

LANES = 128
# Entries per whole 8 x 128 tile of pair rows (64 pairs per row, 8 rows).
PAIR_TILE = 512


def pad_to(n: int, multiple: int) -> int:
    return max(multiple, -(-n // multiple) * multiple)


def to_pair_rows(x: jax.Array, n_pad: int) -> jax.Array:
    """int64 ``[n]`` -> int32 pair rows ``[n_pad // 64, 128]`` (zero padded)."""
    w = lax.bitcast_convert_type(x.astype(jnp.int64), jnp.int32).reshape(-1)
    w = jnp.pad(w, (0, 2 * n_pad - w.shape[0]))
    return w.reshape(-1, LANES)


def from_pair_rows(rows: jax.Array, n: int) -> jax.Array:
    """Pair rows -> int64 ``[n]``."""
    w = rows.reshape(-1)[: 2 * n].reshape(n, 2)
    return lax.bitcast_convert_type(w, jnp.int64)


def words32(buf: jax.Array) -> jax.Array:
    """uint8 ``[n, b]`` (or int64 ``[n, k]``) -> int32 ``[n, b / 4]`` (a bitcast)."""
    n = buf.shape[0]
    if buf.dtype == jnp.int64:
        return lax.bitcast_convert_type(buf, jnp.int32).reshape(n, -1)
    return lax.bitcast_convert_type(buf.reshape(n, -1, 4), jnp.int32)


def from_words32(words: jax.Array, like: jax.Array) -> jax.Array:
    """Inverse of :func:`words32` for an array shaped and typed as ``like``."""
    n = like.shape[0]
    if like.dtype == jnp.int64:
        return lax.bitcast_convert_type(words.reshape(n, -1, 2), jnp.int64)
    return lax.bitcast_convert_type(words, jnp.uint8).reshape(like.shape)


# A canary slot's fields: 8 int32 words (4 int64 fields, 32 bytes); a tile holds 128 slots.
SLOT_WORDS = 8
SLOT_BYTES = 4 * SLOT_WORDS
TILE_SLOTS = LANES


def canary_tiles(buf: jax.Array) -> jax.Array:
    """uint8 ``[N, S]`` -> canary tiles uint8 ``[S, N']``, ``N'`` = ``N`` rounded up to a
    positive multiple of :data:`TILE_SLOTS` (zero slots past ``N``). A bitcast in XLA's layout
    when ``N`` is a multiple of 128; otherwise one compact copy (the pad)."""
    n = buf.shape[0]
    n_pad = pad_to(n, TILE_SLOTS)
    t = buf.T
    return t if n_pad == n else jnp.pad(t, ((0, 0), (0, n_pad - n)))


def canary_from_tiles(tiles: jax.Array, like: jax.Array) -> jax.Array:
    """Inverse of :func:`canary_tiles` for a canary shaped as ``like``."""
    n = like.shape[0]
    return (tiles if tiles.shape[1] == n else tiles[:, :n]).T


def i64_words(x: jax.Array) -> jax.Array:
    """int64 ``[1]`` -> int32 ``[2]`` (low, high)."""
    return lax.bitcast_convert_type(x.astype(jnp.int64), jnp.int32).reshape(2)


def flat_words32(x: jax.Array) -> jax.Array:
    """``x``'s bytes as a flat int32 array (bitcasts only; never through int64, which XLA's CPU
    simplifier folds into an invalid narrowing bitcast)."""
    x = jnp.asarray(x)
    if x.dtype == jnp.bool_:
        x = x.astype(jnp.uint8)
    k = x.dtype.itemsize
    flat = x.reshape(-1)
    if k == 4:
        return lax.bitcast_convert_type(flat, jnp.int32)
    if k == 8:
        return lax.bitcast_convert_type(flat, jnp.int32).reshape(-1)
    if flat.shape[0] % (4 // k):
        raise ValueError(f"kv-canary: a real-KV source buffer must hold a whole number of 4-byte "
                         f"words, got shape {tuple(x.shape)} dtype {x.dtype}")
    return lax.bitcast_convert_type(flat.reshape(-1, 4 // k), jnp.int32)


def strip_words(spec, mode: int) -> int:
    """int32 words of a slot's strip the fingerprint reads (16 bytes in PARTIAL mode)."""
    nbytes = 16 if mode == int(consts.RealKvHashMode.PARTIAL) else 8 * spec.read_words
    return nbytes // 4


def source_strips(buf: jax.Array, spec, mode: int) -> jax.Array:
    """A source's bytes (any compact array; its addressing in ``spec``, a
    :class:`~kvcanary_jax.context.SourceSpec`) -> int32 ``[rows * page_size, E / 4]``, row ``s``
    the words slot ``s``'s fingerprint folds. Bytes outside the strips are never read."""
    words = flat_words32(buf)
    rows, page = spec.num_rows, spec.page_size
    stride, nbpt = 2 * spec.row_stride_words, 2 * spec.nbpt_words
    ew = strip_words(spec, mode)
    off = 2 * spec.word_offset
    need = off + rows * stride
    if words.shape[0] < need:  # the last row may end before a whole stride (its strips fit)
        words = jnp.pad(words, (0, need - words.shape[0]))
    body = words[off:need].reshape(rows, stride)[:, : page * nbpt]
    return body.reshape(rows * page, nbpt)[:, :ew]
