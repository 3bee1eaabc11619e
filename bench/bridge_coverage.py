"""The device time of covering every layer's K and V of a KV pool through the torch bridge: our KV
digest's launchers (``launch_kv_digest_write`` / ``launch_kv_digest_verify``, docs/spec.md §16)
against SGLang 0.5.23's own kernels given the same coverage, every layer passed as real-KV sources.

    python -m bench.bridge_coverage [--smoke] [--iters N] [--windows 1,64] [--out DIR]

The pool is SGLang's ``MHATokenToKVPool`` layout: per layer a bf16 ``[2, slots, heads, head_dim]``
allocation whose halves are ``k_buffer[layer]`` and ``v_buffer[layer]``; every half, as rows of
bytes, is one source (32 layers of 8 heads of 128: 64 sources of 2 KiB, 128 KiB a slot; and a
4-layer pool). A decode step of ``bs`` requests with ``ctx`` cached tokens each:

* **SGLang**: its launchers take at most 4 real-KV sources (``MAX_REAL_KV_SOURCES``), so the
  layers go in chunks of 4 sources, each chunk a canary buffer of its own in ALL mode (every byte
  of its sources folded into each slot's record): per step, one ``launch_canary_verify_kernel``
  per chunk over the decode plan's ``bs * ctx`` entries (every entry every step: a window of 1)
  and one ``launch_canary_write_kernel`` per chunk for the ``bs`` new tokens. Its CUDA kernels on
  a GPU, its torch references on CPU.
* **ours**: one ``launch_kv_digest_verify`` of the same entries at a window (1: the same
  coverage, every entry every step; 64: the coverage mode's, each entry checked once in 64 steps,
  the phase moving each call) and one ``launch_kv_digest_write`` of the new tokens, every source
  in one launch (the direct Triton path on a GPU, DLPack elsewhere).

Both sides read the same pool; their state is set up clean (SGLang's records and our digests of
every cached slot written first), and each case checks after timing that a clean step reports
nothing on either side and that one flipped bit of the last layer's V of a cached slot is
reported by both. Device time: ``bench/timing.py`` (CUPTI on a GPU: every kernel a step launches,
the torch ops around it included). The byte floor: the KV bytes a step must read at the
device's copy bandwidth (``timing.copy_bandwidth_gbs``). Without a GPU (or ``--smoke``): tiny
shapes, wall-clock timing.

Results: ``DIR/bridge_coverage.json`` and a table on stdout.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch

import kvcanary_jax.bridge as bridge
from kvcanary_jax import consts
from kvcanary_jax.bench import timing

CASES = [dict(bs=8, ctx=512), dict(bs=64, ctx=2048)]
MODELS = [dict(layers=32, heads=8, head_dim=128), dict(layers=4, heads=8, head_dim=128)]
# Three layers: six sources, a full chunk of SGLang's four and a partial one.
SMOKE_CASES = [dict(bs=2, ctx=16)]
SMOKE_MODELS = [dict(layers=3, heads=1, head_dim=16)]
WINDOWS = (1, 64)
SMOKE_WINDOWS = (1, 4)
RING = 1024
CHUNK = consts.MAX_REAL_KV_SOURCES  # SGLang's sources per launch


def _i64(x, device):
    return torch.as_tensor(x, dtype=torch.int64).to(device)


def _i32(x, device):
    return torch.tensor([int(x)], dtype=torch.int32, device=device)


def make_case(*, device, bs: int, ctx: int, layers: int, heads: int, head_dim: int, sgl,
              seed: int = 0) -> dict:
    """The pool, both sides' sources and state (set up clean), the decode step's plans and
    tokens. ``sgl``: SGLang's kernel modules (:func:`kvcanary_jax.oracle.load`)."""
    device = torch.device(device)
    g = torch.Generator().manual_seed(seed)
    width = ctx + 1
    num_slots = bs * width + 1
    rtt = torch.cat([torch.zeros(1, width, dtype=torch.int32),
                     (torch.randperm(bs * width, generator=g) + 1).to(torch.int32)
                     .view(bs, width)]).to(device)
    pool = []
    for _ in range(layers):
        bits = torch.randint(-2**15, 2**15, (2, num_slots, heads, head_dim), dtype=torch.int16,
                             generator=g) if device.type == "cpu" else torch.randint(
            -2**15, 2**15, (2, num_slots, heads, head_dim), dtype=torch.int16, device=device)
        pool.append(bits.to(device).view(torch.bfloat16))
    halves = [t for f in pool for t in (f[0], f[1])]  # K_0, V_0, K_1, ...
    row = heads * head_dim * 2
    rows = [t.view(torch.uint8).view(num_slots, -1) for t in halves]
    ours_src = tuple(bridge.RealKvSource(tensor=r, page_size=1, num_bytes_per_token=row,
                                         read_bytes=row) for r in rows)
    sgl_src = [sgl.verify.RealKvSource(tensor=r, page_size=1, num_bytes_per_token=row,
                                       read_bytes=row) for r in rows]
    rpi = torch.arange(1, bs + 1, dtype=torch.int64, device=device)
    tokens = torch.randint(1, 50000, (bs, width), generator=g).to(device)

    def plans(prefix, extend):
        vp = bridge.VerifyPlan.allocate(verify_capacity=max(1, bs * prefix), device=device)
        wp = bridge.WritePlan.allocate(write_req_capacity=bs, device=device)
        bridge.launch_canary_plan_kernels(
            verify_plan_out=vp, write_plan_out=wp, req_pool_indices=rpi,
            prefix_lens=torch.full((bs,), prefix, dtype=torch.int64, device=device),
            extend_seq_lens=torch.full((bs,), extend, dtype=torch.int64, device=device),
            req_to_token=rtt, swa_window_size=0, full_to_swa_index_mapping=None,
            verify_capacity=int(vp.verify_slot_indices.shape[0]),
            req_to_verify_expected_tokens=None, req_to_verify_expected_tokens_valid_lens=None,
            kv_token_id_vs_position_offset=0)
        return vp, wp

    def step_tokens(start, n):
        return dict(input_ids=tokens[:, start:start + n].reshape(-1).contiguous(),
                    positions=torch.arange(start, start + n, device=device).repeat(bs),
                    out_cache_loc=rtt[1:, start:start + n].reshape(-1).to(torch.int64))

    prefill_vp, prefill_wp = plans(0, ctx)
    decode_vp, decode_wp = plans(ctx, 1)
    contexts = []
    for c in range(0, len(sgl_src), CHUNK):
        contexts.append(sgl.verify.VerifyOrWriteContext(
            canary_buf=torch.zeros(num_slots, consts.CANARY_SLOT_BYTES, dtype=torch.uint8,
                                   device=device),
            kernel_kind=sgl.verify.CanaryLaunchTag.TAIL_K_FULL,
            violation_ring=torch.zeros(RING, consts.VIOLATION_FIELDS, dtype=torch.int64,
                                       device=device),
            violation_write_index=torch.zeros(1, dtype=torch.int32, device=device),
            slot_run_counter=torch.zeros(1, dtype=torch.int64, device=device),
            kernel_run_counter=torch.zeros(1, dtype=torch.int64, device=device),
            real_kv_sources=tuple(sgl_src[c:c + CHUNK]),
            real_kv_hash_mode=sgl.consts.RealKvHashMode.ALL,
            enable_chain_position_assert=torch.ones(1, dtype=torch.int32, device=device)))
    digest = bridge.DigestContext.allocate(num_slots=num_slots, device=device,
                                           kernel_kind=int(consts.CanaryLaunchTag.TAIL_K_FULL),
                                           ring_capacity=RING)
    case = dict(device=device, bs=bs, ctx=ctx, layers=layers, num_slots=num_slots,
                slot_bytes=row * len(rows), rows=rows, ours_src=ours_src, contexts=contexts,
                digest=digest, decode_vp=decode_vp, decode_wp=decode_wp,
                decode=step_tokens(ctx, 1), sgl=sgl)
    # Clean state: SGLang's records and our digests of every cached slot.
    prefill = step_tokens(0, ctx)
    for context in contexts:
        sgl_write(sgl, context, prefill_wp, prefill)
    bridge.launch_kv_digest_write(digest_buf=digest.digest_buf, slots=prefill["out_cache_loc"],
                                  sources=ours_src)
    return case


