"""A scripted life of requests through sglang-jax's own pools, allocator, radix cache and batch
builders (0.0.2 or 0.1.0rc0, whichever is installed: tests/_sglang_jax_compat.py), with the canary around every model step; then faults injected into the real pool
arrays and batch fields. Run as a script (it needs its own process: the CPU mesh is set through
XLA_FLAGS before JAX starts); prints one JSON document that tests/test_sglang_jax.py checks.

    python tests/_sglang_jax_life.py --page-size 1 --kv-write kernel
    python tests/_sglang_jax_life.py --page-size 4 --kv-write legacy --host-table
    python tests/_sglang_jax_life.py --page-size 4 --layout head --kv-write head
    python tests/_sglang_jax_life.py ... --tokens feed   (the ids kept on the device: TokenFeed)

What is sglang-jax's own code here: ``ReqToTokenPool``, ``MHATokenToKVPool`` (allocated on a
("data", "tensor") mesh of 2 CPU devices, sharded ``P(None, "tensor")``; 0.1.0rc0: its 5-D
layout, ``P("data", None, "tensor", None, None)``, and with ``--dp 2`` two DP ranks of one
device each, ``P("data", ...)`` over 2, every rank its own slots and batch segment), ``TokenToKVPoolAllocator``
/ ``PagedTokenToKVPoolAllocator``, ``RadixCache``, ``Req``, ``SamplingParams``, ``ScheduleBatch``
(``prepare_for_extend``, ``prepare_for_decode``, ``merge_batch``, ``filter_batch``,
``get_model_worker_batch``: input_ids, positions, out_cache_loc, cache_loc, lengths), the
scheduler's radix-cache calls (``init_next_round_input``, ``inc_lock_ref``,
``cache_unfinished_req``, ``cache_finished_req``), ``MockModelConfig``, ``ForwardBatch.init_new``,
and the KV write: ``MHATokenToKVPool.set_kv_buffer`` (``--kv-write kernel``: sglang-jax's TPU path,
its Pallas ``kv_cache_update`` kernel under ``shard_map``, run in TPU interpret mode on the CPU)
or ``set_kv_buffer_legacy`` (``--kv-write legacy``: the path its native attention backend takes
off TPU).

What is not, and why:
* jax 0.12 has no ``pltpu.TPUMemorySpace`` (the kernel's ``TPUMemorySpace.ANY`` is ``pl.ANY`` now):
  without help the kernel fails at trace time with ``AttributeError: module
  'jax.experimental.pallas.tpu' has no attribute 'TPUMemorySpace'``. This script gives the module
  that one name (``TPUMemorySpace.ANY = pl.ANY``) and runs the kernel unchanged.
* ``ForwardBatch.init_new(batch, model_runner)`` reads ``model_runner.mesh`` and
  ``model_runner.attn_backend`` only; it gets a namespace with the mesh and no backend (the stand-in
  model below does not attend). The real ``ModelRunner`` runs in tests/_sglang_jax_runner.py.
* The model: a stand-in whose K/V are a fixed function of (token, position, head, lane), written
  through the pool's own write path; it returns ``(logits, layers_kv_fused, None)`` as sglang-jax
  0.0.2's model does (0.1.0rc0: it takes the ``MemoryPools`` and returns ``(logits,
  {"token_to_kv_pool": layers}, None, None)``, as 0.1.0rc0's models do). Its "sampler" picks
  next tokens by a fixed rule.
* ``--layout head`` (0.0.2 only): a stand-in pool with 0.1.0rc0's layout, sharding and write
  (:class:`HeadLayoutPool`) inside 0.0.2's world; under 0.1.0rc0 the real pool has that layout.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import types

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=2").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import warnings  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402
from jax.experimental.pallas import tpu as pltpu  # noqa: E402

import _sglang_jax_compat as compat  # noqa: E402
from sgl_jax.srt.configs.model_config import MockModelConfig  # noqa: E402
from sgl_jax.srt.managers.schedule_batch import Req  # noqa: E402
from sgl_jax.srt.mem_cache.allocator import (  # noqa: E402
    PagedTokenToKVPoolAllocator,
    TokenToKVPoolAllocator,
)
from sgl_jax.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool  # noqa: E402
from sgl_jax.srt.mem_cache.radix_cache import RadixCache  # noqa: E402
from sgl_jax.srt.sampling.sampling_params import SamplingParams  # noqa: E402

from kvcanary_jax.integrations import sglang_jax as ksj  # noqa: E402

warnings.filterwarnings("ignore", message=".*donated buffers.*")

HEADS, HEAD_DIM, LAYERS, CONTEXT = 2, 128, 2, 40
MAX_BS, TOKENS, CACHE_LOC = 4, 32, 128


def kv_of(ids, pos, layer):
    """The stand-in model's K and V for tokens (ids, positions): [tokens, heads, head_dim] bf16."""
    base = (ids.astype(jnp.float32)[:, None, None] * 0.37 + pos.astype(jnp.float32)[:, None, None]
            * 1.31 + jnp.arange(HEADS, dtype=jnp.float32)[None, :, None] * 0.5
            + jnp.arange(HEAD_DIM, dtype=jnp.float32)[None, None, :] * 0.011 + layer)
    return jnp.sin(base).astype(jnp.bfloat16), jnp.cos(base).astype(jnp.bfloat16)


