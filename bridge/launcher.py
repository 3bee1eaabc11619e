"""One generic launcher: a :class:`~.declarations.Declaration` run on torch tensors.

For every call, in this order::

    tensors  = declaration.tensors(kwargs)          # named, SGLang's names
    signature (shapes, strides, dtypes, devices of every tensor; the non-tensor arguments)
    static checks (SGLang's errors), skipped when the signature passed them before
    nothing to launch (zero sizes)? -> return
    value checks (CPU tensors by default; opt-in on the GPU)
    args, static, results = declaration.arguments(...)  # named arguments, bucketed; outputs
    path: "triton_direct" (CUDA tensors, triton importable, the function lowers to kernels
          only) or "dlpack" (CPU tensors, and wherever the direct path is unavailable)

No call is recorded and replayed: every call's signature is read again, so a tensor changed in
place (``as_strided_``, ``set_``) is checked and laid out again. A call matching its launcher's
last signature for the same outputs is told apart in C++ (:mod:`kvcanary_jax.bridge.front`);
any other computes its signature in Python. Nothing of a call outlives it but the bounded caches
of :mod:`kvcanary_jax.bridge.cache`, which hold no tensors (the DLPack path's view cache holds them
weakly, :mod:`kvcanary_jax.bridge.views`).

Direct path: the program (lowered, extracted and compiled kernels) is looked up by
:class:`ProgramKey` and its kernels launched with the tensors' pointers on torch's current stream
(:mod:`kvcanary_jax.bridge.triton_direct`): thread-safe without a lock (each thread launches on its
own current stream) and capturable by ``torch.cuda.graph``. DLPack path: imports, one jitted call
with the outputs donated, write-back where the outputs do not alias; serialised per device by one
lock that every launcher shares, so threads sharing buffers, through one launcher or several, never
lose an update or see a donated array (the same per-call work as one thread, in some order, as
SGLang's own launchers on one stream).

:func:`paths` reports, per launcher, the path its last call took and why the direct path was not
taken.
"""

from __future__ import annotations

import dataclasses
import threading
import warnings
import weakref
from typing import Any, NamedTuple

import jax
import torch

from kvcanary_jax import buckets
from kvcanary_jax.bridge import front, streams, triton_direct, views
from kvcanary_jax.bridge.cache import CACHES
from kvcanary_jax.bridge.checks import (Apart, check_outputs_apart_from_inputs,
                                        value_checks_enabled, written_spans)
from kvcanary_jax.bridge.dlpack import (STATS, BridgeError, carry_import, device_info,
                                        import_tensor, write_back, x64_scope)
from kvcanary_jax.bridge.switches import env_switch, switch

__all__ = ["Arg", "Signature", "ProgramKey", "Launcher", "paths", "set_direct", "direct_enabled",
           "lowered_specs", "bind"]


@dataclasses.dataclass(frozen=True)
class Arg:
    """One array argument of a declaration's function: which tensor, and how it is lowered.

    ``name``: the tensor's name in the declaration's tensors (SGLang's name, used in errors),
    which is also its path in the op's pytrees: the declaration's function receives the arrays
    by these names and returns its outputs under the names of the arguments they update.
    ``shape``/``dtype``: the array the function is lowered for. ``layout``:
      ``"dense"``   the tensor itself (compact); with ``shape[0]`` above the tensor's length it is
                    a bucketed token array whose tail the op never reads;
      ``"pitched"`` a 2-D view with packed rows, handed over as its base ``[rows, stride(0)]``
                    starting at the view's first element; ``cols`` is the view's width;
      ``"bytes"``   a real-KV source: ``shape[0]`` bytes from the view's first element.
    ``out``: updated in place (donated on the DLPack path). ``clamp``: pass ``min(tensor,
    clamp)`` (a per-call temporary) instead of the tensor: offsets into a bucketed token array.
    ``pad``: a dense array lowered at a ``shape[0]`` above the tensor's length whose tail the op
    does read (a digest's slots): passed as a per-call temporary, the tensor then ``pad`` (a
    value the op skips), on both paths.
    ``whole_rows``: the op reads a pitched base's whole rows, so the base must lie inside the
    tensor's storage (checked on every call). ``length_of``: not a caller's tensor but an int64
    ``[1]`` holding the length of this call's tensor ``length_of`` (a bucketed token array's
    true length, which the op's kernel reads), the bridge's device scalar for it
    (``CACHES.lengths``, never freed: no copy, no host wait, and a CUDA graph may keep its
    address; read per call by :meth:`Launcher.pointers`); its address is only 8-byte aligned,
    and the kernels are built to take it so. Holds no tensor: arguments are cached per call
    signature.
    """

    name: str
    shape: tuple
    dtype: Any
    layout: str = "dense"
    out: bool = False
    cols: int | None = None
    clamp: int | None = None
    whole_rows: bool = False
    pad: int | None = None
    length_of: str | None = None