def sgl_write(sgl, context, plan, toks) -> None:
    sgl.write.launch_canary_write_kernel(
        context=context, plan=plan, enable_write_input_assert=False, expected_input_tokens=None,
        expected_input_positions=None, **toks)


def sgl_verify(sgl, context, plan) -> None:
    sgl.verify.launch_canary_verify_kernel(context=context, plan=plan,
                                           check_verify_expected_token=False)


def _phases(window, device):
    return [_i32(p, device) for p in range(window)]


def _ours_verify(c, window, phases, i) -> None:
    vp = c["decode_vp"]
    bridge.launch_kv_digest_verify(
        context=c["digest"], slots=vp.verify_slot_indices,
        positions=vp.verify_expected_positions, num_valid=vp.verify_num_valid,
        phase=phases[i % window], window=window, sources=c["ours_src"])


def _ours_write(c) -> None:
    bridge.launch_kv_digest_write(digest_buf=c["digest"].digest_buf,
                                  slots=c["decode"]["out_cache_loc"], sources=c["ours_src"])


def _sgl_step(c, *, verify=True, write=True) -> None:
    for context in c["contexts"]:
        if verify:
            sgl_verify(c["sgl"], context, c["decode_vp"])
        if write:
            sgl_write(c["sgl"], context, c["decode_wp"], c["decode"])


