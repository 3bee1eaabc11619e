"""Floors for a verify that fingerprints real KV (a TAIL verify): plain Triton kernels over the
same bytes, in the same layout, with none of the canary's checks.

    python -m bench.strip_floor [--entries 140018] [--slot-bytes 4096] [--strip-bytes 256]
                                [--iters 30] [--out FILE]

Per entry, each kernel reads what the TAIL verify reads: the plan's slot (8 bytes; the other
three plan fields are read too, 24 bytes), the slot's canary row (32 bytes), its predecessor's row
(the previous entry's slot: a hit), and the slot's K strip (``--strip-bytes`` at the start of a
``--slot-bytes`` row: tpu-inference's layout puts a slot's 8 KV heads, K and V interleaved, in
one 4 KiB row at 8 heads x 128 x bf16, and SGLang's fingerprint reads head 0's K). The slots
are tpu-inference's: blocks of 16 slots, a request's blocks scattered over the cache, each
request's positions in order.

- ``gather``: the loads, XOR-folded (a load floor: every byte read once, nothing computed);
- ``chain``: the same loads, the strip folded as the verify folds it (``h = splitmix64(h ^ w)``
  per word, int64), its result stored (the floor of the fold: the loads and the serial chain);
- each at one entry a lane in one-warp programs of 32 entries (the verify's shape for such
  plans) and in 4-warp programs of 128;
- both again in CUDA C (cupy's NVRTC, where cupy is installed): the whole strip loaded in
  16-byte loads before the first word is folded, nothing masked, at 128 and 256 threads.

Device time per launch (``bench.timing``; the inputs rotate past the L2). Prints a table and
writes JSON with ``--out``. Needs a CUDA GPU, torch and triton (and cupy for the CUDA C rows).
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

M1, M2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB  # splitmix64's multipliers (uint64)


def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def floor_kernel(plan, canary, kv, out, n, SLOT_WORDS: tl.constexpr,
                     STRIP_WORDS: tl.constexpr, BLOCK: tl.constexpr, CHAIN: tl.constexpr,
                     M1C: tl.constexpr, M2C: tl.constexpr):
        pid = tl.program_id(0)
        k = pid * BLOCK + tl.arange(0, BLOCK)
        ok = k < n
        slot = tl.load(plan + 4 * k, mask=ok, other=0)
        epos = tl.load(plan + 4 * k + 1, mask=ok, other=0)
        prev = tl.load(plan + 4 * k + 2, mask=ok, other=0)
        etok = tl.load(plan + 4 * k + 3, mask=ok, other=0)
        acc = epos ^ etok
        for f in tl.static_range(4):
            acc ^= tl.load(canary + slot * 4 + f, mask=ok, other=0)
        p_ok = ok & (prev > 0)
        for f in tl.static_range(3):
            acc ^= tl.load(canary + prev * 4 + f, mask=p_ok, other=0)
        h = tl.zeros([BLOCK], tl.int64)
        base = slot * SLOT_WORDS
        if CHAIN:
            for w in tl.static_range(STRIP_WORDS):
                x = h ^ tl.load(kv + base + w, mask=ok, other=0)
                x = x.to(tl.uint64, bitcast=True)
                x = (x ^ (x >> 30)) * M1C
                x = (x ^ (x >> 27)) * M2C
                h = (x ^ (x >> 31)).to(tl.int64, bitcast=True)
        else:
            cols = tl.arange(0, 4)
            for w in tl.static_range(0, STRIP_WORDS, 4):
                tile = tl.load(kv + base[:, None] + (w + cols)[None, :], mask=ok[:, None],
                               other=0)
                h ^= tl.xor_sum(tile, 1)
        tl.store(out + k, acc ^ h, mask=ok)

    return floor_kernel


CUDA_SOURCE = r"""
// STRIP_WORDS (the strip's 8-byte words, a multiple of 2) is defined by _cuda_kernel.
extern "C" __global__ void strip_floor(const long long* plan, const unsigned long long* canary,
                                       const ulonglong2* kv, long long* out, int n,
                                       int slot_words, int chain) {
    int k = blockIdx.x * blockDim.x + threadIdx.x;
    if (k >= n) return;
    long long slot = plan[4 * k], epos = plan[4 * k + 1], prev = plan[4 * k + 2];
    unsigned long long acc = (unsigned long long)(epos ^ plan[4 * k + 3]);
    const ulonglong2* row = (const ulonglong2*)(canary + 4 * slot);
    ulonglong2 r0 = row[0], r1 = row[1];
    acc ^= r0.x ^ r0.y ^ r1.x ^ r1.y;
    if (prev > 0) {
        const unsigned long long* p = canary + 4 * prev;
        acc ^= p[0] ^ p[1] ^ p[2];
    }
    // The whole strip in flight at once (loads of 16 bytes), then folded.
    const ulonglong2* strip = kv + slot * (slot_words / 2);
    ulonglong2 w[STRIP_WORDS / 2];
    #pragma unroll
    for (int j = 0; j < STRIP_WORDS / 2; ++j) w[j] = strip[j];
    unsigned long long h = 0;
    if (chain) {
        #pragma unroll
        for (int j = 0; j < STRIP_WORDS; ++j) {
            unsigned long long x = h ^ ((j & 1) ? w[j >> 1].y : w[j >> 1].x);
            x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
            x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
            h = x ^ (x >> 31);
        }
    } else {
        #pragma unroll
        for (int j = 0; j < STRIP_WORDS / 2; ++j) h ^= w[j].x ^ w[j].y;
    }
    out[k] = (long long)(acc ^ h);
}
"""


def _cuda_kernel(strip_words: int):
    """The same loads in CUDA C (cupy's NVRTC): every word of the strip loaded before the
    first is folded, 16-byte loads, no masks, no checks."""
    import cupy

    return cupy.RawKernel(CUDA_SOURCE, "strip_floor",
                          options=(f"-DSTRIP_WORDS={strip_words}",))


def _slots(entries: int, rng) -> tuple[np.ndarray, int]:
    """tpu-inference's slots for ``entries`` cached tokens (and the cache's slot count):
    requests of 2,049-2,320 tokens in blocks of 16, the blocks shuffled over the cache (block 0
    is the null block)."""
    lens = []
    while sum(lens) < entries:
        lens.append(int(rng.integers(2049, 2321)))
    lens[-1] -= sum(lens) - entries
    blocks_needed = sum(-(-n // 16) for n in lens)
    order = rng.permutation(blocks_needed) + 1
    out, b = [], 0
    for n in lens:
        nb = -(-n // 16)
        blk = order[b:b + nb]
        b += nb
        pos = np.arange(n)
        out.append(blk[pos // 16] * 16 + pos % 16)
    return np.concatenate(out).astype(np.int64), (blocks_needed + 1) * 16


def run(entries: int, slot_bytes: int, strip_bytes: int, iters: int) -> list[dict]:
    import torch

    import triton
    from kvcanary_jax.bench import timing

    kernel = _kernels()
    rng = np.random.default_rng(0)
    slots, num_slots = _slots(entries, rng)
    prev = np.concatenate([[-1], slots[:-1]])
    plan = np.stack([slots, np.arange(entries), prev, rng.integers(0, 1 << 20, entries)], 1)
    dev = torch.device("cuda")
    per_set = entries * (32 + 32 + strip_bytes)
    sets = timing.num_sets(per_set)
    # One KV buffer (its strips are what matter; the rotated sets read different slots of it).
    kv = torch.randint(-(1 << 62), 1 << 62, (num_slots * sets * slot_bytes // 8,), dtype=torch.int64,
                       device=dev)
    canary = torch.randint(0, 1 << 30, (num_slots * sets * 4,), dtype=torch.int64, device=dev)
    plans = []
    for i in range(sets):  # each set's slots in its own share of the buffers
        shifted = plan.copy()
        shifted[:, 0] += num_slots * i
        shifted[:, 2] = np.where(prev >= 0, prev + num_slots * i, -1)
        plans.append(torch.as_tensor(shifted.reshape(-1), device=dev))
    out = torch.empty(entries, dtype=torch.int64, device=dev)
    rows = []
    for chain in (False, True):
        for block, warps in ((32, 1), (128, 4)):
            grid = (triton.cdiv(entries, block),)

            def call(i, block=block, warps=warps, chain=chain, grid=grid):
                kernel[grid](plans[i % sets], canary, kv, out, entries,
                             SLOT_WORDS=slot_bytes // 8, STRIP_WORDS=strip_bytes // 8,
                             BLOCK=block, CHAIN=chain, M1C=M1, M2C=M2, num_warps=warps)

            t = timing.device_time(call, torch.cuda.synchronize, iters=iters)
            byte_count = entries * (32 + 32 + strip_bytes)
            rows.append({"kernel": "chain" if chain else "gather", "block": block,
                         "num_warps": warps, "entries": entries, "bytes": byte_count,
                         "median_us": round(t["median_us"], 2),
                         "gb_per_s": round(byte_count / t["median_us"] / 1e3, 1)})
            print(f"{rows[-1]['kernel']:6s} block {block:4d} x {warps} warps: "
                  f"{t['median_us']:8.2f} us  {rows[-1]['gb_per_s']:7.1f} GB/s", flush=True)
    try:
        import cupy
    except ImportError:
        print("cupy not installed: no CUDA C rows", flush=True)
        return rows
    cuda = _cuda_kernel(strip_bytes // 8)
    cp = [cupy.from_dlpack(t) for t in plans]
    cp_canary, cp_kv, cp_out = (cupy.from_dlpack(t) for t in (canary, kv, out))
    for chain in (0, 1):
        for block in (128, 256):
            grid = (-(-entries // block),)

            def call(i, block=block, chain=chain, grid=grid):
                cuda(grid, (block,), (cp[i % sets], cp_canary, cp_kv, cp_out, np.int32(entries),
                                      np.int32(slot_bytes // 8), np.int32(chain)))

            t = timing.device_time(call, torch.cuda.synchronize, iters=iters)
            byte_count = entries * (32 + 32 + strip_bytes)
            rows.append({"kernel": ("chain" if chain else "gather") + " (CUDA C)",
                         "block": block, "num_warps": block // 32, "entries": entries,
                         "bytes": byte_count, "median_us": round(t["median_us"], 2),
                         "gb_per_s": round(byte_count / t["median_us"] / 1e3, 1)})
            print(f"{rows[-1]['kernel']:15s} block {block:4d}: {t['median_us']:8.2f} us  "
                  f"{rows[-1]['gb_per_s']:7.1f} GB/s", flush=True)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--entries", type=int, default=140018)
    p.add_argument("--slot-bytes", type=int, default=4096)
    p.add_argument("--strip-bytes", type=int, default=256)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    if a.entries < 1:
        p.error(f"--entries must be >= 1, got {a.entries}")
    if a.strip_bytes < 32 or a.strip_bytes % 32:
        p.error(f"--strip-bytes must be a positive multiple of 32 (the kernels load 4 words at "
                f"once), got {a.strip_bytes}")
    if a.slot_bytes % 16 or a.slot_bytes < a.strip_bytes:
        p.error(f"--slot-bytes must be a multiple of 16 and hold the strip (--strip-bytes "
                f"{a.strip_bytes}), got {a.slot_bytes}")
    from kvcanary_jax.bench import common

    rows = run(a.entries, a.slot_bytes, a.strip_bytes, a.iters)
    result = {"environment": common.environment(), "rows": rows}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
