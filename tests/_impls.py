"""The implementations each op's suite runs: every one that runs on this machine
(:func:`kvcanary_jax.implementations_available`: ``pallas_interpret`` and ``xla`` on a CPU,
``pallas_triton`` too on a CUDA GPU), narrowed by ``KVCANARY_TEST_IMPLEMENTATIONS=a,b`` when set
(e.g. ``pallas_triton,xla`` on the GPU machine, to leave the interpreter to the CPU runs).

``pallas_mosaic_tpu`` runs on a TPU; elsewhere the suites run its kernels in TPU interpret mode
(:func:`config`: its ``Config`` with ``interpret`` set), as the ``tpu_interpret`` parameter of
:func:`with_tpu`."""

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


TPU = "pallas_mosaic_tpu"


def _tpu_wanted() -> bool:
    only = os.environ.get("KVCANARY_TEST_IMPLEMENTATIONS")
    return not only or TPU in (i.strip() for i in only.split(","))


def with_tpu(op: str | None = None) -> list:
    """:func:`implementations` plus ``pallas_mosaic_tpu`` (in TPU interpret mode off a TPU, marked
    ``tpu_interpret``), as pytest parameters."""
    import pytest

    impls = [i for i in implementations(op) if i != TPU]
    tpu = [pytest.param(TPU, marks=pytest.mark.tpu_interpret)] if _tpu_wanted() else []
    return impls + tpu


def tpu_interpreted(implementation: str | None) -> bool:
    """``pallas_mosaic_tpu`` off a TPU: its kernels run in TPU interpret mode, hundreds of times
    slower than the others here (long tests then run a short part, the rest on request)."""
    return implementation == TPU and jax.default_backend() != "tpu"


# Whether TPU interpret mode runs its race detector in the running test (it about doubles an
# interpreted kernel's time). Set per test by conftest's ``tpu_interpret_races`` fixture: on for
# every test under ``--long``; in the fast tier, on for the tests marked ``fuzz`` (every op's
# hostile fuzz, its fuzz against the jnp reference, the race tests) or ``tpu_races``, and off for
# the hand-written cases, which check bytes only.
DETECT_RACES = True


def config(op: str, implementation: str | None, **kw):
    """The launch config a test passes with ``implementation``: None (the op's choice), except
    ``pallas_mosaic_tpu`` off a TPU: its ``Config`` in TPU interpret mode (with the race detector
    as :data:`DETECT_RACES` says)."""
    if implementation != TPU:
        return None
    import importlib

    from kvcanary_jax.ops import _tpu_lib

    mod = importlib.import_module(f"kvcanary_jax.ops.{op}.pallas_mosaic_tpu")
    if not tpu_interpreted(implementation):
        return mod.Config(**kw) if kw else None
    return mod.Config(interpret=_tpu_lib.interpret_params(detect_races=DETECT_RACES), **kw)


def pallas(op: str) -> tuple[str, ...]:
    """The Pallas implementations of ``op`` to test (they share one launch ``Config``)."""
    return tuple(i for i in implementations(op) if i in ("pallas_triton", "pallas_interpret"))


def in_reference_order(implementation: str) -> bool:
    """Whether results are the reference's exactly, ring order included (else: the GPU, whose
    racing programs are compared by :mod:`_races` and :mod:`_write_races`)."""
    return implementation != "pallas_triton"


def lower(fn, args, platform: str, device_kind: str = "TPU v6 lite"):
    """``fn.trace(*args).lower(lowering_platforms=(platform,))`` (``fn`` jitted) on any machine.
    Since jax 0.12 Pallas's Triton lowering reads the GPU's kind from the device, which a machine
    without a GPU lacks: for CUDA an abstract mesh names one (an H200, the GPU this project runs
    on) while the function traces and lowers. The Mosaic TPU lowering reads the TPU generation
    the same way: for TPU one of ``device_kind`` is named."""
    context = contextlib.nullcontext()
    if platform == "cuda":
        from jax.sharding import AbstractDevice, AbstractMesh, AxisType

        h200 = AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="cuda")
        context = jax.sharding.use_abstract_mesh(AbstractMesh(
            (1,), ("x",), axis_types=(AxisType.Auto,), abstract_device=h200))
    elif platform == "tpu":
        from kvcanary_jax.ops import _tpu_lib

        context = _tpu_lib.tpu_lowering(device_kind)
    with context:
        return fn.trace(*args).lower(lowering_platforms=(platform,))