class Signature(NamedTuple):
    """What a call's checks, arguments and program depend on: the launcher, every tensor's
    (shape, strides, dtype, device) in declaration order (None where absent; a bucketed token
    array's bucket in place of its length, :func:`_bucket_metas`), the non-tensor arguments,
    and the addresses of the tensors it writes (two outputs must not share memory, and a
    prepared call checks inputs against their spans). A signature never keeps a tensor."""

    launcher: str
    tensors: tuple
    statics: tuple
    outputs: tuple


class ProgramKey(NamedTuple):
    """A compiled direct-path program: the launcher, its static arguments (sorted items), every
    argument's name and lowered (shape, dtype, layout), the names of the arguments its results
    update, and the CUDA device index."""

    launcher: str
    static: tuple
    args: tuple
    results: tuple
    device: int


class _ProgramSlot:
    """A prepared call's direct-path program, found once by its :class:`ProgramKey` and then
    kept here (weakly: the ``programs`` cache stays the one bound on live programs; an evicted
    program is looked up again), so a call does not hash its key."""

    __slots__ = ("ref",)

    def __init__(self):
        self.ref = None

    def get(self):
        ref = self.ref
        if ref is None:
            return None
        return ref if isinstance(ref, str) else ref()

    def set(self, entry) -> None:
        self.ref = entry if isinstance(entry, str) else weakref.ref(entry)


@dataclasses.dataclass(frozen=True)
class Prepared:
    """Everything a call with a given :class:`Signature` needs beyond its tensors: its checks
    passed; whether there is nothing to launch; the function's arguments, static arguments,
    the names of the arguments its results update (``result_names``) and their positions
    (``results``), bound once here. ``arg_names`` and ``clamped`` (the positions of the
    arguments clamped per call) and ``padded`` (those staged with their ``pad`` per call) let the
    direct path read the pointers in one pass; ``valued`` (the positions of the arguments with
    a ``length_of``, whose addresses each call reads)."""

    skip: bool
    args: tuple[Arg, ...] = ()
    static: dict = dataclasses.field(default_factory=dict)
    results: tuple[int, ...] = ()
    result_names: tuple[str, ...] = ()
    program_key: Any = None
    whole_rows: tuple[Arg, ...] = ()  # arguments checked against their storage on every call
    arg_names: tuple[str, ...] = ()
    ptr_names: tuple[str, ...] = ()  # arg_names, a length's own name replaced by its array's
    clamped: tuple[int, ...] = ()
    padded: tuple[int, ...] = ()
    valued: tuple[int, ...] = ()
    # The bucketed arrays' names and the written tensors' spans (the outputs' addresses are in
    # the signature): each call checks those arrays apart from them, their length being not.
    bucketed_apart: tuple[str, ...] = ()
    written_apart: Any = None
    program: _ProgramSlot = dataclasses.field(default_factory=_ProgramSlot)
    # The signature's :class:`~kvcanary_jax.bridge.front.Front`, built on its first call with
    # the check on: [] until then, [None] where the check cannot hold it.
    front: list = dataclasses.field(default_factory=list)

    # The tensors at ptr_names, read from the call's tensors in one call.
    ptr_tensors: Any = None

    def __post_init__(self):
        if not self.ptr_names:
            object.__setattr__(self, "ptr_names", tuple(a.length_of or a.name for a in self.args))
        if self.ptr_tensors is None:
            object.__setattr__(self, "ptr_tensors", front.getter(self.ptr_names))


# --------------------------------------------------------------------------------------------
# Path report and switch

_PATHS: dict[str, tuple[str, str]] = {}
_DIRECT = {"on": env_switch("KVCANARY_BRIDGE_DIRECT", True)}


