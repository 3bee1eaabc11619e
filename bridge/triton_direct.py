"""The package's Pallas kernels launched from torch without XLA: lower, extract, compile, launch.

One kernel source serves both sides. A bridge launcher's array-level function (the same jitted
function the DLPack path runs through XLA) is lowered for CUDA on any machine::

    jax.jit(fn).trace(*specs).lower(lowering_platforms=("cuda",))

Every Pallas kernel in it is a ``stablehlo.custom_call @__gpu$xla.gpu.triton`` whose
``mhlo.backend_config`` holds the kernel's Triton IR (``ir``, MLIR bytecode written with the Triton
dialect bundled in jaxlib), its grid (``grid_x/y/z``), ``num_warps`` and ``num_stages``.
:func:`extract_program` walks the lowered module and builds a :class:`Program`: the kernels in
execution order, and for each kernel parameter where its memory comes from (:class:`Buf`): a
function argument (the caller's tensor; reshapes and bitcasts between the argument and the kernel
are views of the same bytes), a scratch buffer (a kernel result that aliases no operand, e.g. the
plan's verify offsets), or a constant (the dummy operands of absent optional inputs). Anything
else in the module (an XLA computation between kernels) makes the function unsupported here, and
the bridge takes the DLPack path for it, saying why (:class:`Unsupported`).

The bytecode is parsed in a context built like ``jax._src.pallas.triton.lowering._new_ir_context``
and printed as TTIR text (:func:`ttir_text`); :func:`compile_kernel` compiles that text with the
``triton`` package installed beside torch (``triton.compile`` on a ``.ttir`` file) for a
:class:`triton.backends.compiler.GPUTarget`. Both steps run without a GPU (ptxas ships in the
triton wheel), so CI compiles every kernel for sm_90.

Kernel parameters are the custom call's operands then its results, all pointers (the Pallas
lowering passes shapes and strides as constants). XLA aligns buffers to at least the
``tt.divisibility`` the lowering declares (32 bytes); a torch view need not be (a counter
``counters[1:2]``), so each parameter's declared divisibility is lowered to what the call's
pointer actually has (:func:`with_divisibility`), and compiled kernels are keyed by it: the
aligned case keeps the kernel XLA would run.

Launch (:meth:`Program.launch`, GPU only): for each kernel, the pointers in parameter order, on the
caller's current torch stream, through triton's launcher. No DLPack, no JAX dispatch, no host
synchronisation; a ``torch.cuda.graph`` capture records the launches like any torch kernel.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import operator
import os
import re
import tempfile
import threading
from typing import Any, Callable, Sequence

import numpy as np

from kvcanary_jax.bridge import triton_launch
from kvcanary_jax.bridge.dlpack import BridgeError, copy_into

__all__ = [
    "Buf",
    "KernelCall",
    "Program",
    "Unsupported",
    "extract_program",
    "ttir_text",
    "kernel_params",
    "with_divisibility",
    "with_arg_alignment",
    "compile_kernel",
    "triton_version",
    "available",
]

CUSTOM_CALL = "__gpu$xla.gpu.triton"


class Unsupported(Exception):
    """The function cannot run on the direct path (the reason is the message)."""


@dataclasses.dataclass(frozen=True)
class Buf:
    """Where a kernel parameter's memory comes from: ``kind`` is ``"arg"`` (function argument
    ``index``), ``"scratch"`` (scratch buffer ``index``) or ``"const"`` (constant ``index``)."""

    kind: str
    index: int


@dataclasses.dataclass(frozen=True)
class Param:
    """A kernel pointer parameter as the TTIR declares it."""

    dtype: str  # Triton element type: i8, i32, i64, ...
    divisibility: int | None


@dataclasses.dataclass(frozen=True)
class KernelCall:
    """One Triton kernel launch of a program."""

    name: str
    ttir: str
    grid: tuple[int, int, int]
    num_warps: int
    num_stages: int
    params: tuple[Param, ...]
    bufs: tuple[Buf, ...]  # one per parameter: the custom call's operands, then its results


@dataclasses.dataclass(frozen=True)
class Scratch:
    shape: tuple[int, ...]
    dtype: np.dtype

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize


@dataclasses.dataclass(frozen=True)
class Copy:
    """A function result that is not the memory of the argument it must update (a constant or a
    scratch result): copied into the argument after the kernels."""

    dst_arg: int
    src: Buf


@dataclasses.dataclass(eq=False)
class Program:
    """Kernels, scratch buffers and constants of one lowered function (one shape signature).

    ``copies`` move results into their arguments where a kernel did not write them in place."""

    kernels: tuple[KernelCall, ...]
    scratch: tuple[Scratch, ...]
    consts: tuple[np.ndarray, ...]
    copies: tuple[Copy, ...]
    arg_bytes: tuple[int, ...]  # bytes each argument spans (its lowered shape)


# --------------------------------------------------------------------------------------------
# Lowering and extraction


def _attr_int(attr) -> int:
    from jax._src.lib.mlir import ir

    return int(ir.IntegerAttr(attr).value)


def _np_dtype(element_type) -> np.dtype:
    s = str(element_type)
    table = {"i1": np.bool_, "i8": np.int8, "ui8": np.uint8, "i16": np.int16, "ui16": np.uint16,
             "i32": np.int32, "ui32": np.uint32, "i64": np.int64, "ui64": np.uint64,
             "f16": np.float16, "f32": np.float32, "f64": np.float64, "bf16": np.uint16}
    if s not in table:
        raise Unsupported(f"element type {s}")
    return np.dtype(table[s])


def _tensor_type(value):
    from jax._src.lib.mlir import ir

    t = ir.RankedTensorType(value.type)
    return tuple(int(d) for d in t.shape), _np_dtype(t.element_type)


def _const_array(op) -> np.ndarray:
    from jax._src.lib.mlir import ir

    shape, dtype = _tensor_type(op.result)
    attr = ir.DenseElementsAttr(op.attributes["value"])
    if attr.is_splat:
        v = attr.get_splat_value()
        scalar = (bool(ir.BoolAttr(v).value) if dtype == np.bool_ else
                  int(ir.IntegerAttr(v).value) if dtype.kind in "iu" else
                  float(ir.FloatAttr(v).value))
        return np.full(shape, scalar, dtype)
    return np.array(attr, dtype=dtype).reshape(shape)


class _Walker:
    """Interprets the lowered module's functions over :class:`Buf` values."""

    def __init__(self, module):
        from jax._src.lib.mlir import ir

        self.ir = ir
        self.funcs = {}
        for op in module.body.operations:
            if op.operation.name == "func.func":
                name = ir.StringAttr(op.attributes["sym_name"]).value
                self.funcs[name] = op
        self.kernels: list[KernelCall] = []
        self.scratch: list[Scratch] = []
        self.consts: list[np.ndarray] = []
        self._const_vals: dict[int, np.ndarray] = {}  # const index -> value (for folding)

    def new_const(self, arr: np.ndarray) -> Buf:
        self.consts.append(np.ascontiguousarray(arr))
        self._const_vals[len(self.consts) - 1] = self.consts[-1]
        return Buf("const", len(self.consts) - 1)

    def run(self, fname: str, args: Sequence[Buf]) -> list[Buf]:
        ir = self.ir
        func = self.funcs[fname]
        block = func.regions[0].blocks[0]
        env: dict[Any, Buf] = {}
        for a, b in zip(block.arguments, args):
            env[a] = b
        for op in block.operations:
            name = op.operation.name
            if name == "func.return":
                return [env[v] for v in op.operands]
            if name == "func.call":
                callee = ir.FlatSymbolRefAttr(op.attributes["callee"]).value
                outs = self.run(callee, [env[v] for v in op.operands])
                for r, b in zip(op.results, outs):
                    env[r] = b
            elif name == "stablehlo.custom_call":
                target = ir.StringAttr(op.attributes["call_target_name"]).value
                if target != CUSTOM_CALL:
                    raise Unsupported(f"custom call {target}")
                for r, b in zip(op.results, self.kernel(op, [env[v] for v in op.operands])):
                    env[r] = b
            elif name in ("stablehlo.reshape", "stablehlo.bitcast_convert"):
                src = env[op.operands[0]]
                if src.kind == "const":
                    shape, dtype = _tensor_type(op.result)
                    val = self._const_vals[src.index]
                    env[op.result] = self.new_const(
                        val.reshape(shape) if name == "stablehlo.reshape"
                        else np.ascontiguousarray(val).view(dtype).reshape(shape))
                else:  # row-major: the same bytes
                    env[op.result] = src
            elif name == "stablehlo.constant":
                env[op.result] = self.new_const(_const_array(op))
            elif name in ("stablehlo.broadcast_in_dim", "stablehlo.convert"):
                src = env[op.operands[0]]
                if src.kind != "const":
                    raise Unsupported(f"{name} of a non-constant")
                shape, dtype = _tensor_type(op.result)
                val = self._const_vals[src.index]
                if name == "stablehlo.convert":
                    out = val.astype(dtype)
                else:
                    dims = list(ir.DenseI64ArrayAttr(op.attributes["broadcast_dimensions"]))
                    expanded = val.reshape([val.shape[dims.index(d)] if d in dims else 1
                                            for d in range(len(shape))])
                    out = np.broadcast_to(expanded, shape)
                env[op.result] = self.new_const(out)
            else:
                raise Unsupported(f"XLA operation {name} between the kernels")
        raise Unsupported(f"function {fname} has no return")

    def kernel(self, op, operands: list[Buf]) -> list[Buf]:
        ir = self.ir
        cfg = ir.DictAttr(op.attributes["mhlo.backend_config"])
        aliases = {}
        if "output_operand_aliases" in op.attributes:
            for a in ir.ArrayAttr(op.attributes["output_operand_aliases"]):
                # #stablehlo.output_operand_alias<output_tuple_indices = [i], operand_index = k, ..>
                s = str(a)
                out = re.search(r"output_tuple_indices = \[(\d*)\]", s).group(1)
                k = int(re.search(r"operand_index = (\d+)", s).group(1))
                aliases[int(out) if out else 0] = k
        results = []
        for i, r in enumerate(op.results):
            if i in aliases:
                src = operands[aliases[i]]
                if src.kind == "const":
                    raise Unsupported("a kernel writes into a constant operand")
                results.append(src)
            else:
                shape, dtype = _tensor_type(r)
                self.scratch.append(Scratch(shape, dtype))
                results.append(Buf("scratch", len(self.scratch) - 1))
        text = ttir_text(ir.StringAttr(cfg["ir"]).value_bytes)
        name, params = kernel_params(text)
        bufs = tuple(operands) + tuple(results)
        if len(params) != len(bufs):
            raise Unsupported(f"kernel {name} has {len(params)} parameters for {len(bufs)} "
                              "operands and results")
        self.kernels.append(KernelCall(
            name=name, ttir=text,
            grid=(_attr_int(cfg["grid_x"]), _attr_int(cfg["grid_y"]), _attr_int(cfg["grid_z"])),
            num_warps=_attr_int(cfg["num_warps"]), num_stages=_attr_int(cfg["num_stages"]),
            params=params, bufs=bufs,
        ))
        return results


