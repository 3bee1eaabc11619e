"""The canary around sglang-jax's model step, over sglang-jax's own pools, batches and KV layout.

sglang-jax (``sgl_jax``, the JAX serving stack of SGLang) has no KV integrity check. This module
takes its objects as they are (nothing here imports ``sgl_jax``; attributes are read by name) and
runs kv-canary's HEAD -> model -> TAIL step around its jitted model step, exactly as SGLang's
runtime does around its forward (``kvcanary_jax.runtime``).

**The KV layout.** One fused, head-interleaved buffer per layer, ``[K0, V0, K1, V1, ...]``:

* sglang-jax 0.0.2: ``[size + page_size, heads * 2, head_dim]``;
* sglang-jax HEAD:  ``[pages, page_size, heads * 2 // packing, packing, head_dim]``.

Both are row-major, so slot ``s`` (``page * page_size + offset`` at HEAD) is row ``s`` of a
``[slots, 2 * heads * head_dim]`` view and head ``h``'s K strip is its elements
``[2h * head_dim, (2h + 1) * head_dim)``. :func:`fused_kv_sources` describes the first ``k_heads``
K strips (at most 4, the canary's source limit) as :class:`~kvcanary_jax.RealKvSource` strided
views of the buffer itself (no copy, one code path for both layouts and every ``page_size``); the
TAIL and SWEEP launches fingerprint exactly those bytes of the canary layer (``layer``, 0 by
default, as SGLang fingerprints one layer). The V strips are not fingerprinted (SGLang's V half is
off by default as well).

**Plans from the batch.** The device sees, per step, ``cache_loc`` (every request's slots for
positions ``[0, seq_len)``, each request's segment padded to a multiple of ``page_size`` and the
segments concatenated in batch order, the rest padding), ``out_cache_loc`` (slots written this
step, ``-1`` = padding token), ``positions``, ``input_ids``, ``seq_lens`` and, in extend mode,
``extend_prefix_lens`` / ``extend_seq_lens`` (decode: prefix ``seq_len - 1``, one new token).
:func:`canary_batch` turns them, on the device, into the runtime's batch and a slot table whose
row ``r + 1`` holds request ``r``'s slots (row 0 is the canary's padding row; a request is padding
when ``seq_len == 0``, whatever its ``req_pool_indices`` entry says, since sglang-jax pads with
``-1`` and its row 0 is a real row). The plan therefore verifies the very slots the attention
reads: a stale or wrong ``cache_loc`` entry is checked, not hidden. A caller who prefers the host
``req_to_token`` passes ``table=host_table(...)`` (the batch's rows only, uploaded); that plan then
checks what the table says, and a wrong ``cache_loc`` goes unseen.

**Token ids.** sglang-jax's device batch has no token history. With ``token_checks`` (default),
each step takes ``expected``, an int32 array parallel to ``cache_loc`` holding every request's
token ids (:func:`expected_tokens`, from the requests' ``origin_input_ids + output_ids``). It
feeds SGLang's verify token check and the write's input check (``input_ids`` / ``positions`` of
the batch against the request's history). A server gives each id once instead: with
``token_rows`` (``from_pools(..., incremental_tokens=True)``) the state keeps every request's ids
in an expected-token pool with a row per sglang-jax ``req_to_token`` row, and each step takes a
:class:`TokenDelta` from a :class:`TokenFeed`: only the ids the device lacks (a decode step: one
per request), scattered into the pool on the device. The feed records a delta only once its
step has been dispatched, for the state that step returned: a delta never run records nothing, a
delta sent to another state goes whole, and a delta made for another batch is refused before
anything is donated. Without token checks (``token_checks=False``) the chain hash and positions
still bind every slot to its request. sglang-jax's overlap scheduler builds a decode batch before
the previous step's token reaches the host (the device resolves it): run it with
``token_checks=False``.

**Slot 0 / page 0** is sglang-jax's padding (its allocators hand out slots, or pages, from 1;
padding tokens carry ``out_cache_loc == -1`` and write nothing). As in SGLang, verify never checks
canary slot 0. A real token written to slot 0 (or anywhere but the slot its table names) is
reported the way SGLang reports it: the slot the request's table names was never stamped, so the
next verify of that position flags that slot (its stored position and token are not the
request's) and the next write seeded from it fails the chain-position check; the bytes written to
slot 0 are never fingerprinted.

**Sharding: one canary per KV shard.** sglang-jax 0.0.2 shards each layer buffer over its head
dimension (``P(None, "tensor")``; HEAD: ``P("data", None, "tensor", None, None)``), so every
device holds every slot but only its own heads. The canary runs once per shard, under
``shard_map``: each shard keeps its own state (canary buffers, plans, ring, counters: stacked
along a leading axis sharded over the KV's head-dimension mesh axes), reads the replicated batch,
and fingerprints the first K strip(s) of *its own* heads. This is what SGLang does under tensor
parallelism (each TP rank has its own canary over its own KV shard), and the alternative (one
canary on replicated slot metadata with a sharded source) does not work here: the fingerprint
chains the bytes of one slot through a non-linear hash, so a shard cannot hash its part alone and
combine; a replicated kernel would make XLA gather the sharded buffer onto every device each step,
and it would only ever fingerprint the heads of one shard. Per shard costs no communication and
covers every device's KV. The price: the metadata checks run on every shard (in parallel, no
wall-time cost), 32 bytes per slot per canary buffer per shard, and a metadata fault is reported
once per shard (:func:`read_violations` says which shard reported what). A buffer whose slot
dimension is sharded over a mesh axis of size > 1 (HEAD's data-parallel attention) is refused:
there each rank owns its slots and its own batch segment; run one canary per rank
(:func:`kvcanary_jax.make_sharded_step`).

**The step.** :func:`guard_model_step` wraps a jitted model step: one ``jax.jit`` runs
HEAD (scatter, plan, verify + write) -> the model -> TAIL (verify + write with the plans HEAD
built, fingerprinting the model's new canary-layer buffer), with the canary state and the KV pool
donated. The model is traced under the caller's own 64-bit setting; only the canary runs with
64-bit types. :func:`sweep` re-verifies prefixes held by the radix cache (:func:`radix_prefixes`)
against the TAIL buffers between steps.

Shapes follow sglang-jax's buckets (``bs``, tokens, ``cache_loc`` length): one compilation per
bucket, as the model step itself. Warm-up / precompile batches go through the unguarded step.

**Cost per step**, besides the canary's own ops (SGLang's: HEAD and TAIL each verify every cached
position of the batch and write every new one): the slot table, ``(bs + 1) * context_len`` int32
gathered from ``cache_loc`` on the device (no host transfer), and the expected ids: with
``token_rows``, one int32 array of ``bs`` + the token bucket from the host (decode), its scatter
into the kept pool and the batch's rows of the pool gathered (``(bs + 1) * context_len``);
without, one int32 array the size of ``cache_loc`` from the host every step (23 us of a 64 x
2,048 decode step on the H200), compacted on the device and scattered into the pool by SGLang's
scatter. ``bench/sglang_jax_step.py`` measures the whole against sglang-jax's step.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import weakref
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import kvcanary_jax as kc
from kvcanary_jax import _config
from kvcanary_jax.consts import MAX_REAL_KV_SOURCES
from kvcanary_jax.contracts import TensorMeta
from kvcanary_jax.ops._xla_lib import count_below
from kvcanary_jax.runtime import CanaryViolationError, decode_ring
from kvcanary_jax.runtime.step import head, tail

__all__ = [
    "SglangJaxCanary",
    "ShardViolation",
    "fused_kv_sources",
    "canary_batch",
    "expected_tokens",
    "TokenFeed",
    "TokenDelta",
    "request_token_ids",
    "host_table",
    "guard_model_step",
    "ModelRunnerHook",
    "radix_prefixes",
    "sweep",
    "read_violations",
    "violation_counts",
    "canary_manager",
    "request_resolver",
    "abort_request",
    "drop_radix_slot",
    "Remediator",
    "ManagedModelRunnerHook",
    "store_kv",
    "RequestIds",
    "DeltaBatch",
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


def _int_arg(name: str, value, where: str | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"kv-canary sglang-jax: {where or name} must be an int, got "
                        f"{type(value).__name__} {value!r}")


def _positive_int(name: str, value, where: str | None = None) -> None:
    _int_arg(name, value, where)
    if value <= 0:
        raise ValueError(f"kv-canary sglang-jax: {where or name} must be positive, got {value}")


def _mesh_axes(entry) -> tuple[str, ...]:
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, tuple) else (entry,)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SglangJaxCanary:
    """Static description of one canary over an sglang-jax KV pool (hashable: a jit constant).

    ``num_slots``: slots of the fused buffer (0.0.2: ``size + page_size``; HEAD: ``pages *
    page_size``). ``context_len``: ``req_to_token`` columns (no request is longer). ``max_bs``:
    the largest batch-size bucket. ``layer`` / ``k_heads``: which layer's K strips are
    fingerprinted. ``mesh`` / ``kv_spec``: the pool's mesh and the buffers' PartitionSpec (None:
    one device). ``token_checks``: every step takes the expected token ids (see the module
    docstring). ``sweep_rows``: prefixes per :func:`sweep` launch. ``token_rows``: sglang-jax's
    ``req_to_token`` rows, to keep the expected token ids on the device between steps (each step
    then takes a :class:`TokenDelta` from a :class:`TokenFeed`, only the ids the device lacks;
    the state's ``expected_tokens`` has a row per sglang-jax row, + 1, and its
    ``expected_valid_lens`` is not kept; None: each step takes every request's whole history,
    :func:`expected_tokens`). The rest is
    :class:`kvcanary_jax.CanaryConfig`'s (``implementation``: what every op runs; default: the
    platform's).

    Sizes are checked when the canary is built (our rules, sglang-jax has none to follow):
    ``num_slots``, ``page_size``, ``context_len``, ``max_bs``, ``k_heads`` (at most 4) and
    ``sweep_rows`` positive ints, ``layer >= 0``; a TypeError or ValueError names the field.
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

    def __post_init__(self):
        # Our rules (sglang-jax has no canary): a page size of 0 would start every request's
        # cache_loc segment at 0 (request r checked against request 0's slots: a corrupted slot
        # goes unseen), a negative one misplaces every segment (false alarms on clean steps).
        for name in ("num_slots", "page_size", "context_len", "max_bs", "k_heads", "sweep_rows"):
            _positive_int(name, getattr(self, name))
        _int_arg("layer", self.layer)
        if self.token_rows is not None:
            _positive_int("token_rows", self.token_rows)
            if not self.token_checks:
                raise ValueError("kv-canary sglang-jax: token_rows keeps expected token ids for "
                                 "the token checks, but token_checks=False; drop token_rows")
        if self.layer < 0:
            raise ValueError(f"kv-canary sglang-jax: layer must be >= 0, got {self.layer}")
        if self.k_heads > MAX_REAL_KV_SOURCES:
            raise ValueError(f"kv-canary sglang-jax: k_heads must be in [1, {MAX_REAL_KV_SOURCES}] "
                             f"(the canary's source limit), got {self.k_heads}")
        if self.mesh is not None and self.kv_spec is not None:
            spec = tuple(self.kv_spec)
            slot_axes = [a for entry in spec[:1] for a in _mesh_axes(entry)]
            if math.prod(self.mesh.shape[a] for a in slot_axes) > 1:
                raise NotImplementedError(
                    f"kv-canary sglang-jax: the KV's slot dimension is sharded over {slot_axes} "
                    "(data-parallel attention: each rank owns its slots and batch segment); run "
                    "one canary per rank (kvcanary_jax.make_sharded_step)"
                )

    @classmethod
    def from_pools(cls, req_to_token_pool, token_to_kv_pool, *, max_bs: int,
                   incremental_tokens: bool = False, **kwargs):
        """Read sizes, mesh and sharding from sglang-jax's ``ReqToTokenPool`` and
        ``MHATokenToKVPool`` (0.0.2 or HEAD). ``incremental_tokens``: ``token_rows`` from the
        ``ReqToTokenPool`` (its ``size``), for a :class:`TokenFeed`."""
        if incremental_tokens:
            kwargs["token_rows"] = int(req_to_token_pool.size)
        buf = token_to_kv_pool.kv_buffer[0]
        page_size = token_to_kv_pool.page_size
        _positive_int("page_size", page_size, where="token_to_kv_pool.page_size")
        if len(buf.shape) == 5 and int(buf.shape[1]) != int(page_size):
            # HEAD's layout carries the page size in its shape: a pool whose attribute disagrees
            # would segment cache_loc with one page size while the slots follow the other.
            raise ValueError(
                f"kv-canary sglang-jax: token_to_kv_pool.page_size is {page_size} but its fused "
                f"buffer {tuple(buf.shape)} has pages of {buf.shape[1]} slots (dimension 1)")
        sharding = getattr(token_to_kv_pool, "kv_sharding", None) or getattr(buf, "sharding", None)
        mesh = getattr(sharding, "mesh", None) if isinstance(sharding, NamedSharding) else None
        return cls(
            num_slots=_layout(buf.shape)[0],
            page_size=int(page_size),
            context_len=int(req_to_token_pool.max_context_len),
            max_bs=max_bs,
            mesh=mesh,
            kv_spec=sharding.spec if mesh is not None else None,
            **kwargs,
        )

    @property
    def axes(self) -> tuple[str, ...]:
        """Mesh axes the canary is stacked over: those sharding the buffer's head dimensions."""
        if self.mesh is None or self.kv_spec is None:
            return ()
        return tuple(a for entry in tuple(self.kv_spec)[1:] for a in _mesh_axes(entry))

    @property
    def num_shards(self) -> int:
        return math.prod(self.mesh.shape[a] for a in self.axes) if self.axes else 1

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
        )

    @_config.with_x64
    def init_state(self):
        """Zero-filled per-shard states, stacked on a leading axis and placed on the mesh."""
        one = kc.init_state(self.config)
        n = self.num_shards
        stacked = jax.tree.map(lambda x: jnp.broadcast_to(x[None], (n,) + x.shape), one)
        if not self.axes:
            return jax.device_put(stacked)
        return jax.device_put(stacked, NamedSharding(self.mesh, P(self.axes)))