def set_direct(enabled) -> None:
    """Allow (default) or forbid the direct Triton path (``KVCANARY_BRIDGE_DIRECT=0``):
    ``True`` / ``False`` or the variable's words (``"off"``, ``"0"``, ...); anything else is a
    ``ValueError`` and changes nothing."""
    _DIRECT["on"] = switch("set_direct", enabled)


def direct_enabled() -> bool:
    return _DIRECT["on"]


def call_paths() -> dict[str, dict[str, str]]:
    """Per launcher called so far: the path its last call took (``"triton_direct"`` or
    ``"dlpack"``; ``""`` before its first call) and, for ``"dlpack"`` on a CUDA tensor, why the
    direct path was not taken (what :func:`kvcanary_jax.bridge.paths` reports, with the SGLang
    names each launcher is installed as)."""
    return {k: {"path": p, "reason": r} for k, (p, r) in _PATHS.items()}


# --------------------------------------------------------------------------------------------
# The launcher


def _meta(t):
    if t is None:
        return None
    if not isinstance(t, torch.Tensor):
        return (type(t),)
    return (t.shape, t.stride(), t.dtype, t.device)


def _ptr(t):
    return t.data_ptr() if isinstance(t, torch.Tensor) else None


_Tensor = torch.Tensor
_data_ptr = torch.Tensor.data_ptr


def _metas(values) -> tuple:
    """``_meta`` of each value; a plain ``torch.Tensor`` (the usual case) read inline, without a
    call per tensor (a launcher reads 10-20 of them per call)."""
    return tuple([(t.shape, t.stride(), t.dtype, t.device) if type(t) is _Tensor else _meta(t)
                  for t in values])


# buckets.bucket(n) is 1 << max(_FLOOR_BITS, (n - 1).bit_length()) for n >= 1.
_FLOOR_BITS = (buckets.FLOOR - 1).bit_length()


def _bucket_metas(metas: tuple, k: int) -> tuple:
    """``metas`` with each of the first ``k`` (a declaration's bucketed token arrays) holding
    its bucket (as its power of two) where it has a length: 1-D, at least 2 elements (there its
    stride alone says whether it is contiguous). Empty and 1-element arrays, and every other
    shape, stay exact: the checks and the launch decide on them."""
    out = []
    for m in metas[:k]:
        if m is not None and len(m) == 4 and len(m[0]) == 1 and m[0][0] > 1:
            m = (("bucket", max(_FLOOR_BITS, (m[0][0] - 1).bit_length())),) + m[1:]
        out.append(m)
    return (*out, *metas[k:])


def check_whole_rows(a: Arg, t) -> None:
    """A pitched base whose rows the op reads whole must lie inside ``t``'s storage."""
    rows, pitch = a.shape
    if rows and (t.storage_offset() + rows * pitch) * t.element_size() > \
            t.untyped_storage().nbytes():
        raise BridgeError(
            f"kv-canary bridge: {a.name} is a column slice (shape={tuple(t.shape)}, "
            f"strides={tuple(t.stride())}, storage offset {t.storage_offset()}) whose last row, "
            f"stepped by stride(0)={pitch}, runs past its storage, and the kernel reads whole "
            f"rows; pass {a.name}.contiguous(), or a slice starting at column 0"
        )


_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
# torch.cuda.current_device() without its Python wrapper (the C function initializes CUDA
# itself where it has not been).
_current_device = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device


def _not_a_tensor(launcher: str, name: str, value) -> TypeError:
    return TypeError(f"kv-canary: {launcher} {name} must be a torch.Tensor or None, got "
                     f"{type(value).__name__}")


# One lock per device for the DLPack path, shared by every launcher: two launchers over one
# context (verify in one thread, write in another) donate and replace the same imported buffers,
# so a lock per launcher let one thread read an array the other had just donated ("Array has
# been deleted") and lose the other's counter updates.
_DLPACK_LOCKS: dict[Any, threading.Lock] = {}
_DLPACK_LOCKS_LOCK = threading.Lock()


def _dlpack_lock(device) -> threading.Lock:
    with _DLPACK_LOCKS_LOCK:
        lock = _DLPACK_LOCKS.get(device)
        if lock is None:
            lock = _DLPACK_LOCKS[device] = threading.Lock()
        return lock