def step_layers(out) -> list:
    """The KV layers of a model step's output (either version's contract)."""
    return out[1]["token_to_kv_pool"] if compat.V01 else out[1]


def make_model_step(kv_write: str):
    """sglang-jax's model contract: write each layer's KV of ``out_cache_loc`` through the pool,
    return (output, layers_kv_fused, aux) (0.1.0rc0: take the ``MemoryPools``, return (output,
    {"token_to_kv_pool": layers}, flag, topk_ids)). ``kv_write``: "kernel" = ``set_kv_buffer``, the
    TPU path (its Pallas kernel, simulated in TPU interpret mode); "legacy" =
    ``set_kv_buffer_legacy``, the path its native attention backend takes off TPU; "head" = the
    HEAD-layout stand-in's write."""

    def model_step(forward_batch, pool):
        if compat.V01:
            pool = pool.token_to_kv_pool
        for layer in range(LAYERS):
            k, v = kv_of(forward_batch.input_ids, forward_batch.positions, layer)
            if kv_write == "legacy":
                pool.kv_buffer[layer] = pool.set_kv_buffer_legacy(
                    layer, forward_batch.out_cache_loc, k, v)
                continue
            if kv_write == "head":
                pool.set_kv_buffer(layer, forward_batch.out_cache_loc, k, v)
                continue
            if compat.V01:  # a model's K/V come sharded over tokens (data) and heads (tensor)
                spec = jax.sharding.NamedSharding(pool.mesh, jax.sharding.PartitionSpec(
                    "data", "tensor", None))
                k, v = jax.sharding.reshard(k, spec), jax.sharding.reshard(v, spec)
            # Only sglang-jax's kernel runs in TPU interpret mode; the canary's kernels, outside
            # this scope, run as they would on this machine.
            with pltpu.force_tpu_interpret_mode():
                pool.set_kv_buffer(layer, forward_batch.out_cache_loc, k, v,
                                   is_decode=forward_batch.forward_mode.is_decode())
        logits = jnp.zeros((forward_batch.input_ids.shape[0], 8), jnp.float32)
        if compat.V01:
            return logits, {"token_to_kv_pool": list(pool.kv_buffer)}, None, None
        return logits, list(pool.kv_buffer), None

    return model_step


