"""Handing torch memory to JAX and back: zero-copy import, a view cache, stream order, write-back.

Import. ``Tensor.__dlpack__`` + jaxlib's ``dlpack_managed_tensor_to_buffer`` (what
``jax.dlpack.from_dlpack`` calls, without its per-call device lookups: ~4 us instead of ~20 us on
CPU; ``from_dlpack`` measured 88 us on the H200) always under a scoped ``jax.enable_x64(True)``, so
an int64 tensor never arrives as int32 and the caller's global flag is left alone. The imported
array aliases the tensor's memory (``unsafe_buffer_pointer() == data_ptr()``), except where JAX's
CPU client finds the address less than 64-byte aligned (a 1-element view into a counters array): it
then copies, which :func:`commit_output` detects and answers with a write-back.

Views JAX's DLPack refuses. Only compact tensors import. A 2-D output whose rows are strided
(``pool[:, :n]``, a column slice of a wider table) is imported as its compact base
``[rows, stride(0)]`` (``as_strided`` over the same storage, checked to lie inside it) and the op
is told the logical width, so the kernel never writes a column of the base outside the view. Any
other non-compact tensor is refused with an error naming it.

In place. The bridge's jitted adapters donate the imported output arrays and the kernels alias them
to their outputs (``input_output_aliases``), so on the GPU XLA writes straight into the torch
memory. JAX's CPU client does not donate buffers it imported through DLPack (it runs the kernel
into a fresh buffer); there, and wherever an output's pointer is not the tensor's,
:func:`commit_output` copies the logical view back into the caller's tensor (``stats()`` counts
these write-backs). Elements the kernel leaves alone come back with their old values either way.

Cache. Importing costs a host round trip per tensor, so a tensor seen on two calls at the same
(address, shape, strides, dtype, device) *and with the same storage object* has its array kept
(:class:`ViewCache`); per-step temporaries (a new storage every call) are imported per call and
never kept. The storage identity check catches a tensor freed and reallocated at the same address
(an imported array also holds a DLPack reference to its storage, which keeps the address from being
reused while it lives; whether a donated output inherits that reference is the runtime's business,
the identity check does not depend on it). After a donated call the aliased output array replaces
the entry (its pointer is checked first). The cache is bounded (oldest entries evicted first, 512
by default); :func:`clear_cache` empties it and releases the storages it holds.

Streams (GPU). A cached array carries no ordering with the caller's current torch stream, so each
call orders XLA's work after it (:func:`fence`). By default (``event``) XLA's compute stream,
learnt once per device from inside an execution, waits on an event recorded on torch's current
stream: no import, ~2 us. Where that stream cannot be learnt, or with
``KVCANARY_BRIDGE_STREAM_SYNC=fence`` (:func:`set_stream_sync`), each call imports one tiny fence
tensor instead (torch's current stream -> an event -> JAX's external-ready-events stream -> the
fence's ready event, which the computation waits on because it takes the fence as an operand);
that relies only on PJRT's documented DLPack semantics and costs one import (~20 us on the H200).
Both were checked on the H200 by a side-stream producer test, 1,000 trials each, 0 stale reads.
On the way back
``buffer_to_dlpack_managed_tensor(output, stream=torch current stream)`` makes torch's stream wait
on the output's definition event (the runtime waits, on the host, for the execution to be enqueued
first, so this holds whatever thread enqueues it). No host synchronisation on the GPU path. On CPU
JAX runs asynchronously on its own threads while torch runs synchronously, so the bridge blocks
until the outputs are ready.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import weakref
from typing import Any

import jax

from kvcanary_jax import _config

try:  # jaxlib's DLPack entry point (stable since jaxlib 0.4.x; 5-argument form since ext. 467)
    from jax._src.lib import _jax as _jaxlib
    from jax._src.lib import jaxlib_extension_version as _JAXLIB_EXT
except ImportError:  # pragma: no cover
    _jaxlib = None
    _JAXLIB_EXT = 0

__all__ = [
    "BridgeError",
    "DeviceInfo",
    "device_info",
    "ViewCache",
    "key_of",
    "CACHE",
    "clear_cache",
    "stats",
    "import_input",
    "import_output",
    "commit_output",
    "fence",
    "finish",
    "enter",
    "write_back",
    "reimport",
    "set_stream_sync",
    "stream_sync",
    "probe_compute_stream",
]

_DL_CPU, _DL_CUDA, _DL_CUDA_HOST, _DL_ROCM = 1, 2, 3, 10


class BridgeError(ValueError):
    """A torch tensor the bridge cannot hand to JAX without a silent copy."""


_STATS = collections.Counter()


def stats() -> dict[str, int]:
    """Counters of the bridge's hand-over: imports, cache hits, write-backs, fences."""
    return dict(_STATS)


