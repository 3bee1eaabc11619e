"""The implementations each op's suite runs: every one that runs on this machine
(:func:`kvcanary_jax.implementations_available`: ``pallas_interpret`` and ``xla`` on a CPU,
``pallas_triton`` too on a CUDA GPU), narrowed by ``KVCANARY_TEST_IMPLEMENTATIONS=a,b`` when set
(e.g. ``pallas_triton,xla`` on the GPU machine, to leave the interpreter to the CPU runs).

``pallas_mosaic_tpu`` runs on a TPU; elsewhere the suites run its kernels in TPU interpret mode
(:func:`config`: its ``Config`` with ``interpret`` set), as the ``tpu_interpret`` parameter of
:func:`with_tpu`."""

from __future__ import annotations

import os

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


def config(op: str, implementation: str | None, **kw):
    """The launch config a test passes with ``implementation``: None (the op's choice), except
    ``pallas_mosaic_tpu`` off a TPU: its ``Config`` in TPU interpret mode."""
    if implementation != TPU:
        return None
    import importlib

    import jax

    from kvcanary_jax.ops import _tpu_lib

    mod = importlib.import_module(f"kvcanary_jax.ops.{op}.pallas_mosaic_tpu")
    if jax.default_backend() == "tpu":
        return mod.Config(**kw) if kw else None
    return mod.Config(interpret=_tpu_lib.interpret_params(), **kw)


def pallas(op: str) -> tuple[str, ...]:
    """The Pallas implementations of ``op`` to test (they share one launch ``Config``)."""
    return tuple(i for i in implementations(op) if i in ("pallas_triton", "pallas_interpret"))


def in_reference_order(implementation: str) -> bool:
    """Whether ring rows come in the reference's order (else: as a multiset, GPU atomics)."""
    return implementation != "pallas_triton"