def extract_program(fn: Callable, specs: Sequence[Any], *, results_to_args: Sequence[int],
                    static: dict | None = None) -> Program:
    """Lower ``fn(*specs, **static)`` for CUDA and extract its kernels.

    ``specs``: one ``jax.ShapeDtypeStruct`` per array argument (None entries are passed as
    None). ``results_to_args[j]``: the argument result ``j`` updates in place (the bridge's
    functions return their in-place outputs in order). Raises :class:`Unsupported` where the
    lowered module holds anything but kernels, views and constants, and before lowering where
    ``static`` holds a launch config in interpret mode (its kernels are XLA ops: the call takes
    the DLPack path, which runs them as asked)."""
    import jax

    from kvcanary_jax import _config

    from kvcanary_jax.ops._registry import _interpret_requested, lowering_for

    if _interpret_requested((static or {}).get("config")):
        raise Unsupported("its launch config asks for interpret mode (kernels emulated by XLA "
                          "ops, nothing to launch directly)")

    # lowering_for: the ops select their CUDA kernels even where this host's backend is a CPU.
    with _config.x64_scope(), _config.quiet_triton_lowering(), lowering_for("cuda"):
        # keep_unused: argument i of the lowered module must be argument i of the call.
        lowered = jax.jit(functools.partial(fn, **(static or {})), keep_unused=True).trace(
            *specs).lower(lowering_platforms=("cuda",))
        module = lowered.compiler_ir("stablehlo")
        with module.context:
            w = _Walker(module)
            leaves = [s for s in specs if s is not None]
            args = [Buf("arg", i) for i in range(len(leaves))]
            results = w.run("main", args)
    if len(results) != len(results_to_args):
        raise Unsupported(f"{len(results)} results for {len(results_to_args)} in-place outputs")
    copies = tuple(Copy(a, r) for r, a in zip(results, results_to_args)
                   if not (r.kind == "arg" and r.index == a))
    for c in copies:
        if c.src.kind == "arg":
            raise Unsupported(f"result for argument {c.dst_arg} is argument {c.src.index}")
    arg_bytes = tuple(int(np.prod(s.shape, dtype=np.int64)) * np.dtype(s.dtype).itemsize
                      for s in leaves)
    return Program(kernels=tuple(w.kernels), scratch=tuple(w.scratch), consts=tuple(w.consts),
                   copies=copies, arg_bytes=arg_bytes)


