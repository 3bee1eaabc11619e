"""Backend selection, x64 scoping and Pallas/Triton imports shared by every kernel.

x64: the canary's fields are int64 (token ids, positions, 64-bit hashes). JAX keeps 64-bit types
off by default and then silently narrows int64 to int32. Every public entry point of this package
runs its tracing under :func:`x64_scope` (``jax.enable_x64(True)``, thread-local and restored on
exit), so the caller's global ``jax_enable_x64`` flag is never flipped. A caller who traces our
ops inside their own ``jax.jit`` with x64 off will hand us int32 arrays where int64 is required:
the contract then raises SGLang's dtype error with a hint that names the fix.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import warnings

import jax

# The Triton lowering of Pallas is deprecated in jax 0.11 (still present in 0.12) but is the only
# GPU lowering with gathers, masked scatters and cumsum; silence the notice for our kernels only.
warnings.filterwarnings("ignore", message=".*[Tt]riton.*", category=DeprecationWarning)

from jax.experimental import pallas as pl  # noqa: E402
from jax.experimental.pallas import triton as plt  # noqa: E402

__all__ = ["pl", "plt", "default_interpret", "x64_scope", "x64_enabled", "compiler_params"]


def default_interpret() -> bool:
    """Run Pallas kernels in interpret mode unless JAX's default backend is a GPU."""
    return jax.default_backend() != "gpu"


def x64_enabled() -> bool:
    return bool(jax.config.read("jax_enable_x64"))


def x64_scope():
    """Context manager enabling 64-bit types for the current thread only."""
    if x64_enabled():
        return contextlib.nullcontext()
    return jax.enable_x64(True)


# Whether 64-bit types were on where the caller stood, before our scope switched them on: an int32
# array where int64 is required is then most likely JAX's silent narrowing, and errors say so.
_caller_x64 = contextvars.ContextVar("kvcanary_caller_x64", default=True)

X64_HINT = (
    " (JAX's jax_enable_x64 is off where this op was traced, so int64 arrays were narrowed to "
    "int32; create and trace them under `with jax.enable_x64(True):` or set JAX_ENABLE_X64=1)"
)


def caller_had_x64() -> bool:
    return _caller_x64.get()


def with_x64(fn):
    """Decorator: run ``fn`` under :func:`x64_scope`, remembering the caller's x64 state."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        token = _caller_x64.set(_caller_x64.get() and x64_enabled())
        try:
            with x64_scope():
                return fn(*args, **kwargs)
        finally:
            _caller_x64.reset(token)

    return wrapper


def compiler_params(num_warps: int, num_stages: int = 1):
    return plt.CompilerParams(num_warps=num_warps, num_stages=num_stages)
