"""How the Mosaic TPU kernels are launched: the ``pallas_call`` plumbing and the launch configs.

:func:`call` traces a ``pallas_call`` with 64-bit types off; :func:`compiler_params` and
:func:`cost` are what every kernel passes it; :class:`Config` and :class:`BlockConfig` are what
every op's ``pallas_mosaic_tpu`` launch config has (checked when built); :func:`interpret_params`
is TPU interpret mode as the tests run it; :func:`tpu_lowering` lowers for a TPU on a machine
without one. :mod:`kvcanary_jax.ops._tpu_lib` re-exports everything here (the kernels import that
one module).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, ClassVar

import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kvcanary_jax.ops._tpu_formats import PAIR_TILE

__all__ = [
    "Config",
    "BlockConfig",
    "call",
    "compiler_params",
    "cost",
    "interpret_params",
    "tpu_lowering",
]


def call(kernel, *args, **pallas_kwargs):
    """``pl.pallas_call(kernel, **pallas_kwargs)(*args)`` traced with 64-bit types off: every
    kernel operand is 32-bit, and Python ints in the kernel (indices, constants) must become
    int32, which Mosaic requires, even when the caller traces under ``jax.enable_x64``."""
    with jax.enable_x64(False):
        return pl.pallas_call(kernel, **pallas_kwargs)(*args)


def compiler_params(vmem_limit_bytes: int | None = None):
    return pltpu.CompilerParams(dimension_semantics=("arbitrary",),
                                vmem_limit_bytes=vmem_limit_bytes)


def cost(*, bytes_accessed: int, ops: int = 0) -> pl.CostEstimate:
    """Integer work is reported as ``flops`` (XLA's scheduler only compares magnitudes)."""
    return pl.CostEstimate(flops=int(ops), transcendentals=0, bytes_accessed=int(bytes_accessed))


@dataclasses.dataclass(frozen=True)
class Config:
    """What every op's Mosaic TPU launch config has. ``vmem_limit_bytes``: Mosaic's scoped VMEM
    limit (None: the compiler's default). ``interpret``: None to compile for TPU; a
    ``pltpu.InterpretParams`` runs the kernels in TPU interpret mode instead (any backend; the
    CPU test suites use :func:`interpret_params`). Anything else (``True``, ``1``, ``"yes"``)
    is refused with a TypeError when the config is built (our rule: Pallas would take it as
    generic interpret mode and fail inside XLA with an unrelated slice TypeError). Subclasses
    name their op in ``OP`` (for the errors) and call ``super().__post_init__()``."""

    OP: ClassVar[str] = ""
    vmem_limit_bytes: int | None = None
    interpret: Any = None

    def __post_init__(self):
        where = f"kv-canary: {self.OP or 'Config'} (pallas_mosaic_tpu)"
        if self.interpret is not None and not isinstance(self.interpret, pltpu.InterpretParams):
            raise TypeError(
                f"{where}: interpret must be None (compile for TPU) or a "
                "jax.experimental.pallas.tpu.InterpretParams (TPU interpret mode, e.g. "
                "kvcanary_jax.ops._tpu_lib.interpret_params()), got "
                f"{type(self.interpret).__name__} {self.interpret!r}")
        v = self.vmem_limit_bytes
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v <= 0):
            raise TypeError(f"{where}: vmem_limit_bytes must be None or a positive int, got "
                            f"{type(v).__name__} {v!r}")


@dataclasses.dataclass(frozen=True)
class BlockConfig(Config):
    """A config whose kernels work in blocks of ``block`` entries, a positive multiple of
    ``PAIR_TILE`` (whole 8 x 128 tiles of pair rows). Subclasses name their op in ``OP`` (for
    the error) and set ``block``'s default."""

    block: int = 1024

    def __post_init__(self):
        super().__post_init__()
        if self.block < PAIR_TILE or self.block % PAIR_TILE:
            raise ValueError(f"kv-canary: {self.OP} (pallas_mosaic_tpu): block must be a "
                             f"positive multiple of {PAIR_TILE}, got {self.block}")


def interpret_params(*, detect_races: bool = True):
    """TPU interpret mode as the tests run it: out-of-bounds reads raise, fresh memory is
    poisoned, and the race detector is on unless ``detect_races=False`` (it about doubles a
    kernel's interpreted time)."""
    return pltpu.InterpretParams(out_of_bounds_reads="raise", detect_races=bool(detect_races),
                                 uninitialized_memory="nan")


@contextlib.contextmanager
def tpu_lowering(device_kind: str = "TPU v6 lite"):
    """Context in which ``jax.jit(f).trace(...).lower(lowering_platforms=("tpu",))`` lowers for a
    TPU of ``device_kind`` on a machine without one (the Mosaic lowering asks the device kind)."""
    from jax.sharding import AbstractMesh, AxisType

    try:
        from jax.sharding import AbstractDevice
    except ImportError:  # jax < 0.11
        from jax._src.mesh import AbstractDevice
    dev = AbstractDevice(device_kind=device_kind, num_cores=1, platform="tpu")
    mesh = AbstractMesh((1,), ("x",), (AxisType.Auto,), abstract_device=dev)
    with jax.sharding.use_abstract_mesh(mesh):
        yield
