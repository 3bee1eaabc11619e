"""The device programs of the canary's serving calls, lowered for CUDA on any machine, as digests:
run it on two commits to show that a change leaves what runs on the GPU as it was (a host-side
change, a check made while tracing), or to see which programs a change touches.

    python -m bench.lowered_programs [--implementation pallas_triton,xla] [--dump DIR]

Lowers (``jit(...).trace(...).lower(lowering_platforms=("cuda",))``, an H200 named by an
abstract mesh, as tests/test_lowering.py does) the step ``make_canary_step`` jits, and the
manager's fused step, TAIL, sweep (with the padding guard), readback and coverage counts, for a
config with the coverage window, SWA off, both halves and 3 layers; prints one line per program:
its name, the SHA-256 of its text (first 16 hex digits) and the text's length. ``--dump`` writes
the texts. Run both commits from the same directory: the Triton kernels' serialized IR carries
their source locations, so a checkout elsewhere reads as different.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import warnings

import jax
import jax.numpy as jnp
from jax.sharding import AbstractDevice, AbstractMesh, AxisType

from kvcanary_jax import runtime as rt
from kvcanary_jax.runtime import coverage, device, health
from kvcanary_jax.testing.forward import write_every_layer

LAYERS, SLOTS, WIDTH = 3, 32, 8


def _lower(fn, args) -> str:
    h200 = AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="cuda")
    with jax.sharding.use_abstract_mesh(AbstractMesh((1,), ("x",), axis_types=(AxisType.Auto,),
                                                     abstract_device=h200)):
        jitted = fn if hasattr(fn, "trace") else jax.jit(fn)  # a jit keeps its donations
        return jitted.trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def programs(implementation: str) -> dict[str, str]:
    """Program name -> its lowered text."""
    cfg = rt.CanaryConfig(max_reqs=4, context_len=16, num_slots=SLOTS, max_bs=2, max_tokens=8,
                          ring_capacity=64, implementation=implementation, coverage_window=4,
                          num_layers=LAYERS, enable_v_half=True)
    batch = rt.make_batch(cfg, req_pool_indices=[1], prefix_lens=[0], extend_seq_lens=[2],
                          all_ids=[[5, 6]], input_ids=[5, 6], positions=[0, 1],
                          out_cache_loc=[1, 2])
    with jax.enable_x64(True):
        state = rt.init_state(cfg)
        kv = {"FULL": {"layers": {h: tuple(jnp.zeros((SLOTS, WIDTH), jnp.bfloat16)
                                           for _ in range(LAYERS)) for h in ("K", "V")}}}
        rtt, lut = jnp.zeros((4, 16), jnp.int32), jnp.arange(SLOTS, dtype=jnp.int64)
        phase = health.initial_phase(True)
        sweep_rows = (jnp.zeros((4, 16), jnp.int32), jnp.arange(4, dtype=jnp.int64),
                      jnp.full((4,), 3, jnp.int64))
        step = rt.make_canary_step(cfg, write_every_layer)
        return {
            "step": _lower(step.jitted, (state, kv, batch, rtt, lut)),
            "fused": _lower(lambda *a: device.fused(*a, cfg=cfg, forward=write_every_layer),
                            (state, phase, kv, batch, rtt, lut)),
            "tail": _lower(lambda *a: device.tail_only(*a, cfg=cfg),
                           (state, phase, batch, lut, kv)),
            "sweep": _lower(lambda *a: device.sweep_fn(*a, cfg=cfg, guard=True),
                            (state, *sweep_rows, lut, kv)),
            "observe": _lower(lambda *a: device.observe_fn(*a, cfg=cfg), (state, phase)),
            "counts": _lower(lambda s: coverage.counts(cfg, s), (state,)),
        }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.lowered_programs", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--implementation", default="pallas_triton,xla",
                   help="comma list (default pallas_triton,xla)")
    p.add_argument("--dump", default=None, help="write each program's text into this folder")
    args = p.parse_args(argv)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for impl in args.implementation.split(","):
            for name, text in programs(impl).items():
                print(f"{name}/{impl} {hashlib.sha256(text.encode()).hexdigest()[:16]} {len(text)}")
                if args.dump:
                    os.makedirs(args.dump, exist_ok=True)
                    with open(os.path.join(args.dump, f"{name}_{impl}.txt"), "w") as f:
                        f.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