# --------------------------------------------------------------------------------------------
# TTIR text


def ttir_text(bytecode: bytes) -> str:
    """The kernel's Triton IR as text, parsed in a context with jaxlib's Triton dialect (as the
    Pallas lowering builds it) and printed without locations."""
    from jax._src.interpreters import mlir
    from jax._src.lib.mlir import ir

    from jaxlib.triton import dialect as tt_dialect

    ctx = mlir.JaxIrContext()
    ctx.append_dialect_registry(mlir.upstream_dialects)
    tt_dialect.register_dialect(ctx)
    ctx.load_all_available_dialects()
    with ctx:
        module = ir.Module.parse(bytecode)
        return module.operation.get_asm(enable_debug_info=False)


_FUNC = re.compile(r"tt\.func (?:public |private )?@([\w$.]+)\((.*?)\)\s*(?:attributes|\{)",
                   re.S)
_PTR = re.compile(r"%arg\d+: !tt\.ptr<(\w+)>(?: \{([^}]*)\})?")


def kernel_params(text: str) -> tuple[str, tuple[Param, ...]]:
    """The kernel's name and pointer parameters (element type, declared divisibility)."""
    m = _FUNC.search(text)
    if m is None:
        raise Unsupported("no tt.func in the kernel's IR")
    params = []
    for p in re.split(r",\s*(?=%arg)", m.group(2).strip()):
        pm = _PTR.fullmatch(p.strip())
        if pm is None:
            raise Unsupported(f"kernel parameter {p.strip()!r} is not a pointer")
        div = re.search(r"tt\.divisibility = (\d+)", pm.group(2) or "")
        params.append(Param(pm.group(1), int(div.group(1)) if div else None))
    return m.group(1), tuple(params)