@jax.tree_util.register_pytree_node_class
class HeadLayoutPool:
    """A KV pool in sglang-jax HEAD's layout, which cannot be installed here (it pins jax 0.10.2
    and is not on the registry): per layer ``[pages, page_size, heads * 2 // packing, packing,
    head_dim]``, sharded ``P("data", None, "tensor", None, None)``, written as HEAD's
    ``merge_kv`` + ``update_fused_kv_cache`` do (K and V interleaved per head, one slot per token,
    ``-1`` dropped). Only the layout and the write are HEAD's; everything else in the life is
    sglang-jax 0.0.2's."""

    def __init__(self, size, page_size, mesh, kv_buffer=None):
        self.size, self.page_size, self.mesh = size, page_size, mesh
        self.start_layer = 0
        packing = 2  # bf16
        shape = ((size + page_size) // page_size, page_size, HEADS * 2 // packing, packing,
                 HEAD_DIM)
        self.kv_sharding = jax.sharding.NamedSharding(
            mesh, jax.sharding.PartitionSpec("data", None, "tensor", None, None))
        if kv_buffer is None:
            kv_buffer = [jax.device_put(jnp.zeros(shape, jnp.bfloat16), self.kv_sharding)
                         for _ in range(LAYERS)]
        self.kv_buffer = kv_buffer

    def tree_flatten(self):
        return (self.kv_buffer,), (self.size, self.page_size, self.mesh)

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*aux, kv_buffer=children[0])

    def set_kv_buffer(self, layer, loc, k, v, is_decode=False):
        buf = self.kv_buffer[layer]
        fused = jnp.stack([k, v], axis=2).reshape(k.shape[0], -1)  # [tokens, K0 V0 K1 V1 ...]
        rows = buf.reshape(-1, fused.shape[1])
        rows = rows.at[jnp.where(loc < 0, rows.shape[0], loc)].set(fused, mode="drop")
        self.kv_buffer[layer] = rows.reshape(buf.shape)


