"""Where the torch bridge's per-call host time goes, stage by stage, and the runtime's floors.

For each launcher of :mod:`bench.bridge_overhead`'s decode-like case, the launcher runs ``iters``
times back to back with its stages wrapped in timers: the static-check memo (``check``), the
stream handshake in (``fence``), the jitted call (``dispatch``: host time to hand the work to the
runtime), the stream handshake out (``finish``), the output bookkeeping (``commit``); the rest of
the launcher's wall time is the bridge's own Python (imports from the view cache, keys, pytrees).
Calls replayed by the hot path (:mod:`bridge._fast`, from a signature's third call on) show as
fence + dispatch + finish + the rest; ``replays`` counts them.

The floors, measured in the same process: a jitted call with 1 and with 20 array arguments
(``jit`` and its ``lower().compile()`` executable), DLPack import and export of one array, the
event handshake, torch's own launch of a tiny kernel.

    python -m bench.bridge_profile --device cuda [--bs 64] [--iters 300] [--out profile.json]
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import time

import jax
import jax.numpy as jnp
import torch

import bridge
from bench import bridge_overhead as bo
from bridge import _canary, _fast, _interop, _scatter


def _median_us(fn, iters: int, sync=None) -> float:
    for _ in range(10):
        fn()
    if sync:
        sync()
    ts = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    if sync:
        sync()
    return round(statistics.median(ts) * 1e6, 2)


class _Stages:
    """Wraps module attributes in accumulating timers (wall time inside each call)."""

    def __init__(self):
        self.acc = collections.Counter()
        self._undo = []

    def wrap(self, mod, attr, stage):
        orig = getattr(mod, attr)
        acc = self.acc

        def timed(*a, **k):
            t = time.perf_counter()
            try:
                return orig(*a, **k)
            finally:
                acc[stage] += time.perf_counter() - t

        setattr(mod, attr, timed)
        self._undo.append((mod, attr, orig))

    def restore(self):
        for mod, attr, orig in reversed(self._undo):
            setattr(mod, attr, orig)
        self._undo.clear()


def stages(device: str, bs: int, iters: int) -> dict:
    c = bo.make_case(device=device, bs=bs)
    ops = dict(scatter=bo.run_scatter, plan=bo.run_plan, verify=bo.run_verify,
               write=bo.run_write, step_fused=bo.run_step)
    sync = (lambda: torch.cuda.synchronize()) if c["device"].type == "cuda" else None
    out = {}
    for name, fn in ops.items():
        for _ in range(10):
            fn(c)
        st = _Stages()
        for mod, attr in ((_interop, "enter"), (_interop, "finish"),
                          (_interop, "commit_output")):
            st.wrap(mod, attr, {"commit_output": "commit", "enter": "fence"}.get(attr, attr))
        for fp in _fast._ALL:  # replayed calls: their compiled function is the dispatch
            for b in fp._bound.values():
                st.wrap(b, "fn", "dispatch")
        for attr in ("_plan_adapter", "_verify_adapter", "_write_adapter", "_step_adapter"):
            st.wrap(_canary, attr, "dispatch")
        st.wrap(_scatter, "scatter_adapter", "dispatch")
        for attr in ("_check_plan", "_check_verify", "_check_write"):
            st.wrap(_canary, attr, "check")
        st.wrap(_scatter, "check_scatter", "check")
        st.wrap(_canary, "check_scatter", "check")
        r0 = bridge.stats().get("replays", 0)
        try:
            if sync:
                sync()
            t = time.perf_counter()
            for _ in range(iters):
                fn(c)
            total = time.perf_counter() - t
            if sync:
                sync()
        finally:
            st.restore()
        replayed = bridge.stats().get("replays", 0) - r0
        row = {k: round(v / iters * 1e6, 2) for k, v in st.acc.items()}
        row["replayed"] = replayed
        row["total"] = round(total / iters * 1e6, 2)
        row["python_rest"] = round(row["total"] - sum(
            v for k, v in row.items() if k not in ("total", "replayed")), 2)
        out[name] = row
    return out


def floors(device: str, iters: int) -> dict:
    dev = torch.device(device)
    info = _interop.device_info(torch.zeros(1, device=dev))
    jdev = info.jax_device
    sync = (lambda: torch.cuda.synchronize()) if dev.type == "cuda" else None
    res = {}
    with jax.enable_x64(True):
        x = jax.device_put(jnp.zeros(64, jnp.int64), jdev)
        xs = [jax.device_put(jnp.zeros(64, jnp.int64) + i, jdev) for i in range(20)]
        f1 = jax.jit(lambda a: a + 1)
        f20 = jax.jit(lambda *a: sum(a[1:], a[0]))
        res["jit_1arg"] = _median_us(lambda: f1(x), iters)
        res["jit_20args"] = _median_us(lambda: f20(*xs), iters)
        c1 = f1.lower(x).compile()
        c20 = f20.lower(*xs).compile()
        res["compiled_1arg"] = _median_us(lambda: c1(x), iters)
        res["compiled_20args"] = _median_us(lambda: c20(*xs), iters)
        fs = jax.jit(lambda a, *, k: a + k, static_argnames=("k",))
        res["jit_1arg_static_kw"] = _median_us(lambda: fs(x, k=1), iters)
        fd = jax.jit(lambda a: a + 1, donate_argnums=(0,))
        box = [jax.device_put(jnp.zeros(64, jnp.int64), jdev)]

        def donated():
            box[0] = fd(box[0])

        res["jit_1arg_donated"] = _median_us(donated, iters)
        t = torch.arange(64, dtype=torch.int64, device=dev)
        res["import_fast"] = _median_us(lambda: _interop._raw_import(t, info), iters)
        res["import_from_dlpack"] = _median_us(lambda: jax.dlpack.from_dlpack(t), iters)
        y = f1(x)
        if info.is_gpu:
            s = torch.cuda.current_stream(dev).cuda_stream or 1
            res["export_with_stream"] = _median_us(
                lambda: _interop._jaxlib.buffer_to_dlpack_managed_tensor(y, stream=s), iters)

            def call_then_export():
                z = f1(x)
                _interop._jaxlib.buffer_to_dlpack_managed_tensor(z, stream=s)

            res["jit_then_export"] = _median_us(call_then_export, iters)
            g = _interop.gpu_sync(info)
            cur = torch.cuda.current_stream(dev)

            def event():
                g.event.record(cur)
                g.compute_stream.wait_event(g.event)

            if g.compute_stream is not None:
                res["event_handshake"] = _median_us(event, iters)
            old = bridge.stream_sync()
            bridge.set_stream_sync("fence")
            res["fence_import"] = _median_us(lambda: _interop.fence(info), iters)
            bridge.set_stream_sync(old)
            tt = torch.zeros(64, device=dev)
            res["torch_add_launch"] = _median_us(lambda: tt.add_(1), iters)
        res["block_until_ready_after_call"] = _median_us(
            lambda: jax.block_until_ready(f1(x)), iters)
    if sync:
        sync()
    try:
        res["client"] = {"platform_version": jdev.client.platform_version,
                         "runtime_type": getattr(jdev.client, "runtime_type", None)}
    except Exception as e:  # noqa: BLE001
        res["client"] = repr(e)[:200]
    return res


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--bs", type=int, default=64)
    p.add_argument("--iters", type=int, default=300)
    p.add_argument("--out")
    a = p.parse_args(argv)
    if a.device != "cpu":
        bridge.set_value_checks(False)
    out = {"device": a.device, "bs": a.bs, "iters": a.iters, "stream_sync": bridge.stream_sync(),
           "jax": jax.__version__, "torch": torch.__version__}
    out["floors"] = floors(a.device, a.iters)
    for mode in (("fence", "event") if a.device != "cpu" else ("fence",)):
        bridge.set_stream_sync(mode)
        out["stages_" + mode] = stages(a.device, a.bs, a.iters)
    text = json.dumps(out, indent=1)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    print(text)


if __name__ == "__main__":
    main()