def _violations(c) -> tuple[int, int]:
    """(our rows, SGLang's rows) so far."""
    return (int(c["digest"].violation_write_index[0]),
            sum(int(x.violation_write_index[0]) for x in c["contexts"]))


def _check(c, sync) -> dict:
    """After timing: a clean step reports nothing on either side; one flipped bit of the last
    source (the last layer's V) of a cached slot is reported by both, at that slot."""
    _ours_verify(c, 1, _phases(1, c["device"]), 0)
    _sgl_step(c)
    sync()
    clean = _violations(c) == (0, 0)
    slot = int(c["decode_vp"].verify_slot_indices[0])
    rows = c["rows"][-1]
    rows[slot, 5] ^= 0x10
    _ours_verify(c, 1, _phases(1, c["device"]), 0)
    sgl_verify(c["sgl"], c["contexts"][-1], c["decode_vp"])
    sync()
    rows[slot, 5] ^= 0x10
    found_ours = int(c["digest"].violation_ring[0][consts.VIOLATION_FIELD_SLOT_IDX])
    found_sgl = int(c["contexts"][-1].violation_ring[0][consts.VIOLATION_FIELD_SLOT_IDX])
    return dict(clean=clean, flip_found=_violations(c) == (1, 1) and
                found_ours == found_sgl == slot)