# --------------------------------------------------------------------------------------------
# The batch, on the device
# --------------------------------------------------------------------------------------------


def _lengths(canary: SglangJaxCanary, fb):
    seq = fb.seq_lens.astype(jnp.int64)
    bs = seq.shape[0]
    if bs > canary.max_bs:
        raise ValueError(f"kv-canary sglang-jax: batch of {bs} rows exceeds max_bs={canary.max_bs}")
    active = seq > 0
    mode = fb.forward_mode
    if mode.is_decode():
        prefix, extend = seq - 1, jnp.ones_like(seq)
    elif mode.is_extend():
        prefix = fb.extend_prefix_lens.astype(jnp.int64)
        extend = fb.extend_seq_lens.astype(jnp.int64)
    else:
        raise ValueError(f"kv-canary sglang-jax: no canary step for forward mode {mode!r}")
    prefix = jnp.where(active, prefix, 0)
    extend = jnp.where(active, extend, 0)
    ps = canary.page_size
    aligned = (seq + ps - 1) // ps * ps
    seg = jnp.cumsum(aligned) - aligned  # each request's cache_loc segment start
    rows = jnp.where(active, jnp.arange(1, bs + 1, dtype=jnp.int64), 0)
    return seq, prefix, extend, seg, rows


def _owner(offsets: jax.Array, idx: jax.Array, bs: int) -> jax.Array:
    """For exclusive prefix sums ``offsets`` [bs + 1], the row whose range holds each index
    (``searchsorted`` right, unrolled: no loop in the step's program)."""
    return jnp.clip(count_below(offsets[1:], idx, inclusive=True), 0, max(bs - 1, 0))