class Launcher:
    """Runs one declaration (see the module docstring)."""

    def __init__(self, decl):
        self.decl = decl
        self._addressed = front.getter(decl.addressed)

    def __call__(self, **kwargs) -> None:
        decl = self.decl
        tensors = decl.tensors(kwargs)
        values = tuple(tensors.values())
        statics = decl.statics(kwargs)
        addressed = tuple([t.data_ptr() if type(t) is _Tensor else _ptr(t)
                           for t in self._addressed(tensors)])
        fronts = CACHES.front
        last = fronts.get((decl.name, addressed))
        prep = None if last is None else last.match(values, statics)
        if prep is None:
            metas = _metas(values)
            if decl.bucketed:
                metas = _bucket_metas(metas, decl.bucketed)
            sig = Signature(decl.name, metas, statics, addressed)
            prep = CACHES.prepared.get(sig)
            if prep is None:
                prep = CACHES.prepared.put(sig, self._prepare(kwargs, tensors))
            if front.enabled():
                front.keep(fronts, (decl.name, addressed), prep, values, metas, statics)
        if prep.skip:
            return
        for a in prep.whole_rows:
            check_whole_rows(a, tensors[a.name])
        anchor = tensors[decl.anchor]
        device = anchor.device
        checked = value_checks_enabled(device)
        if prep.bucketed_apart and not checked:
            # A bucketed array's length is not in the signature either: a longer one may reach
            # an output that the signature's check did not see it reach.
            for name in prep.bucketed_apart:
                prep.written_apart.check(name, tensors[name])
        if checked:
            # Addresses of the inputs are not part of the signature: checked again here.
            check_outputs_apart_from_inputs(decl.name, decl.outputs + decl.also_written(kwargs),
                                            tensors)
            # Offsets then lie in [0, n]: a clamp to n would change nothing.
            decl.check_values(kwargs, tensors)
        reason = ""
        if device.type == "cuda":
            if not _DIRECT["on"]:
                reason = "disabled (KVCANARY_BRIDGE_DIRECT=0 or bridge.set_direct(False))"
            else:
                reason = self._direct(prep, tensors, device, clamp=not checked)
                if not reason:
                    _PATHS[decl.name] = ("triton_direct", "")
                    STATS["triton_direct"] += 1
                    return
        self._dlpack(prep, tensors, anchor)
        _PATHS[decl.name] = ("dlpack", reason)
        STATS["dlpack"] += 1

    def _prepare(self, kwargs, tensors) -> Prepared:
        """First call of a signature: the static checks (SGLang's errors), then the arguments."""
        decl = self.decl
        # A non-tensor in an optional slot (a list, a numpy array, an int): SGLang's own error
        # where its checks raise one first, else ours, never an AttributeError from inside.
        stray = next(((n, t) for n, t in tensors.items()
                      if t is not None and not isinstance(t, torch.Tensor)), None)
        try:
            decl.validate(kwargs, tensors)
        except (TypeError, ValueError) as e:
            # Some of SGLang's messages (contiguity, device) name the tensor but not the
            # launcher; they stay word for word, and a note names the launcher in the traceback.
            if decl.name not in str(e):
                e.add_note(f"kv-canary bridge: raised by {decl.name}")
            raise
        except AttributeError as e:
            if stray is None:
                raise
            raise _not_a_tensor(decl.name, *stray) from e
        if stray is not None:
            raise _not_a_tensor(decl.name, *stray)
        # Once per signature (with value checks on, on every call: see __call__).
        written = decl.outputs + decl.also_written(kwargs)
        check_outputs_apart_from_inputs(decl.name, written, tensors)
        # (A history that is absent, the step without a scatter, has no length to check.)
        apart = tuple(n for n in list(tensors)[:decl.bucketed]
                      if isinstance(tensors[n], torch.Tensor))
        anchor = tensors[decl.anchor]
        if anchor.device.type == "meta":
            device_info(anchor, decl.anchor)  # raises the bridge's error for the meta device
        if decl.skip(kwargs, tensors):
            return Prepared(skip=True)
        args, static, result_names = decl.arguments(kwargs, tensors)
        names = tuple(a.name for a in args)
        results = tuple(names.index(n) for n in result_names)
        key = None
        if anchor.device.type == "cuda":
            index = anchor.device.index
            key = ProgramKey(decl.name, tuple(sorted(static.items())),
                             tuple((a.name, a.shape, a.dtype, a.layout) for a in args),
                             tuple(result_names),
                             torch.cuda.current_device() if index is None else index)
        return Prepared(skip=False, args=tuple(args), static=static, results=results,
                        result_names=tuple(result_names), program_key=key,
                        whole_rows=tuple(a for a in args if a.whole_rows), arg_names=names,
                        clamped=tuple(i for i, a in enumerate(args) if a.clamp is not None),
                        padded=tuple(i for i, a in enumerate(args) if a.pad is not None),
                        valued=tuple(i for i, a in enumerate(args) if a.length_of is not None),
                        bucketed_apart=apart, written_apart=Apart(
                            decl.name, written_spans(written, tensors)) if apart else None)

    # ---------------------------------------------------------------------------------------
    # Direct path

    def _direct(self, prep: Prepared, tensors, device, clamp: bool = True) -> str:
        """Launch on the direct path; returns "" or the reason it cannot run this call."""
        key = prep.program_key
        entry = prep.program.get()
        if entry is None:
            ok, reason = triton_direct.available()
            if not ok:
                return reason
            entry = CACHES.programs.get(key)
            if entry is None:
                entry = CACHES.programs.put(key, _build_program(self.decl, prep, device,
                                                                key.device))
            prep.program.set(entry)
        if isinstance(entry, str):
            return entry
        # Per-call temporaries (clamped offsets) live until the launches are queued.
        ptrs, keep = self.pointers(prep, tensors, clamp, device)
        stream = (_raw_stream(key.device) if _raw_stream is not None
                  else torch.cuda.current_stream(device).cuda_stream)

        views_of = None
        if entry.program.copies:
            def views_of(i):
                return _byte_view(tensors[prep.args[i].name], prep.args[i])

        if _current_device() == key.device:
            entry.launch(ptrs, stream, views_of)
        else:  # a kernel runs in its device's context
            with torch.cuda.device(key.device):
                entry.launch(ptrs, stream, views_of)
        del keep
        return ""

    @staticmethod
    def pointers(prep: Prepared, tensors, clamp: bool = True, device=None) -> tuple[list, list]:
        """Each argument's address, and the per-call temporaries behind them (offsets clamped to
        a bucketed token array's true length; arrays padded to their bucket: torch ops on the
        tensors' stream; a length past its table inside a graph capture)."""
        ptrs = list(map(_data_ptr, prep.ptr_tensors(tensors)))
        keep = []
        for i in prep.valued:
            n = tensors[prep.args[i].length_of].shape[0]
            try:
                ptrs[i] = CACHES.lengths.address(device, n)
            except BridgeError:  # past the table inside a capture (in the graph's memory)
                ptrs[i] = None
            if ptrs[i] is None:  # or past the table's bound
                t = _length_tensor(n, device)
                keep.append(t)
                ptrs[i] = t.data_ptr()
        if clamp:
            for i in prep.clamped:
                t = torch.clamp(tensors[prep.arg_names[i]], max=prep.args[i].clamp)
                keep.append(t)
                ptrs[i] = t.data_ptr()
        for i in prep.padded:
            t = _padded(prep.args[i], tensors[prep.arg_names[i]])
            keep.append(t)
            ptrs[i] = t.data_ptr()
        return ptrs, keep

    # ---------------------------------------------------------------------------------------
    # DLPack path

    def _dlpack(self, prep: Prepared, tensors, anchor) -> None:
        decl = self.decl
        info = device_info(anchor, decl.anchor)
        if info.is_gpu and streams.capturing(info.torch_device):
            raise BridgeError(
                f"kv-canary bridge: {decl.name} cannot run inside a torch CUDA graph capture on "
                "the DLPack path (XLA launches outside the capture); the direct Triton path is "
                f"unavailable here: {_PATHS.get(decl.name, ('', ''))[1]}"
            )
        static = dict(prep.static, platform=info.jax_device.platform)
        donate = tuple(1 + i for i, a in enumerate(prep.args) if a.out)
        fn = CACHES.jitted.get_or_build(
            (decl.name, tuple(sorted(static.items())), donate, prep.arg_names, prep.result_names),
            lambda: jax.jit(_positional(bind(decl.fn, prep.arg_names, prep.result_names),
                                        static), donate_argnums=donate, keep_unused=True))
        cache = views.for_device(info.torch_device)
        with _dlpack_lock(info.torch_device), x64_scope():
            presented = [_present(a, tensors[a.name] if a.length_of is None else
                                  _length_view(tensors[a.length_of].shape[0], anchor.device),
                                  info, cache) for a in prep.args]
            fence, stream = streams.enter(info)
            outs = fn(fence, *(p.array for p in presented))
            streams.finish(info, outs[:1], stream)
            for r, i in zip(outs, prep.results):
                _commit(prep.args[i], tensors[prep.args[i].name], presented[i], r, cache)
        if not info.is_gpu:
            # A call after the exit hook (from an atexit handler registered before the bridge
            # was imported: such handlers run after it) waits, as the hook does, for the worker
            # to let go of its imports.
            del presented, outs
            views.wait_if_exiting()


