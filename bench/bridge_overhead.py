"""Per-call host overhead of the torch bridge's launchers (the cache-hit path), and SGLang's.

One decode-like step (``bs`` requests, ``prefix`` cached tokens each, one new token) on persistent
buffers, as a CUDA-graph-style serving loop holds them. For each launcher: the wall time of
``iters`` back-to-back calls divided by ``iters`` (``launch_us``: what the host pays per call, the
kernels overlapping), and of synchronised single calls (``sync_us``). With ``--sglang`` the same
inputs go through SGLang 0.5.23's launchers (its Triton / CUDA kernels on the GPU, its torch
references on CPU) for the ratio the targets are stated in.

    python -m bench.bridge_overhead --device cuda --bs 64 [--sglang] [--out result.json]

On CUDA the launchers are also timed under the other stream handshake (``bridge_event`` or
``bridge_fence`` in the JSON, with their own ratios).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

import bridge


def make_case(*, device, bs: int = 64, prefix: int = 100, width: int = 256, ring: int = 1024):
    """Persistent buffers and one step's inputs (every tensor reused call after call)."""
    device = torch.device(device)
    max_reqs = bs + 1
    g = torch.Generator().manual_seed(0)
    rtt = torch.randperm(max_reqs * width, generator=g).add_(1).to(torch.int32)
    rtt = rtt.reshape(max_reqs, width).to(device)
    num_slots = max_reqs * width + 1
    rpi = torch.arange(1, bs + 1, dtype=torch.int64, device=device)
    prefix_lens = torch.full((bs,), prefix, dtype=torch.int64, device=device)
    extend = torch.ones(bs, dtype=torch.int64, device=device)
    ocl = rtt[rpi, prefix_lens].to(torch.int64)
    hist = torch.randint(0, 50000, (bs * (prefix + 1),), generator=g).to(device)
    offs = torch.arange(0, bs * (prefix + 1) + 1, prefix + 1, dtype=torch.int64, device=device)
    case = dict(
        device=device,
        vp=bridge.VerifyPlan.allocate(verify_capacity=3 * bs * (prefix + 1), device=device),
        wp=bridge.WritePlan.allocate(write_req_capacity=max_reqs, device=device),
        ctx=bridge.VerifyOrWriteContext(
            canary_buf=torch.zeros(num_slots, 32, dtype=torch.uint8, device=device),
            kernel_kind=bridge.CanaryLaunchTag.HEAD_K_FULL,
            violation_ring=torch.zeros(ring, 8, dtype=torch.int64, device=device),
            violation_write_index=torch.zeros(1, dtype=torch.int32, device=device),
            slot_run_counter=torch.zeros(1, dtype=torch.int64, device=device),
            kernel_run_counter=torch.zeros(1, dtype=torch.int64, device=device),
            real_kv_sources=(), real_kv_hash_mode=bridge.RealKvHashMode.NONE,
            enable_chain_position_assert=torch.ones(1, dtype=torch.int32, device=device),
        ),
        rtt=rtt, rpi=rpi, prefix_lens=prefix_lens, extend=extend,
        pool=torch.zeros(max_reqs, width, dtype=torch.int32, device=device),
        valid=prefix_lens + 1, flat=hist, offs=offs,
        input_ids=hist[offs[1:] - 1].contiguous(), positions=prefix_lens.clone(), ocl=ocl,
    )
    return case


def _plan_kw(c):
    return dict(verify_plan_out=c["vp"], write_plan_out=c["wp"], req_pool_indices=c["rpi"],
                prefix_lens=c["prefix_lens"], extend_seq_lens=c["extend"], req_to_token=c["rtt"],
                swa_window_size=0, full_to_swa_index_mapping=None,
                verify_capacity=int(c["vp"].verify_slot_indices.shape[0]),
                req_to_verify_expected_tokens=c["pool"],
                req_to_verify_expected_tokens_valid_lens=c["valid"],
                kv_token_id_vs_position_offset=0)


def run_scatter(c, lib=bridge):
    lib.launch_scatter_req_token_ids_kernel(flat_in=c["flat"], offsets=c["offs"],
                                            req_pool_indices=c["rpi"], pool_out=c["pool"])


def run_plan(c, lib=bridge):
    lib.launch_canary_plan_kernels(**_plan_kw(c))


def run_verify(c, lib=bridge):
    lib.launch_canary_verify_kernel(context=c["ctx"], plan=c["vp"],
                                    check_verify_expected_token=True)


def run_write(c, lib=bridge):
    lib.launch_canary_write_kernel(context=c["ctx"], plan=c["wp"], input_ids=c["input_ids"],
                                   positions=c["positions"], out_cache_loc=c["ocl"],
                                   enable_write_input_assert=False, expected_input_tokens=None,
                                   expected_input_positions=None)


