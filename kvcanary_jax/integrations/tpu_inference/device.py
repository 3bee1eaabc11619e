"""The canary's device side over tpu-inference's step: its description, the batch it derives
from ``AttentionMetadata``, the kept expected-token pool, and HEAD / TAIL / SWEEP per shard.

**The batch, derived on the device.** A step has no slot mapping: the attention kernel writes
the KV of request ``i``'s ``q_len`` new tokens (``q_len = query_start_loc[i + 1] -
query_start_loc[i]``) at positions ``[seq_lens[i] - q_len, seq_lens[i])``, slot
``block_tables[i * max_blocks + pos // block_size] * block_size + pos % block_size``, for the
first ``request_distribution[2]`` requests; tokens past ``query_start_loc[n]`` are padding
(their ``input_positions`` keep stale values: they are masked by ``query_start_loc``, never by
position). :func:`step_batch` turns one data shard's metadata into the runtime's
:class:`~kvcanary_jax.ForwardBatch` (prefix ``seq_len - q_len``, extend ``q_len``, the written
slots as ``out_cache_loc``, ``-1`` for padding) and a slot table whose row ``i + 1`` holds
request ``i``'s slots for positions ``[0, seq_len)`` (row 0: the padding row). The plan
therefore verifies the very slots the attention reads, from the very block table it reads:
a wrong block-table entry is checked, not hidden.

**Expected token ids, kept on the device.** The state's expected-token pool has a row per
request (``pool row``, stable while the request lives, :mod:`.host`), ``+ 1`` (row 0 unused).
Each step takes a :class:`TokenDelta` (per batch row: its pool row + 1, the first position sent
and how many; then each id with the batch row and the column it lands at, laid out by the host,
so that the device searches nothing): the ids the host knows and the device lacks. Positions a step
writes past what the pool holds (the on-device decode loop's own samples, which the host learns
only after the loop) are taken from the step's input ids when first written; a later write of a
position the pool holds is checked against it (the write's input check) and so is every read
(the verify's token check). ``valid`` (the state's ``expected_valid_lens``) is how many leading
positions of each row the pool holds.

**Coverage** (ours, ``coverage_window`` N >= 1; docs/spec.md §17): besides SGLang's fingerprint
of the canary layer, TAIL stamps the digest of every layer's row of each slot the step wrote
and checks a rotating share of the slots it read (a slot read by N consecutive TAILs is checked
in one of them; each step of the on-device decode loop is a TAIL), and the sweep checks every
slot of the cached blocks. A step split in two passes (below, :func:`_passes`) runs two TAILs,
and counts as two steps of the window.

**Shards.** One canary per KV shard: over the data-parallel axis (each rank its blocks, its
block-table rows, its slice of every metadata array) and the KV-head axis (each its own heads).
The states are stacked along a leading axis sharded over both (:attr:`TpuInferenceCanary.axes`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import kvcanary_jax as kc
from kvcanary_jax.integrations.tpu_inference.layout import KvLayout
from kvcanary_jax.ops._xla_lib import count_below
from kvcanary_jax.runtime.kv import digest_reads_rows
from kvcanary_jax.runtime.step import head, tail

__all__ = ["TpuInferenceCanary", "TokenDelta", "step_batch", "apply_delta", "delta_step",
           "metadata", "head_step", "tail_step", "guarded_step", "sweep_step", "kv_arg",
           "pack_state", "unpack_state"]


def _axes(entry) -> tuple[str, ...]:
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, tuple) else (entry,)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TpuInferenceCanary:
    """Static description of one canary over a tpu-inference runner (hashable: a jit constant).

    ``layout``: the canary layer's :class:`KvLayout`; ``layer_index``: its index in
    ``runner.kv_caches``; ``layers``: the layer names whose real KV SGLang's fingerprint reads
    (the canary layer's). ``num_slots``: slots of one data shard; ``max_reqs``: batch rows
    of one data shard (``max_num_reqs // dp``); ``max_blocks``: block-table columns;
    ``pool_rows``: expected-token pool rows; ``mesh`` / ``kv_spec``: the cache's.
    ``coverage_window`` (ours, docs/spec.md §17; 0: off): N >= 1 also digests every array of
    ``runner.kv_caches`` (``num_layers`` of them, each the canary layer's layout), every byte
    of each slot's row, K and V of every local head. The rest is
    :class:`kvcanary_jax.CanaryConfig`'s."""

    layout: KvLayout
    layer_index: int
    layers: tuple[str, ...]
    num_slots: int
    max_reqs: int
    max_blocks: int
    pool_rows: int
    mesh: Mesh
    kv_spec: P
    k_heads: int = 1
    token_checks: bool = True
    sweep_rows: int = 16
    ring_capacity: int = 1024
    real_kv_hash_mode: str = "all"
    implementation: str | None = None
    coverage_window: int = 0
    num_layers: int | None = None

    @property
    def data_axes(self) -> tuple[str, ...]:
        return _axes(tuple(self.kv_spec)[0]) if len(tuple(self.kv_spec)) else ()

    @property
    def head_axes(self) -> tuple[str, ...]:
        spec = tuple(self.kv_spec)
        return _axes(spec[2]) if len(spec) > 2 else ()

    @property
    def axes(self) -> tuple[str, ...]:
        return self.data_axes + self.head_axes

    def _size(self, axes) -> int:
        return math.prod(self.mesh.shape[a] for a in axes)

    @property
    def data_shards(self) -> int:
        return self._size(self.data_axes)

    @property
    def num_shards(self) -> int:
        return self._size(self.axes)

    @property
    def context_len(self) -> int:
        return self.max_blocks * self.layout.block_size

    @property
    def config(self) -> kc.CanaryConfig:
        return kc.CanaryConfig(
            max_reqs=self.pool_rows + 1, write_req_capacity=self.max_reqs + 1,
            context_len=self.context_len, num_slots=self.num_slots, max_bs=self.max_reqs,
            max_tokens=self.max_reqs, ring_capacity=self.ring_capacity,
            real_kv_hash_mode=self.real_kv_hash_mode,
            enable_verify_token_assert=self.token_checks,
            enable_write_input_assert=self.token_checks, implementation=self.implementation,
            coverage_window=self.coverage_window,
            num_layers=self.num_layers if self.coverage_window else None,
            # The guard sweeps every K calls, and a call may run a whole decode loop.
            sweep_in_steps=False)

    def init_state(self):
        """Zero-filled per-shard states, stacked on a leading axis placed over :attr:`axes`."""
        with jax.enable_x64(True):
            # Each device builds its own shards (kc.init_state_stacked).
            return kc.init_state_stacked(self.config, self.num_shards,
                                         NamedSharding(self.mesh, P(self.axes or None)))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TokenDelta:
    """One step's expected ids from the host, per data shard stacked (int32): ``rows``
    ``[shards * max_reqs]`` (pool row + 1 of each batch row, 0 = padding), ``starts`` and
    ``counts`` (first position sent, ids sent), ``ids`` ``[shards * n, 3]``: each id, the batch
    row it belongs to and its column in that row's pool row (``context_len``: padding, written
    nowhere; :meth:`.host.TokenBook.plan` lays them out)."""

    rows: jax.Array
    starts: jax.Array
    counts: jax.Array
    ids: jax.Array


# Up to this many (index, entry) pairs, :func:`_owner` compares every index with every entry.
_OWNER_PAIRS = 1 << 16


def _owner(offsets, idx, n):
    """For exclusive prefix sums ``offsets`` [n + 1], the entry whose range holds each index
    (``searchsorted`` right). A small step (a decode's) compares every index with every entry
    and counts, one reduction; a bigger one searches, unrolled (``jnp.searchsorted`` is a loop,
    two small kernels an iteration on a GPU, 14 a step at 128 requests; the unrolled search's
    dependent gathers were two kernels at 64 requests)."""
    if idx.shape[0] * n <= _OWNER_PAIRS:
        below = jnp.sum(offsets[None, 1:] <= idx[:, None], axis=1, dtype=jnp.int64)
    else:
        below = count_below(offsets[1:], idx, inclusive=True)
    return jnp.clip(below, 0, max(n - 1, 0))


def _gather(values, idx):
    # A clamped gather: masked lanes may compute any index; none reads out of bounds.
    return values[jnp.clip(idx, 0, max(values.shape[0] - 1, 0))]


def step_batch(canary: TpuInferenceCanary, md, input_ids, input_positions, unwritten=None):
    """One data shard's metadata -> (lengths, written positions, table) (trace under x64).
    ``md``: the shard's ``seq_lens`` [M], ``query_start_loc`` [M + 1], ``block_tables``
    [M * max_blocks], ``request_distribution`` [3]. ``unwritten`` (int32 [blocks], or None):
    per block, the first offset a guarded step wrote (:class:`.host.Unwritten`); the table's
    read slots below it are 0, the padding slot, which no check reads (KV with no canary)."""
    seq_lens, qsl, block_tables, dist = md
    m = seq_lens.shape[0]
    if m != canary.max_reqs or block_tables.shape[0] != m * canary.max_blocks:
        raise ValueError(f"kv-canary tpu-inference: a shard's metadata has {m} requests and "
                         f"{block_tables.shape[0]} block-table entries; the canary was built for "
                         f"{canary.max_reqs} x {canary.max_blocks}")
    bs = canary.layout.block_size
    i64 = lambda x: x.astype(jnp.int64)  # noqa: E731
    r = jnp.arange(m, dtype=jnp.int64)
    n = i64(dist[2])
    live = r < n
    qsl = i64(qsl)
    q_len = jnp.where(live, qsl[1:] - qsl[:-1], 0)
    seq = jnp.where(live, i64(seq_lens), 0)
    prefix = jnp.where(live, seq - q_len, 0)
    cols = jnp.arange(canary.context_len, dtype=jnp.int64)
    # The table [M + 1, ctx] with its padding row 0 derived in the same elementwise pass (the
    # small per-request inputs get the extra row, not the table: a concatenate of the table
    # was a copy kernel of its own).
    zero = jnp.zeros((1,), jnp.int64)
    bt = jnp.concatenate([jnp.zeros((1, canary.max_blocks), jnp.int64),
                          i64(block_tables).reshape(m, canary.max_blocks)])
    seq1, prefix1 = jnp.concatenate([zero, seq]), jnp.concatenate([zero, prefix])
    blk = bt[:, cols // bs]
    table = blk * bs + cols % bs
    keep = cols[None, :] < seq1[:, None]
    if unwritten is not None:
        # Only the read positions: the step's own writes keep their slots.
        # A block id outside [1, blocks) (the null block, a broken table) is never masked: the
        # checks report what it reads.
        real = (blk > 0) & (blk < unwritten.shape[0])
        first = jnp.where(real, _gather(unwritten, blk), 0)
        old = (cols[None, :] < prefix1[:, None]) & (cols % bs < first)
        keep = keep & ~old
    table = jnp.where(keep, table, 0).astype(jnp.int32)
    ntok = input_ids.shape[0]
    tok = jnp.arange(ntok, dtype=jnp.int64)
    owner = _owner(qsl, tok, m)
    valid_tok = tok < qsl[jnp.clip(n, 0, m)]
    pos = prefix[owner] + tok - qsl[owner]
    flat_table = table[1:].reshape(-1).astype(jnp.int64)
    slot = jnp.where(valid_tok, _gather(flat_table, owner * canary.context_len + pos), -1)
    return dict(seq=seq, prefix=prefix, q_len=q_len, rows=jnp.where(live & (seq > 0), r + 1, 0),
                owner=owner, valid_tok=valid_tok, pos=jnp.where(valid_tok, pos, 0), slot=slot,
                table=table)


def _delta_cells(canary: TpuInferenceCanary, prow, old, delta: TokenDelta, pending=True):
    """Where a :class:`TokenDelta`'s ids land and what each batch row then holds (trace under
    x64): returns ``(pool rows, columns, held)``, one cell per id (a column of ``ctx`` drops:
    past the ids sent, or a padding row), and per batch row its new held length. ``prow``:
    each batch row's pool row + 1 (0: padding); ``old``: what those rows held before. A new
    request's row (``pending`` and its delta starting at 0) restarts at 0, and every row is
    then raised to what the delta sends (``start + count``)."""
    m, ctx = canary.max_reqs, canary.context_len
    starts, counts = delta.starts.astype(jnp.int64), delta.counts.astype(jnp.int64)
    owner = jnp.clip(delta.ids[:, 1].astype(jnp.int64), 0, max(m - 1, 0))
    col = delta.ids[:, 2].astype(jnp.int64)
    ok = (col >= 0) & (col < ctx) & (prow[owner] > 0)
    cell_rows = jnp.where(ok, prow[owner], 0)
    cols = jnp.where(ok, col, ctx)
    reset = (prow > 0) & jnp.asarray(pending, jnp.bool_) & (starts == 0)
    held = jnp.maximum(jnp.where(reset, 0, old), starts + counts)
    return cell_rows, cols, held


def apply_delta(canary: TpuInferenceCanary, pool, valid, delta: TokenDelta, pending=True):
    """One shard's expected-id pool after a step's :class:`TokenDelta` (trace under x64):
    returns ``(pool, valid)``. The delta's ids land at each batch row's pool row from its
    ``start`` (:func:`_delta_cells`). What the decode loop's steps read (applied once before the
    loop), and a normal step's delta too big for HEAD to take (:func:`.host.head_delta`)."""
    rows_total = pool.shape[0]
    # The old lengths gathered once and passed with the rows through a barrier: the scatter
    # below, indexed by those rows, runs after the gather and updates ``valid`` in place (a
    # reader of the old values fused into a scatter made XLA copy it). Each batch row's pool
    # row is its own (none shared): one scatter sets every row's new length.
    old, prow = jax.lax.optimization_barrier((valid[delta.rows.astype(jnp.int64)],
                                              delta.rows.astype(jnp.int64)))
    cell_rows, cols, held = _delta_cells(canary, prow, old, delta, pending)
    pool = pool.at[cell_rows, cols].set(delta.ids[:, 0], mode="drop")
    valid = valid.at[jnp.where(prow > 0, prow, rows_total)].set(held, mode="drop")
    return pool, valid


def _pool(canary: TpuInferenceCanary, st, b, rows, input_ids, delta: TokenDelta | None = None):
    """The step's expected ids into the pool in one pass: ``delta``'s (None: applied already,
    :func:`apply_delta`) and the step's own first writes; returns (state, batch rows of the pool
    [M + 1, ctx], expected id per token). ``rows`` [M]: each batch row's pool row + 1 (0:
    padding; None: every row). One scatter writes both: a position the step adopts is at or
    past what the delta leaves its row holding, so the two never write one cell. Each row's
    length is set once: what the delta leaves it, raised to the step's last position + 1
    (``prefix + q_len``: :func:`step_batch`'s positions are contiguous per request)."""
    pool, valid = st.expected_tokens, st.expected_valid_lens
    m, ctx, rows_total = canary.max_reqs, canary.context_len, pool.shape[0]
    prow = jnp.zeros((m,), jnp.int64) if rows is None else rows.astype(jnp.int64)
    # What each batch row's pool row holds, read once, before the scatters below, which then
    # update the pool and ``valid`` in place.
    old, prow = jax.lax.optimization_barrier((valid[prow], prow))
    held = old
    if delta is not None:
        cell_rows, cols, held = _delta_cells(canary, prow, old, delta)
    row_t = jnp.where(b["valid_tok"], prow[b["owner"]], 0)
    # Positions past what the pool holds (the on-device decode loop's own samples) are taken
    # from the step's input ids; the rest are checked against the pool. Row 0 (padding) is
    # never written, in the pool or in ``valid``.
    adopt = (row_t > 0) & (b["pos"] >= held[b["owner"]])
    cell_rows_t = jnp.where(adopt, row_t, 0)
    cols_t = jnp.where(adopt, b["pos"], ctx)
    ids = input_ids.astype(jnp.int32)
    if delta is not None:
        cell_rows_t = jnp.concatenate([cell_rows, cell_rows_t])
        cols_t = jnp.concatenate([cols, cols_t])
        ids = jnp.concatenate([delta.ids[:, 0].astype(jnp.int32), ids])
    pool = pool.at[cell_rows_t, cols_t].set(ids, mode="drop")
    last = jnp.where(b["q_len"] > 0, b["prefix"] + b["q_len"], 0)
    valid = valid.at[jnp.where(prow > 0, prow, rows_total)].set(jnp.maximum(held, last),
                                                                 mode="drop")
    expected = pool[row_t, jnp.clip(b["pos"], 0, ctx - 1)].astype(jnp.int64)
    rows_b = jnp.concatenate([jnp.zeros((1,), jnp.int64), prow])
    st = dataclasses.replace(st, expected_tokens=pool, expected_valid_lens=valid)
    return st, pool[rows_b], expected


def _canary_batch(b, input_ids, input_positions, expected, keep=None):
    """The runtime's batch; with ``keep`` (per request), the other requests masked out: no
    row, no length, their tokens moved after the kept ones (the plan reads each request's
    tokens at the running sum of the lengths) and written nowhere (``out_cache_loc`` -1).
    The step's ids and positions are taken as the runner's arrays are (int32: the write widens
    them as it reads them, and reads only the tokens it walks, so padding needs no mask);
    ``all_ids_offsets`` is the running sum of the lengths (``head`` takes the lengths
    themselves: it is read by nothing, and XLA drops it)."""
    zero = jnp.zeros((1,), jnp.int64)
    rows, prefix, q_len, seq = b["rows"], b["prefix"], b["q_len"], b["seq"]
    ids, pos, slot = input_ids, input_positions, b["slot"]
    exp_pos = b["pos"]
    if keep is not None:
        rows, prefix, q_len, seq = (jnp.where(keep, x, 0) for x in (rows, prefix, q_len, seq))
        keep_tok = b["valid_tok"] & keep[b["owner"]]
        tok = jnp.arange(ids.shape[0], dtype=jnp.int64)
        perm = jnp.argsort(jnp.where(keep_tok, 0, ids.shape[0]) + tok)
        ids, pos, exp_pos, expected = ids[perm], pos[perm], exp_pos[perm], expected[perm]
        slot = jnp.where(keep_tok[perm], slot[perm], -1)
    return kc.ForwardBatch(
        req_pool_indices=rows, prefix_lens=prefix, extend_seq_lens=q_len,
        all_ids_flat=zero, all_ids_offsets=jnp.concatenate([zero, jnp.cumsum(seq)]),
        input_ids=ids, positions=pos, out_cache_loc=slot, expected_input_tokens=expected,
        expected_input_positions=exp_pos)


# What TAIL reads of a pass's batch: the write's token arrays.
_TAIL_TOKENS = ("input_ids", "positions", "out_cache_loc", "expected_input_tokens",
                "expected_input_positions")


def _tail_tokens(batch, own: bool) -> dict:
    """A pass's batch as HEAD hands it to TAIL: the write's token arrays only (the rest is
    HEAD's: a value returned from a jit is materialized, read or not). ``own``: the pass over
    every request, whose ids and positions are the step's own arrays, which TAIL takes from its
    arguments (None here: a jit's input returned as is is copied out)."""
    return {f: None if own and f in ("input_ids", "positions") else getattr(batch, f)
            for f in _TAIL_TOKENS}


def _tail_batch(tokens: dict, input_ids, input_positions):
    """:func:`_tail_tokens`' arrays as the runtime's batch for ``tail`` (which reads only
    them; the other fields are placeholders)."""
    zero = jnp.zeros((1,), jnp.int64)
    own = {"input_ids": input_ids, "positions": input_positions}
    return kc.ForwardBatch(req_pool_indices=zero, prefix_lens=zero, extend_seq_lens=zero,
                           all_ids_flat=zero, all_ids_offsets=zero,
                           **{f: own[f] if tokens[f] is None else tokens[f]
                              for f in _TAIL_TOKENS})


def _passes(late, split: bool):
    """The request masks HEAD and TAIL run in turn: one pass over everyone; or, when a request
    reads slots another request of the step writes (vLLM hands out a block to a second request
    in the step that fills it), the writers first and the readers after, so that each verify
    sees the stamps of this step's writes (SGLang's verify runs before its write)."""
    if not split:
        return (None,)
    return (late == 0, late != 0)


def _first(tree):
    return jax.tree.map(lambda x: x[0], tree)


def _stack1(tree):
    return jax.tree.map(lambda x: x[None], tree)


def _no_lut():
    return jnp.zeros((1,), jnp.int64)  # the runtime's placeholder when there is no SWA group


def _k_dict(canary, local):
    """The runtime's KV of one shard: ``local`` is the canary layer's local block or, with a
    coverage window, ``(that block, every layer's local block)`` (:func:`kv_arg`): SGLang's
    fingerprint over the canary layer's K strips, and every layer's whole slot rows for the
    digest (fused layers: a row holds a slot's K and V)."""
    if not canary.coverage_window:
        return {"FULL": {"K": list(canary.layout.k_sources(local, canary.k_heads))}}
    block, layers = local
    return {"FULL": {"K": list(canary.layout.k_sources(block, canary.k_heads)),
                     "layers": {"KV": [canary.layout.row_sources(
                         b, per_row=digest_reads_rows(canary.implementation, b))
                         for b in layers]}}}


def kv_arg(canary: TpuInferenceCanary, kv_caches):
    """What a shard's TAIL or SWEEP reads of the runner's ``kv_caches``: the canary layer's
    array, and with a coverage window every layer's (a list of another length is refused:
    a layer left out would go unverified)."""
    if not canary.coverage_window:
        return kv_caches[canary.layer_index]
    if len(kv_caches) != canary.num_layers:
        raise ValueError(
            f"kv-canary tpu-inference: coverage_window {canary.coverage_window} digests every "
            f"layer's KV: the step has {len(kv_caches)} KV arrays, the canary was built over "
            f"{canary.num_layers}")
    return kv_caches[canary.layer_index], tuple(kv_caches)


def _shard_map(canary, fn, state, per_data, kv=None):
    """``fn(shard state, shard's data, local kv)`` once per shard (``kv`` None: ``fn(shard
    state, shard's data)``); its result (a state, or any pytree of per-shard values) stacked
    along the leading axis."""
    spec = P(canary.axes or None)
    dspec = P(canary.data_axes or None)
    data_specs = jax.tree.map(lambda _: dspec, per_data)
    if kv is None:
        return jax.shard_map(lambda st, data: _stack1(fn(_first(st), data)), mesh=canary.mesh,
                             in_specs=(spec, data_specs), out_specs=spec,
                             check_vma=False)(state, per_data)
    in_specs = (spec, data_specs, jax.tree.map(lambda _: canary.kv_spec, kv))

    def body(st, data, local):
        return _stack1(fn(_first(st), data, local))

    return jax.shard_map(body, mesh=canary.mesh, in_specs=in_specs, out_specs=spec,
                         check_vma=False)(state, per_data, kv)


def metadata(md):
    """What the canary reads of an ``AttentionMetadata``: ``(seq_lens, query_start_loc,
    block_tables, request_distribution)`` (its other fields, some static, stay out of the
    canary's jits)."""
    return (md.seq_lens, md.query_start_loc, md.block_tables, md.request_distribution)


def delta_step(canary: TpuInferenceCanary, pool, valid, delta: TokenDelta):
    """:func:`apply_delta` per shard: ``pool`` / ``valid`` the state's stacked
    ``expected_tokens`` / ``expected_valid_lens``, ``delta`` per data shard stacked. Its own jit
    in the guard, keyed by the delta's id bucket only (the step's jits take its rows)."""
    spec = P(canary.axes or None)
    dspec = P(canary.data_axes or None)

    def body(p, v, d):
        p, v = apply_delta(canary, p[0], v[0], d)
        return p[None], v[None]

    return jax.shard_map(body, mesh=canary.mesh,
                         in_specs=(spec, spec, jax.tree.map(lambda _: dspec, delta)),
                         out_specs=(spec, spec), check_vma=False)(pool, valid, delta)


def head_step(canary: TpuInferenceCanary, state, rows, md, input_ids, input_positions,
              late=None, split: bool = False, unwritten=None):
    """HEAD of a step, per shard, traceable under x64: returns ``(state, passes)``, ``passes``
    what :func:`tail_step` takes after the model. ``md``: :func:`metadata`'s four arrays.
    ``rows`` (with token checks): the step's :class:`TokenDelta` (per data shard stacked; its
    ids written with the step's own in one pass, :func:`_pool`), or its ``rows`` alone [data
    shards * max_reqs] (each batch row's pool row + 1), the delta applied already
    (:func:`delta_step`). ``late`` [data shards * max_reqs]: requests that
    read a slot another request of the step writes; ``split`` (static): whether any does.
    ``unwritten`` [data shards * blocks] (or None: every block read was written since the
    canary started): :func:`step_batch`'s, per data shard."""
    cfg = canary.config
    if late is None:
        late = jnp.zeros((canary.data_shards * canary.max_reqs,), jnp.int32)
    per_data = dict(md=tuple(md), ids=input_ids, pos=input_positions, rows=rows, late=late,
                    unwritten=unwritten)

    def head_fn(st, data):
        b = step_batch(canary, data["md"], data["ids"], data["pos"], data["unwritten"])
        expected_pool, expected = None, jnp.zeros(data["ids"].shape, jnp.int64)
        if canary.token_checks:
            delta = data["rows"] if isinstance(data["rows"], TokenDelta) else None
            st, expected_pool, expected = _pool(
                canary, st, b, data["rows"] if delta is None else delta.rows, data["ids"], delta)
        # Each pass's plans and batch, for its TAIL. The state keeps the last pass's plans, and
        # that pass carries none of its own: a plan returned twice (in the state and in the
        # passes) is copied on the way out, and TAIL's state then copied back in place (19
        # copies of the plan buffers a step, 23 us at bs 64 on an H100). TAIL takes HEAD's
        # batch as it is: the pool it was read from is the one TAIL would read (``head``
        # leaves an ``expected_pool`` caller's pool alone).
        passes = []
        keeps = _passes(data["late"], split)
        for i, keep in enumerate(keeps):
            batch = _canary_batch(b, data["ids"], data["pos"], expected, keep)
            # A request whose last read slot has no canary (0 in the table) starts a new chain.
            st = head(cfg, st, batch, b["table"], _no_lut(), expected_pool=expected_pool,
                      valid_lens=None if expected_pool is None else batch.extend_seq_lens
                      + batch.prefix_lens, fresh_chains=data["unwritten"] is not None)
            passes.append((st.plans if i < len(keeps) - 1 else None,
                           _tail_tokens(batch, own=keep is None)))
        return {"state": st, "plans": passes}

    both = _shard_map(canary, head_fn, state, per_data)
    return both["state"], both["plans"]


def tail_step(canary: TpuInferenceCanary, state, passes, kv, input_ids, input_positions):
    """TAIL of a step after the model, per shard, traceable under x64: ``passes`` from
    :func:`head_step`, ``kv`` what it reads of the model's new KV (:func:`kv_arg`),
    ``input_ids`` / ``input_positions`` the step's, as HEAD took them."""
    cfg = canary.config
    spec = P(canary.axes or None)
    dspec = P(canary.data_axes or None)

    def body(st, pl, local, ids, pos):
        st = _first(st)
        last = st.plans  # the last pass's (an earlier pass carries its own)
        for plans, tokens in _first(pl):
            st = tail(cfg, dataclasses.replace(st, plans=last if plans is None else plans),
                      _tail_batch(tokens, ids, pos), _no_lut(), _k_dict(canary, local))
        return _stack1(st)

    # The plans travel as per-shard values: stacked over every shard axis, not only the data
    # axes the other per-step arrays are split over.
    return jax.shard_map(body, mesh=canary.mesh,
                         in_specs=(spec, spec, jax.tree.map(lambda _: canary.kv_spec, kv),
                                   dspec, dspec),
                         out_specs=spec, check_vma=False)(state, passes, kv, input_ids,
                                                          input_positions)


def guarded_step(canary: TpuInferenceCanary, model, state, rows, md, input_ids,
                 input_positions, kv_caches, late=None, split: bool = False, unwritten=None):
    """HEAD -> ``model(kv_caches) -> out`` -> TAIL in one trace, under x64 (the model is traced
    under the caller's own setting: ``model`` enters it); ``out[0]`` is the new KV list. What
    the on-device decode loop runs in each iteration (the guard's normal steps run
    :func:`head_step`, the runner's own step and :func:`tail_step` as three jits). Arguments
    as :func:`head_step`'s (``md`` an ``AttentionMetadata``); returns ``(state, out)``."""
    state, passes = head_step(canary, state, rows, metadata(md), input_ids, input_positions,
                              late, split, unwritten)
    out = model(kv_caches)
    return tail_step(canary, state, passes, kv_arg(canary, list(out[0])), input_ids,
                     input_positions), out


def sweep_step(canary: TpuInferenceCanary, state, tables, rows, lengths, kv):
    """Verify cached prefixes against the TAIL buffers, per shard (``tables`` [data shards *
    (n + 1), ctx], ``rows`` / ``lengths`` [data shards * n], stacked per data shard; ``kv``:
    :func:`kv_arg` of the runner's KV), and with a coverage window the digest of every slot
    they hold."""
    cfg = canary.config
    n = canary.sweep_rows

    def fn(st, data, local):
        return kc.canary_sweep(cfg, st, rows_table=data["table"].reshape(n + 1, -1),
                               row_indices=data["rows"], lengths=data["lengths"],
                               kv=_k_dict(canary, local))

    per_data = dict(table=tables.reshape(-1), rows=rows, lengths=lengths)
    return _shard_map(canary, fn, state, per_data, kv)


# The decode loop carries the canary state inside its opaque ``kv_caches``, traced without
# 64-bit types: 64-bit leaves travel as int32 pairs.
_WIDE = (jnp.dtype(jnp.int64), jnp.dtype(jnp.uint64))


def pack_state(state) -> Any:
    """The state's 64-bit leaves as int32 ``[..., 2]`` (trace or call under x64)."""
    return jax.tree.map(lambda x: jax.lax.bitcast_convert_type(x, jnp.int32)
                        if x.dtype in _WIDE else x, state)


def unpack_state(packed, like) -> Any:
    """:func:`pack_state` undone, the dtypes taken from ``like`` (a state's abstract shape)."""
    return jax.tree.map(lambda x, ref: jax.lax.bitcast_convert_type(x, ref.dtype)
                        if ref.dtype in _WIDE else x, packed, like)


@functools.lru_cache(maxsize=None)
def state_shapes(canary: TpuInferenceCanary):
    """The abstract stacked state (shapes and dtypes), for :func:`unpack_state`."""
    with jax.enable_x64(True):
        one = jax.eval_shape(lambda: kc.init_state(canary.config))
    n = canary.num_shards
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct((n,) + x.shape, x.dtype), one)
