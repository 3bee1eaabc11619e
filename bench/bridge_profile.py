"""Where the torch bridge's per-call host time goes on the direct Triton path, stage by stage.

For each launcher of :mod:`kvcanary_jax.bench.bridge_overhead`'s decode-like case, ``iters``
back-to-back calls with the launcher's stages wrapped in timers: reading the tensors and the
signature (``bind``), building the array arguments with their buckets and clamps (``arguments``;
absent where a prepared call keeps them, and then part of the rest), the kernel launches themselves (``launch``: pointers, alignment check, triton's launcher, of which
``triton_launcher`` is triton's own compiled launcher, ``kernels`` launches per call); the rest of
the call is the launcher's own Python (cache lookups). Floors in the same process: torch's launch
of a tiny kernel; with ``--sglang``, SGLang 0.5.23's launcher of each op on a twin case, timed the
same way (its fused step: the sum of its four launches).

With ``--stages``, each piece of a repeated call is also timed alone (:func:`stages`).

    python -m bench.bridge_profile [--bs 64] [--iters 300] [--sglang] [--stages] [--out f.json]
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
from kvcanary_jax.bridge.cache import CACHES


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
            if obj is None:
                orig()  # an undo callable
            else:
                setattr(obj, attr, orig)


def _timed_runners(acc):
    """Time triton's compiled launcher inside ``Loaded.launch`` (``triton_launcher``) and count
    its calls (``kernels``); returns the undo."""
    orig = triton_direct.Loaded.runner

    def runner(self, i, divisibility):
        r = orig(self, i, divisibility)

        def timed(*a, **k):
            t = time.perf_counter()
            try:
                return r(*a, **k)
            finally:
                acc["triton_launcher"] += time.perf_counter() - t
                acc["kernels"] += 1

        return timed

    def forget():
        # A launch keeps the runners it was given (each kernel's default, and those chosen per
        # alignment pattern): every kept program fetches them again, through the wrap or not.
        for entry in list(CACHES.programs._d.values()):
            if isinstance(entry, triton_direct.Loaded):
                entry._defaults = [None] * len(entry.program.kernels)
                entry._variants = {}

    def undo():
        triton_direct.Loaded.runner = orig
        forget()

    triton_direct.Loaded.runner = runner
    forget()
    return undo


def _per_call(fn, c, iters: int) -> float:
    for _ in range(5):
        fn(c)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(iters):
        fn(c)
    total = time.perf_counter() - t
    torch.cuda.synchronize()
    return round(total / iters * 1e6, 2)


def sglang_host(*, bs: int = 64, iters: int = 300) -> dict:
    """SGLang's launchers on a twin case, per call (us), timed like ours."""
    lib = bo._SglangLib(cuda_jit=True)
    c = bo.make_case(device="cuda", bs=bs)
    ops = dict(scatter=bo.run_scatter, plan=bo.run_plan, verify=bo.run_verify,
               write=bo.run_write)
    out = {name: _per_call(lambda cc, f=fn: f(cc, lib), c, iters) for name, fn in ops.items()}
    out["step_fused"] = round(sum(out.values()), 2)
    return out


def profile(*, bs: int = 64, iters: int = 300, sglang: bool = False) -> dict:
    c = bo.make_case(device="cuda", bs=bs)
    ops = dict(scatter=bo.run_scatter, plan=bo.run_plan, verify=bo.run_verify,
               write=bo.run_write, step_fused=bo.run_step)
    out = {"bs": bs, "iters": iters}
    for name, fn in ops.items():
        for _ in range(5):
            fn(c)
        torch.cuda.synchronize()
        st = _Stages()
        st._undo.append((None, None, _timed_runners(st.acc)))
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
        kernels = st.acc.pop("kernels", 0) / iters
        us = {k: round(v / iters * 1e6, 2) for k, v in st.acc.items()}
        us["total"] = round(total / iters * 1e6, 2)
        # triton_launcher is part of launch: the rest is what no stage accounts for.
        us["rest"] = round(us["total"] - sum(v for k, v in us.items()
                                             if k not in ("total", "triton_launcher")), 2)
        us["kernels"] = kernels
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
    if sglang:
        out["sglang"] = sglang_host(bs=bs, iters=iters)
    return out