def run_step(c):
    kw = _plan_kw(c)
    bridge.launch_canary_step(
        context=c["ctx"], input_ids=c["input_ids"], positions=c["positions"],
        out_cache_loc=c["ocl"], expected_token_ids=c["flat"], expected_token_offsets=c["offs"],
        check_verify_expected_token=True, **kw,
    )


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(fn, c, *, iters: int, warmup: int = 5) -> dict:
    dev = c["device"]
    for _ in range(warmup):
        fn(c)
    _sync(dev)
    t0 = time.perf_counter()
    for _ in range(iters):
        fn(c)
    t1 = time.perf_counter()
    _sync(dev)
    t2 = time.perf_counter()
    singles = []
    for _ in range(min(iters, 50)):
        s = time.perf_counter()
        fn(c)
        _sync(dev)
        singles.append(time.perf_counter() - s)
    singles.sort()
    return dict(launch_us=round((t1 - t0) / iters * 1e6, 2),
                drain_us=round((t2 - t1) * 1e6, 2),
                sync_us=round(singles[len(singles) // 2] * 1e6, 2))


class _SglangLib:
    """SGLang 0.5.23's launchers under the bridge's names (its own dataclasses are duck-typed
    the same, so the bridge's plan / context objects are passed through)."""

    def __init__(self, cuda_jit: bool):
        from kvcanary_jax import oracle

        ns = oracle.load(cuda_jit=cuda_jit)
        self.launch_scatter_req_token_ids_kernel = ns.scatter.launch_scatter_req_token_ids_kernel
        self.launch_canary_plan_kernels = ns.plan_api.launch_canary_plan_kernels
        self.launch_canary_verify_kernel = ns.verify.launch_canary_verify_kernel
        self.launch_canary_write_kernel = ns.write.launch_canary_write_kernel


def measure(*, device="cpu", bs: int = 64, iters: int = 200, sglang: bool = False) -> dict:
    """Per-call times (microseconds) of every bridge launcher and the fused step; with
    ``sglang`` also SGLang's launchers on the same buffers and the ratios."""
    c = make_case(device=device, bs=bs)
    out = {"device": str(c["device"]), "bs": bs, "iters": iters, "bridge": {}}
    ops = dict(scatter=run_scatter, plan=run_plan, verify=run_verify, write=run_write)
    for name, fn in ops.items():
        out["bridge"][name] = _time(fn, c, iters=iters)
    out["bridge"]["step_fused"] = _time(run_step, c, iters=iters)
    out["stream_sync"] = bridge.stream_sync()
    if c["device"].type == "cuda":
        # The other handshake on the same buffers (see bridge._interop): which one meets the
        # targets, measured in the same process.
        other = "event" if bridge.stream_sync() == "fence" else "fence"
        old = bridge.stream_sync()
        bridge.set_stream_sync(other)
        try:
            info = bridge._interop.device_info(c["pool"])
            out["compute_stream_found"] = \
                bridge._interop.gpu_sync(info).compute_stream is not None
            out["bridge_" + other] = {name: _time(fn, c, iters=iters)
                                      for name, fn in {**ops, "step_fused": run_step}.items()}
        finally:
            bridge.set_stream_sync(old)
    out["cache"] = {"entries": len(bridge._interop.CACHE), **bridge.stats()}
    if sglang:
        lib = _SglangLib(cuda_jit=c["device"].type == "cuda")
        ref = make_case(device=device, bs=bs)
        out["sglang"] = {}
        for name, fn in ops.items():
            try:
                out["sglang"][name] = _time(lambda cc, f=fn: f(cc, lib), ref, iters=iters)
            except Exception as e:  # noqa: BLE001  (SGLang's CUDA JIT needs tvm-ffi + nvcc)
                out["sglang"][name] = {"error": f"{type(e).__name__}: {e}"[:200]}
        ok = [n for n in ops if "launch_us" in out["sglang"][n]]
        out["ratio_launch"] = {n: round(out["bridge"][n]["launch_us"] /
                                        out["sglang"][n]["launch_us"], 2) for n in ok}
        if len(ok) == len(ops):
            total = sum(out["sglang"][n]["launch_us"] for n in ops)
            out["ratio_launch"]["step_fused_vs_sum"] = round(
                out["bridge"]["step_fused"]["launch_us"] / total, 2)
        for key in ("bridge_event", "bridge_fence"):
            if key in out and len(ok) == len(ops):
                out["ratio_launch_" + key[7:]] = {
                    n: round(out[key][n]["launch_us"] / out["sglang"][n]["launch_us"], 2)
                    for n in ok}
                out["ratio_launch_" + key[7:]]["step_fused_vs_sum"] = round(
                    out[key]["step_fused"]["launch_us"] / total, 2)
    return out


def table(out) -> str:
    """Absolute microseconds per call (async launch), ours per handshake and SGLang's, ratios."""
    names = ("scatter", "plan", "verify", "write", "step_fused")
    cols = [("bridge[" + out.get("stream_sync", "?") + "]", out["bridge"])]
    cols += [(f"bridge[{k[7:]}]", out[k]) for k in ("bridge_event", "bridge_fence") if k in out]
    sg = out.get("sglang", {})
    head = f"{'op':<11}" + "".join(f"{n:>16}" for n, _ in cols) + f"{'sglang':>10}" + \
        "".join(f"{'ratio ' + n[7:-1]:>14}" for n, _ in cols)
    lines = [f"device={out['device']} bs={out['bs']} iters={out['iters']} (us per call)", head]
    total = (sum(sg[n]["launch_us"] for n in names[:4])
             if sg and all("launch_us" in sg.get(n, {}) for n in names[:4]) else None)
    for n in names:
        row = f"{n:<11}" + "".join(f"{c[n]['launch_us']:>16.1f}" for _, c in cols)
        ref = (sg.get(n, {}).get("launch_us") if n != "step_fused" else total) if sg else None
        row += f"{ref:>10.1f}" if ref else f"{'-':>10}"
        if ref:
            row += "".join(f"{c[n]['launch_us'] / ref:>13.2f}x" for _, c in cols)
        lines.append(row)
    if sg:
        lines.append("(step_fused's SGLang column is the sum of its four launches; targets: "
                     "ops <= 3x, step <= 1x)")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--bs", type=int, default=64)
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--sglang", action="store_true")
    p.add_argument("--out", help="write the full JSON here (printed otherwise)")
    a = p.parse_args(argv)
    out = measure(device=a.device, bs=a.bs, iters=a.iters, sglang=a.sglang)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)
    else:
        print(json.dumps(out, indent=1))
    print(table(out))


if __name__ == "__main__":
    main()