class World:
    """sglang-jax's pools, allocator and radix cache, the canary, and one guarded model step."""

    def __init__(self, page_size: int, pool_size: int, layout: str, kv_write: str, tokens: str,
                 dp: int = 1, *, req_rows: int = 3, **canary_settings):
        """``canary_settings``: more :class:`SglangJaxCanary` fields (``coverage_window``,
        ``ring_capacity``); with a window the step hands the canary every layer."""
        self.page_size, self.dp = page_size, dp
        self.mesh = compat.mesh(jax.devices()[:2], dp=dp)
        # Three rows for four requests: R4 gets R1's row (a row another request held before).
        self.req_pool = ReqToTokenPool(size=req_rows * dp, max_context_len=CONTEXT)
        compat.prepare_req_pool(self.req_pool, CACHE_LOC)
        ranks = {"dp_size": dp} if dp > 1 else {}
        if layout == "pool":
            self.kv_pool = MHATokenToKVPool(size=pool_size * dp, page_size=page_size,
                                            dtype=jnp.bfloat16, head_num=HEADS, head_dim=HEAD_DIM,
                                            layer_num=LAYERS, mesh=self.mesh, **ranks)
        else:
            self.kv_pool = HeadLayoutPool(pool_size, page_size, self.mesh)
        # 0.1.0rc0's model step takes every pool in one MemoryPools pytree.
        self.pools = self.kv_pool
        if compat.V01:
            from sgl_jax.srt.mem_cache.memory_pool import MemoryPools

            self.pools = MemoryPools(token_to_kv_pool=self.kv_pool)
        if page_size == 1:
            self.allocator = TokenToKVPoolAllocator(size=pool_size * dp, kvcache=self.kv_pool,
                                                    **ranks)
        else:
            self.allocator = PagedTokenToKVPoolAllocator(size=pool_size * dp,
                                                         page_size=page_size,
                                                         kvcache=self.kv_pool, debug_mode=True,
                                                         **ranks)
        self.tree = RadixCache(self.req_pool, self.allocator, page_size=page_size,
                               kv_head_num=HEADS, head_dim=HEAD_DIM, layer_num=LAYERS,
                               max_seq_len=CONTEXT, dtype=jnp.bfloat16)
        self.model_config = MockModelConfig(num_heads=HEADS, head_dim=HEAD_DIM,
                                            num_kv_heads=HEADS, context_len=CONTEXT - 4,
                                            num_hidden_layers=LAYERS)
        self.model_config.vocab_size = 1000
        compat.prepare_model_config(self.model_config)
        self.runner = compat.runner_stand_in(self.mesh)
        self.canary = ksj.SglangJaxCanary.from_pools(self.req_pool, self.kv_pool, max_bs=MAX_BS,
                                                     k_heads=1,
                                                     incremental_tokens=tokens == "feed",
                                                     **canary_settings)
        self.feed = ksj.TokenFeed(self.canary) if tokens == "feed" else None
        self.state = self.canary.init_state()
        every = ({"kv_layers": lambda out, pool: step_layers(out)}
                 if self.canary.coverage_window else {})
        self.step_fn = ksj.guard_model_step(self.canary, make_model_step(kv_write),
                                            batch_argnum=0, pool_argnum=1,
                                            fused_kv=lambda out, pool: step_layers(out)[0],
                                            **every)
        self.log = []

    # -- sglang-jax's scheduler, the parts that touch pools and batches -----------------------

    def new_req(self, rid, prompt, max_new_tokens, dp_rank=0):
        params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
        params.normalize(None)  # as the tokenizer manager does (no stop strings here)
        ranked = {"dp_rank": dp_rank} if compat.V01 else {}
        req = Req(rid=rid, origin_input_text="", origin_input_ids=list(prompt),
                  sampling_params=params, **ranked)
        req.init_next_round_input(self.tree)
        self.tree.inc_lock_ref(req.last_node)
        return req

    def extend_batch(self, reqs):
        """An extend batch of ``reqs`` (with ``dp > 1``: ``reqs[d]`` on DP rank ``d``)."""
        batch = compat.schedule_batch(reqs if self.dp > 1 else [reqs], dp_size=self.dp, req_to_token_pool=self.req_pool,
                                      token_to_kv_pool_allocator=self.allocator,
                                      tree_cache=self.tree, model_config=self.model_config,
                                      enable_overlap=False, mesh=self.mesh)
        batch.prepare_for_extend()
        return batch

    def worker_batch(self, batch):
        mwb = batch.get_model_worker_batch([TOKENS], [MAX_BS], [CACHE_LOC], self.page_size)
        fb = compat.forward_batch(mwb, self.runner)  # replays keep fb past the next batch
        if self.feed is not None:  # only the ids the device lacks
            return mwb, fb, self.feed.delta(compat.reqs_per_dp(batch), mwb)
        ranks = [ksj.request_token_ids(reqs) for reqs in compat.reqs_per_dp(batch)]
        ids = ksj.expected_tokens(ranks if self.dp > 1 else ranks[0], mwb.seq_lens, CACHE_LOC,
                                  self.page_size, dp_size=self.dp)
        return mwb, fb, ids

    @staticmethod
    def next_tokens(reqs):
        return np.array([(7 * r.seqlen + 3 * int(r.rid)) % 997 + 1 for r in reqs], np.int32)

    def finish_step(self, batch, extend):
        """The scheduler's bookkeeping after a step: outputs appended, radix cache updated."""
        outs = []
        for reqs in compat.reqs_per_dp(batch):
            out = self.next_tokens(reqs)
            for req, tok in zip(reqs, out.tolist()):
                req.output_ids.append(tok)
                req.check_finished()
                if req.finished():
                    compat.release_finished(req, self.tree)
                elif extend:
                    self.tree.cache_unfinished_req(req)
            outs.append(out)
        compat.set_output_ids(batch, outs)

    # -- the guarded step ---------------------------------------------------------------------

    def run(self, fb, ids, *, state=None, kv=None, table=None):
        """One guarded model step; returns (state, fused buffers). Defaults: the live world."""
        state = self.state if state is None else state
        pool = self.pools if kv is None else _pool_with(self.pools, kv)
        with jax.set_mesh(self.mesh):
            state, out = self.step_fn(state, fb, pool, expected=ids, table=table)
        return state, step_layers(out)

    def live_step(self, name, batch, extend):
        mwb, fb, ids = self.worker_batch(batch)
        before = ksj.violation_counts(self.state)
        self.state, layers = self.run(fb, ids)
        self.kv_pool.kv_buffer = layers
        self.log.append({"step": name, "mode": "extend" if extend else "decode",
                         "bs": int(mwb.real_bs), "seq_lens": mwb.seq_lens.tolist(),
                         "rows": [r for r in mwb.req_pool_indices.tolist() if r >= 0],
                         "out_cache_loc": mwb.out_cache_loc.tolist(),
                         "new_violations": _dump(ksj.read_violations(self.state, start=before))})
        print(f"{name}: seq_lens {mwb.seq_lens.tolist()} out_cache_loc "
              f"{[x for x in mwb.out_cache_loc.tolist() if x >= 0]}", file=sys.stderr)
        self.finish_step(batch, extend)
        return mwb, fb, ids