def with_divisibility(text: str, divisibility: Sequence[int | None]) -> str:
    """``text`` with parameter ``i``'s ``tt.divisibility`` set to ``divisibility[i]`` (None or
    1 removes it)."""
    m = _FUNC.search(text)
    parts = re.split(r",\s*(?=%arg)", m.group(2).strip())
    out = []
    for p, d in zip(parts, divisibility):
        p = re.sub(r" \{[^}]*\}$", "", p.strip())
        if d is not None and d > 1:
            p += f" {{tt.divisibility = {d} : i32}}"
        out.append(p)
    return text[:m.start(2)] + ", ".join(out) + text[m.end(2):]


def with_arg_alignment(program: Program, alignment: dict[int, int]) -> Program:
    """``program`` with each parameter on argument ``i``'s memory declared at most
    ``alignment[i]`` bytes divisible (an argument whose address the caller knows is only that
    aligned: compiling for it once, rather than per pointer met)."""
    if not alignment:
        return program
    kernels = []
    for k in program.kernels:
        div = tuple(min(p.divisibility, alignment[b.index])
                    if p.divisibility and b.kind == "arg" and b.index in alignment
                    else p.divisibility for p, b in zip(k.params, k.bufs))
        if div != tuple(p.divisibility for p in k.params):
            k = dataclasses.replace(
                k, ttir=with_divisibility(k.ttir, div),
                params=tuple(dataclasses.replace(p, divisibility=d)
                             for p, d in zip(k.params, div)))
        kernels.append(k)
    return dataclasses.replace(program, kernels=tuple(kernels))


# --------------------------------------------------------------------------------------------
# Compilation with torch's triton


def triton_version() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


_AVAILABLE: list = []  # the probe's answer, once per process (asked on every launch)


def available() -> tuple[bool, str]:
    """(usable, reason): triton importable and its CUDA backend present."""
    if not _AVAILABLE:
        try:
            import triton  # noqa: F401
            from triton.backends.compiler import GPUTarget  # noqa: F401
        except ImportError as e:
            _AVAILABLE.append((False, f"triton is not importable ({e})"))
        else:
            _AVAILABLE.append((True, ""))
    return _AVAILABLE[0]


_SRC_DIR = None
_SRC_LOCK = threading.Lock()


