"""HiCache through sglang-jax 0.1.0rc0's own ``LRUHostKVPool`` and ``HiCacheController``, with
the canary's :class:`~kvcanary_jax.integrations.sglang_jax.HiCacheHook` (run as a script: the
2-device CPU mesh is set before JAX starts; prints one JSON document that
tests/test_sglang_jax_01.py checks).

The world of tests/_sglang_jax_life.py (page size 4, its pools, allocator, radix cache, requests
and batches, the canary around every step). R1 and R2 prefill and decode; then R1's first two
pages are backed up to host memory through the controller (``write``, as
``UnifiedRadixCache.write_backup`` does), loaded back into two other device pages (``load``, as
``load_back``'s stage + flush), and R1's ``req_to_token`` row is pointed at them, the old pages
zeroed and freed: R1 reads its prefix from the reloaded pages from the next step on (the steps of
``UnifiedRadixCache``'s load-back, driven by hand: its tree is not the life's ``RadixCache``).
Scenarios, each in a world of its own:

* ``intact``: the hook installed, the page reloaded as it was backed up;
* ``corrupted``: the hook installed, one K byte of the canary layer flipped in host memory (the
  host pool's copy of the page) before the load;
* ``no hook``: the page reloaded intact without the hook (the canary rows stay behind);
* ``dp intact`` / ``dp corrupted``: the same on DP rank 1 of two (the controller's global page
  ids, ``rank * pages_per_rank + local``; rank 1's canary);
* ``coverage intact`` / ``coverage corrupted`` / ``coverage dp corrupted``: the canary with a
  coverage window of 2 (every layer digested), the byte flipped in host memory in layer 1's V
  strip of head 1 (bytes SGLang's layer-0 K fingerprint never reads): the page's digests travel
  with it, so the reloaded slots are checked (the report's share stays 1) and the flip is
  reported by the digest check of the shard holding head 1, within the window.
"""

from __future__ import annotations

import json
import os
import sys
import types

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(_HERE), _HERE]

import _sglang_jax_life as life  # noqa: E402  (sets the 2-device mesh before JAX starts)
import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402
from jax.experimental.pallas import tpu as pltpu  # noqa: E402
from sgl_jax.srt.mem_cache.hicache_controller import HiCacheController  # noqa: E402
from sgl_jax.srt.mem_cache.host_kv_pool import LRUHostKVPool  # noqa: E402

from kvcanary_jax.integrations import sglang_jax as ksj  # noqa: E402

PAGE = 4