# --------------------------------------------------------------------------------------------
# Devices


@dataclasses.dataclass(frozen=True)
class DeviceInfo:
    torch_device: Any
    jax_device: Any
    dl_type: int
    is_gpu: bool
    stream: int | None  # JAX's stream for external ready events (GPU)

    @property
    def platform(self) -> str:
        """JAX's platform of the tensors' device: what picks each op's implementation."""
        return "gpu" if self.is_gpu else "cpu"


_DEVICES: dict[Any, DeviceInfo] = {}


def device_info(t) -> DeviceInfo:
    dev = t.device
    info = _DEVICES.get(dev)
    if info is not None:
        return info
    dl_type, dl_id = t.__dlpack_device__()
    dl_type = int(dl_type)
    if dl_type == _DL_CPU:
        jdev = jax.devices("cpu")[0]
        stream = None
        is_gpu = False
    elif dl_type in (_DL_CUDA, _DL_ROCM):
        try:
            gpus = jax.devices("gpu")
        except RuntimeError as e:
            raise BridgeError(
                f"kv-canary bridge: tensor on {dev} needs a JAX GPU backend "
                f"(install jax[cuda]); JAX has {jax.default_backend()!r} only"
            ) from e
        matching = [d for d in gpus if getattr(d, "local_hardware_id", d.id) == int(dl_id)]
        if not matching:
            raise BridgeError(f"kv-canary bridge: JAX sees no GPU with hardware id {dl_id} ({dev})")
        jdev = matching[0]
        try:
            stream = int(jdev.get_stream_for_external_ready_events())
        except Exception:  # noqa: BLE001  (UNIMPLEMENTED on some clients)
            stream = None
        is_gpu = True
    else:
        raise BridgeError(f"kv-canary bridge: unsupported device {dev} (DLPack type {dl_type})")
    info = DeviceInfo(torch_device=dev, jax_device=jdev, dl_type=dl_type, is_gpu=is_gpu,
                      stream=stream)
    _DEVICES[dev] = info
    return info


# --------------------------------------------------------------------------------------------
# Raw import


_FAST_IMPORT = [_jaxlib is not None and _JAXLIB_EXT >= 467]
_FAST_EXPORT = [_jaxlib is not None and hasattr(_jaxlib, "buffer_to_dlpack_managed_tensor")]


def _raw_import(t, info: DeviceInfo):
    """DLPack import of a compact tensor; caller holds the x64 scope."""
    _STATS["imports"] += 1
    if _FAST_IMPORT[0]:
        cap = t.__dlpack__(stream=info.stream) if info.is_gpu else t.__dlpack__()
        try:
            return _jaxlib.dlpack_managed_tensor_to_buffer(
                cap, info.jax_device, info.stream, None, info.dl_type
            )
        except TypeError:  # another jaxlib signature: use the public entry point from now on
            _FAST_IMPORT[0] = False
    _STATS["slow_imports"] += 1
    return jax.dlpack.from_dlpack(t)


def _compact_base(t, name: str):
    """(tensor to import, logical column count or None). Refuses views it cannot express."""
    if t.is_contiguous():
        return t, None
    if t.dim() == 2 and t.stride(1) == 1 and t.stride(0) >= t.shape[1] and t.shape[0] > 0:
        rows, s0 = int(t.shape[0]), int(t.stride(0))
        end = t.storage_offset() + rows * s0
        if end * t.element_size() <= t.untyped_storage().nbytes():
            return t.as_strided((rows, s0), (s0, 1)), int(t.shape[1])
    raise BridgeError(
        f"kv-canary bridge: {name} is a strided view (shape={tuple(t.shape)}, "
        f"strides={tuple(t.stride())}) that cannot be shared with JAX without a copy; pass "
        f"{name}.contiguous() and copy the result back, or a view whose only gap is between rows"
    )


