"""The implementations each op's suite runs: every one that runs on this machine
(:func:`kvcanary_jax.implementations_available`: ``pallas_interpret`` and ``xla`` on a CPU,
``pallas_triton`` too on a CUDA GPU), narrowed by ``KVCANARY_TEST_IMPLEMENTATIONS=a,b`` when set
(e.g. ``pallas_triton,xla`` on the GPU machine, to leave the interpreter to the CPU runs)."""

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


def pallas(op: str) -> tuple[str, ...]:
    """The Pallas implementations of ``op`` to test (they share one launch ``Config``)."""
    return tuple(i for i in implementations(op) if i in ("pallas_triton", "pallas_interpret"))


def in_reference_order(implementation: str) -> bool:
    """Whether ring rows come in the reference's order (else: as a multiset, GPU atomics)."""
    return implementation != "pallas_triton"
