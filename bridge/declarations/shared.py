"""What the launchers' declarations share (:mod:`kvcanary_jax.bridge.declarations`).

* :class:`Declaration`: one launcher as data, what the generic launcher
  (:mod:`kvcanary_jax.bridge.launcher`) runs;
* binding by name: each argument's name is its path in the op's pytrees, and the function
  rebuilds the pytrees from the arrays bound under those names (:func:`rebuild`,
  :func:`fields_of`, :func:`context_from`; :data:`VP_FIELDS`, :data:`WP_FIELDS`: the plans'
  fields);
* the arguments' forms (:class:`~kvcanary_jax.bridge.launcher.Arg`): a dense tensor
  (:func:`dense`), a 2-D view with packed rows as its base (:func:`pitched`), offsets clamped to
  a bucketed token array's true length (:func:`offsets_arg`), a real-KV source as the bytes its
  kernels read (:func:`source_args`, :func:`named_source_args`);
* the context's tensors each op hands over (:func:`ctx_tensors`, :func:`ctx_args`,
  :func:`required_of`, :func:`source_statics`), and the context as the ops' contracts read it
  (:func:`ctx_for_checks`);
* the checks every launcher runs besides its op's contract: one device (:func:`same_device`),
  distinct in-place outputs (:func:`check_distinct_outputs`);
* which implementation runs the op for a tensor's device (:func:`platform_of`,
  :func:`impl_for`).
"""

from __future__ import annotations

import dataclasses
import numbers
import operator
import types
from typing import Callable

import torch

from kvcanary_jax.bridge.dlpack import BridgeError
from kvcanary_jax.bridge.launcher import Arg
from kvcanary_jax import default_implementation
from kvcanary_jax import plans as _plans
from kvcanary_jax.context import RealKvSource, VerifyOrWriteContext, check_source_sizes
from kvcanary_jax.contracts import Contract, SameDevice, TensorMeta, meta_of

__all__ = [
    "Declaration",
    "VP_FIELDS",
    "WP_FIELDS",
    "platform_of",
    "impl_for",
    "rebuild",
    "fields_of",
    "reader",
    "context_from",
    "dense",
    "pitched",
    "offsets_arg",
    "count_arg",
    "source_statics",
    "hashable",
    "ctx_for_checks",
    "same_device",
    "check_distinct_outputs",
    "required_of",
    "ctx_tensors",
    "ctx_args",
    "source_args",
    "named_source_args",
]


@dataclasses.dataclass(frozen=True)
class Declaration:
    """One launcher (see :mod:`kvcanary_jax.bridge.declarations`). Every callable takes the
    call's keyword arguments (and the tensors dict that ``tensors`` returned)."""

    name: str
    anchor: str  # the tensor whose device the call runs on
    outputs: tuple[str, ...]  # in-place outputs that must not share memory (checked per address)
    tensors: Callable[[dict], dict]
    statics: Callable[[dict], tuple]
    validate: Callable[[dict, dict], None]
    skip: Callable[[dict, dict], bool]
    check_values: Callable[[dict, dict], None]
    # (kwargs, tensors) -> (args, static, results): ``results`` names the arguments the
    # function's outputs update (the launcher binds both by name, once per signature).
    arguments: Callable[..., tuple]
    fn: Callable  # fn(named arrays, **static) -> {argument name: its new value}
    # Tensors this call writes besides ``outputs`` (the step's expected-token pool when it
    # scatters): they must not share memory with any input either.
    also_written: Callable[[dict], tuple] = lambda kw: ()
    # Every tensor ``also_written`` may name: their addresses join the outputs' in the call
    # signature, since the spans a prepared call checks inputs against come from them.
    may_also_write: tuple[str, ...] = ()
    # The first ``bucketed`` tensors are token arrays lowered at ``bucket(length)`` whose true
    # length the function takes per call (an argument with ``length_of``): a call signature
    # holds their bucket, not their length, so a history that grows every step (SGLang's
    # scatter) keeps its prepared call. No check may depend on their exact length.
    bucketed: int = 0
    # outputs + may_also_write: the tensors whose addresses a call signature holds.
    addressed: tuple[str, ...] = dataclasses.field(init=False, default=())

    def __post_init__(self):
        object.__setattr__(self, "addressed", self.outputs + self.may_also_write)


# --------------------------------------------------------------------------------------------
# Shared pieces

# Field names read off the package's pytrees: a field declared there is bound by its name.
VP_FIELDS = tuple(f.name for f in dataclasses.fields(_plans.VerifyPlan))
WP_FIELDS = tuple(f.name for f in dataclasses.fields(_plans.WritePlan))
# Every array field of the context (each op hands over those it reads: ``array_fields(op)``).
_CTX_FIELDS = tuple(dict.fromkeys(VerifyOrWriteContext.array_fields("verify")
                                  + VerifyOrWriteContext.array_fields("write")))