# --------------------------------------------------------------------------------------------
# Cache


class _Entry:
    __slots__ = ("storage", "array", "aliased")

    def __init__(self, storage, array):
        self.storage = storage  # weakref to the storage object the array was imported from
        self.array = array
        self.aliased = 0  # donated calls whose output was checked to alias the tensor


# Whether every donated output's pointer is compared with the tensor's ("always") or only on an
# entry's first ALIAS_WARMUP calls ("warmup", the default): XLA's aliasing of a donated buffer is
# fixed by the compiled executable, and reading an output's pointer may wait for the runtime, so
# after the warm-up calls the check stays off the hot path.
ALIAS_CHECK = os.environ.get("KVCANARY_BRIDGE_ALIAS_CHECK", "warmup")
ALIAS_WARMUP = 3


def key_of(t) -> tuple:
    """Cache key (and static-check signature) of a tensor: address, shape, strides, dtype,
    device. Computed once per tensor per call and reused."""
    return (t.data_ptr(), t.shape, t.stride(), t.dtype, t.device)


class ViewCache:
    """JAX views of torch tensors, keyed on (address, shape, strides, dtype, device) and checked
    against the storage object, so a freed-and-reallocated tensor at the same address misses.

    Single dict operations only (atomic under the GIL); two threads importing the same tensor at
    once may both import it, which costs time, never correctness."""

    def __init__(self, max_entries: int = 512):
        self.max_entries = max_entries
        self._entries: collections.OrderedDict[tuple, _Entry] = collections.OrderedDict()
        # Tensors seen once: cached on the second sighting, so per-step temporaries (new storage
        # every call) are neither kept alive nor allowed to evict the persistent buffers.
        self._seen: collections.OrderedDict[tuple, Any] = collections.OrderedDict()

    key = staticmethod(key_of)

    def get(self, t, info: DeviceInfo, key: tuple | None = None, *, cacheable: bool = True):
        """A JAX array aliasing compact tensor ``t`` (cached when seen before)."""
        if key is None:
            key = key_of(t)
        storage = t.untyped_storage()
        e = self._entries.get(key)
        if e is not None:
            if e.storage() is storage and not e.array.is_deleted():
                _STATS["cache_hits"] += 1
                return e.array
            self._entries.pop(key, None)
        arr = _raw_import(t, info)
        if not cacheable or t.numel() == 0 or arr.unsafe_buffer_pointer() != t.data_ptr():
            # A copying import (CPU alignment) is a snapshot: never serve it twice.
            return arr
        seen = self._seen.pop(key, None)
        if seen is not None and seen() is storage:
            self._entries[key] = _Entry(weakref.ref(storage), arr)
            while len(self._entries) > self.max_entries:  # oldest first
                self._entries.popitem(last=False)
        else:
            self._seen[key] = weakref.ref(storage)
            while len(self._seen) > self.max_entries:
                self._seen.popitem(last=False)
        return arr

    def replace(self, key: tuple, array) -> None:
        """After a donated call: the aliased output stands in for the deleted input."""
        e = self._entries.get(key)
        if e is not None:
            e.array = array

    def drop(self, key: tuple) -> None:
        self._entries.pop(key, None)

    def clear(self) -> None:
        self._entries.clear()
        self._seen.clear()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, t) -> bool:
        return key_of(t) in self._entries


CACHE = ViewCache()


def clear_cache() -> None:
    """Forget every cached JAX view and recorded call (and release the torch storages they keep
    alive)."""
    CACHE.clear()
    from bridge import _fast

    _fast.clear()


# --------------------------------------------------------------------------------------------
# Inputs and outputs of one call


