"""tpu-inference 0.32's KV cache layouts, and the real-KV sources over them.

One array per attention layer (``runner.kv_caches[i]``), bf16 by default, fp8 with an fp8
``cache_dtype``; ``packing = 32 // dtype bits`` (2 for bf16, 4 for fp8, 1 for f32):

* **RPA v3** (every head_dim but 64): ``[blocks, block_size, align(2 * kv_heads, packing) //
  packing, packing, align(head_dim, 128)]``. K and V are head-interleaved (``merge_kv``: combined
  head ``2h`` is ``K_h``, ``2h + 1`` is ``V_h``), padded with zero heads to a multiple of
  ``packing`` and with zero lanes to 128. Row-major, so slot ``s = block * block_size + offset``
  is row ``s`` of a ``[slots, combined heads * lanes]`` view, and ``K_h`` starts at element
  ``2h * lanes`` of it (the padded pitch: ``lanes``, not ``head_dim``).
* **RPA v3, head_dim 64** (``kernel_hd64``): ``[blocks, block_size, align(kv_heads, packing) //
  packing, packing, 128]``: each head's K and V share one 128-lane row, ``K_h`` in lanes 0..63
  of row ``h``, so at element ``h * 128``.

The head dimension (axis 2) is sharded over the KV-head mesh axis and the block dimension
(axis 0) over the data-parallel axis (``P('data', None, 'model')``); a shard's local block holds
its own heads of its own blocks, in the same layout.

:func:`kv_layout` recognises a layer's array from its shape, its dtype and the model's head
count and head_dim, and refuses anything else when the guard is installed, naming what it found
and what is supported. :meth:`KvLayout.k_sources` describes the first K strips of a local block
as :class:`~kvcanary_jax.RealKvSource` strided views of the array itself (page size 1, no copy):
the whole padded strip for RPA v3 (its zero lanes included: every byte the kernel stores for
``K_h``), the 64 K lanes for head_dim 64.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp

import kvcanary_jax as kc
from kvcanary_jax.consts import MAX_REAL_KV_SOURCES
from kvcanary_jax.contracts import TensorMeta

__all__ = ["KvLayout", "kv_layout", "SUPPORTED_LAYOUTS", "RPA_V3", "RPA_V3_HD64"]

RPA_V3 = "rpa_v3"
RPA_V3_HD64 = "rpa_v3_hd64"
LANES = 128
SUPPORTED_LAYOUTS = (
    "tpu-inference 0.32's RPA v3 layouts, one 5-D array per attention layer: "
    "[blocks, block_size, align(2*kv_heads, packing)/packing, packing, align(head_dim, 128)] "
    "(K_h and V_h interleaved, head_dim padded to 128 lanes), or for head_dim 64 "
    "[blocks, block_size, align(kv_heads, packing)/packing, packing, 128] (K_h | V_h in one "
    "128-lane row); packing = 32 // dtype bits (bf16: 2, fp8: 4, float32: 1)")


def _align(x: int, to: int) -> int:
    return -(-x // to) * to


@dataclasses.dataclass(frozen=True, kw_only=True)
class KvLayout:
    """One layer's KV array as a shard holds it (hashable: a jit constant).

    ``kind``: :data:`RPA_V3` or :data:`RPA_V3_HD64`. ``local_heads``: the KV heads of one
    head shard. ``row_elems``: elements per slot. ``k_pitch``: elements from ``K_h`` to
    ``K_{h+1}``. ``k_elems``: elements fingerprinted per K strip."""

    kind: str
    block_size: int
    head_dim: int
    lanes: int
    packing: int
    dtype: str
    local_heads: int
    row_elems: int
    k_pitch: int
    k_elems: int

    @property
    def itemsize(self) -> int:
        return jnp.dtype(self.dtype).itemsize

    def k_sources(self, local_block, k_heads: int) -> tuple[kc.RealKvSource, ...]:
        """Sources over the K strips of local heads ``0 .. k_heads - 1`` of a local block
        ``[blocks, block_size, ...]`` (under ``shard_map``: the shard's own heads)."""
        slots = int(local_block.shape[0]) * int(local_block.shape[1])
        strip = self.k_elems * self.itemsize
        view = TensorMeta(shape=(slots, self.k_elems), dtype=self.dtype,
                          strides=(self.row_elems, 1), device=None, framework="jax")
        return tuple(
            kc.RealKvSource(tensor=local_block, page_size=1, num_bytes_per_token=strip,
                            read_bytes=strip, view=view,
                            offset_bytes=h * self.k_pitch * self.itemsize)
            for h in range(k_heads))

    def row_sources(self, local_block, *, per_row: bool = True) -> tuple[kc.RealKvSource, ...]:
        """The coverage digest's sources over one layer's local block: each slot's whole row
        (every local head's K and V, padding heads and lanes included: every byte the
        attention kernel stores for the slot), views of the array itself (page size 1, no
        copy). ``per_row``: one strip per 128-lane row, in row order, each of which the TPU
        digest kernel reads in place (a whole row of several would be laid out as 32-bit rows
        first, a copy of every layer each step); else one source over the whole row (the
        form of the other kernels: :func:`kvcanary_jax.runtime.kv.digest_reads_rows`)."""
        slots = int(local_block.shape[0]) * int(local_block.shape[1])
        width = self.lanes if per_row else self.row_elems
        strip = width * self.itemsize
        view = TensorMeta(shape=(slots, width), dtype=self.dtype,
                          strides=(self.row_elems, 1), device=None, framework="jax")
        return tuple(
            kc.RealKvSource(tensor=local_block, page_size=1, num_bytes_per_token=strip,
                            read_bytes=strip, view=view, offset_bytes=r * strip)
            for r in range(self.row_elems // width))


def kv_layout(shape, dtype, *, head_dim: int, kv_heads: int, head_shards: int,
              block_size: int, k_heads: int = 1, where: str = "the KV cache") -> KvLayout:
    """The layout of a layer's global array ``shape`` / ``dtype`` for a model of ``kv_heads``
    KV heads (as the cache holds them, replicated to the head shards where fewer) of
    ``head_dim``, its head axis split over ``head_shards``. Raises ValueError naming what was
    found and what is supported (our rules: tpu-inference has no canary)."""
    shape = tuple(int(d) for d in shape)
    dt = jnp.dtype(dtype)
    found = f"{where}: shape {shape}, dtype {dt.name}, head_dim {head_dim}, kv_heads {kv_heads}"
    if len(shape) != 5:
        raise ValueError(f"kv-canary tpu-inference: layout not recognised ({found}); "
                         f"supported: {SUPPORTED_LAYOUTS} (MLA and other caches are not)")
    blocks, bs, groups, packing, lanes = shape
    want_packing = 32 // (dt.itemsize * 8) if dt.itemsize <= 4 else 0
    if packing != want_packing:
        raise ValueError(f"kv-canary tpu-inference: packing {packing} does not match dtype "
                         f"{dt.name} (RPA packs 32 // {dt.itemsize * 8} = {want_packing} per "
                         f"row) ({found}); supported: {SUPPORTED_LAYOUTS}")
    if bs != block_size:
        raise ValueError(f"kv-canary tpu-inference: block dimension {bs} is not the cache's "
                         f"block_size {block_size} ({found}; context parallelism, which scales "
                         "it, is not supported)")
    if groups % head_shards:
        raise ValueError(f"kv-canary tpu-inference: {groups} head rows do not split over "
                         f"{head_shards} head shards ({found})")
    local_groups = groups // head_shards
    heads = kv_heads // head_shards if kv_heads % head_shards == 0 else 0
    if head_dim == 64:
        kind, pitch, k_elems = RPA_V3_HD64, LANES, 64
        ok = lanes == LANES and heads and local_groups * packing == _align(heads, packing)
        need = f"[{blocks}, {block_size}, align({heads}, {packing})/{packing} per shard, " \
               f"{packing}, {LANES}]"
    else:
        kind, pitch, k_elems = RPA_V3, 2 * lanes, lanes
        ok = (lanes == _align(head_dim, LANES) and heads
              and local_groups * packing == _align(2 * heads, packing))
        need = f"[{blocks}, {block_size}, align(2*{heads}, {packing})/{packing} per shard, " \
               f"{packing}, {_align(head_dim, LANES)}]"
    if not ok:
        raise ValueError(f"kv-canary tpu-inference: layout not recognised ({found}, "
                         f"{head_shards} head shard(s)); expected {need}; supported: "
                         f"{SUPPORTED_LAYOUTS}")
    if not 1 <= k_heads <= min(MAX_REAL_KV_SOURCES, heads):
        raise ValueError(f"kv-canary tpu-inference: k_heads must be in [1, "
                         f"{min(MAX_REAL_KV_SOURCES, heads)}] (at most {MAX_REAL_KV_SOURCES} "
                         f"sources, {heads} KV heads per shard), got {k_heads}")
    strip = k_elems * dt.itemsize
    if strip % 16:
        raise ValueError(f"kv-canary tpu-inference: a K strip of {k_elems} x {dt.name} is "
                         f"{strip} bytes; the real-KV fingerprint reads multiples of 16 bytes "
                         f"({found})")
    return KvLayout(kind=kind, block_size=bs, head_dim=head_dim, lanes=lanes, packing=packing,
                    dtype=dt.name, local_heads=heads, row_elems=local_groups * packing * lanes,
                    k_pitch=pitch, k_elems=k_elems)


def local_slots(shape, data_shards: int) -> int:
    """Slots of one data shard's block range."""
    return math.prod(shape[:2]) // data_shards
