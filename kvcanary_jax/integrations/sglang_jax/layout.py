"""sglang-jax's KV layout and the static description of one canary over its pools.

**The KV layout.** One fused, head-interleaved buffer per layer, ``[K0, V0, K1, V1, ...]``:

* sglang-jax 0.0.2: ``[size + page_size, heads * 2, head_dim]``;
* sglang-jax 0.1.0rc0 (and HEAD): ``[(size + page_size * dp_size) / page_size, page_size,
  heads * 2 // packing, packing, head_dim]``, sharded ``P("data", None, "tensor", None, None)``.

Both are row-major, so slot ``s`` (``page * page_size + offset`` at HEAD) is row ``s`` of a
``[slots, 2 * heads * head_dim]`` view and head ``h``'s K strip is its elements
``[2h * head_dim, (2h + 1) * head_dim)``. :func:`fused_kv_sources` describes the first ``k_heads``
K strips (at most 4, the canary's source limit) as :class:`~kvcanary_jax.RealKvSource` strided
views of the buffer itself (no copy, one code path for both layouts and every ``page_size``); the
TAIL and SWEEP launches fingerprint exactly those bytes of the canary layer (``layer``, 0 by
default, as SGLang fingerprints one layer). The V strips are not fingerprinted (SGLang's V half is
off by default as well).

**The coverage window** (ours, ``coverage_window`` N >= 1; docs/spec.md §17): besides SGLang's
fingerprint, every layer of the pool is handed to the runtime's per-slot KV digest: the slot's
whole row of the fused buffer (every head's K and V strip, in place, strided views as above), as
one source (:func:`layer_source`) or, where the digest is the TPU kernel, as one strip per head row
(:func:`layer_sources`, which that kernel reads in place), so a slot's digest covers every byte of
its K and V in every layer. Under tensor parallelism each KV shard digests its own heads of every
layer. What the window cannot cover is refused when the canary is built (a ValueError naming the
setting): a window without ``num_layers``, more strips than a digest takes
(``MAX_DIGEST_SOURCES``), a pool whose layers differ in shape (slot counts or widths), a canary
``layer`` the pool lacks.

:class:`SglangJaxCanary` is the canary's static description (sizes, mesh, sharding, token
mode), read from sglang-jax's pools by :meth:`SglangJaxCanary.from_pools`; its ``config`` is the
runtime's :class:`kvcanary_jax.CanaryConfig` and its ``init_state()`` the per-shard states,
stacked.

**Data parallelism** (0.1.0rc0, ``dp_size > 1``): the slot dimension is sharded over ``data``.
Each DP rank owns its slots (its allocator hands out rank-local slot numbers, from 1, into its
``size / dp_size + page_size`` slots), its requests and its segment of every batch array
(``input_ids``, ``out_cache_loc``, ``seq_lens``, ``cache_loc``, ... each split in ``dp_size``
equal segments, rank after rank). So each rank runs its own canary over its local slots and its
batch segment, as SGLang runs one per DP rank (and :func:`kvcanary_jax.make_sharded_step`): the
canary is stacked over the DP axes and the head axes (:attr:`SglangJaxCanary.axes`), shard ``i``
being DP rank ``i // head_shards``; ``num_slots`` and ``max_bs`` are per rank.

:func:`require_int` / :func:`require_positive_int` are the integration's argument
checks (our rules: sglang-jax has none to follow).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

import kvcanary_jax as kc
from kvcanary_jax import _config
from kvcanary_jax.consts import MAX_DIGEST_SOURCES, MAX_REAL_KV_SOURCES
from kvcanary_jax.contracts import TensorMeta
from kvcanary_jax.runtime.kv import digest_reads_rows

__all__ = [
    "SglangJaxCanary",
    "fused_kv_sources",
    "layer_source",
    "layer_sources",
    "require_int",
    "require_positive_int",
]


_LAYOUT_SLOT_DIMS = {3: 1, 5: 2}  # 0.0.2 [slots, 2H, D]; HEAD [pages, page_size, 2H/p, p, D]


def _layout(shape: Sequence[int]) -> tuple[int, int, int]:
    """(slots, elements per slot, head_dim) of a fused buffer of either layout."""
    nd = len(shape)
    if nd not in _LAYOUT_SLOT_DIMS:
        raise ValueError(
            "kv-canary sglang-jax: a fused KV buffer is [slots, heads*2, head_dim] (0.0.2) or "
            f"[pages, page_size, heads*2/packing, packing, head_dim] (HEAD), got shape {tuple(shape)}"
        )
    k = _LAYOUT_SLOT_DIMS[nd]
    return math.prod(shape[:k]), math.prod(shape[k:]), int(shape[-1])


def fused_kv_sources(buffer: jax.Array, *, k_heads: int = 1) -> tuple[kc.RealKvSource, ...]:
    """Real-KV sources over the K strips of heads ``0 .. k_heads - 1`` of a fused buffer.

    ``buffer`` is one layer's fused buffer in either layout (under ``shard_map``: the local
    block, whose heads are the shard's own). Source ``h`` addresses slot ``s``'s K strip of head
    ``h``: ``head_dim`` elements at element ``s * (2 * heads * head_dim) + 2h * head_dim`` of the
    buffer, as a strided view (page size 1, no copy).
    """
    slots, width, head_dim = _layout(buffer.shape)
    heads = width // (2 * head_dim)
    if not 1 <= k_heads <= min(MAX_REAL_KV_SOURCES, heads):
        raise ValueError(
            f"kv-canary sglang-jax: k_heads must be in [1, {min(MAX_REAL_KV_SOURCES, heads)}] "
            f"(at most {MAX_REAL_KV_SOURCES} sources, {heads} K heads in this buffer), got {k_heads}"
        )
    itemsize = jnp.dtype(buffer.dtype).itemsize
    strip = head_dim * itemsize
    view = TensorMeta(shape=(slots, head_dim), dtype=jnp.dtype(buffer.dtype).name,
                      strides=(width, 1), device=None, framework="jax")
    return tuple(
        kc.RealKvSource(tensor=buffer, page_size=1, num_bytes_per_token=strip, read_bytes=strip,
                        view=view, offset_bytes=2 * h * strip)
        for h in range(k_heads)
    )


def layer_source(buffer: jax.Array) -> kc.RealKvSource:
    """The coverage digest's source over one layer's fused buffer (either layout; under
    ``shard_map``: the local block) where the digest is not the TPU kernel: slot ``s``'s whole
    row, every head's K and V strips, as one strided view of the buffer itself (page size 1, no
    copy). For the TPU kernel, :func:`layer_sources`."""
    slots, width, _ = _layout(buffer.shape)
    row = width * jnp.dtype(buffer.dtype).itemsize
    view = TensorMeta(shape=(slots, width), dtype=jnp.dtype(buffer.dtype).name,
                      strides=(width, 1), device=None, framework="jax")
    return kc.RealKvSource(tensor=buffer, page_size=1, num_bytes_per_token=row, read_bytes=row,
                           view=view)


def layer_sources(buffer: jax.Array) -> tuple[kc.RealKvSource, ...]:
    """The coverage digest's sources over one layer's fused buffer (either layout; under
    ``shard_map``: the local block): slot ``s``'s whole row, every byte of it, as one strip per
    head row in the buffer's order (``K_0, V_0, K_1, ...``), each a strided view of the buffer
    itself (page size 1, no copy). Strips of one row each, because that is what the TPU digest
    kernel reads in place (with ``head_dim`` a multiple of 128): a source spanning several
    rows would be laid out as 32-bit rows by XLA first, a copy of every layer each step (18 GiB
    of temporaries for 4 layers of 4 GiB, which fails to compile for v5e). The step hands these
    where the digest runs the TPU kernel, :func:`layer_source` elsewhere
    (:func:`kvcanary_jax.runtime.kv.digest_reads_rows`)."""
    slots, width, head_dim = _layout(buffer.shape)
    strip = head_dim * jnp.dtype(buffer.dtype).itemsize
    view = TensorMeta(shape=(slots, head_dim), dtype=jnp.dtype(buffer.dtype).name,
                      strides=(width, 1), device=None, framework="jax")
    return tuple(
        kc.RealKvSource(tensor=buffer, page_size=1, num_bytes_per_token=strip, read_bytes=strip,
                        view=view, offset_bytes=r * strip)
        for r in range(width // head_dim))


def _check_pool_layers(layers: list, start: int, kwargs: dict) -> None:
    """:meth:`SglangJaxCanary.from_pools`' checks of the pool's layers against the canary's
    settings (``kwargs``; ``num_layers`` filled in from the pool)."""
    if not layers:
        raise ValueError("kv-canary sglang-jax: token_to_kv_pool.kv_buffer holds no layer")
    count = len(layers)
    asked = kwargs.setdefault("num_layers", count)
    if asked != count:
        raise ValueError(f"kv-canary sglang-jax: num_layers={asked!r}, but the pool holds "
                         f"{count} layers (token_to_kv_pool.kv_buffer)")
    layer = kwargs.get("layer", 0)
    if isinstance(layer, (int, np.integer)) and not isinstance(layer, bool) and not (
            start <= layer < start + count):
        raise ValueError(f"kv-canary sglang-jax: layer={layer} names a layer the pool lacks "
                         f"(it holds layers {start} .. {start + count - 1})")
    if not kwargs.get("coverage_window"):
        return
    shape = tuple(layers[0].shape)
    for i, buf in enumerate(layers):
        if tuple(buf.shape) != shape:
            raise ValueError(
                f"kv-canary sglang-jax: coverage_window {kwargs['coverage_window']} digests "
                f"every layer of a slot, but token_to_kv_pool.kv_buffer[{i}] is "
                f"{tuple(buf.shape)} and layer 0 is {shape} (layers of different slot counts "
                "or widths)")


def require_int(name: str, value, where: str | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"kv-canary sglang-jax: {where or name} must be an int, got "
                        f"{type(value).__name__} {value!r}")


def require_positive_int(name: str, value, where: str | None = None) -> None:
    require_int(name, value, where)
    if value <= 0:
        raise ValueError(f"kv-canary sglang-jax: {where or name} must be positive, got {value}")


def _mesh_axes(entry) -> tuple[str, ...]:
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, tuple) else (entry,)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SglangJaxCanary:
    """Static description of one canary over an sglang-jax KV pool (hashable: a jit constant).

    ``num_slots``: slots of the fused buffer per DP rank (0.0.2: ``size + page_size``;
    0.1.0rc0: ``pages * page_size / dp_size``). ``context_len``: ``req_to_token`` columns (no
    request is longer). ``max_bs``: the largest batch-size bucket per DP rank. ``layer`` / ``k_heads``: which layer's K strips are
    fingerprinted. ``mesh`` / ``kv_spec``: the pool's mesh and the buffers' PartitionSpec (None:
    one device). ``token_checks``: every step takes the expected token ids (see
    :mod:`~kvcanary_jax.integrations.sglang_jax.tokens`). ``sweep_rows``: prefixes per :func:`sweep` launch. ``token_rows``: sglang-jax's
    ``req_to_token`` rows, to keep the expected token ids on the device between steps (each step
    then takes a :class:`TokenDelta` from a :class:`TokenFeed`, only the ids the device lacks;
    the state's ``expected_tokens`` has a row per sglang-jax row, + 1, and its
    ``expected_valid_lens`` is not kept; None: each step takes every request's whole history,
    :func:`expected_tokens`). The rest is
    :class:`kvcanary_jax.CanaryConfig`'s (``implementation``: what every op runs; default: the
    platform's).

    ``coverage_window`` (ours; 0: off, SGLang's behaviour): N >= 1 also digests every layer's K
    and V of each slot the step writes and checks the slots a step reads within N steps, and
    every slot a :func:`sweep` walks (docs/spec.md §17). ``num_layers``: the pool's layers
    (:meth:`from_pools` reads it), required with a window: a step or sweep handing another
    count of layers is refused. ``sweep_interval``: the steps between your :func:`sweep` calls
    (0: not stated); at most the window, a step leaves to the next sweep the slots it reads that
    the last sweep checked (they are checked within the window all the same, and their bytes
    are not read twice in it; docs/spec.md §17.2). :func:`canary_manager` takes it from here.

    Sizes are checked when the canary is built (our rules, sglang-jax has none to follow):
    ``num_slots``, ``page_size``, ``context_len``, ``max_bs``, ``k_heads`` (at most 4) and
    ``sweep_rows`` positive ints, ``layer >= 0``, ``coverage_window >= 0``, ``num_layers``
    positive (at most ``MAX_DIGEST_SOURCES`` with a window); a TypeError or ValueError names the
    field.
    A page size that is not the pool's would misplace every request's ``cache_loc`` segment:
    0 checked request ``r`` against request 0's slots (a corrupted slot unseen), a negative one
    raised false alarms on clean steps.
    """

    num_slots: int
    page_size: int
    context_len: int
    max_bs: int
    layer: int = 0
    k_heads: int = 1
    mesh: Mesh | None = None
    kv_spec: P | None = None
    token_checks: bool = True
    token_rows: int | None = None
    sweep_rows: int = 16
    ring_capacity: int = 1024
    verify_capacity: int | None = None
    real_kv_hash_mode: str = "all"
    implementation: str | None = None
    coverage_window: int = 0
    num_layers: int | None = None
    sweep_interval: int = 0

    def __post_init__(self):
        # Our rules (sglang-jax has no canary): a page size of 0 would start every request's
        # cache_loc segment at 0 (request r checked against request 0's slots: a corrupted slot
        # goes unseen), a negative one misplaces every segment (false alarms on clean steps).
        for name in ("num_slots", "page_size", "context_len", "max_bs", "k_heads", "sweep_rows"):
            require_positive_int(name, getattr(self, name))
        require_int("layer", self.layer)
        if self.token_rows is not None:
            require_positive_int("token_rows", self.token_rows)
            if not self.token_checks:
                raise ValueError("kv-canary sglang-jax: token_rows keeps expected token ids for "
                                 "the token checks, but token_checks=False; drop token_rows")
        if self.layer < 0:
            raise ValueError(f"kv-canary sglang-jax: layer must be >= 0, got {self.layer}")
        if self.k_heads > MAX_REAL_KV_SOURCES:
            raise ValueError(f"kv-canary sglang-jax: k_heads must be in [1, {MAX_REAL_KV_SOURCES}] "
                             f"(the canary's source limit), got {self.k_heads}")
        self._check_coverage()
        if self.mesh is not None and self.kv_spec is not None:
            unknown = [a for a in (*self.dp_axes, *self.head_axes) if a not in self.mesh.shape]
            if unknown:
                raise ValueError(f"kv-canary sglang-jax: kv_spec {self.kv_spec} names mesh axes "
                                 f"{unknown} that the mesh {dict(self.mesh.shape)} lacks")

    def _check_coverage(self):
        """Ours: a window the canary cannot honour is refused here, naming the setting."""
        require_int("coverage_window", self.coverage_window)
        if self.coverage_window < 0:
            raise ValueError("kv-canary sglang-jax: coverage_window must be >= 0 (0: off), got "
                             f"{self.coverage_window}")
        if self.num_layers is not None:
            require_positive_int("num_layers", self.num_layers)
        require_int("sweep_interval", self.sweep_interval)
        if self.sweep_interval < 0:
            raise ValueError("kv-canary sglang-jax: sweep_interval must be >= 0 (0: not "
                             f"stated), got {self.sweep_interval}")
        if not self.coverage_window:
            if self.sweep_interval:
                raise ValueError(
                    f"kv-canary sglang-jax: sweep_interval={self.sweep_interval} with "
                    "coverage_window 0: the interval of your sweep() calls is stated for a "
                    "coverage window (the steps leave read slots to the sweep by it); set "
                    "coverage_window, or leave sweep_interval at 0")
            return
        if self.num_layers is None:
            raise ValueError(
                f"kv-canary sglang-jax: coverage_window {self.coverage_window} digests every "
                "layer of the pool: set num_layers (SglangJaxCanary.from_pools reads it from "
                "the pool), so that a step handing fewer layers is refused")
        self._check_strips(1)  # one source a layer (from_pools checks the TPU kernel's strips)

    def _check_strips(self, per_layer: int) -> None:
        if self.coverage_window and self.num_layers * per_layer > MAX_DIGEST_SOURCES:
            raise ValueError(
                f"kv-canary sglang-jax: coverage_window {self.coverage_window} cannot cover "
                f"num_layers={self.num_layers}: a slot's digest takes at most "
                f"{MAX_DIGEST_SOURCES} sources, and each layer gives {per_layer} (the TPU "
                "kernel's: a strip per K and V head of a KV shard)")

    @classmethod
    def from_pools(cls, req_to_token_pool, token_to_kv_pool, *, max_bs: int,
                   incremental_tokens: bool = False, **kwargs):
        """Read sizes, mesh and sharding from sglang-jax's ``ReqToTokenPool`` and
        ``MHATokenToKVPool`` (0.0.2 or 0.1.0rc0; ``max_bs`` per DP rank). ``incremental_tokens``: ``token_rows`` from the
        ``ReqToTokenPool`` (its ``size``), for a :class:`TokenFeed`. ``num_layers`` is the
        pool's layer count; the canary ``layer`` must be one of the pool's layers (from its
        ``start_layer``), and with a ``coverage_window`` every layer must have layer 0's shape
        (ValueError otherwise, naming the setting)."""
        if incremental_tokens:
            kwargs["token_rows"] = int(req_to_token_pool.size)
        layers = list(token_to_kv_pool.kv_buffer)
        _check_pool_layers(layers, int(getattr(token_to_kv_pool, "start_layer", 0) or 0), kwargs)
        buf = layers[0]
        page_size = token_to_kv_pool.page_size
        require_positive_int("page_size", page_size, where="token_to_kv_pool.page_size")
        if len(buf.shape) == 5 and int(buf.shape[1]) != int(page_size):
            # HEAD's layout carries the page size in its shape: a pool whose attribute disagrees
            # would segment cache_loc with one page size while the slots follow the other.
            raise ValueError(
                f"kv-canary sglang-jax: token_to_kv_pool.page_size is {page_size} but its fused "
                f"buffer {tuple(buf.shape)} has pages of {buf.shape[1]} slots (dimension 1)")
        sharding = getattr(token_to_kv_pool, "kv_sharding", None) or getattr(buf, "sharding", None)
        mesh = getattr(sharding, "mesh", None) if isinstance(sharding, NamedSharding) else None
        spec = sharding.spec if mesh is not None else None
        slots = _layout(buf.shape)[0]
        dp = math.prod(mesh.shape[a] for a in _mesh_axes(tuple(spec)[0])) if spec else 1
        if slots % dp:
            raise ValueError(f"kv-canary sglang-jax: the fused buffer {tuple(buf.shape)} has "
                             f"{slots} slots, not a multiple of its {dp} data-parallel ranks")
        canary = cls(
            num_slots=slots // dp,
            page_size=int(page_size),
            context_len=int(req_to_token_pool.max_context_len),
            max_bs=max_bs,
            mesh=mesh,
            kv_spec=spec,
            **kwargs,
        )
        _, width, head_dim = _layout(buf.shape)
        if canary.coverage_window and digest_reads_rows(canary.implementation, buf):
            canary._check_strips(max(width // head_dim // canary.head_shards, 1))
        return canary

    @property
    def dp_axes(self) -> tuple[str, ...]:
        """Mesh axes sharding the buffer's slot dimension (dimension 0 of either layout): the
        data-parallel ranks (sglang-jax 0.1.0rc0: ``"data"``). Each rank owns its slots (its
        allocator hands out rank-local slot numbers) and its segment of every batch array."""
        if self.mesh is None or self.kv_spec is None or not tuple(self.kv_spec):
            return ()
        return _mesh_axes(tuple(self.kv_spec)[0])

    @property
    def head_axes(self) -> tuple[str, ...]:
        """Mesh axes sharding the buffer's head dimensions (tensor parallelism)."""
        if self.mesh is None or self.kv_spec is None:
            return ()
        return tuple(a for entry in tuple(self.kv_spec)[1:] for a in _mesh_axes(entry))

    @property
    def axes(self) -> tuple[str, ...]:
        """Mesh axes the canary is stacked over: the data-parallel ones, then those sharding the
        buffer's head dimensions. Shard ``i`` is DP rank ``i // head_shards``, head shard
        ``i % head_shards``."""
        return self.dp_axes + self.head_axes

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks: one canary per rank (and per head shard within it)."""
        return math.prod(self.mesh.shape[a] for a in self.dp_axes) if self.dp_axes else 1

    @property
    def head_shards(self) -> int:
        return math.prod(self.mesh.shape[a] for a in self.head_axes) if self.head_axes else 1

    @property
    def num_shards(self) -> int:
        return self.dp_size * self.head_shards

    def dp_rank(self, shard: int) -> int:
        """The data-parallel rank of canary shard ``shard`` (a :class:`ShardViolation`'s)."""
        return int(shard) // self.head_shards

    @property
    def config(self) -> kc.CanaryConfig:
        # The plans' rows are batch rows + 1 (row 0 = padding). The expected-token pool has
        # those rows, or, kept between steps (token_rows), sglang-jax's rows + 1.
        rows = self.max_bs if self.token_rows is None else self.token_rows
        return kc.CanaryConfig(
            max_reqs=rows + 1,
            write_req_capacity=self.max_bs + 1,
            context_len=self.context_len,
            num_slots=self.num_slots,
            max_bs=self.max_bs,
            max_tokens=self.max_bs,
            verify_capacity=self.verify_capacity,
            ring_capacity=self.ring_capacity,
            real_kv_hash_mode=self.real_kv_hash_mode,
            enable_verify_token_assert=self.token_checks,
            enable_write_input_assert=self.token_checks,
            implementation=self.implementation,
            coverage_window=self.coverage_window,
            num_layers=self.num_layers,
            sweep_interval=self.sweep_interval,
        )

    def auto_mesh(self) -> Mesh | None:
        """The canary's mesh with Auto axes when sglang-jax built it with Explicit ones (0.1.0rc0),
        else None. Explicit axes type every array's sharding, which the runtime manager's host
        side (its readback slices the stacked shards) does not expect."""
        if self.mesh is None or not any(t == AxisType.Explicit
                                        for t in getattr(self.mesh, "axis_types", ())):
            return None
        return Mesh(self.mesh.devices, self.mesh.axis_names,
                    axis_types=(AxisType.Auto,) * len(self.mesh.axis_names))

    @_config.with_x64
    def init_state(self):
        """Zero-filled per-shard states, stacked on a leading axis and placed on the mesh."""
        # Each device builds its own shards (kc.init_state_stacked).
        return kc.init_state_stacked(self.config, self.num_shards,
                                     NamedSharding(self.mesh, P(self.axes)) if self.axes
                                     else None)