def _pool_with(pool, kv):
    leaves, treedef = jax.tree.flatten(pool)
    return jax.tree.unflatten(treedef, list(kv) + leaves[len(kv):])


def _dump(violations):
    return [{"shard": sv.shard, "tag": sv.violation.tag, "slot": sv.violation.slot,
             "position": sv.violation.position, "token": sv.violation.stored_token,
             "expected_token": sv.violation.expected_token,
             "reasons": list(sv.violation.reasons)} for sv in violations]


def _copy(tree):
    """A copy in buffers of its own, finished before this returns: a snapshot that the steps
    dispatched next, which donate the state and KV it was taken from, can never consume. (The
    forward batches replayed are kept apart from the next batch by compat.forward_batch.)"""
    out = jax.tree.map(lambda x: jax.device_put(x, may_alias=False), tree)
    jax.block_until_ready(out)
    return out


def _slot_rows(buf):
    """Either layout, on the host, as [slots, heads * 2, head_dim] uint16 words (both are
    row-major slot rows). Faults are made on the host and put back with the buffer's sharding:
    0.1.0rc0's Explicit mesh refuses eager reshapes of a sharded buffer."""
    words = np.asarray(jax.device_get(buf)).view(np.uint16)
    return words.reshape(-1, 2 * HEADS, HEAD_DIM)


def _put_rows(rows, buf):
    return jax.device_put(rows.view(jnp.bfloat16).reshape(buf.shape), buf.sharding)


def _flip_byte(buf, slot, head_row, byte):
    """Flip one bit of byte ``byte`` of row ``head_row`` (a combined K/V head) of ``slot``."""
    words = _slot_rows(buf).copy()
    i, shift = byte // 2, 8 * (byte % 2)
    words[slot, head_row, i] ^= np.uint16(1 << shift)
    return _put_rows(words, buf)


