"""The implementations each op's suite runs: every one that runs on this machine
(:func:`kvcanary_jax.implementations_available`: ``pallas_interpret`` and ``xla`` on a CPU,
``pallas_triton`` too on a CUDA GPU), narrowed by ``KVCANARY_TEST_IMPLEMENTATIONS=a,b`` when set
(e.g. ``pallas_triton,xla`` on the GPU machine, to leave the interpreter to the CPU runs)."""

from __future__ import annotations

import os

import contextlib

import jax

from kvcanary_jax import implementations_available


def implementations(op: str | None = None) -> tuple[str, ...]:
    """Implementations of ``op`` (None: of every op) to test here."""
    avail = implementations_available(op)
    only = os.environ.get("KVCANARY_TEST_IMPLEMENTATIONS")
    if not only:
        return avail
    asked = tuple(i.strip() for i in only.split(",") if i.strip())
    missing = [i for i in asked if i not in avail]
    if missing:
        raise RuntimeError(f"KVCANARY_TEST_IMPLEMENTATIONS asks for {missing}, not available "
                           f"here for {op or 'every op'} (available: {avail})")
    return asked


def pallas(op: str) -> tuple[str, ...]:
    """The Pallas implementations of ``op`` to test (they share one launch ``Config``)."""
    return tuple(i for i in implementations(op) if i in ("pallas_triton", "pallas_interpret"))


def in_reference_order(implementation: str) -> bool:
    """Whether ring rows come in the reference's order (else: as a multiset, GPU atomics)."""
    return implementation != "pallas_triton"


def lower(fn, args, platform: str):
    """``fn.trace(*args).lower(lowering_platforms=(platform,))`` (``fn`` jitted) on any machine.
    Since jax 0.12 Pallas's Triton lowering reads the GPU's kind from the device, which a machine
    without a GPU lacks: for CUDA an abstract mesh names one (an H200, the GPU this project runs
    on) while the function traces and lowers."""
    context = contextlib.nullcontext()
    if platform == "cuda":
        from jax.sharding import AbstractDevice, AbstractMesh, AxisType

        h200 = AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="cuda")
        context = jax.sharding.use_abstract_mesh(AbstractMesh(
            (1,), ("x",), axis_types=(AxisType.Auto,), abstract_device=h200))
    with context:
        return fn.trace(*args).lower(lowering_platforms=(platform,))
