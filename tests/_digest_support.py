"""The KV digest's test oracle and cases: numpy only (the package's jnp code is what is tested).

A source is an :class:`NpSource`: a compact numpy buffer and the addressing of docs/spec.md §2.4
(page size, bytes per token, bytes read, an optional strided view and byte offset), read here
byte by byte from the buffer's bytes. The digest of a slot is :func:`kvcanary_jax.hashing.
digest_np` of its strips (checked against the Python-int :func:`kvcanary_jax.hashing.digest_int`
in the tests); :func:`np_write` and :func:`np_verify` are the ops, entry by entry, with the ring
guard.
"""

from __future__ import annotations

import collections
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from kvcanary_jax import consts, hashing
from kvcanary_jax.context import DigestContext, RealKvSource
from kvcanary_jax.contracts import TensorMeta

INDEX_MAX = consts.VIOLATION_WRITE_INDEX_MAX


@dataclasses.dataclass
class NpSource:
    """``base``: a compact buffer of any dtype; ``view``: ``(shape, strides)`` in elements of
    ``base`` (None: ``base`` itself, 2-D); ``offset``: bytes into ``base``."""

    base: np.ndarray
    page: int
    nbpt: int
    read: int
    view: tuple | None = None
    offset: int = 0

    @property
    def itemsize(self) -> int:
        return self.base.dtype.itemsize

    @property
    def rows(self) -> int:
        return self.view[0][0] if self.view else self.base.shape[0]

    @property
    def row_bytes(self) -> int:
        if self.view:
            return self.view[1][0] * self.itemsize
        return int(np.prod(self.base.shape[1:])) * self.itemsize

    def byte_at(self, slot: int, k: int) -> int:
        """Where byte ``k`` of ``slot``'s strip lies in ``base``'s bytes."""
        return self.offset + (slot // self.page) * self.row_bytes + \
            (slot % self.page) * self.nbpt + k

    def strips(self, slots) -> np.ndarray:
        """uint8 ``[n, read]``: the slots' strips, zero for a slot whose row is past the rows."""
        flat = self.base.reshape(-1).view(np.uint8)
        out = np.zeros((len(slots), self.read), np.uint8)
        for n, s in enumerate(slots):
            if 0 <= s and s // self.page < self.rows:
                at = self.byte_at(int(s), 0)
                out[n] = flat[at:at + self.read]
        return out

    def jax(self) -> RealKvSource:
        view = None
        if self.view:
            view = TensorMeta(shape=tuple(self.view[0]), dtype=jnp.dtype(self.base.dtype).name,
                              strides=tuple(self.view[1]), device=None, framework="jax")
        return RealKvSource(tensor=jnp.asarray(self.base), page_size=self.page,
                            num_bytes_per_token=self.nbpt, read_bytes=self.read, view=view,
                            offset_bytes=self.offset)



def flip(sources, flips) -> list:
    """The sources with bits flipped in copies of their buffers (views of one buffer keep
    sharing it). ``flips``: ``(source index, slot, byte of the slot's strip, bit)`` each; a byte
    index past ``read`` (up to ``nbpt``) names a byte of the slot's token the digest does not
    read."""
    copies = {}
    for s in sources:
        copies.setdefault(id(s.base), s.base.copy())
    for i, slot, k, bit in flips:
        src = sources[i]
        copies[id(src.base)].reshape(-1).view(np.uint8)[src.byte_at(slot, k)] ^= \
            np.uint8(1 << bit)
    return [dataclasses.replace(s, base=copies[id(s.base)]) for s in sources]


def random_flip(rng, sources, slot: int):
    """A flip of one random bit of a random byte of ``slot``'s strip of a random source that
    holds the slot (a source shorter than the slots has no bytes for its last ones)."""
    holders = [i for i, s in enumerate(sources) if slot // s.page < s.rows]
    i = int(rng.choice(holders))
    return i, slot, int(rng.integers(sources[i].read)), int(rng.integers(8))


def jax_sources(sources) -> tuple:
    """The sources as RealKvSources, views of one buffer sharing one JAX array."""
    arrays = {}
    out = []
    for s in sources:
        src = s.jax()
        key = id(s.base)
        if key in arrays:
            src = dataclasses.replace(src, tensor=arrays[key])
        arrays[key] = src.tensor
        out.append(src)
    return tuple(out)


def np_digests(sources, slots) -> np.ndarray:
    return hashing.digest_np([s.strips(slots) for s in sources])


def _random_bytes(rng, shape, dtype) -> np.ndarray:
    dtype = np.dtype(dtype)
    n = int(np.prod(shape)) * dtype.itemsize
    return rng.integers(0, 256, n, dtype=np.uint8).view(dtype).reshape(shape)


def fused(rng, slots: int, heads: int, head_dim: int, dtype=jnp.bfloat16, *, v: bool = True):
    """sglang-jax's fused, head-interleaved layer ``[slots, 2 * heads, head_dim]`` and its K (and
    V) strips of every head as strided views (``fused_kv_sources``' construction)."""
    base = _random_bytes(rng, (slots, 2 * heads, head_dim), dtype)
    strip = head_dim * base.dtype.itemsize
    view = ((slots, head_dim), (2 * heads * head_dim, 1))
    halves = (0, 1) if v else (0,)
    return [NpSource(base, 1, strip, strip, view, (2 * h + half) * strip)
            for h in range(heads) for half in halves]


def random_sources(rng, num_slots: int, *, small: bool = False):
    """One to several sources of different kinds and widths (their order shuffled): plain rows
    read in part, packed pages of 16-bit words, a fused layer's strided head strips, int64 pages,
    a float32 source shorter than the slots (its last slots read zero words), and (unless
    ``small``) 2 KiB strips, several tiles of a kernel's loads."""
    kinds = ["plain", "paged", "fused", "int64", "short"] + ([] if small else ["wide"])
    picked = rng.choice(kinds, size=int(rng.integers(1, 3 if small else 5)), replace=False)
    out = []
    for kind in picked:
        if kind == "plain":
            nbpt = int(rng.choice([16, 48, 64] if small else [16, 48, 64, 272]))
            read = 16 * int(rng.integers(1, nbpt // 16 + 1))
            out.append(NpSource(_random_bytes(rng, (num_slots, nbpt), np.uint8), 1, nbpt, read))
        elif kind == "paged":
            page, nbpt = int(rng.choice([2, 4])), int(rng.choice([16, 32, 48]))
            rows = -(-num_slots // page)
            dt = np.int16 if rng.integers(2) else jnp.bfloat16
            out.append(NpSource(_random_bytes(rng, (rows, page * nbpt // 2), dt), page, nbpt,
                                nbpt))
        elif kind == "fused":
            out += fused(rng, num_slots, int(rng.integers(1, 3)), 8 * int(rng.integers(1, 3)))
        elif kind == "wide":  # 258 words: more than two of the kernels' 128-word tiles
            out.append(NpSource(_random_bytes(rng, (num_slots, 2064), np.uint8), 1, 2064, 2064))
        elif kind == "int64":
            out.append(NpSource(_random_bytes(rng, (-(-num_slots // 2), 8), np.int64), 2, 32, 32))
        else:
            rows = max(num_slots - int(rng.integers(1, 4)), 0)
            out.append(NpSource(_random_bytes(rng, (rows, 8), np.float32), 1, 32, 16))
    order = rng.permutation(len(out))
    return [out[i] for i in order]


def _strips_of(base: np.ndarray, slots: int, width: int, count: int) -> list:
    """``count`` strips of ``width`` elements of each slot's ``base`` row (a fused layer's K and
    V heads, interleaved), as strided views: slot ``s`` is elements ``[s * per_slot, ...)``."""
    per_slot = base.size // slots
    strip = width * base.dtype.itemsize
    view = ((slots, width), (per_slot, 1))
    return [NpSource(base, 1, strip, strip, view, k * strip) for k in range(count)]


def in_place_layouts(rng, slots: int) -> dict:
    """Sources of every dtype and layout the Mosaic kernel reads in place (rows of 128 elements
    or more, whole 512-byte slices), by name: 2-D rows of each serving dtype, row counts that are
    not a multiple of a 32-bit word's rows (a partial last group), strips read in part at an
    offset, pages, views at a row offset and a row stride, and fused K/V layers as
    ``fused_kv_sources`` sees them (sglang-jax 0.0.2's ``[slots, 2 * heads, head_dim]``, its
    HEAD's paged ``[pages, page_size, 2 * heads / packing, packing, head_dim]``, and a 2-D
    ``[slots, 2 * heads * head_dim]`` one)."""
    import ml_dtypes

    bf16, n = jnp.bfloat16, slots
    pages = -(-n // 4)
    head = _random_bytes(rng, (pages, 4, 2, 2, 128), bf16)  # 2 heads, packing 2
    return {
        "bf16 rows": [NpSource(_random_bytes(rng, (n, 128), bf16), 1, 256, 256)],
        "int16 rows read in part at an offset": [
            NpSource(_random_bytes(rng, (n, 256), np.int16), 1, 256, 128, None, 256)],
        "uint8 rows": [NpSource(_random_bytes(rng, (n, 128), np.uint8), 1, 128, 128)],
        "fp8 e4m3 rows": [
            NpSource(_random_bytes(rng, (n, 256), ml_dtypes.float8_e4m3fn), 1, 256, 256)],
        "fp8 e5m2 rows": [
            NpSource(_random_bytes(rng, (n, 128), ml_dtypes.float8_e5m2), 1, 128, 128)],
        "float32 rows": [NpSource(_random_bytes(rng, (n, 128), np.float32), 1, 512, 512)],
        "bf16 pages of 4": [NpSource(_random_bytes(rng, (pages, 512), bf16), 4, 256, 256)],
        "int8 pages of 2 read in part": [
            NpSource(_random_bytes(rng, (-(-n // 2), 256), np.int8), 2, 128, 64)],
        "int8 rows at a row offset": [NpSource(_random_bytes(rng, (n + 3, 128), np.int8), 1,
                                               128, 128, ((n, 128), (128, 1)), 3 * 128)],
        "bf16 odd rows": [NpSource(_random_bytes(rng, (2 * n, 128), bf16), 1, 256, 256,
                                   ((n, 128), (256, 1)), 256)],
        "bf16 fused layer": fused(rng, n, 2, 128),
        "int8 fused layer": fused(rng, n, 2, 128, np.int8),
        "bf16 fused 2-D layer": _strips_of(_random_bytes(rng, (n, 512), bf16), n, 128, 4),
        "bf16 paged fused layer": _strips_of(head, pages * 4, 128, 4),
    }


# ---------------------------------------------------------------------------------------------
# The ops, entry by entry.


def np_write(digest_buf: np.ndarray, slots, sources) -> np.ndarray:
    out = digest_buf.copy()
    valid = [int(s) for s in slots if 0 <= s < len(out)]
    if valid:
        for s, d in zip(valid, np_digests(sources, valid)):
            out[s] = d
    return out


@dataclasses.dataclass
class State:
    digest: np.ndarray  # int64 [num_slots]
    ring: np.ndarray  # int64 [cap, 8]
    widx: int = 0
    sctr: int = 0
    kctr: int = 0
    kind: int = 0

    def context(self) -> DigestContext:
        with jax.enable_x64(True):
            return DigestContext(
                digest_buf=jnp.asarray(self.digest), kernel_kind=self.kind,
                violation_ring=jnp.asarray(self.ring),
                violation_write_index=jnp.asarray([self.widx], jnp.int32),
                slot_run_counter=jnp.asarray([self.sctr], jnp.int64),
                kernel_run_counter=jnp.asarray([self.kctr], jnp.int64))

    @classmethod
    def of(cls, ctx: DigestContext) -> "State":
        return cls(np.asarray(ctx.digest_buf), np.asarray(ctx.violation_ring),
                   int(ctx.violation_write_index[0]), int(ctx.slot_run_counter[0]),
                   int(ctx.kernel_run_counter[0]), int(ctx.kernel_kind))


def np_verify(st: State, slots, positions, num_valid: int, phase: int, window: int,
              sources) -> tuple[State, list]:
    """The new state and every row the launch found (recorded or not)."""
    n = len(slots)
    active = min(max(num_valid, 0), n)
    p = phase % window
    picked = [e for e in range(active) if 0 < slots[e] < len(st.digest) and slots[e] % window == p]
    got = np_digests(sources, [int(slots[e]) for e in picked]) if picked else []
    rows = [(st.kind, int(slots[e]), int(positions[e]), 0, 0, int(st.digest[slots[e]]), int(d),
             consts.KV_DIGEST_MISMATCH)
            for e, d in zip(picked, got) if int(d) != int(st.digest[slots[e]])]
    ring = st.ring.copy()
    widx = st.widx
    if widx >= 0:
        for j, r in enumerate(rows):
            if widx + j < len(ring):
                ring[widx + j] = r
        widx = min(widx + len(rows), INDEX_MAX)
    return State(st.digest, ring, widx, st.sctr + len(picked), st.kctr + 1, st.kind), rows


def assert_verified(got: State, want: State, before: State, rows, *, ordered: bool) -> None:
    """``got`` equals ``want`` (counters, index, every ring row byte for byte); without
    ``ordered`` (GPU atomics claim rows block by block) the launch's rows are compared as a
    multiset, and where the ring fills, the rows that landed are some of the launch's."""
    assert (got.widx, got.sctr, got.kctr) == (want.widx, want.sctr, want.kctr)
    np.testing.assert_array_equal(got.digest, before.digest)
    if ordered:
        np.testing.assert_array_equal(got.ring, want.ring)
        return
    cap, w0 = len(before.ring), before.widx
    lo = min(max(w0, 0), cap) if w0 >= 0 else cap
    np.testing.assert_array_equal(got.ring[:lo], before.ring[:lo])
    hi = min(w0 + len(rows), cap) if w0 >= 0 else cap
    np.testing.assert_array_equal(got.ring[hi:], before.ring[hi:])
    landed = collections.Counter(tuple(int(v) for v in r) for r in got.ring[lo:hi])
    found = collections.Counter(tuple(int(v) for v in r) for r in rows)
    assert not landed - found, landed
    if w0 >= 0 and w0 + len(rows) <= cap:
        assert landed == found