def _gather(values: jax.Array, idx: jax.Array) -> jax.Array:
    # A clamped gather: masked lanes may compute any index; none reads out of bounds.
    return values[jnp.clip(idx, 0, max(values.shape[0] - 1, 0))]


def canary_batch(canary: SglangJaxCanary, forward_batch, *, expected: jax.Array | None = None):
    """sglang-jax ``ForwardBatch`` -> (:class:`kvcanary_jax.ForwardBatch`, slot table), jittable.

    The table is int32 ``[bs + 1, context_len]``: row ``r + 1`` holds ``cache_loc``'s segment of
    request ``r`` up to its ``seq_len``, zeros after; row 0 is zeros. ``expected`` is required
    iff ``canary.token_checks``: int32 parallel to ``cache_loc`` (:func:`expected_tokens`), or,
    with ``canary.token_rows``, a :class:`TokenDelta`'s ``array`` (the batch's
    ``all_ids_flat`` is then a placeholder: the ids are in the state's pool, which the guarded
    step updates). Trace under 64-bit types.
    """
    batch, table, _ = _device_batch(canary, forward_batch, expected)
    return batch, table


def _device_batch(canary: SglangJaxCanary, forward_batch, expected):
    """:func:`canary_batch`, and with ``token_rows`` the delta's device form for
    :func:`_fed_pool` (None otherwise)."""
    fb = forward_batch
    seq, prefix, extend, seg, rows = _lengths(canary, fb)
    bs = seq.shape[0]
    cache_loc = fb.cache_loc.astype(jnp.int32)
    cols = jnp.arange(canary.context_len, dtype=jnp.int64)
    table = jnp.where(cols[None, :] < seq[:, None], _gather(cache_loc, seg[:, None] + cols[None, :]), 0)
    table = jnp.concatenate([jnp.zeros((1, canary.context_len), jnp.int32), table.astype(jnp.int32)])

    zero = jnp.zeros((1,), jnp.int64)
    coff = jnp.concatenate([zero, jnp.cumsum(seq)])  # compact offsets: valid_lens = seq_lens
    woff = jnp.concatenate([zero, jnp.cumsum(extend)])
    ntok = fb.input_ids.shape[0]
    tok = jnp.arange(ntok, dtype=jnp.int64)
    owner = _owner(woff, tok, bs)
    exp_pos = prefix[owner] + tok - woff[owner]
    fed = None
    if canary.token_checks and expected is None:
        raise ValueError("kv-canary sglang-jax: token_checks needs `expected` every step "
                         "(expected_tokens(...), or a TokenFeed's delta with token_rows), or "
                         "build the canary with token_checks=False")
    if canary.token_rows is not None:  # implies token_checks
        if expected.ndim != 1 or expected.shape[0] <= bs:
            raise ValueError(f"kv-canary sglang-jax: with token_rows, expected is a TokenDelta's "
                             f"array, int32 [bs + n] (bs={bs}), got shape {expected.shape}")
        starts = expected[:bs].astype(jnp.int64)
        ids = expected[bs:]
        dlen = jnp.where(rows != 0, seq - starts, 0)
        doff = jnp.concatenate([zero, jnp.cumsum(dlen)])
        exp_tok = _gather(ids, doff[owner] + exp_pos - starts[owner]).astype(jnp.int64)
        flat = jnp.zeros((1,), jnp.int64)
        prow = jnp.where(rows != 0, fb.req_pool_indices.astype(jnp.int64) + 1, 0)
        fed = (prow, starts, doff, ids)
    elif canary.token_checks:
        if expected.shape != cache_loc.shape:
            raise ValueError(f"kv-canary sglang-jax: expected {expected.shape} must be parallel "
                             f"to cache_loc {cache_loc.shape}")
        ids = expected.astype(jnp.int64)
        t = jnp.arange(ids.shape[0], dtype=jnp.int64)
        r = _owner(coff, t, bs)
        flat = jnp.where(t < coff[bs], _gather(ids, seg[r] + t - coff[r]), 0)
        exp_tok = _gather(ids, seg[owner] + exp_pos)
    else:
        flat = jnp.zeros((1,), jnp.int64)
        exp_tok = jnp.zeros((ntok,), jnp.int64)
    batch = kc.ForwardBatch(
        req_pool_indices=rows,
        prefix_lens=prefix,
        extend_seq_lens=extend,
        all_ids_flat=flat,
        all_ids_offsets=coff,
        input_ids=fb.input_ids.astype(jnp.int64),
        positions=fb.positions.astype(jnp.int64),
        out_cache_loc=fb.out_cache_loc.astype(jnp.int64),
        expected_input_tokens=exp_tok,
        expected_input_positions=exp_pos,
    )
    return batch, table, fed


def _fed_pool(canary: SglangJaxCanary, st, seq, fed):
    """One shard's state with a :class:`TokenDelta` applied to its expected-token pool (rows =
    sglang-jax rows + 1, kept between steps), and the batch's rows of it for the plan
    (``[bs + 1, context_len]``, row ``r + 1`` = request ``r``'s, row 0 the padding row's)."""
    prow, starts, doff, ids = fed
    bs = prow.shape[0]
    i = jnp.arange(ids.shape[0], dtype=jnp.int64)
    r = _owner(doff, i, bs)
    live = (i < doff[bs]) & (prow[r] > 0)
    # Entries past the delta's ids (and any of a padding row) go to a column past the pool's
    # width: dropped, never written anywhere.
    col = jnp.where(live, starts[r] + i - doff[r], canary.context_len)
    pool = st.expected_tokens.at[prow[r], col].set(ids, mode="drop")
    rows_b = jnp.concatenate([jnp.zeros((1,), jnp.int64), prow])
    # The state's expected_valid_lens is not kept here: nothing reads it, the plan takes this
    # step's seq_lens, and its scatter would be one more launch per step.
    return dataclasses.replace(st, expected_tokens=pool), pool[rows_b]


# --------------------------------------------------------------------------------------------
# Host helpers (numpy; no device work)
# --------------------------------------------------------------------------------------------


def request_token_ids(reqs) -> list[list[int]]:
    """Each sglang-jax ``Req``'s token history, prompt then output (batch order)."""
    out = []
    for i, r in enumerate(reqs):
        try:
            out.append(list(r.origin_input_ids) + list(r.output_ids))
        except (AttributeError, TypeError) as e:
            raise TypeError(f"kv-canary sglang-jax: reqs[{i}] must be an sglang-jax Req (with "
                            f"origin_input_ids and output_ids), got {type(r).__name__}: {e}") from None
    return out


def _host_ints(name: str, values) -> np.ndarray:
    arr = np.asarray(values)
    if arr.ndim != 1 or not (arr.size == 0 or np.issubdtype(arr.dtype, np.integer)):
        raise ValueError(f"kv-canary sglang-jax: {name} must be a 1-D sequence of ints, got "
                         f"shape {arr.shape} dtype {arr.dtype}")
    return arr.astype(np.int64)