def import_input(t, name: str, info: DeviceInfo, key: tuple | None = None):
    """JAX array aliasing a read-only input (compact, or refused with an error naming it)."""
    if not t.is_contiguous():
        raise BridgeError(
            f"kv-canary bridge: {name} must be contiguous to be shared with JAX without a copy "
            f"(shape={tuple(t.shape)}, strides={tuple(t.stride())}); pass {name}.contiguous()"
        )
    return CACHE.get(t, info, key)


class Output:
    """An in-place output: the caller's tensor, the compact base imported for it (and its cache
    key), the logical column count when the base is wider than the view, the imported array."""

    __slots__ = ("tensor", "base", "key", "cols", "array")

    def __init__(self, tensor, base, key, cols, array):
        self.tensor, self.base, self.key, self.cols, self.array = tensor, base, key, cols, array


def import_output(t, name: str, info: DeviceInfo, key: tuple | None = None) -> Output:
    if t.is_contiguous():
        base, cols = t, None
        key = key_of(t) if key is None else key
    else:
        base, cols = _compact_base(t, name)
        key = key_of(base)
    return Output(t, base, key, cols, CACHE.get(base, info, key))


def commit_output(out: Output, result) -> None:
    """Make ``result`` (the kernel's output for ``out``) visible in the caller's tensor."""
    base = out.base
    e = CACHE._entries.get(out.key)
    if e is not None and ALIAS_CHECK == "warmup" and e.aliased >= ALIAS_WARMUP:
        e.array = result
        return
    if result.unsafe_buffer_pointer() == base.data_ptr():
        if e is not None:
            e.array = result
            e.aliased += 1
        return
    CACHE.drop(out.key)
    write_back(out, result)


def write_back(out: Output, result) -> None:
    """Copy the logical view of ``result`` into the caller's tensor (never the columns of the
    base outside the view): where the output does not alias it (JAX's CPU client does not donate
    DLPack-imported buffers; an unaligned CPU import is a copy)."""
    _STATS["write_backs"] += 1
    import torch

    src = torch.from_dlpack(result)
    if out.cols is not None:
        src = src[:, : out.cols]
    out.tensor.copy_(src.reshape(out.tensor.shape))


def reimport(t, info: DeviceInfo):
    """A fresh (uncached) import of compact tensor ``t``; caller holds the x64 scope."""
    return _raw_import(t, info)


# How JAX's kernels are ordered after the caller's current torch stream (GPU):
#   "fence": each call imports a tiny tensor whose DLPack ready event is recorded on JAX's
#            external-ready-events stream after that stream waited on torch's current stream;
#            the computation takes it as an operand, so XLA's compute stream waits on that event.
#            Relies only on PJRT's documented DLPack semantics.
#   "event": XLA's compute stream (learnt once per device from a buffer_callback's execution
#            context) waits directly on an event recorded on torch's current stream: no import,
#            ~5 us. Relies on the runtime launching every execution of the device on that one
#            stream (true of the stream-executor GPU client: one compute stream per device); the
#            probe checks the stream is the same over several executions and the fence is used
#            where it is not, or where the probe fails.
STREAM_SYNC = [os.environ.get("KVCANARY_BRIDGE_STREAM_SYNC", "event").lower()]


def set_stream_sync(mode: str) -> None:
    """``"event"`` (default) or ``"fence"``: see the module docstring."""
    if mode not in ("fence", "event"):
        raise ValueError(
            f"kv-canary bridge: stream sync mode must be 'fence' or 'event', got {mode!r}"
        )
    STREAM_SYNC[0] = mode


def stream_sync() -> str:
    return STREAM_SYNC[0]