def measure_case(case: dict, model: dict, *, windows, iters: int, bw_gbs: float, sgl) -> dict:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    c = make_case(device=device, sgl=sgl, **case, **model)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    entries, bs = case["bs"] * case["ctx"], case["bs"]
    row = dict(case, **model, sources=len(c["ours_src"]), sglang_launches_per_half=len(
        c["contexts"]), slot_bytes=c["slot_bytes"], entries=entries)
    t = {}
    t["sglang_verify"] = timing.device_time(lambda i: _sgl_step(c, write=False), sync,
                                            iters=iters)
    t["sglang_write"] = timing.device_time(lambda i: _sgl_step(c, verify=False), sync,
                                           iters=iters)
    t["sglang_step"] = timing.device_time(lambda i: _sgl_step(c), sync, iters=iters)
    t["ours_write"] = timing.device_time(lambda i: _ours_write(c), sync, iters=iters)
    for w in windows:
        phases = _phases(w, device)
        t[f"ours_verify_w{w}"] = timing.device_time(
            lambda i, w=w, p=phases: _ours_verify(c, w, p, i), sync, iters=iters)
        t[f"ours_step_w{w}"] = timing.device_time(
            lambda i, w=w, p=phases: (_ours_verify(c, w, p, i), _ours_write(c)), sync,
            iters=iters)
    row["times"] = t
    row["ours_correct"] = _check(c, sync)
    # The KV bytes a step must read: the new tokens' slots, and the entries checked.
    floors = {}
    for w in windows:
        nbytes = (bs + math.ceil(entries / w)) * c["slot_bytes"]
        floors[f"w{w}"] = nbytes / (bw_gbs * 1e3) if bw_gbs == bw_gbs else None
    row["floor_us"] = floors
    sgl_us = t["sglang_step"]["median_us"]
    row["sglang_over_ours"] = {f"w{w}": sgl_us / t[f"ours_step_w{w}"]["median_us"]
                               for w in windows}
    del c
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def table(rows, windows) -> str:
    head = ("| pool | case | SGLang verify + write (us) | ours write (us) | "
            + " | ".join(f"ours step w={w} (us) | SGLang / ours w={w} | floor w={w} (us)"
                         for w in windows) + " | clean, flip found |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        t = r["times"]
        cells = [f"{r['layers']} layers ({r['sources']} sources)", f"bs={r['bs']} ctx={r['ctx']}",
                 f"{t['sglang_verify']['median_us']:.1f} + {t['sglang_write']['median_us']:.1f}"
                 f" = {t['sglang_step']['median_us']:.1f}",
                 f"{t['ours_write']['median_us']:.1f}"]
        for w in windows:
            floor = r["floor_us"][f"w{w}"]
            cells += [f"{t[f'ours_step_w{w}']['median_us']:.1f}",
                      f"{r['sglang_over_ours'][f'w{w}']:.2f}x",
                      "-" if floor is None else f"{floor:.1f}"]
        ok = r["ours_correct"]
        cells.append(f"{ok['clean']}, {ok['flip_found']}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _positive(v):
    try:
        n = int(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an int >= 1, got {v!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {n}")
    return n


def _windows(v):
    return tuple(_positive(w) for w in v.split(","))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.bridge_coverage",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (any machine)")
    ap.add_argument("--iters", type=_positive, default=None, help="timed iterations per figure")
    ap.add_argument("--windows", type=_windows, default=None,
                    help="our windows, comma list (default 1,64)")
    ap.add_argument("--out", default=os.path.join("bench", "results"),
                    help="output directory (bridge_coverage.json)")
    args = ap.parse_args(argv)
    from kvcanary_jax import oracle

    gpu = torch.cuda.is_available()
    smoke = args.smoke or not gpu
    if smoke and not args.smoke:
        print("no GPU: running the smoke mode", file=sys.stderr)
    windows = args.windows or (SMOKE_WINDOWS if smoke else WINDOWS)
    cases, models = (SMOKE_CASES, SMOKE_MODELS) if smoke else (CASES, MODELS)
    iters = args.iters or (3 if smoke else 20)
    sgl = oracle.load(cuda_jit=gpu)
    bw = timing.copy_bandwidth_gbs()
    rows = [measure_case(c, m, windows=windows, iters=iters, bw_gbs=bw, sgl=sgl)
            for m in models for c in cases]
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bridge_coverage.json"), "w") as f:
        json.dump({"mode": "smoke" if smoke else "full", "iters": iters, "windows": windows,
                   "copy_bandwidth_gbs": bw, "paths": bridge.paths(), "rows": rows}, f,
                  indent=1, default=str)
    print(f"copy bandwidth {bw:.0f} GB/s; our paths "
          f"{ {k: v['path'] for k, v in bridge.paths().items() if 'digest' in k} }")
    print(table(rows, windows))
    return 0 if all(all(r["ours_correct"].values()) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
