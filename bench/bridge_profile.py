"""Where the torch bridge's per-call host time goes on the direct Triton path, stage by stage.

For each launcher of :mod:`kvcanary_jax.bench.bridge_overhead`'s decode-like case, ``iters``
back-to-back calls with the launcher's stages wrapped in timers: reading the tensors and the
signature (``bind``), building the array arguments with their buckets and clamps (``arguments``),
the kernel launches themselves (``launch``: pointers, alignment check, triton's launcher); the rest
of the call is the launcher's own Python (cache lookups). Floors in the same process: torch's launch
of a tiny kernel.

    python -m bench.bridge_profile [--bs 64] [--iters 300] [--out profile.json]
"""

from __future__ import annotations

import argparse
import collections
import json
import time

import torch

import kvcanary_jax.bridge as bridge
from kvcanary_jax.bench import bridge_overhead as bo
from kvcanary_jax.bridge import declarations, triton_direct


class _Stages:
    """Wraps attributes in accumulating wall-time timers."""

    def __init__(self):
        self.acc = collections.Counter()
        self._undo = []

    def wrap(self, obj, attr, stage):
        orig = getattr(obj, attr)
        acc = self.acc

        def timed(*a, **k):
            t = time.perf_counter()
            try:
                return orig(*a, **k)
            finally:
                acc[stage] += time.perf_counter() - t

        setattr(obj, attr, timed)
        self._undo.append((obj, attr, orig))

    def undo(self):
        for obj, attr, orig in reversed(self._undo):
            setattr(obj, attr, orig)


def profile(*, bs: int = 64, iters: int = 300) -> dict:
    c = bo.make_case(device="cuda", bs=bs)
    ops = dict(scatter=bo.run_scatter, plan=bo.run_plan, verify=bo.run_verify,
               write=bo.run_write, step_fused=bo.run_step)
    out = {"bs": bs, "iters": iters}
    for name, fn in ops.items():
        for _ in range(5):
            fn(c)
        torch.cuda.synchronize()
        st = _Stages()
        st.wrap(triton_direct.Loaded, "launch", "launch")
        for d in (declarations.SCATTER, declarations.PLAN, declarations.VERIFY,
                  declarations.WRITE, declarations.STEP):
            object.__setattr__(d, "arguments", _timed(d.arguments, st.acc, "arguments"))
            object.__setattr__(d, "tensors", _timed(d.tensors, st.acc, "bind"))
        try:
            t = time.perf_counter()
            for _ in range(iters):
                fn(c)
            total = time.perf_counter() - t
        finally:
            st.undo()
            for d in (declarations.SCATTER, declarations.PLAN, declarations.VERIFY,
                      declarations.WRITE, declarations.STEP):
                object.__setattr__(d, "arguments", d.arguments.__wrapped__)
                object.__setattr__(d, "tensors", d.tensors.__wrapped__)
        torch.cuda.synchronize()
        us = {k: round(v / iters * 1e6, 2) for k, v in st.acc.items()}
        us["total"] = round(total / iters * 1e6, 2)
        us["rest"] = round(us["total"] - sum(v for k, v in us.items() if k != "total"), 2)
        out[name] = us
    x = torch.zeros(16, device="cuda")
    for _ in range(10):
        x.add_(1)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(iters):
        x.add_(1)
    out["floor_torch_tiny_kernel_us"] = round((time.perf_counter() - t) / iters * 1e6, 2)
    out["paths"] = bridge.paths()
    return out


def _timed(fn, acc, stage):
    def timed(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            acc[stage] += time.perf_counter() - t

    timed.__wrapped__ = fn
    return timed


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bs", type=int, default=64)
    p.add_argument("--iters", type=int, default=300)
    p.add_argument("--out")
    a = p.parse_args(argv)
    out = profile(bs=a.bs, iters=a.iters)
    print(json.dumps(out, indent=1))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