def _source_file(text: str) -> str:
    """A content-addressed ``.ttir`` file (triton.compile reads IR from a path)."""
    global _SRC_DIR
    with _SRC_LOCK:
        if _SRC_DIR is None:
            _SRC_DIR = tempfile.mkdtemp(prefix="kvcanary-ttir-")
    path = os.path.join(_SRC_DIR, hashlib.sha256(text.encode()).hexdigest()[:32] + ".ttir")
    if not os.path.exists(path):
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}"
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    return path


def compile_kernel(text: str, *, num_warps: int, num_stages: int, target=None):
    """``triton.compile`` of TTIR ``text`` for ``target`` (a ``GPUTarget``; the current device's
    when None). Returns triton's compiled kernel."""
    import triton

    # Integer kernels: fp fusion changes nothing; said explicitly so triton does not warn.
    return triton.compile(_source_file(text), target=target,
                          options=dict(num_warps=num_warps, num_stages=num_stages,
                                       enable_fp_fusion=True))


# --------------------------------------------------------------------------------------------
# Launch (GPU)


_ELEM_BYTES = {"i1": 1, "i8": 1, "i16": 2, "i32": 4, "i64": 8, "f16": 2, "bf16": 2, "f32": 4,
               "f64": 8}


def _alignment(ptr: int, cap: int) -> int:
    return min(cap, ptr & -ptr) if ptr else cap


def divisibility_for(kernel: KernelCall, ptrs: Sequence[int]) -> tuple[int | None, ...]:
    """Each parameter's declared divisibility, lowered to what its pointer has."""
    return tuple(None if p.divisibility is None else _alignment(ptr, p.divisibility)
                 for p, ptr in zip(kernel.params, ptrs))


def check_alignment(kernel: KernelCall, ptrs: Sequence[int], names: Sequence[str]) -> None:
    """Every pointer aligned to its element type (the kernel loads whole elements)."""
    for p, ptr, name in zip(kernel.params, ptrs, names):
        size = _ELEM_BYTES.get(p.dtype, 1)
        if ptr % size:
            raise BridgeError(
                f"kv-canary bridge: {name} starts at an address that is not {size}-byte aligned "
                f"(the kernel reads it as {p.dtype}); pass a tensor whose data_ptr() is a "
                f"multiple of {size}"
            )


def _required(p: Param) -> int:
    """The alignment a parameter's pointer must have for the kernel as compiled: its declared
    divisibility, else its element's size."""
    return p.divisibility or _ELEM_BYTES.get(p.dtype, 1)


def _gather(positions: tuple[int, ...]) -> Callable[[Sequence[int]], tuple]:
    """``pointers -> tuple(pointers[i] for i in positions)``, in one C call."""
    if len(positions) > 1:
        return operator.itemgetter(*positions)
    if positions:
        (i,) = positions
        return lambda p: (p[i],)
    return lambda p: ()


