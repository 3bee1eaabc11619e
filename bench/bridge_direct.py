"""The bridge's direct Triton path on the GPU: graph device time and per-kernel device time.

* ``graph``: the four-op canary step (scatter, plan, write, verify) captured into one
  ``torch.cuda.graph`` through the bridge, and SGLang 0.5.23's four launchers captured the same
  way on a twin set of buffers: device time per replay (CUDA events around ``replays``
  back-to-back replays, after warm-up replays).
* ``kernels``: device time of each kernel (CUPTI through ``torch.profiler``, median over calls)
  when the launchers run on the direct path and on the DLPack path (XLA runs the same kernels):
  the same kernel source, so the two should agree within noise.

    python -m bench.bridge_direct [--bs 64,256] [--replays 200] [--calls 50] [--out result.json]
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

import kvcanary_jax.bridge as bridge
from kvcanary_jax.bench import bridge_overhead as bo

OPS = (bo.run_scatter, bo.run_plan, bo.run_write, bo.run_verify)


def _step(c, lib=None):
    for op in OPS:
        op(c) if lib is None else op(c, lib)


def graph_us(c, lib=None, *, replays: int) -> float:
    """Device time per replay of the captured four-op step (microseconds)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            _step(c, lib)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        _step(c, lib)
    for _ in range(10):
        g.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(replays):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / replays


def kernel_times(c, *, direct: bool, calls: int) -> dict:
    """Median device time (us) per kernel name over ``calls`` calls of each launcher."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    old = bridge.direct_enabled()
    bridge.set_direct(direct)
    try:
        for _ in range(3):
            _step(c)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(calls):
                _step(c)
                torch.cuda.synchronize()
    finally:
        bridge.set_direct(old)
    times: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type == DeviceType.CUDA and "kvcanary" in e.name:
            times.setdefault(e.name, []).append(e.time_range.end - e.time_range.start)
    return {k: round(statistics.median(v), 2) for k, v in sorted(times.items())}


def measure(*, bs: int, replays: int, calls: int) -> dict:
    out = {"bs": bs}
    lib = bo._SglangLib(cuda_jit=True)
    with bridge.value_checks(False):
        ours = graph_us(bo.make_case(device="cuda", bs=bs), replays=replays)
        try:
            theirs = graph_us(bo.make_case(device="cuda", bs=bs), lib, replays=replays)
        except RuntimeError as e:  # a launcher that synchronises cannot be captured
            theirs = None
            out["sglang_graph_error"] = str(e)[:300]
        out["graph_us"] = {"bridge_direct": round(ours, 2),
                           "sglang": None if theirs is None else round(theirs, 2)}
        if theirs:
            out["graph_ratio"] = round(ours / theirs, 2)
        direct = kernel_times(bo.make_case(device="cuda", bs=bs), direct=True, calls=calls)
        jax_path = kernel_times(bo.make_case(device="cuda", bs=bs), direct=False, calls=calls)
    out["kernel_us"] = {k: {"direct": direct.get(k), "jax": jax_path.get(k),
                            "ratio": round(direct[k] / jax_path[k], 2)
                            if direct.get(k) and jax_path.get(k) else None}
                        for k in sorted(set(direct) | set(jax_path))}
    out["paths"] = bridge.paths()
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bs", default="64,256")
    p.add_argument("--replays", type=int, default=200)
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--out")
    a = p.parse_args(argv)
    results = []
    for bs in (int(x) for x in a.bs.split(",")):
        r = measure(bs=bs, replays=a.replays, calls=a.calls)
        results.append(r)
        print(f"bs={bs} graph us per replay: {r['graph_us']} ratio {r.get('graph_ratio')}")
        for k, v in r["kernel_us"].items():
            print(f"  {k:<40} direct {v['direct']} us  jax {v['jax']} us  ratio {v['ratio']}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