def _length_tensor(n: int, device):
    """A per-call int64 ``[1]`` holding ``n`` (made on the current stream; no host wait)."""
    return torch.full((1,), n, dtype=torch.int64, device=device)


def _length_view(n: int, device):
    """The length ``n`` as a tensor for the DLPack path: the table's view, else per call."""
    try:
        t = CACHES.lengths.view(device, n)
    except BridgeError:
        t = None
    return _length_tensor(n, device) if t is None else t


def _padded(a: Arg, t):
    """``t`` then ``a.pad`` up to ``a.shape`` (a per-call temporary, never cached)."""
    staged = torch.full(a.shape, a.pad, dtype=t.dtype, device=t.device)
    staged[: t.shape[0]].copy_(t)
    return staged


def _byte_view(t, a: Arg):
    """Argument ``a``'s memory (its lowered shape from ``t``'s first element) as flat bytes."""
    nbytes = int(torch.Size(a.shape).numel()) * torch.empty((), dtype=a.dtype).element_size()
    u8 = t.detach()
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(
        u8.untyped_storage(), u8.storage_offset() * u8.element_size(), (nbytes,), (1,))


def bind(fn, names, result_names):
    """``fn`` (a declaration's function: arrays by name in, outputs by name out) as a function
    of the arrays in the order of ``names``, returning the outputs in the order of
    ``result_names``: what XLA and the direct path's lowering call. Bound once per signature;
    the names are only read while the function is traced."""
    names, result_names = tuple(names), tuple(result_names)

    def call(*arrays, **static):
        out = fn(dict(zip(names, arrays)), **static)
        return tuple(out[n] for n in result_names)
    return call


