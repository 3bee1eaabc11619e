"""The torch bridge's per-call Python before a launch, measured on CPU tensors (no GPU needed).

The direct Triton path's host time is this Python plus triton's launcher per kernel. Here every
launcher of :mod:`kvcanary_jax.bench.bridge_overhead`'s decode-like case is called back to back on
CPU tensors with value checks off (the GPU default) and the launch itself replaced by what the
direct path does per call besides triton's launcher: read each argument's pointer (and clamp the
write's offsets into its bucketed token arrays, as a torch op on the tensors' device; the
scatter's kernel reads its true length from the bridge's table of lengths). So the time per
call is: the tensors and the signature, the prepared-call lookup, the per-call storage checks, the
path decision and the pointers. ``scatter_growing`` and ``step_growing`` take a history one token
a request longer at every call, as SGLang's server scatters it (``bridge_overhead``'s), each
length unseen before (the prepared calls are forgotten before each run of at most
``bridge_overhead.GROW`` calls). Minimum over ``--repeat`` runs of ``--iters`` calls, in CPU time of
the calling thread (``time.thread_time``: on a shared machine, wall time mostly measures the other
processes).

    python -m bench.bridge_host_cpu [--bs 64,256] [--iters 2000] [--repeat 7]
"""

from __future__ import annotations

import argparse
import json
import time

import kvcanary_jax.bridge as bridge
from kvcanary_jax.bench import bridge_overhead as bo
from kvcanary_jax.bridge import launcher
from kvcanary_jax.bridge.cache import CACHES


def _pointers_only(self, prep, tensors, anchor):
    """The direct path's per-call work besides triton's launcher: clamps and pointers."""
    return self.pointers(prep, tensors, True, anchor.device)


def measure(bs: int, iters: int, repeat: int) -> dict:
    c = bo.make_case(device="cpu", bs=bs)
    ops = dict(scatter=bo.run_scatter, plan=bo.run_plan, verify=bo.run_verify,
               write=bo.run_write, step_fused=bo.run_step,
               scatter_growing=bo.run_scatter_growing, step_growing=bo.run_step_growing)
    out = {}
    bridge.set_value_checks(False)
    original = launcher.Launcher._dlpack
    launcher.Launcher._dlpack = _pointers_only
    try:
        for name, fn in ops.items():
            fn(c)  # the first call checks and prepares
            growing = name.endswith("_growing")
            n = min(iters, bo.GROW - 1) if growing else iters
            best = float("inf")
            for _ in range(repeat):
                if growing:  # every length unseen, as a server's: no signature kept from before
                    CACHES.prepared.clear()
                    c["calls"][0] = 1
                t0 = time.thread_time()
                for _ in range(n):
                    fn(c)
                best = min(best, (time.thread_time() - t0) / n)
            out[name] = round(best * 1e6, 2)
    finally:
        launcher.Launcher._dlpack = original
        bridge.set_value_checks("auto")
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bs", default="64,256")
    p.add_argument("--iters", type=int, default=2000)
    p.add_argument("--repeat", type=int, default=7)
    p.add_argument("--out")
    a = p.parse_args(argv)
    res = {f"bs{bs}": measure(int(bs), a.iters, a.repeat) for bs in a.bs.split(",")}
    print(json.dumps(res, indent=1))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
