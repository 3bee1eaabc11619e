"""x64 scoping and the scope that keeps the Triton-lowering notice to our own kernels.

x64: the canary's fields are int64 (token ids, positions, 64-bit hashes). JAX keeps 64-bit types
off by default and then silently narrows int64 to int32. Every public entry point of this package
runs its tracing under :func:`x64_scope` (``jax.enable_x64(True)``, thread-local and restored on
exit), so the caller's global ``jax_enable_x64`` flag is never flipped. A caller who traces our
ops inside their own ``jax.jit`` with x64 off will hand us int32 arrays where int64 is required:
the contract then raises SGLang's dtype error with a hint that names the fix.

The Triton notice: since jax 0.11, lowering a ``pallas_call`` through Triton emits a
``DeprecationWarning`` ("The Pallas Triton backend is deprecated ...", id ``jax-pallas-triton``).
The warning is raised when the enclosing ``jax.jit`` is *lowered*, not when our code traces the
``pallas_call``: tracing is lazy, lowering happens at the first call of the jitted function (or at
an explicit ``.lower()``). :func:`quiet_triton_lowering` ignores exactly that notice inside a
``warnings.catch_warnings()`` block, and :func:`entry_point` puts that block around every public
entry point that calls (and so lowers) our own jitted functions: the ops, the runtime's step
functions, the bridge's launches. Nothing changes ``warnings.filters`` outside those blocks. When
a caller traces our ops inside their own ``jax.jit``, the lowering happens in the caller's call,
outside our scope: the notice then follows the caller's own filters (hidden by Python's default
filters, which show ``DeprecationWarning`` only for ``__main__``); wrap that call in
:func:`quiet_triton_lowering` (``kvcanary_jax.quiet_triton_lowering``) to silence it there. ``warnings.catch_warnings`` swaps the
process-wide filter list while the block runs, so a warning raised by another thread during our
lowering may be filtered by it too (Python offers no thread-local filters before 3.14).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import warnings

import jax

__all__ = [
    "x64_scope",
    "x64_enabled",
    "with_x64",
    "caller_had_x64",
    "X64_HINT",
    "TRITON_NOTICE",
    "quiet_triton_lowering",
    "entry_point",
]


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


# The start of the notice JAX's Triton lowering emits (jax >= 0.11; a regex matched at the start).
TRITON_NOTICE = r"The Pallas Triton backend is deprecated"


@contextlib.contextmanager
def quiet_triton_lowering():
    """Ignore the Triton-lowering deprecation notice inside the block, and nothing else; the
    caller's warning filters are restored on exit."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=TRITON_NOTICE, category=DeprecationWarning)
        yield


def entry_point(fn):
    """Decorator for public entry points that call (and so may lower) our jitted kernels:
    :func:`with_x64` plus :func:`quiet_triton_lowering` around the call."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with quiet_triton_lowering():
            return fn(*args, **kwargs)

    return with_x64(wrapper)
