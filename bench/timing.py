"""Device time of a callable, measured the same way for JAX and torch kernels.

``torch.profiler`` (CUPTI) records every kernel, memcpy and memset of the process, XLA's
included, so one method times both sides. Iterations are separated by a marker kernel
(``torch.cuda._sleep``, named ``spin_kernel``) launched after a full synchronisation; the device
time of one iteration is the summed duration of the GPU activities between two markers, i.e.
every kernel (and copy) the call launches, idle gaps excluded.

On a machine without a GPU (the CPU smoke mode) the same interface falls back to wall-clock time
of synchronised calls.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import numpy as np

L2_BYTES = 60 * 1024 * 1024
ROTATE_TARGET_BYTES = 4 * L2_BYTES  # rotate among enough input sets to overflow the L2 cache
MAX_SETS = 32


def num_sets(bytes_per_set: int) -> int:
    """How many input sets to rotate among so consecutive calls do not hit in L2."""
    return int(max(2, min(MAX_SETS, -(-ROTATE_TARGET_BYTES // max(bytes_per_set, 1)))))


def _gpu_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def summarize(samples_us: list[float]) -> dict:
    a = np.asarray(samples_us, dtype=np.float64)
    return {
        "median_us": float(np.median(a)),
        "p10_us": float(np.percentile(a, 10)),
        "p90_us": float(np.percentile(a, 90)),
        "min_us": float(a.min()),
        "n": int(a.size),
    }


def device_time(run: Callable[[int], None], sync: Callable[[], None], *, iters: int, warmup: int = 3) -> dict:
    """Per-iteration device time (us) of ``run(i)``; ``sync()`` must wait for its work."""
    for i in range(warmup):
        run(i)
    sync()
    if not _gpu_available():
        samples = []
        for i in range(iters):
            t0 = time.perf_counter()
            run(i)
            sync()
            samples.append((time.perf_counter() - t0) * 1e6)
        return summarize(samples)

    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(iters):
            torch.cuda._sleep(1000)
            torch.cuda.synchronize()
            run(i)
            sync()
            torch.cuda.synchronize()
        torch.cuda._sleep(1000)
        torch.cuda.synchronize()
    # The GPU's events are tagged CUDA, or PrivateUse1 once a process registers a torch backend
    # of its own (tpu-inference's torchax does): they are the same kernels either way.
    gpu_types = (DeviceType.CUDA, DeviceType.PrivateUse1)
    events = [e for e in prof.events() if e.device_type in gpu_types]
    events.sort(key=lambda e: e.time_range.start)
    samples, current, started, names, busy = [], 0.0, False, {}, {}
    for e in events:
        if "spin_kernel" in e.name:
            if started:
                samples.append(current)
            current, started = 0.0, True
            continue
        if started:
            us = e.time_range.end - e.time_range.start
            current += us
            names[e.name] = names.get(e.name, 0) + 1
            busy[e.name] = busy.get(e.name, 0.0) + us
    if len(samples) != iters:
        raise RuntimeError(f"profiler saw {len(samples)} iterations, expected {iters}")
    out = summarize(samples)
    out["kernels_per_call"] = {k: v / iters for k, v in names.items()}
    # Each kernel's (or copy's) device time per call, summed over its launches: where the time goes.
    out["kernel_us_per_call"] = {k: round(v / iters, 2)
                                 for k, v in sorted(busy.items(), key=lambda kv: -kv[1])}
    return out


def call_time(run: Callable[[int], None], sync: Callable[[], None], *, iters: int, warmup: int = 3) -> dict:
    """Wall time per call from Python (async launches back to back, one sync at the end)."""
    for i in range(warmup):
        run(i)
    sync()
    reps = []
    for _ in range(5):
        t0 = time.perf_counter()
        for i in range(iters):
            run(i)
        sync()
        reps.append((time.perf_counter() - t0) * 1e6 / iters)
    return {"median_us": statistics.median(reps), "min_us": min(reps), "n": len(reps)}


def copy_bandwidth_gbs(nbytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth (bytes read + written per second), measured now."""
    if not _gpu_available():
        return float("nan")
    import torch

    src = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(10):
        start.record()
        dst.copy_(src)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e-3)
    return nbytes / statistics.median(times) / 1e9