def _positional(fn, static):
    def call(fence, *arrays):
        del fence  # an operand only so that the computation waits on its ready event
        return tuple(fn(*arrays, **static))
    return call


class _Presented(NamedTuple):
    array: Any        # the JAX array handed to the function
    alias: int | None  # the address it aliases (None: a copy)
    back: Any         # the tensor a non-aliasing result is copied into (None: not an output)
    cols: int | None  # write back only these columns (the base of a pitched view)


def _present(a: Arg, t, info, cache) -> _Presented:
    back = t if a.out else None
    if a.clamp is not None:
        t = torch.clamp(t, max=a.clamp)  # a per-call temporary, never cached
        return _Presented(_import(t, info), None, None, None)
    if a.layout == "dense":
        if tuple(t.shape) != a.shape:
            # A bucketed array: the tensor's elements, then a tail the op never reads (the
            # declaration clamps the offsets that index it) or skips (its ``pad``).
            staged = _padded(dataclasses.replace(a, pad=-7) if a.pad is None else a, t)
            STATS["bucket_copies"] += 1
            return _Presented(_import(staged, info), None, None, None)
        if not t.is_contiguous():
            STATS["view_copies"] += 1
            return _Presented(_import(t.contiguous(), info), None, back, None)
        src, cols = t, None
    elif a.layout == "pitched":
        rows, pitch = a.shape
        if t.is_contiguous() and pitch == t.shape[1]:
            src, cols = t, None
        elif (t.storage_offset() + rows * pitch) * t.element_size() <= \
                t.untyped_storage().nbytes():
            src, cols = t.detach().as_strided((rows, pitch), (pitch, 1)), a.cols
        else:  # the base would run past the storage: a compact copy, written back after
            STATS["view_copies"] += 1
            return _Presented(_import(t.contiguous(), info), None, back, None)
    else:  # "bytes": the source's bytes from its first element
        u8 = t.detach()
        src = torch.empty(0, dtype=torch.uint8, device=t.device).set_(
            u8.untyped_storage(), u8.storage_offset() * u8.element_size(), a.shape, (1,))
        cols = None
    tag = (a.shape, a.layout)
    arr = cache.get(t, tag)
    if arr is not None:
        STATS["view_hits"] += 1
        return _Presented(arr, src.data_ptr(), back, cols)
    arr = _import(src, info)
    if arr.unsafe_buffer_pointer() != src.data_ptr() or src.numel() == 0:
        return _Presented(arr, None, back, cols)  # a copying import: a snapshot, never cached
    cache.put(t, arr, tag)
    return _Presented(arr, src.data_ptr(), back, cols)