def stages(*, bs: int = 64, number: int = 2000, repeat: int = 7) -> dict:
    """Each piece of a repeated call on the direct path, timed alone (the best of ``repeat``
    runs of ``number`` calls, us): the call's tensors (``bind``), its non-tensor arguments,
    the written tensors' addresses, the front's lookup and match, the signature it saves
    (for comparison), the pointers, the stream and device reads, the launch (with triton's
    launcher, ``runners``: that alone), and the whole call."""
    import timeit

    from kvcanary_jax.bridge import launcher

    c = bo.make_case(device="cuda", bs=bs)
    ops = dict(scatter=(bo.run_scatter, declarations.SCATTER),
               plan=(bo.run_plan, declarations.PLAN), verify=(bo.run_verify, declarations.VERIFY),
               write=(bo.run_write, declarations.WRITE), step_fused=(bo.run_step, declarations.STEP))
    out = {}

    def best(fn):
        fn()
        torch.cuda.synchronize()
        t = min(timeit.repeat(fn, number=number, repeat=repeat)) / number * 1e6
        torch.cuda.synchronize()
        return round(t, 2)

    for name, (run, decl) in ops.items():
        seen = {}
        call = launcher.Launcher.__call__

        def grab(self, **kw):
            seen.update(kw)
            return call(self, **kw)

        launcher.Launcher.__call__ = grab
        try:
            run(c)
        finally:
            launcher.Launcher.__call__ = call
        L = launcher.Launcher(decl)
        kw = seen
        tensors = decl.tensors(kw)
        values, statics = tuple(tensors.values()), decl.statics(kw)
        addressed = tuple([t.data_ptr() if isinstance(t, torch.Tensor) else None
                           for t in L._addressed(tensors)])
        f = CACHES.front.get((decl.name, addressed))
        prep = f.prepared
        entry = prep.program.get()
        device = tensors[decl.anchor].device
        ptrs, _ = launcher.Launcher.pointers(prep, tensors, True, device)
        stream = torch.cuda.current_stream().cuda_stream
        pool = list(ptrs) + list(entry.const_ptrs)
        runners = [(entry._defaults[i] or entry.runner(i, None), g)
                   for i, g in enumerate(entry.gathers)]

        def launch_runners():
            for r, g in runners:
                r(*g(pool), stream=stream)

        metas = launcher._metas
        out[name] = dict(
            bind=best(lambda: decl.tensors(kw)),
            statics=best(lambda: decl.statics(kw)),
            addressed=best(lambda: tuple([t.data_ptr() if type(t) is torch.Tensor else None
                                          for t in L._addressed(tensors)])),
            front=best(lambda: CACHES.front.get((decl.name, addressed)).match(values, statics)),
            signature_saved=best(lambda: CACHES.prepared.get(launcher.Signature(
                decl.name, metas(values), statics, addressed))),
            pointers=best(lambda: launcher.Launcher.pointers(prep, tensors, True, device)),
            stream=best(lambda: launcher._raw_stream(0)),
            current_device=best(lambda: launcher._current_device()),
            launch=best(lambda: entry.launch(ptrs, stream, None)) if not entry.scratch_bytes
            else None,
            runners=best(launch_runners) if not entry.scratch_bytes else None,
            call=best(lambda: run(c)),
        )
    x = torch.zeros(16, device="cuda")
    out["torch_add_"] = best(lambda: x.add_(1))
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
    p.add_argument("--sglang", action="store_true",
                   help="also time SGLang 0.5.23's launchers (needs its CUDA JIT kernels)")
    p.add_argument("--stages", action="store_true",
                   help="also time each piece of a repeated call alone (stages())")
    p.add_argument("--out")
    a = p.parse_args(argv)
    out = profile(bs=a.bs, iters=a.iters, sglang=a.sglang)
    if a.stages:
        out["stages"] = stages(bs=a.bs)
    print(json.dumps(out, indent=1))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