def main(page_size: int, layout: str, kv_write: str, host_table: bool, tokens: str):
    pool_size = 36 if page_size == 1 else 40
    w = World(page_size, pool_size, layout, kv_write, tokens)
    report = {"page_size": page_size, "layout": layout, "kv_write": kv_write, "tokens": tokens,
              "num_shards": w.canary.num_shards,
              "kv_shape": list(w.kv_pool.kv_buffer[0].shape),
              "kv_spec": str(w.kv_pool.kv_buffer[0].sharding.spec)}

    # R1, R2 prefill together, then three decode steps; R1 then finishes (its prompt and output
    # stay in the radix cache).
    r1 = w.new_req("1", [11, 12, 13, 14, 15, 16, 17, 18], max_new_tokens=4)
    r2 = w.new_req("2", [21, 22, 23, 24, 25], max_new_tokens=7)
    running = w.extend_batch([r1, r2])
    w.live_step("prefill r1 r2", running, extend=True)
    r2_row = r2.req_pool_idx  # 0.1.0rc0 clears it when the row is freed
    for i in range(3):
        running.prepare_for_decode()
        w.live_step(f"decode {i}", running, extend=False)
    assert r1.finished() and not r2.finished()
    running.filter_batch()

    # R3 shares R1's first 8 tokens: a prefix-cache hit (its prefix slots are R1's).
    r3 = w.new_req("3", [11, 12, 13, 14, 15, 16, 17, 18, 31, 32, 33], max_new_tokens=8)
    report["r3_prefix_len"] = len(r3.prefix_indices)
    new = w.extend_batch([r3])
    w.live_step("prefill r3 (prefix hit)", new, extend=True)
    running.merge_batch(new)
    for i in range(3):
        running.prepare_for_decode()
        w.live_step(f"decode r2 r3 {i}", running, extend=False)
    assert r2.finished()
    running.filter_batch()

    # R4 needs more slots than are free: the allocator evicts R2's cached tokens from the radix
    # cache and hands their slots out again.
    freed_before = set(np.asarray(w.req_pool.req_to_token[r2_row, :12]).tolist())
    r4 = w.new_req("4", list(range(41, 41 + 13)), max_new_tokens=8)
    new = w.extend_batch([r4])
    w.live_step("prefill r4 (reused slots)", new, extend=True)
    r4_slots = np.asarray(w.req_pool.req_to_token[r4.req_pool_idx, :13]).tolist()
    report["r4_reused_slots"] = sorted(set(r4_slots) & freed_before)
    running.merge_batch(new)
    running.prepare_for_decode()
    w.live_step("decode r3 r4 0", running, extend=False)

    # Radix-cache sweep, clean.
    before = ksj.violation_counts(w.state)
    prefixes = ksj.radix_prefixes(w.tree)
    w.state = ksj.sweep(w.canary, w.state, w.kv_pool.kv_buffer[0], prefixes)
    report["sweep_clean"] = _dump(ksj.read_violations(w.state, start=before))
    report["sweep_prefixes"] = [p.tolist() for p in prefixes]

    # The step every fault is replayed on (and the one after it, for faults seen a step late).
    running.prepare_for_decode()
    mwb_a, fb_a, ids_a = w.worker_batch(running)
    snapshot = (_copy(w.state), _copy(w.kv_pool.kv_buffer))
    report["replay_step"] = {"seq_lens": mwb_a.seq_lens.tolist(),
                             "out_cache_loc": mwb_a.out_cache_loc.tolist(),
                             "positions": mwb_a.positions.tolist()}
    table_r3 = w.req_pool.req_to_token[r3.req_pool_idx].tolist()
    table_r4 = w.req_pool.req_to_token[r4.req_pool_idx].tolist()
    report["r3_slots"] = table_r3[: int(mwb_a.seq_lens[0])]
    report["r4_slots"] = table_r4[: int(mwb_a.seq_lens[1])]
    w.live_step("decode r3 r4 1", running, extend=False)  # the live world goes on, clean
    running.prepare_for_decode()
    mwb_b, fb_b, ids_b = w.worker_batch(running)

    def replay(name, *, kv_fault=None, fb=fb_a, then_next=False, table=None):
        state, kv = _copy(snapshot[0]), _copy(snapshot[1])
        if kv_fault is not None:
            kv = kv_fault(kv)
        state, kv = w.run(fb, ids_a, state=state, kv=kv, table=table)
        found = _dump(ksj.read_violations(state))
        entry = {"fault": name, "step": found}
        if then_next:
            before = ksj.violation_counts(state)
            state, kv = w.run(fb_b, ids_b, state=state, kv=kv)
            entry["next_step"] = _dump(ksj.read_violations(state, start=before))
        return entry

    def with_field(fb, name, values):
        arr = getattr(fb, name)
        new = jax.device_put(jnp.asarray(np.asarray(values, np.asarray(arr).dtype)), arr.sharding)
        leaves, treedef = jax.tree.flatten(fb)
        out = jax.tree.unflatten(treedef, leaves)
        setattr(out, name, new)
        return out

    faults = []
    faults.append(replay("clean replay"))
    if host_table:  # plans from the host req_to_token instead of cache_loc (one more compile)
        faults.append(replay("clean replay, host req_to_token table",
                             table=ksj.host_table(w.req_pool.req_to_token,
                                                  mwb_a.req_pool_indices, mwb_a.seq_lens,
                                                  CONTEXT)))

    # 1. A flipped K byte in a cached slot of R3, head 0 (shard 0) and head 1 (shard 1).
    p = 3
    s = report["r3_slots"][p]
    report["flip"] = {"slot": s, "position": p}
    faults.append(replay("flip K byte head 0",
                         kv_fault=lambda kv: [_flip_byte(kv[0], s, 0, 5)] + kv[1:]))
    faults.append(replay("flip K byte head 1",
                         kv_fault=lambda kv: [_flip_byte(kv[0], s, 2, 100)] + kv[1:]))
    if host_table:
        faults.append(replay("flip K byte head 0, host req_to_token table",
                             kv_fault=lambda kv: [_flip_byte(kv[0], s, 0, 5)] + kv[1:],
                             table=ksj.host_table(w.req_pool.req_to_token,
                                                  mwb_a.req_pool_indices, mwb_a.seq_lens,
                                                  CONTEXT)))

    # 2. A stale cache_loc entry: R3's position 5 points at a slot R2 used to hold (now R4's).
    cache_loc = np.asarray(fb_a.cache_loc).copy()
    stale_pos = 5
    stale_slot = report["r4_reused_slots"][0]
    cache_loc[stale_pos] = stale_slot  # R3's segment starts at 0
    report["stale"] = {"position": stale_pos, "slot": stale_slot,
                       "right_slot": report["r3_slots"][stale_pos]}
    faults.append(replay("stale cache_loc entry", fb=with_field(fb_a, "cache_loc", cache_loc)))

    # 3. Two cached slots of R3 swap their KV bytes (every head, every layer).
    sa, sb = report["r3_slots"][1], report["r3_slots"][9]
    report["swap"] = {"slots": [sa, sb], "positions": [1, 9]}

    def swap(kv):
        out = []
        for buf in kv:
            rows = _slot_rows(buf).copy()
            rows[[sa, sb]] = rows[[sb, sa]]
            out.append(_put_rows(rows, buf))
        return out

    faults.append(replay("swap two slots", kv_fault=swap))

    # 4. R4's new token is written into a slot R3 still reads (R3's position 2).
    out_loc = np.asarray(fb_a.out_cache_loc).copy()
    victim = report["r3_slots"][2]
    report["overwrite"] = {"slot": victim, "position": 2, "r4_position": int(mwb_a.positions[1]),
                           "r4_slot": int(out_loc[1])}
    out_loc[1] = victim
    faults.append(replay("write into a slot another request reads",
                         fb=with_field(fb_a, "out_cache_loc", out_loc)))

    # 5. R4's new token is written to slot 0 (the padding slot): seen one step later.
    out_loc = np.asarray(fb_a.out_cache_loc).copy()
    report["slot0"] = {"r4_position": int(mwb_a.positions[1]), "r4_slot": int(out_loc[1]),
                       "r4_next_slot": int(mwb_b.out_cache_loc[1])}
    out_loc[1] = 0
    faults.append(replay("write to slot 0", fb=with_field(fb_a, "out_cache_loc", out_loc),
                         then_next=True))

    # 6. R4's input id this step is not the one its history holds (the write's input check:
    # the expected id comes from the request's history, whole or kept on the device).
    ids_in = np.asarray(fb_a.input_ids).copy()
    report["wrong_input"] = {"r4_slot": int(mwb_a.out_cache_loc[1]),
                             "r4_position": int(mwb_a.positions[1]),
                             "right_token": int(ids_in[1]), "token": int(ids_in[1]) + 1}
    ids_in[1] += 1
    faults.append(replay("input id not the request's", fb=with_field(fb_a, "input_ids", ids_in)))

    # 7. A flipped K byte in a slot the radix cache holds, found by the sweep between steps.
    target, pos = int(prefixes[0][4]), 4
    state, kv = _copy(w.state), _copy(w.kv_pool.kv_buffer)
    before = ksj.violation_counts(state)
    state = ksj.sweep(w.canary, state, _flip_byte(kv[0], target, 0, 9), prefixes)
    report["sweep_fault"] = {"slot": target, "position": pos,
                             "found": _dump(ksj.read_violations(state, start=before))}

    report["faults"] = faults
    report["life"] = w.log
    report["total_violations_live"] = ksj.violation_counts(w.state).tolist()
    json.dump(report, sys.stdout)


if __name__ == "__main__":
    if not hasattr(pltpu, "TPUMemorySpace"):
        pltpu.TPUMemorySpace = types.SimpleNamespace(ANY=pl.ANY)
    parser = argparse.ArgumentParser()
    parser.add_argument("--page-size", type=int, default=1)
    parser.add_argument("--layout", choices=("pool", "head"), default="pool")
    parser.add_argument("--kv-write", choices=("kernel", "legacy", "head"), default="kernel")
    parser.add_argument("--host-table", action="store_true")
    parser.add_argument("--tokens", choices=("full", "feed"), default="full")
    args = parser.parse_args()
    main(args.page_size, args.layout, args.kv_write, args.host_table, args.tokens)
