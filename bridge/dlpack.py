"""Torch memory handed to JAX and back over DLPack (the path for CPU tensors and the fallback).

Import: ``tensor.detach().__dlpack__()`` into jaxlib's ``dlpack_managed_tensor_to_buffer`` (what
``jax.dlpack.from_dlpack`` calls, without its per-call device lookups), always under a scoped
``jax.enable_x64(True)`` so an int64 tensor never arrives as int32 and the caller's global flag is
left alone. ``detach()`` makes an alias sharing the storage: a tensor with ``requires_grad=True``
(a real-KV source of a model under autograd) imports like any other, and the imported array holds
the alias, not the caller's tensor object, so a cache keyed by that object can let it go (see
:mod:`kvcanary_jax.bridge.views`). The array aliases the tensor's memory (``unsafe_buffer_pointer()
== data_ptr()``), except where JAX's CPU client finds the address less than 64-byte aligned (a
1-element view into a counters array): it then copies, which the launcher detects and answers with
a write-back.

In place: the jitted functions donate the output arrays and the kernels alias them, so on the GPU
XLA writes straight into the torch memory. JAX's CPU client does not donate buffers it imported
through DLPack (the kernel runs into a fresh buffer); there, and wherever an output's pointer is
not the tensor's, :func:`write_back` copies the logical view back into the caller's tensor.
Elements the kernel leaves alone come back with their old values either way.

Views: a 2-D tensor whose rows are strided (``pool[:, :n]``) is handed over as its compact base
``[rows, stride(0)]`` when that base lies inside the storage (the op is told the logical width and
never touches a column outside the view). A view the base cannot express (``pool[:, 2:6]`` of the
last rows of a storage, whose base would run past it) is copied into a compact temporary and
copied back after the call; :func:`stats` counts those copies.
"""

from __future__ import annotations

import collections
import dataclasses
import weakref
from typing import Any

import jax

from kvcanary_jax import _config

try:  # jaxlib's DLPack entry point (5-argument form since extension 467)
    from jax._src.lib import _jax as _jaxlib
    from jax._src.lib import jaxlib_extension_version as _JAXLIB_EXT
except ImportError:  # pragma: no cover
    _jaxlib = None
    _JAXLIB_EXT = 0

__all__ = [
    "BridgeError",
    "DeviceInfo",
    "device_info",
    "import_tensor",
    "carry_import",
    "released_but_held",
    "track_import",
    "write_back",
    "copy_into",
    "x64_scope",
    "STATS",
    "stats",
]

_DL_CPU, _DL_CUDA, _DL_ROCM = 1, 2, 10
# Page-locked host memory: torch's __dlpack_device__ says kDLCUDAHost (kDLROCMHost) for a pinned
# CPU tensor, while the capsule it exports says kDLCPU. Host memory all the same: the CPU path.
_DL_HOST = (_DL_CPU, 3, 11)


class BridgeError(ValueError):
    """A torch tensor the bridge cannot run on as given (the message says what to pass)."""


STATS: collections.Counter = collections.Counter()


def stats() -> dict[str, int]:
    """Counters: launches per path, imports, view-cache hits, write-backs, copies of views."""
    return dict(STATS)


def x64_scope():
    return _config.x64_scope()


@dataclasses.dataclass(frozen=True)
class DeviceInfo:
    torch_device: Any
    jax_device: Any
    dl_type: int
    is_gpu: bool
    stream: int | None  # JAX's stream for external ready events (GPU)


_DEVICES: dict[Any, DeviceInfo] = {}