def _import(t, info):
    if t.numel() == 0:
        return jax.numpy.zeros(tuple(t.shape), _JAX_DTYPES[t.dtype])
    return import_tensor(t, info)


_JAX_DTYPES = {torch.int64: "int64", torch.int32: "int32", torch.uint8: "uint8",
               torch.int8: "int8", torch.int16: "int16", torch.bool: "bool",
               torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def _commit(a: Arg, t, p: _Presented, result, cache) -> None:
    """Make ``result`` visible in the caller's tensor ``t``: in place already where it aliases
    the imported memory (the result then stands in for the donated array), else a copy."""
    if p.alias is not None and result.unsafe_buffer_pointer() == p.alias:
        cache.put(t, result, (a.shape, a.layout))
        carry_import(p.array, result)
        return
    if p.back is not None:
        write_back(p.back, result, p.cols)


def lowered_specs(args) -> list:
    """The ``jax.ShapeDtypeStruct`` each argument is lowered as."""
    return [jax.ShapeDtypeStruct(a.shape, _JAX_DTYPES[a.dtype]) for a in args]


def _build_program(decl, prep: Prepared, device, index):
    """Lower, extract, compile and load every kernel; the reason (a string) where the direct path
    cannot run this call, reported by :func:`paths` (and warned once) while the call takes the
    DLPack path."""
    try:
        program = triton_direct.extract_program(bind(decl.fn, prep.arg_names,
                                                     prep.result_names),
                                                lowered_specs(prep.args),
                                                results_to_args=prep.results,
                                                static=dict(prep.static, platform="cuda"))
    except triton_direct.Unsupported as e:
        return f"{decl.name}: {e}"
    # A value's device scalar is a row of an int64 table: 8-byte aligned, not the 32 bytes
    # the lowering declares (one kernel for every value, no variant compiled per alignment).
    program = triton_direct.with_arg_alignment(program, {i: 8 for i in prep.valued})
    loaded = triton_direct.Loaded(program, device, _compile_variant(index),
                                  [a.name for a in prep.args])
    try:
        # Every kernel compiled and loaded before the first launch: a failure here (a TTIR the
        # installed triton cannot parse, ptxas) must not leave half a program launched.
        for i in range(len(program.kernels)):
            loaded.runner(i, None)
    except Exception as e:  # noqa: BLE001  (reported: paths(), a warning, the DLPack path runs)
        reason = f"{decl.name}: triton could not compile a kernel: {type(e).__name__}: {e}"
        warnings.warn(f"kv-canary bridge: {reason}; using the DLPack path", RuntimeWarning,
                      stacklevel=3)
        return reason[:2000]
    STATS["direct_programs"] += 1
    return loaded


def _compile_variant(index):
    def compile_one(kernel, divisibility):
        text = kernel.ttir
        if divisibility != tuple(p.divisibility for p in kernel.params):
            text = triton_direct.with_divisibility(text, divisibility)
        key = (index, text, kernel.num_warps, kernel.num_stages)

        def build():
            STATS["direct_compiles"] += 1
            with torch.cuda.device(index):
                return triton_direct.compile_kernel(text, num_warps=kernel.num_warps,
                                                    num_stages=kernel.num_stages)
        return CACHES.variants.get_or_build(key, build)
    return compile_one