class _GpuSync:
    """Per-device objects of the stream handshake, built once: torch wrappers of JAX's streams,
    one reusable event (``cudaStreamWaitEvent`` takes the event's state when it is enqueued, so
    re-recording it on the next call cannot disturb a wait already queued), the fence tensor."""

    __slots__ = ("event", "ready_stream", "compute_stream", "fence", "torch_device", "index",
                 "streams", "raw_stream", "capturing", "record", "wait")

    def __init__(self, info: DeviceInfo):
        import torch

        self.torch_device = info.torch_device
        self.index = info.torch_device.index
        if self.index is None:
            self.index = torch.cuda.current_device()
        # The caller's current stream is looked up by its raw handle (one C call) and its torch
        # wrapper kept per handle: a wrapper names its stream by that handle, so reusing it is
        # exact. The torch C entry points are used where present (the Python wrappers around
        # them cost more than the CUDA calls on a busy host).
        self.streams: dict[int, Any] = {}
        self.raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        self.capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing",
                                 torch.cuda.is_current_stream_capturing)
        base = getattr(torch._C, "_CudaEventBase", None)
        self.record = getattr(base, "record", None) or torch.cuda.Event.record
        self.wait = getattr(base, "wait", None) or torch.cuda.Event.wait
        self.event = torch.cuda.Event()
        self.ready_stream = (None if info.stream is None else
                             torch.cuda.ExternalStream(info.stream, device=info.torch_device))
        self.fence = torch.zeros(16, dtype=torch.int32, device=info.torch_device)
        handle = probe_compute_stream(info.jax_device)
        self.compute_stream = (None if handle is None else
                               torch.cuda.ExternalStream(handle, device=info.torch_device))


def probe_compute_stream(jax_device, runs: int = 3):
    """The raw stream XLA executes on for ``jax_device`` (seen from inside an execution), or None
    where it cannot be learnt or differs between executions."""
    try:
        import numpy as np
        from jax.experimental.buffer_callback import buffer_callback

        seen = []

        def record(ctx, out, x):
            del out, x
            seen.append(int(ctx.stream))

        probe = jax.jit(buffer_callback(record, jax.ShapeDtypeStruct((1,), np.int32),
                                        has_side_effect=True))
        x = jax.device_put(np.zeros(1, np.int32), jax_device)
        for _ in range(runs):
            jax.block_until_ready(probe(x))
    except Exception:  # noqa: BLE001  (no buffer_callback, no GPU FFI context, ...)
        return None
    if len(seen) != runs or len(set(seen)) != 1 or not seen[0]:
        return None
    return seen[0]


_SYNCS: dict[Any, _GpuSync] = {}


def gpu_sync(info: DeviceInfo) -> _GpuSync:
    s = _SYNCS.get(info.torch_device)
    if s is None:
        s = _SYNCS[info.torch_device] = _GpuSync(info)
    return s


def fence(info: DeviceInfo):
    """Order the computation after the caller's current torch stream (GPU); returns the operand
    the computation must take (a fresh fence import, or None). None on CPU, where torch work is
    already complete."""
    return enter(info)[0]


def enter(info: DeviceInfo):
    """:func:`fence`, and the caller's current raw stream handle for :func:`finish` (None on
    CPU)."""
    if not info.is_gpu:
        return None, None
    s = _SYNCS.get(info.torch_device) or gpu_sync(info)
    if s.capturing():
        # XLA launches on its own streams, outside the capture: the graph would silently miss
        # the canary work (SGLang's kernels are capturable; these are not).
        raise BridgeError(
            "kv-canary bridge: cannot launch inside a torch CUDA graph capture; call it outside "
            "the captured region"
        )
    import torch

    raw = s.raw_stream(s.index) if s.raw_stream is not None else None
    cur = s.streams.get(raw) if raw is not None else None
    if cur is None:
        cur = torch.cuda.current_stream(info.torch_device)
        raw = cur.cuda_stream
        if len(s.streams) > 64:
            s.streams.clear()
        s.streams[raw] = cur
    # The legacy default stream is handle 0 to torch; DLPack reserves 0 and names it 1
    # (cudaStreamLegacy, also a valid raw handle).
    handle = raw or 1
    if STREAM_SYNC[0] == "event" and s.compute_stream is not None:
        s.record(s.event, cur)
        s.wait(s.event, s.compute_stream)
        _STATS["event_waits"] += 1
        return None, handle
    _STATS["fences"] += 1
    if _FAST_IMPORT[0] and s.ready_stream is not None:
        # What ``Tensor.__dlpack__(stream=...)`` does, with the event and stream objects reused.
        s.event.record(cur)
        s.ready_stream.wait_event(s.event)
        cap = torch.utils.dlpack.to_dlpack(s.fence)
        _STATS["imports"] += 1
        try:
            return _jaxlib.dlpack_managed_tensor_to_buffer(
                cap, info.jax_device, info.stream, None, info.dl_type
            ), handle
        except TypeError:
            _FAST_IMPORT[0] = False
    return _raw_import(s.fence, info), handle