def device_info(t, name: str) -> DeviceInfo:
    """The JAX device of torch tensor ``t`` (named ``name`` in errors)."""
    dev = t.device
    info = _DEVICES.get(dev)
    if info is not None:
        return info
    if dev.type == "meta":
        raise BridgeError(
            f"kv-canary bridge: {name} is on the meta device, which holds no data to run on; "
            "pass tensors on cpu or cuda"
        )
    dl_type, dl_id = t.__dlpack_device__()
    dl_type = int(dl_type)
    stream = None
    if dl_type in _DL_HOST and dev.type == "cpu":
        jdev, is_gpu, dl_type = jax.devices("cpu")[0], False, _DL_CPU
    elif dl_type in (_DL_CUDA, _DL_ROCM):
        try:
            gpus = jax.devices("gpu")
        except RuntimeError as e:
            raise BridgeError(
                f"kv-canary bridge: {name} is on {dev}, and JAX has no GPU backend "
                f"({jax.default_backend()!r} only) for the DLPack path; install jax[cuda] or "
                "triton for the direct path"
            ) from e
        matching = [d for d in gpus if getattr(d, "local_hardware_id", d.id) == int(dl_id)]
        if not matching:
            raise BridgeError(f"kv-canary bridge: JAX sees no GPU with hardware id {dl_id} ({dev})")
        jdev, is_gpu = matching[0], True
        try:
            stream = int(jdev.get_stream_for_external_ready_events())
        except (AttributeError, RuntimeError, NotImplementedError):  # UNIMPLEMENTED on some clients
            stream = None
    else:
        raise BridgeError(f"kv-canary bridge: unsupported device {dev} of {name}")
    info = DeviceInfo(torch_device=dev, jax_device=jdev, dl_type=dl_type, is_gpu=is_gpu,
                      stream=stream)
    _DEVICES[dev] = info
    return info


_FAST_IMPORT = _jaxlib is not None and _JAXLIB_EXT >= 467


def import_tensor(t, info: DeviceInfo):
    """A JAX array over compact tensor ``t``'s memory; the caller holds the x64 scope."""
    STATS["imports"] += 1
    alias = t.detach()
    if _FAST_IMPORT:
        cap = alias.__dlpack__(stream=info.stream) if info.is_gpu else alias.__dlpack__()
        array = _jaxlib.dlpack_managed_tensor_to_buffer(cap, info.jax_device, info.stream, None,
                                                        info.dl_type)
    else:
        array = jax.dlpack.from_dlpack(alias)
    if not info.is_gpu:  # released at exit only once XLA's CPU workers are done with it
        track_import(array, alias)
    return array


# Every CPU import that may still be held: id(alias) -> [weak reference to the JAX array that
# holds it, to the torch alias exported to it, the array's id]. An entry goes when the alias dies.
_IMPORTS: dict[int, list] = {}
_KEYS: dict[int, int] = {}  # id(array) -> its entry's key


def track_import(array, alias) -> None:
    """Record a CPU import: ``array``, the JAX array over ``alias``'s memory (the exit hook of
    :mod:`kvcanary_jax.bridge.views` waits for those a worker thread still holds)."""
    key = id(alias)

    def gone(_ref, key=key, imports=_IMPORTS, keys=_KEYS):
        entry = imports.get(key)
        if entry is not None and entry[1] is _ref:
            del imports[key]
            if keys.get(entry[2]) == key:
                del keys[entry[2]]

    _IMPORTS[key] = [weakref.ref(array), weakref.ref(alias, gone), id(array)]
    _KEYS[id(array)] = key


def carry_import(array, result) -> None:
    """``result``, a launch's output over the memory of import ``array`` (donated, so now
    deleted), holds that import from now on."""
    key = _KEYS.get(id(array))
    entry = _IMPORTS.get(key)
    if entry is None or entry[0]() is not array:
        return
    _KEYS.pop(id(array), None)  # (its alias' callback may have gone first)
    entry[0], entry[2] = weakref.ref(result), id(result)
    _KEYS[id(result)] = key


def released_but_held() -> int:
    """Imports a worker thread may still hold: the torch alias is alive while the JAX array that
    held it is gone or deleted (a donated operand)."""
    n = 0
    for array_ref, alias_ref, _ in list(_IMPORTS.values()):
        if alias_ref() is not None:
            array = array_ref()
            n += array is None or array.is_deleted()
    return n


def write_back(dst, result, cols: int | None = None) -> None:
    """Copy ``result`` (a JAX array) into torch tensor ``dst``; with ``cols`` only the first
    ``cols`` columns of each row (``result`` is then the compact base of ``dst``)."""
    import torch

    STATS["write_backs"] += 1
    src = torch.from_dlpack(result)
    if cols is not None:
        src = src[:, :cols]
    copy_into(dst, src.reshape(dst.shape))


def copy_into(dst, src) -> None:
    """``dst.copy_(src)`` into a caller's tensor, standing in for a kernel's write. An inference
    tensor (allocated under ``torch.inference_mode()``) refuses an in-place update outside the
    mode, while the kernels write its memory as they write any other (as SGLang's do): the copy
    runs inside the mode for it, so that a launch never fails half written."""
    import torch

    if dst.is_inference() and not torch.is_inference_mode_enabled():
        with torch.inference_mode():
            dst.copy_(src)
    else:
        dst.copy_(src)
