"""Which implementation of an op runs, and with which launch configuration.

Implementation names (the ``implementation=`` argument of every op):

* ``"xla"``: a vectorised jnp/lax formulation; runs wherever XLA does (CPU, GPU, TPU).
* ``"pallas_triton"``: the Pallas kernels through JAX's Triton lowering (CUDA GPUs).
* ``"pallas_interpret"``: the same kernels in Pallas interpret mode (any backend; a test tool,
  each grid program emulated by a loop of XLA ops). A name for ``"pallas_triton"`` with its
  launch config's ``interpret`` set (see below).
* ``"pallas_mosaic_tpu"``: Pallas kernels through the Mosaic TPU lowering.

Each op package declares its implementations in its ``api.py`` (:func:`standard_op` registers the
usual four), one line each::

    OP = _registry.Op("verify")
    OP.register("pallas_triton", ".pallas_triton")
    OP.register("pallas_interpret", ".pallas_triton")

A registration names the backend module (relative to the op package, imported on first use).
Every backend module exposes ``Config`` (a frozen, hashable dataclass: a static jit argument, part
of the jit's cache key), ``heuristics(shapes) -> Config`` and ``run(<the op's array-level
arguments>, *, <statics>, config)``.

Interpret mode is one field of the launch config, ``interpret``, for both kernel families (as
JAX's Pallas ops take ``interpret=``): ``pallas_triton``'s ``Config(interpret=True)`` runs its
kernels in Pallas interpret mode, ``pallas_mosaic_tpu``'s ``Config(interpret=pltpu.
InterpretParams(...))`` in TPU interpret mode; either runs anywhere (no CUDA GPU, no TPU needed,
so neither falls back for the platform). ``"pallas_interpret"`` is the ``pallas_triton`` module
with the resolved config (whichever way it was resolved) replaced by ``interpret=True``. A tuned
table never turns interpretation on: an entry that names ``interpret`` is refused
(:class:`TuningTableError`).

The default (``implementation=None``): ``pallas_triton`` when the platform is a CUDA GPU and the
Triton lowering imports; ``pallas_mosaic_tpu`` on a TPU where the op registers it; ``xla``
everywhere else (CPU, TPU without a Mosaic kernel, ROCm; ``pallas_interpret`` runs only when asked
for). An implementation that is asked for (or is the platform's default) but cannot be used
here — not registered for the op, its lowering does not import, a future JAX refuses it,
``pallas_triton`` on a platform other than a CUDA GPU (lowering for CUDA from a CPU host, under
:func:`lowering_for` or an abstract CUDA device, keeps it, as does a config in interpret mode
anywhere) — falls back to ``xla`` with one :class:`FallbackWarning` per process and reason,
saying why.

The launch configuration of a call, in order (as tokamax's ``op.py``): the ``config=`` argument;
else the tuned table of the device kind (``kvcanary_jax/tuning/<op>.<device_kind>.json``, written
by ``bench/tune_*.py``: the entry whose key matches the call's static shapes); else the backend's
``heuristics(shapes)``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import importlib.resources
import json
import os
import re
import sys
import tempfile
import threading
import warnings
from types import ModuleType
from typing import Mapping

import jax

__all__ = [
    "IMPLEMENTATIONS",
    "FallbackWarning",
    "Op",
    "standard_op",
    "op",
    "implementations_available",
    "default_implementation",
    "device_kind",
    "table_name",
    "load_table",
    "tuned_config",
    "update_tuned_table",
    "tuned_table_path",
    "TuningTableError",
    "lowering_for",
]

IMPLEMENTATIONS = ("xla", "pallas_triton", "pallas_interpret", "pallas_mosaic_tpu")

# What the default, and an unusable implementation, falls back to: every op registers ``xla``.
_FALLBACKS = ("xla",)


class FallbackWarning(RuntimeWarning):
    """The implementation asked for (or the platform's default) is unusable here; another ran."""


# ---------------------------------------------------------------------------------------------
# Probes: can this implementation's lowering be produced in this process?


def _imports(module: str) -> str | None:
    try:
        importlib.import_module(module)
    except Exception as e:  # noqa: BLE001  (any import failure means: not usable)
        return f"{module} does not import ({type(e).__name__}: {e})"
    return None


@functools.lru_cache(maxsize=None)
def _triton_lowering() -> str | None:
    """None when the Pallas Triton lowering is usable, else why not."""
    try:
        from jax.experimental.pallas import triton as plt
    except Exception as e:  # noqa: BLE001  (any import failure means: not usable)
        return f"the Pallas Triton lowering does not import ({type(e).__name__}: {e})"
    if not hasattr(plt, "CompilerParams"):
        return "this JAX's Pallas Triton module has no CompilerParams"
    try:
        from jax._src import deprecations

        if deprecations.is_accelerated("jax-pallas-triton"):
            return "this JAX refuses the Pallas Triton lowering (deprecation jax-pallas-triton)"
    except Exception:  # noqa: BLE001  (older JAX: the deprecation is not registered)
        pass
    return None


@functools.lru_cache(maxsize=None)
def _pallas_triton_module() -> str | None:
    """The interpret-mode kernels use the Triton module's load/store/atomic primitives."""
    return _imports("jax.experimental.pallas.triton")


@functools.lru_cache(maxsize=None)
def _mosaic_tpu() -> str | None:
    return _imports("jax.experimental.pallas.tpu")


_PROBES = {
    "xla": lambda: None,
    "pallas_triton": _triton_lowering,
    "pallas_interpret": _pallas_triton_module,
    "pallas_mosaic_tpu": _mosaic_tpu,
}


@functools.lru_cache(maxsize=None)
def _is_cuda(platform: str) -> bool:
    if platform == "cuda":
        return True
    if platform != "gpu":
        return False
    try:
        version = str(jax.devices("gpu")[0].client.platform_version).lower()
    except Exception:  # noqa: BLE001  (JAX's "gpu" is CUDA unless its client says ROCm)
        return True
    return "rocm" not in version


def _runs_on(implementation: str, platform: str) -> bool:
    """Whether the implementation executes on devices of ``platform`` (not just lowers)."""
    if implementation in ("xla", "pallas_interpret"):
        return True
    if implementation == "pallas_triton":
        return _is_cuda(platform)
    return platform == "tpu"


_TARGET = threading.local()


@contextlib.contextmanager
def lowering_for(platform: str):
    """Trace for ``platform`` whatever this machine's backend: around
    ``jax.jit(f).trace(...).lower(lowering_platforms=(platform,))`` (the torch bridge's direct
    path lowers for CUDA this way, also on a CPU host), so that the selection follows the
    compile target, not the host."""
    old = getattr(_TARGET, "platform", None)
    _TARGET.platform = platform
    try:
        yield
    finally:
        _TARGET.platform = old


def _args_platform(args) -> str | None:
    """The platform ``args`` are placed on, when their avals or shardings name one: a jit traced
    with arguments sharded over a mesh of another platform's devices (e.g. a TPU topology's, on a
    CPU host) carries that mesh, with its device kind and platform, in every aval; concrete
    arrays and ``ShapeDtypeStruct`` s carry their sharding's devices. None when none says."""
    if args is None:
        return None
    for leaf in jax.tree.leaves(args):
        for sharding in (getattr(_typeof(leaf), "sharding", None), getattr(leaf, "sharding", None)):
            device = getattr(getattr(sharding, "mesh", None), "abstract_device", None)
            if device is not None and getattr(device, "platform", None):
                return device.platform
            try:
                devices = sharding.device_set if sharding is not None else ()
            except Exception:  # noqa: BLE001  (an abstract sharding has no concrete devices)
                devices = ()
            for d in devices:
                return d.platform
    return None


def _typeof(x):
    try:
        return jax.typeof(x)
    except Exception:  # noqa: BLE001  (not an array: no aval)
        return None


def _platform(platform: str | None, args=None) -> str:
    """``platform``, else the platform being targeted: that of :func:`lowering_for` in scope,
    else that of the abstract device in scope (a lowering for another platform than this
    machine's, e.g. TPU on a CPU machine), else that of the devices ``args`` are placed on
    (:func:`_args_platform`), else JAX's default backend. (A bare
    ``.lower(lowering_platforms=...)`` is not seen: the choice is made while tracing, before the
    lowering names its platform.)"""
    if platform is not None:
        return platform
    target = getattr(_TARGET, "platform", None)
    if target is not None:
        return target
    try:
        device = jax.sharding.get_abstract_mesh().abstract_device
    except Exception:  # noqa: BLE001  (no abstract mesh API, or none in scope)
        device = None
    if device is not None:
        return device.platform
    return _args_platform(args) or jax.default_backend()


def _interpret_requested(config) -> bool:
    """Whether ``config`` (a launch config, or None) asks for interpret mode: Pallas interpret
    mode (``pallas_triton``'s ``interpret=True``) or TPU interpret mode (``pallas_mosaic_tpu``'s
    ``interpret=pltpu.InterpretParams(...)``)."""
    return getattr(config, "interpret", None) not in (None, False)


# Implementation names that are another's kernels in interpret mode (``pallas_interpret``: those
# of ``pallas_triton``, registered with its module): the call's launch config gets
# ``interpret=True``.
_INTERPRETED = frozenset({"pallas_interpret"})


def _interpreted(implementation: str, config):
    """``config``, with ``interpret=True`` where ``implementation`` names interpret mode."""
    if implementation in _INTERPRETED and config.interpret is not True:
        return dataclasses.replace(config, interpret=True)
    return config


# ---------------------------------------------------------------------------------------------
# Ops and their registrations


_OPS: dict[str, "Op"] = {}
_WARNED: set[tuple[str, str, str]] = set()


class Op:
    """One op's implementations (see the module docstring)."""

    def __init__(self, name: str):
        self.name = name
        self.package = f"kvcanary_jax.ops.{name}"
        self._registered: dict[str, str] = {}  # implementation -> its module's dotted path
        _OPS[name] = self

    def register(self, implementation: str, module: str) -> None:
        """``module``: dotted path, relative (``".xla"``) to the op's package."""
        if implementation not in IMPLEMENTATIONS:
            raise ValueError(f"kv-canary: unknown implementation {implementation!r}; known: "
                             f"{', '.join(IMPLEMENTATIONS)}")
        self._registered[implementation] = (self.package + module if module.startswith(".")
                                            else module)

    def registered(self) -> tuple[str, ...]:
        return tuple(i for i in IMPLEMENTATIONS if i in self._registered)

    def unusable(self, implementation: str, *, platform: str | None = None,
                 config=None) -> str | None:
        """None when ``implementation`` can be traced and lowered here, else why not. The Triton
        kernels compile for CUDA GPUs only and the Mosaic TPU kernels for TPUs only: elsewhere
        they are usable in interpret mode (a ``config`` with ``interpret`` set)."""
        if implementation not in self._registered:
            return f"{self.name} has no {implementation!r} implementation"
        if implementation == "pallas_triton" and _interpret_requested(config):
            # Pallas interpret mode, exactly as pallas_interpret: any platform, and no Triton
            # lowering needed (only the Triton module's primitives).
            return _PROBES["pallas_interpret"]()
        why = _PROBES[implementation]()
        if why is None and implementation == "pallas_triton":
            p = _platform(platform)
            if not _is_cuda(p):
                # Pallas compiles its Triton kernels for CUDA only; on a CPU backend JAX would
                # fail at compile time with "Only interpret mode is supported on CPU backend".
                return (f"its kernels compile for CUDA GPUs and the platform is {p!r} "
                        "(pallas_interpret runs the same kernels anywhere, as a test tool)")
        if why is None and implementation == "pallas_mosaic_tpu":
            p = _platform(platform)
            if p != "tpu" and not _interpret_requested(config):
                return (f"its kernels compile for TPUs and the platform is {p!r} (TPU interpret "
                        f"mode: pass its Config(interpret=pltpu.InterpretParams()))")
        return why

    def available(self, platform: str | None = None) -> tuple[str, ...]:
        """Implementations that are usable and execute on ``platform`` (default: JAX's)."""
        p = _platform(platform)
        return tuple(i for i in self.registered()
                     if self.unusable(i, platform=p) is None and _runs_on(i, p))

    def default(self, platform: str | None = None) -> str:
        return self.select(None, platform=platform)

    def select(self, implementation: str | None = None, *, platform: str | None = None,
               config=None, args=None) -> str:
        """The implementation a call runs: ``implementation`` when usable (with ``config``, the
        call's launch config if given), else the fallback (with one :class:`FallbackWarning` per
        reason); ``None``: the platform's default. The platform: ``platform``, else the target
        of the trace (an abstract TPU device in scope, or ``args``, the call's arrays, placed on
        another platform's devices), else JAX's default backend."""
        if implementation is not None and implementation not in IMPLEMENTATIONS:
            raise ValueError(f"kv-canary: {self.name}: unknown implementation "
                             f"{implementation!r}; known: {', '.join(IMPLEMENTATIONS)}")
        p = _platform(platform, args)
        asked = implementation
        if asked is None:
            if _is_cuda(p):
                asked = "pallas_triton"
            elif p == "tpu" and "pallas_mosaic_tpu" in self._registered:
                asked = "pallas_mosaic_tpu"
        if asked is not None:
            why = self.unusable(asked, platform=p, config=config)
            if why is None:
                return asked
        for fallback in _FALLBACKS:
            if self.unusable(fallback) is None:
                if asked is not None and asked != fallback:
                    self._warn(asked, fallback, why)
                return fallback
        raise RuntimeError(f"kv-canary: {self.name}: no usable implementation "
                           f"(registered: {', '.join(self.registered()) or 'none'})")

    def _warn(self, asked: str, used: str, why: str) -> None:
        key = (asked, used, why)
        if key in _WARNED:
            return
        _WARNED.add(key)
        warnings.warn(f"kv-canary: implementation {asked!r} is unavailable: {why}; using "
                      f"{used!r}", FallbackWarning, stacklevel=_caller_level())

    def module(self, implementation: str) -> ModuleType:
        return importlib.import_module(self._registered[implementation])

    def config(self, implementation: str, shapes: Mapping[str, int], config=None, *,
               kind: str | None = None):
        """The launch configuration: ``config`` (checked against the backend's type), else the
        tuned table's entry for ``shapes`` on device kind ``kind`` (default: the default
        device's; an entry never sets ``interpret``), else the backend's heuristics; for
        ``pallas_interpret``, that config with ``interpret=True``."""
        mod = self.module(implementation)
        if config is not None:
            if not isinstance(config, mod.Config):
                raise TypeError(f"kv-canary: {self.name}: implementation {implementation!r} "
                                f"takes a {mod.__name__}.Config, got {type(config).__name__}")
            return _interpreted(implementation, config)
        tuned = tuned_config(self.name, implementation, shapes, kind=kind)
        if tuned is not None:
            where = f"its {implementation!r} entry for {dict(shapes)}"
            if "interpret" in tuned:
                raise _malformed(tuned_table_path(self.name, kind),
                                 f"{where} sets 'interpret' (a table tunes compiled kernels; "
                                 f"interpret mode is the call's: implementation="
                                 f"'pallas_interpret' or a config= with interpret set)")
            try:
                config = mod.Config(**tuned)
            except (TypeError, ValueError) as e:  # an unknown field, a missing or bad value
                raise _malformed(tuned_table_path(self.name, kind),
                                 f"{where} is not a {mod.__name__}.Config ({e})") from None
            return _interpreted(implementation, config)
        return _interpreted(implementation, mod.heuristics(shapes))

    def run(self, implementation: str, *args, config, **kwargs):
        """``run`` of the implementation's module (``pallas_interpret``: ``config`` with
        ``interpret=True``, also where it did not come from :meth:`config`)."""
        return self.module(implementation).run(*args, config=_interpreted(implementation, config),
                                               **kwargs)


def op(name: str) -> Op:
    """The registered op ``name`` (``scatter``, ``plan``, ``write``, ``verify``)."""
    try:
        return _OPS[name]
    except KeyError:
        raise ValueError(f"kv-canary: unknown op {name!r}; known: {', '.join(_OPS)}") from None


def implementations_available(op_name: str | None = None, *,
                              platform: str | None = None) -> tuple[str, ...]:
    """Implementations that run here (on ``platform``, default JAX's default backend): for one
    op, or those every op has."""
    ops = [op(op_name)] if op_name is not None else list(_OPS.values())
    sets = [set(o.available(platform)) for o in ops]
    common = set.intersection(*sets) if sets else set()
    return tuple(i for i in IMPLEMENTATIONS if i in common)


def default_implementation(op_name: str, platform: str | None = None) -> str:
    """What ``implementation=None`` runs for ``op_name`` on ``platform`` (default: JAX's)."""
    return op(op_name).default(platform)


# ---------------------------------------------------------------------------------------------
# Tuned tables: kvcanary_jax/tuning/<op>.<device kind>.json
#
#   {"op": "verify", "device_kind": "NVIDIA H200",
#    "implementations": {"pallas_triton": [
#        {"key": {"capacity": 1024}, "config": {...}, "median_us": 2.43, "source": "..."}]}}
#
# An entry applies to a call whose static shapes contain every item of its key.


@functools.lru_cache(maxsize=None)
def device_kind(platform: str | None = None) -> str:
    """The device kind of ``platform``'s first device (default: JAX's default backend)."""
    return jax.devices(platform)[0].device_kind


def table_name(op_name: str, kind: str) -> str:
    return f"{op_name}.{re.sub(r'[^a-z0-9]+', '_', kind.lower()).strip('_')}.json"


def _tuning_dir():
    return importlib.resources.files("kvcanary_jax").joinpath("tuning")


class TuningTableError(ValueError):
    """A tuned table that cannot be read as one (the message names the file and what is
    wrong)."""


def _malformed(path, what: str) -> TuningTableError:
    return TuningTableError(f"kv-canary: tuned table {path} is malformed: {what} (rerun the "
                            "tuning script that wrote it, or delete the file)")


def _checked_table(path, text: str) -> dict:
    """The table in ``text``, its structure checked (our rule: what :func:`tuned_config` and
    :func:`update_tuned_table` read, so that neither fails later with a raw KeyError)."""
    try:
        table = json.loads(text)
    except ValueError as e:  # JSONDecodeError, and an empty or truncated file
        raise _malformed(path, f"not JSON ({e})") from None
    if not isinstance(table, dict):
        raise _malformed(path, f"the top level is a {type(table).__name__}, not an object")
    impls = table.get("implementations")
    if not isinstance(impls, dict):
        raise _malformed(path, "'implementations' must be an object of implementation -> list")
    for impl, entries in impls.items():
        if not isinstance(entries, list):
            raise _malformed(path, f"implementations[{impl!r}] must be a list of entries")
        for i, e in enumerate(entries):
            if not (isinstance(e, dict) and isinstance(e.get("key"), dict)
                    and isinstance(e.get("config"), dict)):
                raise _malformed(path, f"implementations[{impl!r}][{i}] must be an object with "
                                       "a 'key' object and a 'config' object")
    return table


@functools.lru_cache(maxsize=None)
def _table_and_path(op_name: str, kind: str) -> tuple[dict, str]:
    f = _tuning_dir().joinpath(table_name(op_name, kind))
    if not f.is_file():
        return {}, str(f)
    return _checked_table(f, f.read_text()), str(f)


def load_table(op_name: str, kind: str) -> dict:
    """The tuned table of ``op_name`` on device kind ``kind`` ({} when there is none). Raises
    :class:`TuningTableError` (a ValueError naming the file) for one that is not a table."""
    return _table_and_path(op_name, kind)[0]


load_table.cache_clear = _table_and_path.cache_clear


def tuned_config(op_name: str, implementation: str, shapes: Mapping[str, int], *,
                 kind: str | None = None) -> dict | None:
    """The config fields of the tuned entry for ``shapes``, or None."""
    table = load_table(op_name, device_kind() if kind is None else kind)
    for entry in table.get("implementations", {}).get(implementation, ()):
        if all(shapes.get(k) == v for k, v in entry["key"].items()):
            return dict(entry["config"])
    return None


def tuned_table_path(op_name: str, kind: str | None = None) -> str:
    """Where the tuned table of ``op_name`` on ``kind`` (default: the default device's) lives."""
    return _table_and_path(op_name, device_kind() if kind is None else kind)[1]


def update_tuned_table(op_name: str, implementation: str, kind: str, entries, *,
                       directory: str | os.PathLike | None = None) -> str:
    """Merge ``entries`` (dicts with ``key`` and ``config``, plus any measurements) into the
    table of ``op_name`` on ``kind``; an entry replaces the one with the same key. Writes into
    ``directory`` (default: the package's ``tuning/``, i.e. a source checkout) and returns the
    file's path. The file is replaced atomically (a temporary file in the same directory, then
    a rename): an interrupted run leaves the old table or the new one, never half of one. An
    existing file that is not a table is refused (:class:`TuningTableError`), not overwritten;
    an entry whose config names ``interpret`` is refused (ValueError) before anything is
    written."""
    directory = os.fspath(directory) if directory is not None else os.fspath(_tuning_dir())
    path = os.path.join(directory, table_name(op_name, kind))
    entries = list(entries)
    for e in entries:
        if "interpret" in e["config"]:
            raise ValueError(f"kv-canary: tuned table {path}: the entry for {e['key']} sets "
                             "'interpret'; a table tunes compiled kernels and never turns "
                             "interpret mode on (leave the field out)")
    table = {"op": op_name, "device_kind": kind, "implementations": {}}
    if os.path.exists(path):
        with open(path) as f:
            table = _checked_table(path, f.read())
    rows = {json.dumps(e["key"], sort_keys=True): e
            for e in table["implementations"].get(implementation, [])}
    for e in entries:
        rows[json.dumps(e["key"], sort_keys=True)] = dict(e)
    table["implementations"][implementation] = sorted(
        rows.values(), key=lambda e: sorted(e["key"].items()))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{table_name(op_name, kind)}.", suffix=".tmp",
                               dir=directory)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(table, f, indent=1, sort_keys=False)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    load_table.cache_clear()
    return path


def standard_op(name: str) -> Op:
    """The op ``name`` with the implementations every op has, each in the op package's module of
    that name (``pallas_interpret``: the ``pallas_triton`` module, its config with
    ``interpret=True``)."""
    op = Op(name)
    op.register("pallas_triton", ".pallas_triton")
    op.register("pallas_interpret", ".pallas_triton")
    op.register("xla", ".xla")
    op.register("pallas_mosaic_tpu", ".pallas_mosaic_tpu")
    return op


def _caller_level() -> int:
    """``warnings.warn``'s stacklevel, counted from its caller's frame, of the first frame outside
    this package and JAX: the caller's own line, however deep the entry points and JAX's tracing
    put the registry's call."""
    inside = tuple(os.path.dirname(os.path.abspath(m.__file__)) + os.sep
                   for m in (sys.modules["kvcanary_jax"], sys.modules["jax"]))
    frame, level = sys._getframe(2), 2  # the caller of warnings.warn's caller
    while frame is not None and frame.f_code.co_filename.startswith(inside):
        frame, level = frame.f_back, level + 1
    return level if frame is not None else 1