def finish(info: DeviceInfo, results, stream: int | None = None) -> None:
    """Order the caller's later torch work after the kernels (GPU: stream wait; CPU: block).
    ``stream``: the caller's raw stream handle from :func:`enter` (looked up when omitted)."""
    if not results:
        return
    if info.is_gpu:
        if stream is None:
            import torch

            stream = torch.cuda.current_stream(info.torch_device).cuda_stream or 1
        # All outputs of one execution become ready together: one wait suffices. The capsule is
        # dropped unconsumed at once, releasing its reference (the array stays donatable).
        if _FAST_EXPORT[0]:
            try:
                _jaxlib.buffer_to_dlpack_managed_tensor(results[0], stream=stream)
                return
            except TypeError:
                _FAST_EXPORT[0] = False
        _STATS["slow_exports"] += 1
        results[0].__dlpack__(stream=stream)
    else:
        jax.block_until_ready(results)


def x64_scope():
    return _config.x64_scope()


# --------------------------------------------------------------------------------------------
# Real-KV sources


_SPECS: dict[tuple, Any] = {}


def _source_base(t):
    """A compact tensor over the bytes of source view ``t`` (2-D, packed rows, any row stride)."""
    if t.is_contiguous():
        return t
    rows, cols, s0 = int(t.shape[0]), int(t.shape[1]), int(t.stride(0))
    storage_elems = t.untyped_storage().nbytes() // t.element_size()
    if t.storage_offset() + rows * s0 <= storage_elems:
        return t.as_strided((rows, s0), (s0, 1))
    # The last row's stride runs past the storage: take the view's exact span, whole 8-byte words.
    span = (rows - 1) * s0 + cols
    span -= span % max(1, 8 // t.element_size())
    return t.as_strided((span,), (1,))


def import_sources(sources, info: DeviceInfo):
    """(buffers, specs) for the ops' array-level entries: each source's compact base imported
    zero-copy and its static addressing, computed by the package from the view's metadata."""
    from kvcanary_jax.context import RealKvSource as _JaxSource
    from kvcanary_jax.context import source_spec
    from kvcanary_jax.contracts import meta_of

    bufs, specs = [], []
    for s in sources:
        t = s.tensor
        base = _source_base(t)
        arr = CACHE.get(base, info)
        key = (key_of(t), int(s.page_size), int(s.num_bytes_per_token), int(s.read_bytes))
        spec = _SPECS.get(key)
        if spec is None:
            spec = source_spec(_JaxSource(
                tensor=arr, page_size=int(s.page_size),
                num_bytes_per_token=int(s.num_bytes_per_token), read_bytes=int(s.read_bytes),
                view=meta_of(t), offset_bytes=0,
            ))
            if len(_SPECS) > 1024:
                _SPECS.clear()
            _SPECS[key] = spec
        bufs.append(arr)
        specs.append(spec)
    return tuple(bufs), tuple(specs)


def check_distinct_outputs(outputs: dict) -> None:
    """Two in-place outputs sharing memory cannot both be donated (and SGLang's kernels would
    race on them): refuse, naming both."""
    spans = []
    for name, t in outputs.items():
        if t is None or t.numel() == 0:
            continue
        lo = t.data_ptr()
        last = (t.shape[0] - 1) * t.stride(0) + (t[0].numel() if t.dim() > 1 else 1)
        hi = lo + last * t.element_size()
        for other, (a, b) in spans:
            if lo < b and a < hi and t.device == outputs[other].device:
                raise BridgeError(
                    f"kv-canary bridge: {name} and {other} share memory; in-place outputs must "
                    "be distinct tensors"
                )
        spans.append((name, (lo, hi)))