def _flip_host_byte(host_pool, host_id: int, slot_in_page: int, layer: int = 0,
                    row: int = 0) -> None:
    """One bit of element 5 of fused row ``row`` (``2h``: K of head ``h``, ``2h + 1``: its V) of
    ``layer``, in the host pool's copy of a page (its packed ``(layers, page_size,
    2H/packing, packing, head_dim)`` array)."""
    packed = host_pool._slots[host_id]  # sglang-jax's host memory itself: the fault goes there
    words = np.asarray(jax.device_get(packed)).view(np.uint16).copy()
    packing = words.shape[3]
    words[layer, slot_in_page, row // packing, row % packing, 5] ^= np.uint16(0x0100)
    host_pool._slots[host_id] = jax.device_put(words.view(packed.dtype), packed.sharding)


def scenario(hooked: bool, corrupt: bool, dp: int = 1, window: int = 0) -> dict:
    # With DP the KV is written by the pool's kernel (per rank, under shard_map over data).
    w = life.World(page_size=PAGE, pool_size=40, layout="pool",
                   kv_write="legacy" if dp == 1 else "kernel", tokens="feed", dp=dp,
                   coverage_window=window)
    rank = dp - 1  # R1 on the last rank
    per_rank_pages = w.kv_pool.kv_buffer[0].shape[0] // dp
    pool = w.kv_pool
    host_pool = LRUHostKVPool(device_pool=pool, pool_size=8, page_size=PAGE,
                              layer_num=life.LAYERS,
                              per_layer_shape=tuple(int(d) for d in pool.kv_buffer[0].shape[1:]),
                              dtype=pool.dtype, mesh=w.mesh,
                              partition_spec=pool.kv_sharding.spec)
    controller = HiCacheController(host_pool, pool)
    hook = ksj.HiCacheHook(w, controller) if hooked else None

    r1 = w.new_req("1", [11, 12, 13, 14, 15, 16, 17, 18], max_new_tokens=8, dp_rank=rank)
    r2 = w.new_req("2", [21, 22, 23, 24, 25], max_new_tokens=8)
    running = w.extend_batch([r1, r2] if dp == 1 else [[r2], [r1]])
    w.live_step("prefill r1 r2", running, extend=True)
    for i in range(2):
        running.prepare_for_decode()
        w.live_step(f"decode {i}", running, extend=False)

    # Backup: R1's first two pages to host memory, through the controller.
    row = r1.req_pool_idx
    old_slots = np.asarray(w.req_pool.req_to_token[row, :2 * PAGE]).copy()
    old_pages = [rank * per_rank_pages + int(p) for p in old_slots[::PAGE] // PAGE]
    host_ids = [int(h) for h in host_pool.alloc(2)]
    controller.write(old_pages, host_ids)
    controller.drain_pending()
    out = {"old_pages": old_pages, "host_ids": host_ids,
           "rows_backed_up": sorted(hook.host_rows) if hook else []}

    # Load-back into two other pages; R1's prefix now reads them, the old pages are gone.
    new_slots = np.asarray(w.allocator.alloc(2 * PAGE, dp_rank=rank))
    new_pages = [rank * per_rank_pages + int(p) for p in new_slots[::PAGE] // PAGE]
    if corrupt:
        # R1's position 6 (page 1, slot 2): K of head 0 in the canary layer, or with a window
        # layer 1's V of head 1.
        _flip_host_byte(host_pool, host_ids[1], 2, *((1, 3) if window else (0, 0)))
    with pltpu.force_tpu_interpret_mode():  # write_kv_layer's Pallas kernel, on the CPU
        controller.load(host_ids, new_pages)
    w.req_pool.req_to_token[row, :2 * PAGE] = new_slots
    rows = rank * per_rank_pages * PAGE + old_slots  # the buffer's rows are global
    w.kv_pool.kv_buffer = [_zero_slots(b, rows) for b in w.kv_pool.kv_buffer]
    w.allocator.free(old_slots, dp_rank=rank)
    out.update(new_pages=new_pages, new_slots=new_slots.tolist(), corrupt_position=6,
               corrupt_slot=int(new_slots[6]))

    # R1 reads its prefix from the reloaded pages.
    before = len(w.log)
    for i in range(2):
        running.prepare_for_decode()
        w.live_step(f"decode after the load {i}", running, extend=False)
    out["after_load"] = [v for step in w.log[before:] for v in step["new_violations"]]
    out["before_load"] = [v for step in w.log[:before] for v in step["new_violations"]]
    if window:  # the coverage report of the state now, through the manager
        manager = ksj.canary_manager(w.canary, "log", sweep_interval=8)
        ksj.observe(manager, w.canary, w.state)
        cov = ksj.coverage(manager, w.canary)
        out["coverage"] = {"live": cov.live_bytes, "verified": cov.verified_bytes,
                           "read": cov.read_bytes}
    if hook is not None:
        controller.evict_callback(host_ids)
        out["rows_after_evict"] = sorted(hook.host_rows)
        hook.uninstall()
    controller.shutdown()
    return out


def _zero_slots(buf, slots):
    rows = life._slot_rows(buf).copy()
    rows[np.asarray(slots)] = 0
    return life._put_rows(rows, buf)


if __name__ == "__main__":
    if not hasattr(pltpu, "TPUMemorySpace"):
        pltpu.TPUMemorySpace = types.SimpleNamespace(ANY=pl.ANY)
    json.dump({"intact": scenario(hooked=True, corrupt=False),
               "corrupted": scenario(hooked=True, corrupt=True),
               "no hook": scenario(hooked=False, corrupt=False),
               "dp intact": scenario(hooked=True, corrupt=False, dp=2),
               "dp corrupted": scenario(hooked=True, corrupt=True, dp=2),
               "coverage intact": scenario(hooked=True, corrupt=False, window=2),
               "coverage corrupted": scenario(hooked=True, corrupt=True, window=2),
               "coverage dp corrupted": scenario(hooked=True, corrupt=True, dp=2, window=2)},
              sys.stdout)