class Loaded:
    """A :class:`Program` compiled for one CUDA device, ready to launch.

    ``compile`` is ``(kernel, divisibility) -> triton compiled kernel`` (cached by the caller).
    Constants live on the device for the object's lifetime; scratch is allocated per launch
    from torch's caching allocator (inside a graph capture, from the graph's pool), so two
    threads or streams never share it."""

    def __init__(self, program: Program, device, compile: Callable, names: Sequence[str]):
        import torch

        self.program = program
        self.device = device
        self.names = tuple(names)  # argument names, for errors
        self._compile = compile
        # torch's allocators align to at least 64 bytes: constants meet the kernels' 32.
        self.consts = []
        for c in program.consts:
            host = torch.from_numpy(np.ascontiguousarray(c).view(np.uint8).reshape(-1).copy())
            self.consts.append(torch.empty(host.shape, dtype=torch.uint8,
                                           device=device).copy_(host))
        offs, total = [], 0
        for s in program.scratch:
            offs.append(total)
            total += -(-max(s.nbytes, 1) // 256) * 256
        self.scratch_offsets = offs
        self.scratch_bytes = total
        # The constants' addresses, fixed for the object's lifetime.
        self.const_ptrs = [c.data_ptr() for c in self.consts]
        # Per kernel: its parameters as positions in one list of the call's pointers (the
        # arguments', then the scratch buffers', then the constants'), read by one C call.
        nargs = len(self.names)
        first = {"arg": 0, "scratch": nargs, "const": nargs + len(offs)}
        self.gathers = [_gather(tuple(first[b.kind] + b.index for b in k.bufs))
                        for k in program.kernels]
        # Every kernel's default variant is right for a call whose pointers all have their
        # declared divisibility. Each argument's strictest one over the kernels, grouped by
        # mask: (mask, argument positions). Scratch offsets are multiples of 256 and the
        # constants fixed, so they are checked here once (the scratch base per call).
        need: dict[tuple[str, int], int] = {}
        for k in program.kernels:
            for b, prm in zip(k.bufs, k.params):
                if _required(prm) > 1:
                    key = (b.kind, b.index)
                    need[key] = max(need.get(key, 1), _required(prm))
        groups: dict[int, list[int]] = {}
        for (kind, j), d in sorted(need.items()):
            if kind == "arg":
                groups.setdefault(d - 1, []).append(j)
        self.arg_masks = tuple((m, tuple(js)) for m, js in groups.items())
        self.scratch_mask = max([d for (kind, _), d in need.items()
                                 if kind == "scratch"] + [1]) - 1
        self.uniform = all(o & self.scratch_mask == 0 for o in offs) and all(
            self.const_ptrs[j] % d == 0 for (kind, j), d in need.items() if kind == "const")
        self._defaults: list = [None] * len(program.kernels)
        # Calls with a pointer less aligned than declared: runners per low-bits pattern.
        self.low_mask = max([d for d in need.values()] + [1]) - 1
        self._variants: dict[tuple, list] = {}
        self._runners: dict[tuple, Callable] = {}
        self._lock = threading.Lock()

    def runner(self, i: int, divisibility: tuple | None):
        key = (i, divisibility)
        r = self._runners.get(key)
        if r is None:
            import torch

            k = self.program.kernels[i]
            compiled = self._compile(k, divisibility or tuple(p.divisibility for p in k.params))
            with self._lock, torch.cuda.device(self.device):
                r = self._runners.get(key) or self._runners.setdefault(
                    key, triton_launch.runner(compiled, k.grid, len(k.params)))
        return r

    def _variants_for(self, pool: Sequence[int]) -> list:
        """Each kernel's runner for the pointers ``pool``: its default where every parameter
        has its declared divisibility, else one compiled for what they have (a pointer not
        aligned to its element type is refused, naming its tensor)."""
        runs = []
        for i, gather in enumerate(self.gathers):
            args = gather(pool)
            k = self.program.kernels[i]
            div = None
            if any(a & (_required(p) - 1) for a, p in zip(args, k.params)):
                check_alignment(k, args, [self.names[b.index] if b.kind == "arg" else b.kind
                                          for b in k.bufs])
                div = divisibility_for(k, args)
            runs.append(self.runner(i, div))
        return runs

    def launch(self, ptrs: Sequence[int], stream: int, arg_views: Callable | None = None) -> None:
        """Launch every kernel on raw CUDA stream ``stream`` with argument pointers ``ptrs``;
        ``arg_views(i)`` gives argument ``i`` as a flat uint8 tensor (for result copies)."""
        import torch

        scratch = None
        pool = ptrs
        uniform = self.uniform
        if self.scratch_bytes:
            scratch = torch.empty(self.scratch_bytes, dtype=torch.uint8, device=self.device)
            base = scratch.data_ptr()
            pool = [*ptrs, *[base + o for o in self.scratch_offsets], *self.const_ptrs]
            uniform = uniform and not base & self.scratch_mask
        elif self.const_ptrs:
            pool = [*ptrs, *self.const_ptrs]
        if uniform:
            for mask, positions in self.arg_masks:
                low = 0
                for j in positions:
                    low |= ptrs[j]
                if low & mask:
                    uniform = False
                    break
        if uniform:  # every pointer as aligned as declared: each kernel's default variant
            defaults = self._defaults
            for i, gather in enumerate(self.gathers):
                run = defaults[i]
                if run is None:
                    run = defaults[i] = self.runner(i, None)
                run(*gather(pool), stream=stream)
        else:
            # Some pointer is less aligned than declared: the kernels for these pointers'
            # alignments, found once per pattern of low address bits.
            key = tuple([p & self.low_mask for p in pool])
            runs = self._variants.get(key)
            if runs is None:
                runs = self._variants_for(pool)
                if len(self._variants) >= 64:
                    self._variants.clear()
                self._variants[key] = runs
            for run, gather in zip(runs, self.gathers):
                run(*gather(pool), stream=stream)
        for c in self.program.copies:
            dst = arg_views(c.dst_arg)
            if c.src.kind == "const":
                copy_into(dst, self.consts[c.src.index][: dst.numel()])
            else:
                off = self.scratch_offsets[c.src.index]
                copy_into(dst, scratch[off: off + dst.numel()])
        del scratch  # back to the caching allocator, ordered on the current stream
