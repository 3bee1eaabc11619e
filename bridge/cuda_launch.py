"""Compiled Triton kernels launched through CUDA's driver API (``cuLaunchKernel``) from Python.

triton's own launcher (``compiled[grid](*args, stream=...)``) costs 8-9 us a kernel on the host
(bench/NOTES.md, "where a direct launch's host time goes"): launch metadata built per call, its
hooks, the arguments parsed against the signature, the scratch allocators asked. The direct path's
kernels need none of it: every parameter is a device pointer, no kernel has global or profile
scratch, clusters, cooperative or programmatic launches. :func:`runner` gives such a kernel a
launch of its own: the pointers written into a parameter block bound once, one ``cuLaunchKernel``
through ``ctypes`` (libcuda, which every CUDA machine has: nothing to compile, nothing to
install).

A kernel that is not of that kind, a machine whose driver cannot list a kernel's parameters
(``cuFuncGetParamInfo``, CUDA 12.4), or ``KVCANARY_BRIDGE_LAUNCH=triton`` keeps triton's launcher
(:func:`why_not` says why), and so does every call while a triton launch hook is set (a
profiler, such as proton, that sees launches through it). The result is the same kernel on the
same stream with the same pointers either way.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Callable, Sequence

from kvcanary_jax.bridge.dlpack import BridgeError
from kvcanary_jax.bridge.switches import choice, env_choice

__all__ = ["runner", "why_not", "set_launch", "launch_choice", "LAUNCHES"]

# The launch a runner takes: "driver" (this module) or "triton" (triton's own launcher).
LAUNCHES = ("driver", "triton")
_CHOICE = {"launch": env_choice("KVCANARY_BRIDGE_LAUNCH", "driver", LAUNCHES)}

_CUDA_ERROR_INVALID_CONTEXT = 201
_CUDA_ERROR_INVALID_VALUE = 1


def set_launch(value) -> None:
    """``"driver"`` or ``"triton"`` (any case; ``KVCANARY_BRIDGE_LAUNCH``, default driver): how
    the direct path launches kernels prepared after this call. A refused value changes nothing."""
    _CHOICE["launch"] = choice("set_launch", value, LAUNCHES)


def launch_choice() -> str:
    return _CHOICE["launch"]


class _Driver:
    """libcuda's entry points this module calls, typed once (``ctypes`` converts by them)."""

    def __init__(self):
        lib = ctypes.CDLL("libcuda.so.1")
        u, p, sz = ctypes.c_uint, ctypes.c_void_p, ctypes.c_size_t
        self.launch = lib.cuLaunchKernel
        self.launch.argtypes = [p, u, u, u, u, u, u, u, p, p, p]
        self.launch.restype = ctypes.c_int
        self.param_info = getattr(lib, "cuFuncGetParamInfo", None)
        if self.param_info is not None:
            self.param_info.argtypes = [p, sz, ctypes.POINTER(sz), ctypes.POINTER(sz)]
            self.param_info.restype = ctypes.c_int
        self.error_name = lib.cuGetErrorName
        self.error_name.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        self.device_get = lib.cuDeviceGet
        self.device_get.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int]
        self.retain = lib.cuDevicePrimaryCtxRetain
        self.retain.argtypes = [ctypes.POINTER(p), ctypes.c_int]
        self.set_current = lib.cuCtxSetCurrent
        self.set_current.argtypes = [p]

    def name(self, rc: int) -> str:
        s = ctypes.c_char_p()
        return s.value.decode() if self.error_name(rc, ctypes.byref(s)) == 0 and s.value \
            else f"CUDA error {rc}"

    def num_params(self, function: int) -> int | None:
        """The kernel's parameter count where each is 8 bytes, else None."""
        off, size = ctypes.c_size_t(), ctypes.c_size_t()
        n = 0
        while True:
            rc = self.param_info(function, n, ctypes.byref(off), ctypes.byref(size))
            if rc == _CUDA_ERROR_INVALID_VALUE:
                return n
            if rc != 0 or size.value != 8:
                return None
            n += 1

    def make_current(self, ordinal: int) -> None:
        """The device's primary context (torch's for that device) current on this thread."""
        dev, ctx = ctypes.c_int(), ctypes.c_void_p()
        rc = self.device_get(ctypes.byref(dev), ordinal)
        rc = rc or self.retain(ctypes.byref(ctx), dev.value)
        rc = rc or self.set_current(ctx)
        if rc:
            raise BridgeError(f"kv-canary bridge: cannot make CUDA device {ordinal}'s context "
                              f"current ({self.name(rc)})")