def platform_of(t) -> str:
    """The JAX platform whose default implementation runs the op for tensor ``t``'s device
    (the launcher replaces it by the DLPack path's device platform, or "cuda" on the direct
    path, whose functions must lower to Pallas Triton kernels)."""
    return "cuda" if t.device.type == "cuda" else "cpu"


def impl_for(op: str, platform: str) -> str:
    return default_implementation(op, platform)


# Binding by name: each argument's name is its path in the op's pytrees (a context field,
# ``plan.<field>``, ``real_kv_sources[i].tensor``, a token array's name), and each output comes
# back under the name of the argument it updates.

def rebuild(cls, named: dict, prefix: str = ""):
    """The pytree ``cls`` from the arrays bound as ``prefix + field`` (None where no argument
    holds a field: an optional array left out, or a field the op does not read)."""
    return cls(**{f.name: named.get(prefix + f.name) for f in dataclasses.fields(cls)})


def fields_of(obj, names, prefix: str = "") -> dict:
    """``{prefix + name: obj.name}`` for each of ``names`` (a tuple)."""
    read = _READERS.get((names, prefix))
    if read is None:
        read = _READERS.setdefault((names, prefix), reader(names, prefix))
    return read(obj)


def reader(names: tuple, prefix: str = ""):
    """:func:`fields_of` for these ``names`` and ``prefix``, as one function: a call site on
    every launch keeps it (one attribute read for all the fields)."""
    keys = tuple(prefix + k for k in names)
    if not names:
        return lambda obj: {}
    if len(names) == 1:
        return lambda obj: {keys[0]: getattr(obj, names[0])}
    get = operator.attrgetter(*names)
    return lambda obj: dict(zip(keys, get(obj)))


_READERS: dict = {}


def context_from(named: dict, *, op: str, kind: int, mode: int, sources: tuple):
    """The op's :class:`~kvcanary_jax.context.VerifyOrWriteContext` from the arrays bound by
    name; ``sources``: the static :class:`~kvcanary_jax.context.RealKvSource` s whose tensors
    are bound as ``real_kv_sources[i].tensor``."""
    return VerifyOrWriteContext(
        **{k: named.get(k) for k in _CTX_FIELDS}, kernel_kind=kind, real_kv_hash_mode=mode,
        real_kv_sources=tuple(dataclasses.replace(s, tensor=named[f"real_kv_sources[{i}].tensor"])
                              for i, s in enumerate(sources)))


def dense(name, t, *, out=False, shape=None, clamp=None, pad=None) -> Arg:
    return Arg(name=name, shape=tuple(t.shape) if shape is None else shape, dtype=t.dtype,
               out=out, clamp=clamp, pad=pad)


def pitched(name, t, *, out, check_fits: bool) -> Arg:
    """A 2-D view with packed rows, as its base ``[rows, stride(0)]`` from its first element.
    ``check_fits``: the op reads the base's full rows (not only the view's columns), so the base
    must lie inside the storage (checked on every call: it depends on the storage offset)."""
    rows, cols = int(t.shape[0]), int(t.shape[1])
    pitch = int(t.stride(0)) if rows > 1 else max(cols, int(t.stride(0)))
    if t.is_contiguous() or rows == 0:
        pitch = cols
    elif t.stride(1) != 1 or pitch < cols:
        raise BridgeError(
            f"kv-canary bridge: {name} is a strided view (shape={tuple(t.shape)}, "
            f"strides={tuple(t.stride())}) the kernels cannot address (they step rows by "
            f"stride(0) over packed columns); pass {name}.contiguous() and copy the result back"
        )
    return Arg(name=name, shape=(rows, pitch), dtype=t.dtype, layout="pitched", out=out,
               cols=cols, whole_rows=check_fits)


def _source_arg(name, s) -> tuple[Arg, RealKvSource]:
    """A real-KV source as the bytes its kernels read, from the view's first element, and its
    static description: the view as uint8 rows (row stride, row count), with its tensor bound
    by ``name`` when the function runs."""
    t = s.tensor
    item = t.element_size()
    rows = int(t.shape[0])
    stride_bytes = int(t.stride(0)) * item
    need = 0 if rows == 0 else (rows - 1) * stride_bytes + int(s.page_size) * int(
        s.num_bytes_per_token)
    view = TensorMeta(shape=(rows, int(t.shape[1]) * item), dtype="uint8",
                      strides=(stride_bytes, 1), device=None, framework="torch")
    static = RealKvSource(tensor=None, page_size=int(s.page_size),
                          num_bytes_per_token=int(s.num_bytes_per_token),
                          read_bytes=int(s.read_bytes), view=view)
    return Arg(name=name, shape=(max(need, 8),), dtype=torch.uint8, layout="bytes"), static


