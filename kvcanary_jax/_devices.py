"""Picking the platform a command line runs on (the demo's and the benchmarks' ``--device``).

Kept apart from :mod:`kvcanary_jax.cli` so that the benchmarks (``bench/``) use it without
importing the command line, which itself launches the benchmark for ``kvcanary-jax bench``."""

from __future__ import annotations

__all__ = ["select_device"]


def select_device(device: str) -> None:
    """Pins JAX to the host for ``cpu`` (before JAX initialises its backends); for ``gpu``,
    checks that JAX's default backend is a GPU."""
    import jax

    if device == "cpu":
        jax.config.update("jax_platforms", "cpu")
        return
    if jax.default_backend() != "gpu":
        raise SystemExit("kvcanary-jax: --device gpu needs a CUDA GPU (JAX sees "
                         f"{jax.default_backend()!r})")