_DRIVER: list = []  # [_Driver] or [reason it cannot load], once per process
_DRIVER_LOCK = threading.Lock()


def _driver():
    if not _DRIVER:
        with _DRIVER_LOCK:
            if not _DRIVER:
                try:
                    _DRIVER.append(_Driver())
                except (OSError, AttributeError) as e:
                    _DRIVER.append(f"libcuda's launch API is not loadable ({e})")
    return _DRIVER[0]


def _meta(compiled, name, default=0):
    return getattr(compiled.metadata, name, default) or default


def why_not(compiled, num_args: int) -> str:
    """"" where :func:`runner` can launch ``compiled`` (handles loaded) with ``num_args``
    pointers, else the reason it keeps triton's launcher."""
    if _CHOICE["launch"] != "driver":
        return "KVCANARY_BRIDGE_LAUNCH=triton"
    if not hasattr(compiled, "metadata") or not isinstance(getattr(compiled, "function", None),
                                                           int):
        return "not a loaded triton kernel"
    drv = _driver()
    if isinstance(drv, str):
        return drv
    if drv.param_info is None:
        return "the CUDA driver has no cuFuncGetParamInfo (CUDA 12.4 or newer lists parameters)"
    for key in ("global_scratch_size", "profile_scratch_size", "launch_cooperative_grid",
                "launch_pdl"):
        if _meta(compiled, key):
            return f"the kernel needs {key}"
    if _meta(compiled, "num_ctas", 1) != 1:
        return "the kernel runs in clusters"
    n = drv.num_params(compiled.function)
    # triton appends its scratch pointers (none here: passed as null) after the arguments.
    if n is None or not num_args <= n <= num_args + 2:
        return f"the kernel takes {n} parameters where {num_args} pointers (and scratch) go"
    return ""


def _hooked(hook) -> bool:
    """A triton launch hook is set: a callable, or a chain of them (``knobs.HookChain``, empty
    by default) holding one."""
    return hook is not None and bool(getattr(hook, "calls", True))


class _Runner:
    """``runner(*pointers, stream=raw_stream)``: one ``cuLaunchKernel`` of a loaded kernel."""

    def __init__(self, compiled, grid: Sequence[int], device: int, fallback: Callable, n: int):
        drv = _driver()
        self._launch, self._drv = drv.launch, drv
        self._device = device
        self._fallback = fallback
        self._function = ctypes.c_void_p(compiled.function)
        gx, gy, gz = (tuple(grid) + (1, 1))[:3]
        self._dims = (gx, gy, gz, 32 * compiled.metadata.num_warps, 1, 1,
                      compiled.metadata.shared)
        self._n = n
        # The parameter block: n pointers, each at its own 8 bytes, and the table of their
        # addresses that cuLaunchKernel reads (it copies the values before it returns).
        self._values = (ctypes.c_uint64 * n)()
        base = ctypes.addressof(self._values)
        self._table = (ctypes.c_void_p * n)(*(base + 8 * i for i in range(n)))
        self._lock = threading.Lock()
        try:
            from triton import knobs
            self._hooks = knobs.runtime
        except ImportError:  # older triton: its launch hooks live elsewhere; none read here
            self._hooks = None

    def __call__(self, *ptrs, stream):
        hooks = self._hooks
        if hooks is not None and (_hooked(hooks.launch_enter_hook)
                                  or _hooked(hooks.launch_exit_hook)):
            return self._fallback(*ptrs, stream=stream)
        with self._lock:  # one parameter block: two threads' pointers never mix
            values = self._values
            for i, p in enumerate(ptrs):
                values[i] = p
            rc = self._launch(self._function, *self._dims, stream, self._table, None)
            if rc == _CUDA_ERROR_INVALID_CONTEXT:  # a thread with no context current yet
                self._drv.make_current(self._device)
                rc = self._launch(self._function, *self._dims, stream, self._table, None)
        if rc:
            raise BridgeError(f"kv-canary bridge: cuLaunchKernel failed ({self._drv.name(rc)})")


def runner(compiled, grid: Sequence[int], device: int, num_args: int) -> tuple[Callable, str]:
    """The launch of a loaded triton kernel (``compiled[grid]`` already taken, so its handles are
    loaded on ``device``) with ``num_args`` pointer arguments, and "" or why it is triton's."""
    fallback = compiled[tuple(grid)]
    reason = why_not(compiled, num_args)
    if reason:
        return fallback, reason
    return _Runner(compiled, grid, device, fallback, num_args + 2), ""
