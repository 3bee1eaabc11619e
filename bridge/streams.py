"""Stream order between the caller's torch stream and XLA's (DLPack path on the GPU).

The direct path launches on the caller's current torch stream and needs none of this. On the
DLPack path a cached array carries no ordering with the caller's current torch stream, so each
call orders XLA's work after it (:func:`enter`). By default (``event``) XLA's compute stream,
learnt once per device from inside an execution, waits on an event recorded on torch's current
stream: no import, ~2 us. Where that stream cannot be learnt, or with
``KVCANARY_BRIDGE_STREAM_SYNC=fence`` (:func:`set_stream_sync`), each call imports one tiny fence
tensor instead (torch's current stream -> an event -> JAX's external-ready-events stream -> the
fence's ready event, which the computation waits on because it takes the fence as an operand);
that relies only on PJRT's documented DLPack semantics and costs one import (~20 us on the H200).
Both were checked on the H200 by a side-stream producer test, 1,000 trials each, 0 stale reads.
On the way back ``buffer_to_dlpack_managed_tensor(output, stream=torch current stream)`` makes
torch's stream wait on the output's definition event (:func:`finish`). No host synchronisation on
the GPU; on CPU JAX runs asynchronously on its own threads while torch runs synchronously, so
:func:`finish` blocks until the outputs are ready.

XLA launches on its own streams, outside a torch CUDA graph capture: the DLPack path refuses to
run under capture (the direct path is captured like any torch kernel).
"""

from __future__ import annotations

import threading
from typing import Any

import jax

from kvcanary_jax.bridge.dlpack import STATS as _STATS
from kvcanary_jax.bridge.dlpack import BridgeError, DeviceInfo, import_tensor
from kvcanary_jax.bridge.switches import choice, env_choice

try:
    from jax._src.lib import _jax as _jaxlib
except ImportError:  # pragma: no cover
    _jaxlib = None

_FAST_EXPORT = _jaxlib is not None and hasattr(_jaxlib, "buffer_to_dlpack_managed_tensor")

__all__ = ["set_stream_sync", "stream_sync", "enter", "finish", "gpu_sync",
           "probe_compute_stream", "capturing"]

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
_MODE = {"value": env_choice("KVCANARY_BRIDGE_STREAM_SYNC", "event", ("event", "fence"))}


def set_stream_sync(mode: str) -> None:
    """``"event"`` (default) or ``"fence"``, any case: see the module docstring. Anything else
    is a ``ValueError`` and changes nothing."""
    _MODE["value"] = choice("set_stream_sync", mode, ("event", "fence"))


def stream_sync() -> str:
    return _MODE["value"]


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
    except (ImportError, AttributeError, NotImplementedError, RuntimeError, TypeError,
            ValueError):  # no buffer_callback, no GPU FFI context, ...: the fence is used
        return None
    if len(seen) != runs or len(set(seen)) != 1 or not seen[0]:
        return None
    return seen[0]


_SYNCS: dict[Any, _GpuSync] = {}
_SYNCS_LOCK = threading.Lock()


def gpu_sync(info: DeviceInfo) -> _GpuSync:
    with _SYNCS_LOCK:
        s = _SYNCS.get(info.torch_device)
        if s is None:
            s = _SYNCS[info.torch_device] = _GpuSync(info)
        return s


def capturing(device) -> bool:
    """Whether torch's current stream on ``device`` is capturing a CUDA graph."""
    import torch

    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


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
    if _MODE["value"] == "event" and s.compute_stream is not None:
        s.record(s.event, cur)
        s.wait(s.event, s.compute_stream)
        _STATS["event_waits"] += 1
        return None, handle
    _STATS["fences"] += 1
    # Tensor.__dlpack__(stream=JAX ready stream) makes that stream wait on torch's current one.
    return import_tensor(s.fence, info), handle


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
        if _FAST_EXPORT:
            _jaxlib.buffer_to_dlpack_managed_tensor(results[0], stream=stream)
        else:
            results[0].__dlpack__(stream=stream)
    else:
        jax.block_until_ready(results)


