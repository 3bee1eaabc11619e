"""Registers, spills and 16-byte loads of the KV digest's Triton kernels, on any machine.

    python -m bench.digest_resources [--sweep] [--cases write,verify]

For each case of ``bench/op_digest.py`` (its full model) and launch config (the heuristics', or
with ``--sweep`` the sweep's variants), the Pallas kernels are lowered for CUDA, their Triton IR
compiled for sm_90 by the ``triton`` package's own compiler (``ptxas`` included: no GPU needed),
and ``cuobjdump`` of the same package reports per kernel: grid, registers a thread, stack (spill)
bytes a thread, and how many of the loads are 16 bytes wide. A kernel over 128 registers runs
fewer than 4 programs of 4 warps an SM; one with stack bytes spills to local memory.

The Triton IR comes from JAX's Pallas lowering (its module is captured while the op lowers), so
this reads what JAX hands XLA; XLA's own Triton may schedule the same IR a little differently.
Needs the ``triton`` package (the torch wheel's).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

from kvcanary_jax.bench import op_digest

TARGET = ("cuda", 90, 32)


def _capture():
    """A list that fills with ``(kernel name, Triton IR text, grid)`` as Pallas lowers kernels."""
    from jax._src.pallas.triton import lowering, pallas_call_registration

    seen = []
    inner = lowering.lower_jaxpr_to_triton_module

    def lower(jaxpr, grid_mapping, *args, **kwargs):
        out = inner(jaxpr, grid_mapping, *args, **kwargs)
        seen.append((jaxpr.debug_info.func_name,
                     out.module.operation.get_asm(enable_debug_info=False), out.grid))
        return out

    pallas_call_registration.lowering.lower_jaxpr_to_triton_module = lower
    return seen


def _resources(text: str, config, workdir: str) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget

    path = os.path.join(workdir, "kernel.ttir")
    with open(path, "w") as f:
        f.write(text)
    compiled = triton.compile(path, target=GPUTarget(*TARGET),
                              options=dict(num_warps=config.num_warps,
                                           num_stages=config.num_stages))
    cubin = os.path.join(workdir, "kernel.cubin")
    with open(cubin, "wb") as f:
        f.write(compiled.asm["cubin"])
    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    usage = subprocess.run([os.path.join(tools, "cuobjdump"), "-res-usage", cubin],
                           capture_output=True, text=True, check=True).stdout
    sass = subprocess.run([os.path.join(tools, "cuobjdump"), "-sass", cubin],
                          capture_output=True, text=True, check=True).stdout
    field = lambda name: int(re.search(rf"{name}:(\d+)", usage).group(1))  # noqa: E731
    return {"registers": field("REG"), "stack": field("STACK"),
            "loads": sass.count("LDG"), "loads_16B": sass.count("LDG.E.128")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.digest_resources",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--sweep", action="store_true", help="the sweep's variants too")
    ap.add_argument("--cases", default="write,verify", help="functions to report")
    args = ap.parse_args(argv)
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

    import jax
    import jax.numpy as jnp
    from jax.sharding import AbstractDevice, AbstractMesh, AxisType

    import kvcanary_jax as kc
    from kvcanary_jax.ops.digest import pallas_triton

    seen = _capture()
    model = op_digest.FULL_MODEL
    # Lowering reads the GPU's kind from the device; off a GPU an abstract mesh names one.
    h200 = AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="cuda")
    mesh = AbstractMesh((1,), ("x",), axis_types=(AxisType.Auto,), abstract_device=h200)
    wanted = set(args.cases.split(","))
    with jax.enable_x64(True), tempfile.TemporaryDirectory() as workdir:
        slots = 1024  # the buffers' size changes no kernel but its index width (int32 here too)
        width = 2 * model["heads"] * model["head_dim"]
        kv = [jnp.zeros((slots, width), jnp.bfloat16) for _ in range(model["layers"])]
        sources = tuple(kc.RealKvSource(tensor=b, page_size=1, num_bytes_per_token=width * 2,
                                        read_bytes=width * 2) for b in kv)
        for case in op_digest.FULL_CASES:
            if case["function"] not in wanted:
                continue
            shapes = op_digest.shapes_of(case, model)
            first = pallas_triton.heuristics(shapes)
            configs = op_digest.variants(first, verify=bool(shapes["verify"])) if args.sweep \
                else [first]
            n = shapes["capacity"]
            for config in configs:
                seen.clear()
                if case["function"] == "write":
                    fn = jax.jit(lambda b, s, src, c=config: kc.digest_write(
                        b, s, src, implementation="pallas_triton", config=c))
                    call = (jnp.zeros(slots, jnp.int64), jnp.zeros(n, jnp.int64), sources)
                else:
                    def fn(ctx, s, p, nv, ph, src, c=config, w=case["window"]):
                        return kc.digest_verify(ctx, s, p, nv, ph, window=w, sources=src,
                                                implementation="pallas_triton", config=c)

                    fn = jax.jit(fn)
                    i32 = jnp.zeros((1,), jnp.int32)
                    call = (kc.DigestContext.allocate(num_slots=slots, ring_capacity=1024),
                            jnp.zeros(n, jnp.int64), jnp.zeros(n, jnp.int64), i32, i32, sources)
                with jax.sharding.use_abstract_mesh(mesh):
                    fn.trace(*call).lower(lowering_platforms=("cuda",))
                parts = []
                for name, text, grid in seen:
                    r = _resources(text, config, workdir)
                    parts.append(f"{name.removeprefix('kvcanary_digest_')}[{grid[0]}] "
                                 f"reg={r['registers']} stack={r['stack']} "
                                 f"16B-loads={r['loads_16B']}/{r['loads']}")
                print(f"| {op_digest._case_name(case)} | {op_digest.config_text(config)} | "
                      f"{' ; '.join(parts)} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