def expected_tokens(token_ids: Sequence[Sequence[int]], seq_lens, cache_loc_len: int,
                    page_size: int) -> np.ndarray:
    """Token ids laid out like ``cache_loc``: request ``r``'s first ``seq_lens[r]`` ids at its
    page-aligned segment, zeros elsewhere (int32 ``[cache_loc_len]``). Rows of ``seq_lens``
    past ``len(token_ids)`` (batch padding) must be 0.

    Raises (our rules, checked before anything is laid out) TypeError / ValueError for a
    ``page_size`` that is not a positive int, a negative ``cache_loc_len`` or ``seq_lens``
    entry, a padding row with a length, a request with fewer ids than its ``seq_len``, and
    segments that do not fit ``cache_loc_len``."""
    _positive_int("page_size", page_size)
    _int_arg("cache_loc_len", cache_loc_len)
    if cache_loc_len < 0:
        raise ValueError(f"kv-canary sglang-jax: cache_loc_len must be >= 0, got {cache_loc_len}")
    seq = _host_ints("seq_lens", seq_lens)
    if (seq < 0).any():
        r = int(np.nonzero(seq < 0)[0][0])
        raise ValueError(f"kv-canary sglang-jax: seq_lens[{r}] must be >= 0, got {seq[r]}")
    need = sum(-(-n // page_size) * page_size for n in seq.tolist() if n > 0)
    if need > cache_loc_len:
        raise ValueError(f"kv-canary sglang-jax: {need} cache_loc entries for a bucket of {cache_loc_len}")
    out = np.zeros((cache_loc_len,), np.int32)
    at = 0
    for r, n in enumerate(seq.tolist()):
        if n <= 0:
            continue
        if r >= len(token_ids):
            raise ValueError(f"kv-canary sglang-jax: seq_lens[{r}] is {n} but token_ids has "
                             f"{len(token_ids)} requests (padding rows must have seq_len 0)")
        ids = np.asarray(token_ids[r][:n], np.int64)
        if ids.shape[0] != n:
            raise ValueError(f"kv-canary sglang-jax: request {r} has {ids.shape[0]} token ids "
                             f"for seq_len {n}")
        out[at : at + n] = ids
        at += -(-n // page_size) * page_size
    return out


def host_table(req_to_token: np.ndarray, req_pool_indices, seq_lens, context_len: int | None = None
               ) -> np.ndarray:
    """The slot table from sglang-jax's host ``req_to_token`` (the batch's rows only): int32
    ``[bs + 1, context_len]``, row ``r + 1`` = request ``r``'s first ``seq_len`` slots.

    Raises ValueError (our rules) for a ``req_to_token`` that is not 2-D, lists of different
    lengths, a negative ``seq_len``, an active request (``seq_len > 0``) whose row is outside
    ``[0, req_to_token rows)`` (numpy would read row -1 as the last row: a wrong table, checked
    silently) or whose ``seq_len`` exceeds ``context_len`` (its tail would go unchecked)."""
    table = np.asarray(req_to_token)
    if table.ndim != 2:
        raise ValueError(f"kv-canary sglang-jax: req_to_token must be 2-D [rows, context_len], "
                         f"got shape {table.shape}")
    ctx = table.shape[1] if context_len is None else context_len
    _int_arg("context_len", ctx)
    if not 0 < ctx <= table.shape[1]:
        raise ValueError(f"kv-canary sglang-jax: context_len must be in [1, {table.shape[1]}] "
                         f"(req_to_token's columns), got {ctx}")
    rp = _host_ints("req_pool_indices", req_pool_indices)
    seq = _host_ints("seq_lens", seq_lens)
    if rp.shape != seq.shape:
        raise ValueError(f"kv-canary sglang-jax: req_pool_indices ({rp.shape[0]}) and seq_lens "
                         f"({seq.shape[0]}) must have one entry per request")
    for r in range(seq.shape[0]):
        if seq[r] < 0 or seq[r] > ctx:
            raise ValueError(f"kv-canary sglang-jax: seq_lens[{r}] must be in [0, {ctx}] "
                             f"(context_len), got {seq[r]}")
        if seq[r] > 0 and not 0 <= rp[r] < table.shape[0]:
            raise ValueError(f"kv-canary sglang-jax: req_pool_indices[{r}] must be a row of "
                             f"req_to_token, in [0, {table.shape[0]}), got {rp[r]}")
    out = np.zeros((rp.shape[0] + 1, ctx), np.int32)
    for r in np.nonzero(seq > 0)[0].tolist():
        n = int(seq[r])
        out[r + 1, :n] = table[rp[r], :n]
    return out


class RequestIds(NamedTuple):
    """One request of a :class:`TokenDelta`: batch row ``index``, sglang-jax row ``row``, its
    ``Req``, its ``seq_len`` and the tokens this step writes (``new``). Once the step has run,
    the row holds the request's first ``seq_len`` ids: a :class:`TokenFeed` records it as is.
    The ``Req`` itself is kept (one per row, released when another request takes the row or the
    feed is reset) and compared with ``is``: a request is never taken for another, not even one
    with the same ``rid`` that CPython placed at a finished request's address (its ``id()``)."""

    index: int
    row: int
    req: Any
    seq_len: int
    new: int


@dataclasses.dataclass(frozen=True, eq=False)
class DeltaBatch:
    """The batch a :class:`TokenDelta` was made for, as sglang-jax padded it: ``bs`` rows, the
    token bucket (``tokens``, ``input_ids``'s length), the ``cache_loc`` bucket, the forward
    mode, the rows and lengths (numpy, padding rows included), and sglang-jax's batch id
    (``bid``, which ``ForwardBatch.init_new`` copies from the ``ModelWorkerBatch``; None when
    the batch has none)."""

    bs: int
    tokens: int
    cache_loc: int
    decode: bool
    req_pool_indices: np.ndarray
    seq_lens: np.ndarray
    extend_seq_lens: np.ndarray | None
    bid: int | None

    def check(self, forward_batch) -> None:
        """Raise ValueError unless ``forward_batch`` is the batch this delta was made for (its
        shapes and mode; its rows and lengths through the batch id when both carry one, else
        read from the batch, a host transfer when they are device arrays)."""
        fb = forward_batch
        shapes = {"rows (bs)": (self.bs, int(fb.seq_lens.shape[0])),
                  "token bucket": (self.tokens, int(fb.input_ids.shape[0])),
                  "cache_loc bucket": (self.cache_loc, int(fb.cache_loc.shape[0])),
                  "decode mode": (self.decode, bool(fb.forward_mode.is_decode()))}
        for what, (made, got) in shapes.items():
            if made != got:
                raise ValueError(_other_batch(f"{what} {made}, this batch's is {got}"))
        bid = getattr(fb, "bid", None)
        if self.bid is not None and isinstance(bid, (int, np.integer)) and bid == self.bid:
            return
        fields = {"req_pool_indices": self.req_pool_indices, "seq_lens": self.seq_lens}
        if not self.decode:
            fields["extend_seq_lens"] = self.extend_seq_lens
        got = jax.device_get({name: getattr(fb, name) for name in fields})
        for name, made in fields.items():
            have = np.asarray(got[name]).astype(np.int64)
            if not np.array_equal(made, have):
                raise ValueError(_other_batch(f"{name} {made.tolist()}, this batch's are "
                                              f"{have.tolist()}"))


def _other_batch(what: str) -> str:
    return (f"kv-canary sglang-jax: the TokenDelta was made for another batch ({what}); make "
            "each step's delta from the ModelWorkerBatch its ForwardBatch comes from, padded "
            "to the same buckets")


@dataclasses.dataclass(frozen=True, eq=False)
class TokenDelta:
    """One step's expected token ids from a :class:`TokenFeed`: ``array``, int32 ``[bs + n]``,
    is each batch row's first column sent (``bs`` entries, 0 for padding rows), then, request
    after request, its ids from that column to its ``seq_len`` (zeros after). ``n`` is the
    batch's token bucket when the ids fit it, else its ``cache_loc`` bucket (two shapes per
    bucket at most; a decode step sends one id per request). ``batch`` is the batch it was made
    for, ``requests`` what it sends for each request (the guarded step checks the one and
    recomputes ``array`` from the other when the state does not hold what it was made on)."""

    array: np.ndarray
    feed: "TokenFeed"
    batch: DeltaBatch
    requests: tuple[RequestIds, ...]


class TokenFeed:
    """The host side of a canary with ``token_rows``: which ids each sglang-jax row holds on the
    device, and each step's :class:`TokenDelta`.

    The device keeps every request's ids in its row of the state's expected-token pool (row =
    ``req_pool_idx + 1``), so a step sends only the ids the device lacks: a decode step one per
    request instead of every request's whole history. A row is the request's while the same
    ``Req`` object holds it (compared with ``is``); a row another request held before, a
    request seen first, and a request back after a retraction in a row someone else used in
    between are sent whole; this step's new tokens are always sent.

    What the device holds is recorded in two phases: :meth:`delta` records nothing the device
    holds, the guarded step records the delta once it has dispatched the step (a delta never
    run, or whose step failed before it ran, changes nothing), for the state that step
    returned. The feed knows that one state (its expected-token pool, by identity; a
    :func:`sweep` keeps it): a delta sent to any other state (a fork, a copy, a fresh
    ``init_state()``) is sent whole, and a delta made before an earlier one ran, or made on
    what a delta never run would have left, is recomputed from what the state holds, before
    the step is dispatched. Deltas can be made ahead, in step order (each is made on what the
    ones before it leave), and sent in any order. :meth:`reset` forgets everything (every row
    sent whole once)."""

    def __init__(self, canary: SglangJaxCanary):
        if not isinstance(canary, SglangJaxCanary) or canary.token_rows is None:
            raise ValueError("kv-canary sglang-jax: a TokenFeed needs a canary built with "
                             "token_rows (SglangJaxCanary.from_pools(..., incremental_tokens=True))")
        self.canary = canary
        # What the state the last guarded step returned holds, per row, and that state's pool
        # (a weak reference: the feed keeps no device memory alive).
        self._held: dict[int, RequestIds] = {}
        self._fed: weakref.ref | None = None
        # What the rows will hold once every delta made so far has run: deltas made ahead are
        # made on it (the steps check them against _held).
        self._ahead: dict[int, RequestIds] = {}

    def reset(self) -> None:
        """Forget what the device holds: the next delta sends each of its requests whole."""
        self._held, self._fed = {}, None
        self._ahead.clear()

    def delta(self, reqs, model_worker_batch) -> TokenDelta:
        """The ids the device lacks for sglang-jax's ``ModelWorkerBatch`` (its
        ``req_pool_indices``, ``seq_lens``, ``forward_mode``, ``extend_seq_lens``, ``input_ids``
        and ``cache_loc``, padded as sglang-jax pads them, and its ``bid``) of ``reqs``
        (``batch.reqs``, batch order: prompt then output ids each). Give it to the step of that
        very batch.

        Raises (our rules, before anything is recorded) TypeError / ValueError for a request
        that is not a ``Req``, lists of different lengths, a padding row with a length, a row
        outside ``[0, token_rows)`` or held by two requests of the batch, a ``seq_len`` past
        ``context_len`` or with fewer ids, and ids that do not fit ``cache_loc``."""
        mwb = model_worker_batch
        rp = _host_ints("req_pool_indices", mwb.req_pool_indices)
        seq = _host_ints("seq_lens", mwb.seq_lens)
        if rp.shape != seq.shape:
            raise ValueError(f"kv-canary sglang-jax: req_pool_indices ({rp.shape[0]}) and seq_lens "
                             f"({seq.shape[0]}) must have one entry per request")
        decode = bool(mwb.forward_mode.is_decode())
        extend = None
        if decode:
            new = np.minimum(seq, 1)
        else:
            new = extend = _host_ints("extend_seq_lens", mwb.extend_seq_lens)
            if new.shape != seq.shape:
                raise ValueError(f"kv-canary sglang-jax: extend_seq_lens ({new.shape[0]}) and "
                                 f"seq_lens ({seq.shape[0]}) must have one entry per request")
        bid = getattr(mwb, "bid", None)
        batch = DeltaBatch(bs=int(seq.shape[0]), tokens=int(np.asarray(mwb.input_ids).shape[0]),
                           cache_loc=int(np.asarray(mwb.cache_loc).shape[0]), decode=decode,
                           req_pool_indices=rp, seq_lens=seq, extend_seq_lens=extend,
                           bid=int(bid) if isinstance(bid, (int, np.integer)) else None)
        rows, ctx = self.canary.token_rows, self.canary.context_len
        requests, seen = [], {}
        for r, (row, n, k) in enumerate(zip(rp.tolist(), seq.tolist(), new.tolist())):
            if n < 0:
                raise ValueError(f"kv-canary sglang-jax: seq_lens[{r}] must be >= 0, got {n}")
            if n == 0:
                continue
            if r >= len(reqs):
                raise ValueError(f"kv-canary sglang-jax: seq_lens[{r}] is {n} but reqs has "
                                 f"{len(reqs)} requests (padding rows must have seq_len 0)")
            if not 0 <= row < rows:
                raise ValueError(f"kv-canary sglang-jax: req_pool_indices[{r}] must be a row in "
                                 f"[0, {rows}) (token_rows), got {row}")
            if row in seen:
                raise ValueError(f"kv-canary sglang-jax: requests {seen[row]} and {r} of the batch "
                                 f"are both in row {row}")
            seen[row] = r
            if n > ctx:
                raise ValueError(f"kv-canary sglang-jax: seq_lens[{r}] must be in [0, {ctx}] "
                                 f"(context_len), got {n}")
            if not 0 <= k <= n:
                raise ValueError(f"kv-canary sglang-jax: request {r} extends {k} tokens with "
                                 f"seq_len {n}")
            _history(reqs[r], r, n)
            requests.append(RequestIds(index=r, row=row, req=reqs[r], seq_len=n, new=k))
        delta = TokenDelta(array=_lay_out(batch, requests, self._ahead), feed=self, batch=batch,
                           requests=tuple(requests))
        self._ahead.update((req.row, req) for req in requests)
        return delta

    def prepare(self, delta: TokenDelta, state, forward_batch) -> TokenDelta:
        """The delta as the guarded step sends it to ``state`` for ``forward_batch``: ``delta``
        itself when ``state`` holds what it was made on, else recomputed from what ``state``
        holds (whole, for a state this feed did not feed last). Records nothing.

        Raises ValueError (before anything runs or is donated) for a delta made for another
        batch (:meth:`DeltaBatch.check`) or whose requests no longer hold its ids."""
        delta.batch.check(forward_batch)
        held = self._held_by(state)
        starts = delta.array[: delta.batch.bs].tolist()
        for req in delta.requests:
            start = starts[req.index]
            mine = held.get(req.row)
            if start and (mine is None or mine.req is not req.req or mine.seq_len < start):
                return dataclasses.replace(delta, array=_lay_out(delta.batch, delta.requests, held))
        return delta

    def commit(self, sent: TokenDelta, state, new_state) -> None:
        """Record what ``sent`` (:meth:`prepare`'s) put in ``state``'s pool: ``new_state``, the
        state the guarded step returned, holds it. The guarded step calls this once it has
        dispatched the step."""
        held = self._held_by(state)
        held.update((req.row, req) for req in sent.requests)
        self._held, self._fed = held, weakref.ref(new_state.expected_tokens)

    def _held_by(self, state) -> dict[int, RequestIds]:
        fed = None if self._fed is None else self._fed()
        return self._held if fed is not None and fed is state.expected_tokens else {}


def _history(req, r: int, n: int):
    """``req``'s prompt and output ids, holding at least ``n`` ids (batch row ``r``)."""
    try:
        prompt, output = req.origin_input_ids, req.output_ids
        have = len(prompt) + len(output)
    except (AttributeError, TypeError) as e:
        raise TypeError(f"kv-canary sglang-jax: reqs[{r}] must be an sglang-jax Req (with "
                        f"origin_input_ids and output_ids), got {type(req).__name__}: "
                        f"{e}") from None
    if have < n:
        raise ValueError(f"kv-canary sglang-jax: request {r} has {have} token ids for seq_len {n}")
    return prompt, output


def _lay_out(batch: DeltaBatch, requests, held: dict[int, RequestIds]) -> np.ndarray:
    """A delta's array for ``requests`` sent to rows holding ``held``."""
    starts = [0] * batch.bs
    ids = []
    for req in requests:
        mine = held.get(req.row)
        known = mine.seq_len if mine is not None and mine.req is req.req else 0
        n = req.seq_len
        start = min(known, n - req.new)
        starts[req.index] = start
        # Only the ids sent, sliced from the prompt and the output (no whole-history copy).
        prompt, output = _history(req.req, req.index, n)
        p = len(prompt)
        ids.extend(prompt[start:min(n, p)])
        ids.extend(output[max(start - p, 0):max(n - p, 0)])
    total = len(ids)
    size = batch.tokens if total <= batch.tokens else batch.cache_loc
    if total > size:
        raise ValueError(f"kv-canary sglang-jax: {total} token ids to send do not fit the "
                         f"cache_loc bucket of {batch.cache_loc}")
    out = np.zeros((batch.bs + size,), np.int32)
    out[: batch.bs] = starts
    out[batch.bs : batch.bs + total] = ids
    return out


def _expected_array(canary: SglangJaxCanary, expected, state, forward_batch):
    """The step's ``expected`` as the jitted step takes it, and the :class:`TokenDelta` to
    commit once the step is dispatched (None without ``token_rows``)."""
    if canary.token_rows is not None:  # implies token_checks (checked when it is built)
        if not isinstance(expected, TokenDelta):
            raise TypeError("kv-canary sglang-jax: this canary keeps token ids on the device "
                            "(token_rows): give each step a TokenFeed's delta, got "
                            f"{type(expected).__name__}")
        if expected.feed.canary != canary:
            raise ValueError("kv-canary sglang-jax: the TokenDelta comes from the feed of "
                             "another canary")
        sent = expected.feed.prepare(expected, state, forward_batch)
        return sent.array, sent
    if isinstance(expected, TokenDelta):
        raise TypeError("kv-canary sglang-jax: a TokenDelta needs a canary with token_rows; "
                        "this one takes expected_tokens(...)")
    return expected, None


# --------------------------------------------------------------------------------------------
# Per-shard execution
# --------------------------------------------------------------------------------------------


def _first(tree):
    return jax.tree.map(lambda x: x[0], tree)


def _stack1(tree):
    return jax.tree.map(lambda x: x[None], tree)


def _per_shard(canary: SglangJaxCanary, fn, state, replicated, kv=None):
    """Run ``fn(shard_state, replicated, local_kv)`` once per KV shard; returns stacked states."""
    if not canary.axes:
        return _stack1(fn(_first(state), replicated, kv))

    def body(st, rep, local):
        return _stack1(fn(_first(st), rep, local))

    spec = P(canary.axes)
    kv_spec = P() if kv is None else canary.kv_spec
    return jax.shard_map(body, mesh=canary.mesh, in_specs=(spec, P(), kv_spec), out_specs=spec,
                         check_vma=False)(state, replicated, kv)


def _kv_dict(canary: SglangJaxCanary, local_buffer):
    return {"FULL": {"K": list(fused_kv_sources(local_buffer, k_heads=canary.k_heads))}}


def _no_lut():
    return jnp.zeros((1,), jnp.int64)  # the runtime's placeholder when there is no SWA group


def _head(canary: SglangJaxCanary, state, batch, table, fed=None):
    cfg = canary.config

    def fn(st, rep, _):
        b, t, f = rep
        pool = None
        if f is not None:
            seq = b.all_ids_offsets[1:] - b.all_ids_offsets[:-1]
            st, pool = _fed_pool(canary, st, seq, f)
        return head(cfg, st, b, t, _no_lut(), expected_pool=pool)

    return _per_shard(canary, fn, state, (batch, table, fed))


def _tail(canary: SglangJaxCanary, state, batch, kv_buffer):
    cfg = canary.config
    return _per_shard(canary, lambda st, b, kv: tail(cfg, st, b, _no_lut(), _kv_dict(canary, kv)),
                      state, batch, kv_buffer)


def guard_model_step(canary: SglangJaxCanary, model_step: Callable, *, batch_argnum: int,
                     pool_argnum: int, fused_kv: Callable[[Any, Any], jax.Array],
                     static_argnums: Sequence[int] = ()):
    """Wrap sglang-jax's jitted model step with the canary: HEAD before it, TAIL after it.

    ``model_step(*args)`` is the model call (sglang-jax 0.0.2: ``ModelRunner``'s
    ``jitted_run_model(model_def, model_state_def, model_state_leaves, forward_batch,
    token_to_kv_pool, logits_metadata)``), ``args[batch_argnum]`` its ``ForwardBatch`` and
    ``args[pool_argnum]`` its KV pool; ``fused_kv(out, pool)`` picks the canary layer's new fused
    buffer from the step's output (0.0.2: ``out[1][layer]``). Returns
    ``step(state, *args, expected=None, table=None) -> (state, out)``, one ``jax.jit`` with the
    canary state and the pool donated (use the buffers ``out`` returns, as sglang-jax does).
    ``expected``: :func:`expected_tokens` (required with ``token_checks``); ``table``:
    :func:`host_table` to plan from ``req_to_token`` instead of ``cache_loc``.
    """
    for name, value in (("batch_argnum", batch_argnum), ("pool_argnum", pool_argnum)):
        _int_arg(name, value)
        if value < 0:
            raise ValueError(f"kv-canary sglang-jax: {name} must be >= 0 (an index into the "
                             f"model step's positional arguments), got {value}")
    if batch_argnum == pool_argnum:
        raise ValueError(f"kv-canary sglang-jax: batch_argnum and pool_argnum are both "
                         f"{batch_argnum}; the batch and the KV pool are different arguments")
    if batch_argnum in static_argnums or pool_argnum in static_argnums:
        raise ValueError("kv-canary sglang-jax: the batch and the KV pool cannot be static "
                         f"arguments (static_argnums={tuple(static_argnums)})")
    if not callable(model_step) or not callable(fused_kv):
        raise TypeError("kv-canary sglang-jax: model_step and fused_kv must be callables")
    nfixed = 4  # state, expected, table, model_x64

    def traced(state, expected, table, model_x64, *args):
        batch, cache_table, fed = _device_batch(canary, args[batch_argnum], expected)
        state = _head(canary, state, batch, cache_table if table is None else table, fed)
        with jax.enable_x64(model_x64):
            out = model_step(*args)
        state = _tail(canary, state, batch, fused_kv(out, args[pool_argnum]))
        return state, out

    jitted = jax.jit(
        traced,
        static_argnums=(3,) + tuple(nfixed + a for a in static_argnums),
        donate_argnums=(0, nfixed + pool_argnum),
    )

    @_config.entry_point
    def step(state, *args, expected=None, table=None):
        if len(args) <= max(batch_argnum, pool_argnum):
            raise TypeError(f"kv-canary sglang-jax: the model step takes its batch at "
                            f"{batch_argnum} and its KV pool at {pool_argnum}, got "
                            f"{len(args)} arguments")
        array, sent = _expected_array(canary, expected, state, args[batch_argnum])
        new_state, out = jitted(state, array, table, _config.caller_had_x64(), *args)
        if sent is not None:  # dispatched: the state it returned holds the delta's ids
            sent.feed.commit(sent, state, new_state)
        return new_state, out

    step.jitted = jitted
    return step


def _run_model(model_def, model_state_def, model_state_leaves, forward_batch, token_to_kv_pool,
               logits_metadata):
    """sglang-jax 0.0.2's ``jitted_run_model`` body (``ModelRunner.initialize_jit``)."""
    from flax import nnx

    state = jax.tree_util.tree_unflatten(model_state_def, model_state_leaves)
    return nnx.merge(model_def, state)(forward_batch, token_to_kv_pool, logits_metadata)


def store_kv(model_runner, layers, forward_batch) -> None:
    """Store a step's new fused KV buffers in the runner's pool, as sglang-jax 0.0.2's
    ``ModelRunner._forward`` does after ``jitted_run_model`` (its
    ``_set_kv_cache_after_forward``; a runner without it: the pool's ``kv_buffer`` slice from
    ``start_layer``)."""
    set_after = getattr(model_runner, "_set_kv_cache_after_forward", None)
    if set_after is not None:
        set_after(layers, forward_batch)
        return
    pool = model_runner.token_to_kv_pool
    start = getattr(pool, "start_layer", 0)
    pool.kv_buffer[start : start + len(layers)] = layers


class ModelRunnerHook:
    """The canary installed in an sglang-jax 0.0.2 ``ModelRunner``.

    Replaces the runner's ``jitted_run_model`` (the hook sglang-jax's ``_forward`` calls) with the
    guarded step over the same model definition, weights and KV pool; the runner keeps storing
    the KV buffers the step returns. Before each ``model_runner.forward``, give the step's expected
    token ids with :meth:`expect` (with ``token_checks``): with ``token_rows``,
    ``hook.expect(hook.feed.delta(batch.reqs, model_worker_batch))``, else
    :func:`expected_tokens`. ``state`` is the canary's device state; ``feed`` its
    :class:`TokenFeed` (None without ``token_rows``). A step refused before it runs (a delta
    made for another batch, ...) leaves the runner's pool, the state and the feed as they were.
    """

    def __init__(self, canary: SglangJaxCanary, model_runner):
        from flax import nnx

        model_def, model_state = nnx.split(model_runner.model)
        leaves, state_def = jax.tree_util.tree_flatten(model_state)
        self.canary = canary
        self.state = canary.init_state()
        self.feed = TokenFeed(canary) if canary.token_rows is not None else None
        self._runner = model_runner
        self._model = (model_def, state_def, leaves)
        self._pending: dict = {}
        self._unguarded = model_runner.jitted_run_model
        self._step = guard_model_step(
            canary, _run_model, batch_argnum=3, pool_argnum=4, static_argnums=(1,),
            fused_kv=lambda out, pool: out[1][canary.layer - pool.start_layer])
        model_runner.jitted_run_model = self._run

    def expect(self, expected: np.ndarray | TokenDelta | None = None,
               table: np.ndarray | None = None) -> None:
        """The next step's :func:`expected_tokens` or :class:`TokenDelta` (and optional
        :func:`host_table`)."""
        self._pending = {"expected": expected, "table": table}

    def _run(self, forward_batch, logits_metadata):
        # A step refused before it runs donates nothing and records nothing in the feed: the
        # runner's pool, the state and the feed are as they were.
        model_def, state_def, leaves = self._model
        pending, self._pending = self._pending, {}
        self.state, out = self._step(self.state, model_def, state_def, leaves, forward_batch,
                                     self._runner.token_to_kv_pool, logits_metadata, **pending)
        return out

    def uninstall(self) -> None:
        """Give the runner its own ``jitted_run_model`` back."""
        self._runner.jitted_run_model = self._unguarded


# --------------------------------------------------------------------------------------------
# Sweep of radix-cached prefixes
# --------------------------------------------------------------------------------------------


def radix_prefixes(tree_cache) -> list[np.ndarray]:
    """Slot lists of every root-to-leaf path of sglang-jax's ``RadixCache`` (evicted subtrees
    skipped): the cached prefixes a sweep re-verifies."""
    root = getattr(tree_cache, "root_node", None)
    if root is None or not hasattr(root, "children"):
        raise TypeError("kv-canary sglang-jax: tree_cache must be an sglang-jax RadixCache (with "
                        f"root_node.children), got {type(tree_cache).__name__}")
    out = []
    stack = [(root, np.zeros((0,), np.int64))]
    while stack:
        node, prefix = stack.pop()
        kids = [c for c in node.children.values() if c.value is not None]
        if not kids and prefix.shape[0]:
            out.append(prefix)
        for child in kids:
            stack.append((child, np.concatenate([prefix, np.asarray(child.value, np.int64)])))
    return out


@functools.partial(jax.jit, static_argnames=("canary",), donate_argnames=("state",))
def _sweep_jit(state, expected_tokens, rows_table, row_indices, lengths, kv_buffer, *, canary):
    # The expected-token pool stays out of the donated state and out of the result (the sweep's
    # token check is off, it reads nothing there): the caller's state keeps the very pool array
    # its TokenFeed knows.
    cfg = canary.config

    def fn(st, rep, kv):
        return kc.canary_sweep(cfg, st, rows_table=rep[0], row_indices=rep[1], lengths=rep[2],
                               kv=_kv_dict(canary, kv))

    state = dataclasses.replace(state, expected_tokens=expected_tokens)
    state = _per_shard(canary, fn, state, (rows_table, row_indices, lengths), kv_buffer)
    return dataclasses.replace(state, expected_tokens=None)


@_config.entry_point
def sweep(canary: SglangJaxCanary, state, kv_buffer: jax.Array, prefixes: Sequence[Sequence[int]]):
    """Verify cached prefixes (slot lists, position ``j`` at index ``j``) against the TAIL
    buffers with the SWEEP tags (token check off), ``canary.sweep_rows`` prefixes per launch.
    ``kv_buffer`` is the canary layer's current fused buffer. ``state`` is donated.

    Raises ValueError (our rule, before anything runs or is donated) for a prefix longer than
    ``canary.context_len`` (its tail would go unchecked) or holding a slot outside
    ``[0, canary.num_slots)`` (never verified). The state's expected-token pool is not donated:
    the returned state keeps that very array (a :class:`TokenFeed` still knows the state)."""
    n = canary.sweep_rows
    prefixes = [_host_ints(f"prefixes[{i}]", p) for i, p in enumerate(prefixes)]
    for i, p in enumerate(prefixes):
        if p.shape[0] > canary.context_len:
            raise ValueError(f"kv-canary sglang-jax: prefixes[{i}] has {p.shape[0]} slots, more "
                             f"than context_len={canary.context_len}")
        bad = np.nonzero((p < 0) | (p >= canary.num_slots))[0]
        if bad.size:
            raise ValueError(f"kv-canary sglang-jax: prefixes[{i}][{bad[0]}] must be a slot in "
                             f"[0, {canary.num_slots}), got {p[bad[0]]}")
    pool = state.expected_tokens
    state = dataclasses.replace(state, expected_tokens=None)
    for start in range(0, max(len(prefixes), 1), n):
        chunk = prefixes[start : start + n]
        table = np.zeros((n + 1, canary.context_len), np.int32)
        rows = np.zeros((n,), np.int64)
        lens = np.zeros((n,), np.int64)
        for i, slots in enumerate(chunk):
            k = slots.shape[0]
            table[i + 1, :k] = slots
            rows[i], lens[i] = i + 1, k
        state = _sweep_jit(state, pool, table, rows, lens, kv_buffer, canary=canary)
    return dataclasses.replace(state, expected_tokens=pool)


# --------------------------------------------------------------------------------------------
# Host side: violations per shard
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ShardViolation:
    """A decoded ring row and the shard (index along :attr:`SglangJaxCanary.axes`) that saw it."""

    shard: int
    violation: kc.Violation

    def __str__(self) -> str:
        return f"shard {self.shard}: {self.violation}"


def violation_counts(state) -> np.ndarray:
    """Violations ever recorded, per shard (negative: the ring guard's host-visible report)."""
    return np.asarray(state.violation_write_index)[:, 0].astype(np.int64)


def read_violations(state, *, start=0) -> list[ShardViolation]:
    """Every shard's ring rows from ``start`` on, shard by shard, in ring order. ``start``: one
    ring index for every shard, or one per shard (e.g. :func:`violation_counts` taken before a
    step, to read what that step added)."""
    ring = np.asarray(state.violation_ring)
    counts = violation_counts(state)
    starts = np.broadcast_to(np.asarray(start, np.int64), counts.shape)
    return [
        ShardViolation(shard=i, violation=v)
        for i in range(ring.shape[0])
        for v in decode_ring(ring[i], int(counts[i]), start=int(starts[i]))
    ]


# --------------------------------------------------------------------------------------------
# The runtime manager and remediation
# --------------------------------------------------------------------------------------------


def canary_manager(canary: SglangJaxCanary, mode: str = "log", *, on_violation=None,
                   **fields):
    """A :class:`kvcanary_jax.runtime.CanaryManager` over the canary's state (observe mode: the
    guarded step runs in :func:`guard_model_step`, the manager runs the host side after it:
    readback one step late, reporting, health, stats, remediation). Its ring capacity, real-KV
    mode and token checks are the canary's; ``fields`` are the other
    :class:`~kvcanary_jax.runtime.ManagerConfig` fields (``stats_print_every_n_steps``, ...).
    The sweep stays :func:`sweep`'s: a ``sweep_interval`` here is refused."""
    from kvcanary_jax.runtime import CanaryManager, ManagerConfig

    if fields.get("sweep_interval", 0):
        raise ValueError("kv-canary sglang-jax: run the radix sweep with sglang_jax.sweep(); the "
                         "observe-mode manager takes no sweep_interval")
    cfg = canary.config
    config = ManagerConfig(mode=mode, ring_capacity=cfg.ring_capacity,
                           real_data=cfg.real_kv_hash_mode if mode != "none" else "none",
                           enable_verify_token_assert=cfg.enable_verify_token_assert,
                           enable_write_input_assert=cfg.enable_write_input_assert, **fields)
    return CanaryManager(config, cfg, on_violation=on_violation, allocate=False)


def request_resolver(reqs, req_to_token_pool):
    """``resolve(slot, violation) -> Req | None`` for one step's requests (sglang-jax ``Req``:
    ``req_pool_idx``, ``origin_input_ids``, ``output_ids``): the request whose
    ``req_to_token`` row holds ``slot`` among its first ``len(origin_input_ids) +
    len(output_ids)`` entries. Reads the pool's table only when called (a violation)."""
    reqs = list(reqs)

    def resolve(slot, violation=None):
        table = np.asarray(req_to_token_pool.req_to_token)
        for req in reqs:
            row = getattr(req, "req_pool_idx", None)
            if row is None:
                continue
            n = len(req.origin_input_ids) + len(req.output_ids)
            if int(slot) in set(np.asarray(table[int(row), :n]).tolist()):
                return req
        return None

    return resolve


def abort_request(req, message: str) -> None:
    """sglang-jax's own abort: ``to_abort`` is turned into ``FINISH_ABORT(message)`` by
    ``Req.check_finished`` at the end of the step, and the scheduler releases the request."""
    req.to_abort = True
    req.to_abort_message = message


def _subtree(node):
    out, stack = [], [node]
    while stack:
        n = stack.pop()
        out.append(n)
        stack.extend(n.children.values())
    return out


def drop_radix_slot(tree_cache, slot: int) -> tuple[int, bool]:
    """Drop from sglang-jax's ``RadixCache`` the node holding ``slot`` and every node below it
    (their KV extends the bad one), freeing their slots through the cache's allocator, as its
    ``evict`` does, so no later request matches the corrupted prefix. Nodes a running request
    still locks (``lock_ref > 0``) cannot be freed yet. Returns ``(tokens dropped, whether
    locked nodes remain)``; a slot no node holds drops nothing."""
    target = None
    for node in _subtree(tree_cache.root_node):
        if node is tree_cache.root_node or node.value is None:
            continue
        if int(slot) in set(np.asarray(node.value).reshape(-1).tolist()):
            target = node
            break
    if target is None:
        return 0, False
    dropped, locked = 0, False
    # Leaves first: a node is deleted once its children are gone.
    for node in reversed(_subtree(target)):
        if node.lock_ref > 0 or node.children:
            locked = locked or node.lock_ref > 0
            continue
        tree_cache.token_to_kv_pool_allocator.free(node.value)
        dropped += len(node.value)
        tree_cache._delete_leaf(node)
    return dropped, locked


class Remediator:
    """The ``on_violation`` callback of a :func:`canary_manager`: aborts the request a violation
    belongs to (:func:`abort_request`) and drops the radix-cache node holding the slot
    (:func:`drop_radix_slot`). Slots whose nodes were still locked are kept in ``pending`` and
    retried at every later violation and by :meth:`retry` (call it after the scheduler released
    the aborted requests). ``aborted`` / ``dropped`` record what was done."""

    def __init__(self, tree_cache, *, message: str = "kv-canary: KV cache corruption detected"):
        self.tree_cache = tree_cache
        self.message = message
        self.pending: set[int] = set()
        self.aborted: list = []
        self.dropped: dict[int, int] = {}

    def __call__(self, report) -> None:
        v = report.violation
        if report.request is not None and not getattr(report.request, "to_abort", False):
            abort_request(report.request, f"{self.message} (slot {v.slot}, {v.tag}, "
                                          f"{'|'.join(v.reasons)})")
            self.aborted.append(report.request)
        if v.slot > 0:  # slot 0 is the padding slot: no node holds it
            self.pending.add(int(v.slot))
        self.retry()

    def retry(self) -> None:
        for slot in sorted(self.pending):
            n, locked = drop_radix_slot(self.tree_cache, slot)
            if n:
                self.dropped[slot] = self.dropped.get(slot, 0) + n
            if not locked:
                self.pending.discard(slot)


class ManagedModelRunnerHook(ModelRunnerHook):
    """:class:`ModelRunnerHook` with a :func:`canary_manager` running the host side after every
    guarded step (``manager.observe``). Give each step's requests with
    ``expect(..., reqs=batch.reqs)`` so violations reach ``on_violation`` with their request.

    When the manager raises after a step (raise mode, the health and phase checks), the step
    has run and its new KV buffers are stored in the runner's pool (:func:`store_kv`) before the
    error propagates: the runner keeps serving-ready KV, and a ``CanaryViolationError`` carries
    the same buffers as ``kv``."""

    def __init__(self, canary: SglangJaxCanary, model_runner, manager):
        if not getattr(manager, "enabled", False):
            raise ValueError("kv-canary sglang-jax: the manager runs --kv-canary none: install no "
                             "hook at all (the canary is off)")
        super().__init__(canary, model_runner)
        self.manager = manager
        self._reqs = None

    def expect(self, expected: np.ndarray | TokenDelta | None = None,
               table: np.ndarray | None = None, *, reqs=None) -> None:
        super().expect(expected, table)
        self._reqs = reqs

    def _run(self, forward_batch, logits_metadata):
        out = super()._run(forward_batch, logits_metadata)
        reqs, self._reqs = self._reqs, None
        try:
            resolve = (request_resolver(reqs, self._runner.req_to_token_pool)
                       if reqs is not None else None)
            self.manager.observe(self.state, resolve=resolve)
        except BaseException as e:
            # The step ran: the pool passed in was donated, and the runner stores the step's
            # buffers only when this returns. Store them now, as the runner would, so it keeps
            # serving-ready KV, and hand them with the error as CanaryManager.step does.
            layers = out[1]
            store_kv(self._runner, layers, forward_batch)
            if isinstance(e, CanaryViolationError):
                e.kv = layers
            raise
        return out