def source_statics(context) -> tuple:
    """The sources' sizes in a call signature, each with its type: a float or a tensor that
    equals an earlier call's integer must not reuse that call's checks (which refuse it)."""
    return tuple(hashable(v) for s in context.real_kv_sources
                 for v in (s.page_size, s.num_bytes_per_token, s.read_bytes))


def hashable(x) -> tuple:
    """``x`` in a call signature: an integer (numpy's too) as its value with its type (``True`` is
    not ``1``), any other value by its type alone (an array scalar is not hashable; the checks
    refuse every such value, so it is never cached)."""
    return (int(x) if isinstance(x, numbers.Integral) else None, type(x))


def ctx_for_checks(context):
    """SGLang's context as the ops' contracts read it: the package's context over the torch
    tensors, each source as its tensor and the torch view's metadata. A source's sizes must be
    integers (SGLang's own ``RealKvSource`` takes any number)."""
    for s in context.real_kv_sources:
        check_source_sizes(s)
    return VerifyOrWriteContext(
        **{k: getattr(context, k, None) for k in _CTX_FIELDS}, kernel_kind=context.kernel_kind,
        real_kv_hash_mode=context.real_kv_hash_mode,
        real_kv_sources=tuple(types.SimpleNamespace(tensor=s.tensor, meta=meta_of(s.tensor))
                              for s in context.real_kv_sources))


def same_device(op, anchor, tensors: dict):
    present = {k: v for k, v in tensors.items() if isinstance(v, torch.Tensor)}
    Contract(op=op, checks=(SameDevice(anchor, tuple(present)),)).validate(present)


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


def count_arg(name, of: str) -> Arg:
    """Token array ``of``'s true length, this call's: an int64 ``[1]`` the bridge supplies
    (``Arg.length_of``) and the op reads (the scatter's ``num_tokens``: its offsets read as at
    most that), so one prepared call serves every length of a bucket."""
    return Arg(name=name, shape=(1,), dtype=torch.int64, length_of=of)


def offsets_arg(name, t, n: int, b: int) -> Arg:
    """Offsets indexing a token array of true length ``n`` lowered at bucket ``b``: clamped to
    ``min(offsets, n)`` per call where ``b > n``, so every range loses exactly its indices at or
    past ``n``, which the ops never read (see :mod:`kvcanary_jax.buckets`)."""
    return dense(name, t, clamp=n if b != n else None)


# --------------------------------------------------------------------------------------------
# The context's tensors

_SOURCE_NAMES = tuple(f"real_kv_sources[{i}].tensor" for i in range(8))
# The context fields each op reads (the context's declaration says), looked up once; a field
# declared with a default may be missing from the caller's context (read as None, not handed
# over).
_CTX_READ = {op: VerifyOrWriteContext.array_fields(op) for op in ("verify", "write")}
_CTX_OPTIONAL = VerifyOrWriteContext.optional_fields()
# Per op: (required fields, optional fields), split once so a call reads each without a test.
_CTX_SPLIT = {op: (tuple(k for k in f if k not in _CTX_OPTIONAL),
                   tuple(k for k in f if k in _CTX_OPTIONAL)) for op, f in _CTX_READ.items()}


def required_of(ts: dict) -> dict:
    """The tensors a launcher requires: all but the optional context fields left absent."""
    return {k: v for k, v in ts.items() if v is not None or k not in _CTX_OPTIONAL}


def ctx_tensors(context, op: str) -> dict:
    required, optional = _CTX_SPLIT[op]
    out = {k: getattr(context, k) for k in required}
    if optional:
        out.update({k: getattr(context, k, None) for k in optional})
    sources = context.real_kv_sources
    if sources:
        # More than MAX_REAL_KV_SOURCES is refused by the contract, named like the others.
        out.update({(_SOURCE_NAMES[i] if i < 8 else f"real_kv_sources[{i}].tensor"): s.tensor
                    for i, s in enumerate(sources)})
    return out


def ctx_args(ts, op: str, outputs: tuple[str, ...]) -> list[Arg]:
    return [dense(k, ts[k], out=k in outputs) for k in _CTX_READ[op] if ts[k] is not None]


def source_args(context):
    return named_source_args(context.real_kv_sources, "real_kv_sources")


def named_source_args(sources, field: str):
    """``(args, statics)`` of the sources of argument ``field``: each as its bytes, named
    ``field[i].tensor``, and its static description (the function rebinds the tensors by those
    names)."""
    pairs = [_source_arg(f"{field}[{i}].tensor", s) for i, s in enumerate(sources)]
    return [a for a, _ in pairs], tuple(s for _, s in pairs)
