"""RealKvSource and VerifyOrWriteContext: the launch context shared by write and verify.

Registered pytrees with SGLang's field names. Arrays are data fields (they pass through
``jax.jit`` and donation); ``kernel_kind``, ``real_kv_hash_mode`` and a source's ``page_size``,
``num_bytes_per_token``, ``read_bytes`` (and its optional strided ``view``) are static meta fields,
as they are compile-time or host-side values in SGLang too.

A source's bytes are addressed as SGLang's access rule says: for slot ``s`` the strip
``U[s // page_size, (s % page_size) * num_bytes_per_token : ... + num_bytes_per_token]`` of the
tensor viewed as uint8 rows, rows stepped by the row stride. A JAX array is compact, so its row
stride is its row width. A strided torch view (a per-layer slice of a wider buffer) cannot cross
DLPack as such; it is passed as its compact base buffer (``tensor``, any shape and dtype) plus
``view``, the view's :class:`~kvcanary_jax.contracts.TensorMeta` (shape, strides in elements,
dtype), and ``offset_bytes``, the view's byte offset into the base. The checks then run on the
view's metadata, so the messages match what SGLang prints for the view itself.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from kvcanary_jax import consts
from kvcanary_jax.contracts import Check, Contract, Rule, TensorMeta, meta_of

__all__ = [
    "RealKvSource",
    "VerifyOrWriteContext",
    "DigestContext",
    "SourceSpec",
    "SOURCE_CONTRACT",
    "check_source_sizes",
    "SourceCount",
    "SourceAbi",
    "source_spec",
    "as_words",
    "check_extent",
    "check_extents",
    "check_write_index",
    "itemsize_of",
]

# The ops that read a context array field unless its declaration says otherwise (the field's
# ``read_by`` metadata): what the contracts check and the torch bridge hands over per op.
_CONTEXT_OPS = ("verify", "write")


def itemsize_of(dtype_name: str) -> int:
    return int(jnp.dtype(dtype_name).itemsize)


def _row_stride_bytes(m: TensorMeta) -> int:
    return int(m.stride(0)) * itemsize_of(m.dtype)


def _not_integer(metas, s):
    """The first of the three sizes that is not an integer (a float would be truncated where the
    kernels index with it, and a bool is not a size)."""
    for name in ("page_size", "num_bytes_per_token", "read_bytes"):
        v = s[name]
        if isinstance(v, bool) or not isinstance(v, numbers.Integral):
            return {"name": name, "got": f"{type(v).__name__} {v!r}"}
    return None


_SIZES_ARE_INTEGERS = Rule(_not_integer, "kv-canary: RealKvSource.{name} must be an int, got {got}",
                           TypeError)


def check_source_sizes(source) -> None:
    """The first of :data:`SOURCE_CONTRACT`'s checks, alone: a source built elsewhere (SGLang's
    ``RealKvSource`` takes any number) has integer sizes."""
    _SIZES_ARE_INTEGERS.run({}, {n: getattr(source, n) for n in
                                 ("page_size", "num_bytes_per_token", "read_bytes")})


def _page_size_bad(metas, s):
    return None if s["page_size"] >= 1 else {}


def _nbpt_bad(metas, s):
    n = s["num_bytes_per_token"]
    return None if (n > 0 and n % 16 == 0) else {}


def _read_bytes_bad(metas, s):
    r, n = s["read_bytes"], s["num_bytes_per_token"]
    return None if (0 < r <= n and r % 16 == 0) else {}


def _ndim_bad(metas, s):
    m = metas["tensor"]
    return None if m.ndim >= 2 else {"shape": m.shape}


def _row_stride_bad(metas, s):
    m = metas["tensor"]
    b = _row_stride_bytes(m)
    if b % 16 == 0:
        return None
    return {"bytes": b, "shape": m.shape, "strides": tuple(m.stride(d) for d in range(m.ndim)),
            "dtype": m.fmt_dtype()}


def _row_width_bad(metas, s):
    m = metas["tensor"]
    row_bytes = int(m.shape[1]) * itemsize_of(m.dtype)
    need = s["page_size"] * s["num_bytes_per_token"]
    if row_bytes >= need:
        return None
    return {"row_bytes": row_bytes, "need": need, "shape": m.shape, "dtype": m.fmt_dtype()}


# SGLang's RealKvSource.__post_init__, in its order and words (all ValueError). Scalars:
# page_size, num_bytes_per_token, read_bytes; tensor meta: "tensor" (the source's logical view).
SOURCE_CONTRACT = Contract(
    op="RealKvSource",
    checks=(
        _SIZES_ARE_INTEGERS,
        Rule(_page_size_bad, "kv-canary: RealKvSource.page_size must be >= 1, got {page_size}"),
        Rule(
            _nbpt_bad,
            "kv-canary: RealKvSource.num_bytes_per_token must be a positive multiple of 16, "
            "got {num_bytes_per_token}",
        ),
        Rule(
            _read_bytes_bad,
            "kv-canary: RealKvSource.read_bytes must be a positive multiple of 16 in "
            "(0, num_bytes_per_token={num_bytes_per_token}], got {read_bytes}",
        ),
        Rule(_ndim_bad, "kv-canary: RealKvSource.tensor must be at least 2-D, got shape {shape}"),
        Rule(
            _row_stride_bad,
            "kv-canary: RealKvSource.tensor row stride must be a multiple of 16 bytes, "
            "got {bytes} bytes (shape={shape}, strides={strides}, dtype={dtype})",
        ),
        Rule(
            _row_width_bad,
            "kv-canary: RealKvSource.tensor row is {row_bytes} bytes wide but "
            "page_size={page_size} x num_bytes_per_token={num_bytes_per_token} "
            "needs {need} (shape={shape}, dtype={dtype})",
        ),
    ),
)


@dataclasses.dataclass(frozen=True)
class SourceCount(Check):
    """At most MAX_REAL_KV_SOURCES sources (scalar ``num_sources``); raised on every path."""

    def run(self, metas, scalars):
        n = scalars["num_sources"]
        if n > consts.MAX_REAL_KV_SOURCES:
            raise ValueError(
                f"kv-canary: at most {consts.MAX_REAL_KV_SOURCES} RealKvSource entries supported "
                f"by the CUDA ABI, got {n}"
            )


@dataclasses.dataclass(frozen=True)
class SourceAbi(Check):
    """SGLang's per-source launch checks (metas ``real_kv_sources[i].tensor``), source by source:
    rows packed (stride(-1) == 1), then the uint8 view 2-D."""

    def run(self, metas, scalars):
        for i in range(scalars["num_sources"]):
            m = metas.get(f"real_kv_sources[{i}].tensor")
            if m is None:
                continue
            strides = tuple(m.stride(d) for d in range(m.ndim))
            if m.ndim and strides[-1] != 1:
                raise ValueError(
                    f"kv-canary: real_kv_sources[{i}].tensor rows must be packed "
                    f"(stride(-1) == 1), got strides {strides}"
                )
            if m.ndim != 2:
                raise ValueError(
                    f"kv-canary: real_kv_sources[{i}].tensor (viewed as uint8) must be 2-D, "
                    f"got {m.ndim}-D"
                )


def _is_array_like(x: Any) -> bool:
    # JAX rebuilds pytrees with placeholder leaves at times; only real arrays are checked.
    return hasattr(x, "shape") and hasattr(x, "dtype")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class RealKvSource:
    """One region of real KV bytes folded into each slot's fingerprint (SGLang's fields).

    ``tensor``: any dtype, 2-D ``[rows, row_elems]``; or, with ``view`` given, the compact base
    buffer of the strided view ``view`` starting ``offset_bytes`` into it. Construction raises
    SGLang's ValueErrors (page_size >= 1; num_bytes_per_token and read_bytes positive multiples of
    16, read_bytes <= num_bytes_per_token; at least 2-D; row stride a multiple of 16 bytes; rows
    at least page_size * num_bytes_per_token bytes wide).
    """

    tensor: jax.Array
    page_size: int = dataclasses.field(metadata=dict(static=True))
    num_bytes_per_token: int = dataclasses.field(metadata=dict(static=True))
    read_bytes: int = dataclasses.field(metadata=dict(static=True))
    view: TensorMeta | None = dataclasses.field(default=None, metadata=dict(static=True))
    offset_bytes: int = dataclasses.field(default=0, metadata=dict(static=True))

    def __post_init__(self) -> None:
        if self.view is None and not _is_array_like(self.tensor):
            return
        SOURCE_CONTRACT.validate_metas(
            {"tensor": self.meta},
            page_size=self.page_size,
            num_bytes_per_token=self.num_bytes_per_token,
            read_bytes=self.read_bytes,
        )

    @property
    def meta(self) -> TensorMeta:
        """The source's logical view, as its checks see it."""
        return self.view if self.view is not None else meta_of(self.tensor)


class SourceSpec(NamedTuple):
    """Static addressing of one source over its flat int64 words (see :func:`as_words`).

    Word ``w`` of slot ``s``'s strip is at
    ``word_offset + (s // page_size) * row_stride_words + (s % page_size) * nbpt_words + w``;
    rows at or past ``num_rows`` are never read. ``read_words`` = read_bytes / 8 (ALL mode).
    """

    word_offset: int
    row_stride_words: int
    num_rows: int
    page_size: int
    nbpt_words: int
    read_words: int


def source_spec(src: RealKvSource) -> SourceSpec:
    m = src.meta
    if src.offset_bytes % 8 != 0:
        raise ValueError(
            f"kv-canary: RealKvSource.offset_bytes must be a multiple of 8, got {src.offset_bytes}"
        )
    return SourceSpec(
        word_offset=src.offset_bytes // 8,
        row_stride_words=_row_stride_bytes(m) // 8,
        num_rows=int(m.shape[0]),
        page_size=src.page_size,
        nbpt_words=src.num_bytes_per_token // 8,
        read_words=src.read_bytes // 8,
    )


def check_extent(words: jax.Array, spec: SourceSpec, i: int) -> None:
    """The kernels read, for the last row, up to ``page_size * nbpt_words`` words past its start:
    a buffer shorter than that would be read out of bounds, so refuse it at trace time."""
    need = spec.word_offset + (spec.num_rows - 1) * spec.row_stride_words + \
        spec.page_size * spec.nbpt_words
    if spec.num_rows > 0 and words.shape[0] < need:
        raise ValueError(
            f"kv-canary: real_kv_sources[{i}] buffer holds {words.shape[0]} 8-byte words but its "
            f"rows span {need}"
        )


def check_extents(sources) -> None:
    """:func:`check_extent` for every source (its buffer, any dtype, against its spec)."""
    for i, s in enumerate(sources):
        check_extent(as_words(s.tensor), source_spec(s), i)


def nonempty_source(src: RealKvSource) -> RealKvSource:
    """``src`` with a 0-byte buffer replaced by one zero word: its spec (taken from the original
    view) addresses no row, so nothing is read from it, but no implementation has to trace a
    load from an empty array (the fold still takes its step for that source)."""
    if jnp.size(src.tensor) != 0:
        return src
    return dataclasses.replace(src, tensor=jnp.zeros((1,), jnp.int64), view=src.meta)


def as_words(x: jax.Array) -> jax.Array:
    """``x``'s bytes as a flat int64 array (a bitcast under jit, no arithmetic)."""
    x = jnp.asarray(x)
    if x.dtype == jnp.bool_:
        x = x.astype(jnp.uint8)
    k = x.dtype.itemsize
    flat = x.reshape(-1)
    if k == 8:
        return jax.lax.bitcast_convert_type(flat, jnp.int64)
    if 8 % k != 0 or flat.shape[0] % (8 // k) != 0:
        raise ValueError(
            f"kv-canary: a real-KV source buffer must hold a whole number of 8-byte words, "
            f"got shape {tuple(x.shape)} dtype {x.dtype}"
        )
    return jax.lax.bitcast_convert_type(flat.reshape(-1, 8 // k), jnp.int64)


def check_write_index(value: int, prefix: str = "kv-canary:") -> int:
    """A host-side ``violation_write_index`` value, or RuntimeError when it is negative (SGLang's
    torch reference raises RuntimeError on a negative index once it has a row to record; the
    ring guard writes nothing then). ``prefix`` starts the message."""
    value = int(value)
    if value < 0:
        raise RuntimeError(
            f"{prefix} violation_write_index is {value}, negative: it only counts up from 0, so "
            "something overwrote it; the ring's rows and the violation count cannot be trusted, "
            "and no violation is recorded while it stays negative")
    return value


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class VerifyOrWriteContext:
    """Shared launch context of write and verify (SGLang's fields).

    ``canary_buf`` uint8 ``[num_slots, slot_stride_bytes]``; ``violation_ring`` int64
    ``[ring_capacity, 8]``; ``violation_write_index`` int32 ``[1]``; ``slot_run_counter`` and
    ``kernel_run_counter`` int64 ``[1]``; ``real_kv_sources`` a tuple of at most 4
    :class:`RealKvSource`; ``enable_chain_position_assert`` int32 ``[1]`` (write only).
    ``kernel_kind`` (a :class:`~kvcanary_jax.consts.CanaryLaunchTag`) and ``real_kv_hash_mode``
    are static.
    """

    canary_buf: jax.Array
    kernel_kind: consts.CanaryLaunchTag = dataclasses.field(metadata=dict(static=True))
    violation_ring: jax.Array
    violation_write_index: jax.Array
    slot_run_counter: jax.Array
    kernel_run_counter: jax.Array
    real_kv_sources: tuple[RealKvSource, ...]
    real_kv_hash_mode: consts.RealKvHashMode = dataclasses.field(metadata=dict(static=True))
    enable_chain_position_assert: jax.Array = dataclasses.field(metadata=dict(read_by=("write",)))

    def replace(self, **changes) -> "VerifyOrWriteContext":
        return dataclasses.replace(self, **changes)

    @classmethod
    def array_fields(cls, op: str) -> tuple[str, ...]:
        """The array fields ``op`` (``"verify"`` or ``"write"``) reads, in declaration order
        (a field's ``read_by`` metadata; both ops when it has none). The contracts check them and
        the torch bridge hands them over under these names."""
        return tuple(f.name for f in dataclasses.fields(cls)
                     if not f.metadata.get("static") and f.name != "real_kv_sources"
                     and op in f.metadata.get("read_by", _CONTEXT_OPS))

    @classmethod
    def optional_fields(cls) -> frozenset[str]:
        """Array fields declared with a default: they may be None (absent), and the torch
        bridge hands them over only when the caller's context has them."""
        return frozenset(f.name for f in dataclasses.fields(cls)
                         if f.default is not dataclasses.MISSING and not f.metadata.get("static"))

    def arrays(self, op: str) -> dict[str, Any]:
        """``op``'s arrays by name: :meth:`array_fields`, then each source's buffer as
        ``real_kv_sources[i].tensor``."""
        out = {k: getattr(self, k) for k in self.array_fields(op)}
        out.update({f"real_kv_sources[{i}].tensor": s.tensor
                    for i, s in enumerate(self.real_kv_sources)})
        return out

    def real_kv_words(self) -> int:
        """Words each slot's real-KV fingerprint folds (0 when nothing is fingerprinted): 2 per
        source in PARTIAL mode, ``read_bytes / 8`` in ALL."""
        mode = int(self.real_kv_hash_mode)
        if mode == int(consts.RealKvHashMode.NONE):
            return 0
        partial = mode == int(consts.RealKvHashMode.PARTIAL)
        return sum(2 if partial else s.read_bytes // 8 for s in self.real_kv_sources)

    def bound_sources(self) -> tuple[tuple[Any, SourceSpec], ...]:
        """Each source as ``(buffer, SourceSpec)``: what the kernels address."""
        return tuple((s.tensor, source_spec(s)) for s in self.real_kv_sources)

    @classmethod
    def allocate(
        cls,
        *,
        num_slots: int,
        kernel_kind: consts.CanaryLaunchTag = consts.CanaryLaunchTag.HEAD_K_FULL,
        ring_capacity: int = 1024,
        slot_stride_bytes: int = consts.CANARY_SLOT_BYTES,
        real_kv_sources: tuple[RealKvSource, ...] = (),
        real_kv_hash_mode: consts.RealKvHashMode = consts.RealKvHashMode.NONE,
        enable_chain_position_assert: int = 1,
    ) -> "VerifyOrWriteContext":
        """Zero-filled buffers and counters, as the runtime allocates them."""
        from kvcanary_jax import _config

        _check_sizes("VerifyOrWriteContext", num_slots=num_slots, ring_capacity=ring_capacity,
                     slot_stride_bytes=slot_stride_bytes)
        with _config.x64_scope():
            return cls(
                canary_buf=jnp.zeros((num_slots, slot_stride_bytes), jnp.uint8),
                kernel_kind=consts.CanaryLaunchTag(kernel_kind),
                violation_ring=jnp.zeros((ring_capacity, consts.VIOLATION_FIELDS), jnp.int64),
                violation_write_index=jnp.zeros((1,), jnp.int32),
                slot_run_counter=jnp.zeros((1,), jnp.int64),
                kernel_run_counter=jnp.zeros((1,), jnp.int64),
                real_kv_sources=tuple(real_kv_sources),
                real_kv_hash_mode=consts.RealKvHashMode(real_kv_hash_mode),
                enable_chain_position_assert=jnp.full((1,), enable_chain_position_assert,
                                                      jnp.int32),
            )



@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class DigestContext:
    """Launch context of ``digest_verify`` (ours, docs/spec.md §16): the per-slot KV digests and
    the violation ring and counters, laid out as in :class:`VerifyOrWriteContext`.

    ``digest_buf`` int64 ``[num_slots]`` (one digest per KV slot, 0 until written);
    ``violation_ring`` int64 ``[ring_capacity, 8]``; ``violation_write_index`` int32 ``[1]``;
    ``slot_run_counter`` and ``kernel_run_counter`` int64 ``[1]``. ``kernel_kind`` (static, an int
    in ``[0, 2**31)``, e.g. a :class:`~kvcanary_jax.consts.CanaryLaunchTag`) is stamped into the
    rows the launch records.
    """

    digest_buf: jax.Array
    kernel_kind: int = dataclasses.field(metadata=dict(static=True))
    violation_ring: jax.Array
    violation_write_index: jax.Array
    slot_run_counter: jax.Array
    kernel_run_counter: jax.Array

    def __post_init__(self) -> None:
        kind = self.kernel_kind
        if isinstance(kind, bool) or not isinstance(kind, int) or not 0 <= kind < 2**31:
            raise TypeError(f"kv-canary digest: DigestContext.kernel_kind must be an int in "
                            f"[0, 2**31), got {type(kind).__name__} {kind!r}")

    def replace(self, **changes) -> "DigestContext":
        return dataclasses.replace(self, **changes)

    @classmethod
    def allocate(cls, *, num_slots: int, kernel_kind: int = 0,
                 ring_capacity: int = 1024) -> "DigestContext":
        """Zero-filled digests, ring and counters."""
        from kvcanary_jax import _config

        _check_sizes("DigestContext", num_slots=num_slots, ring_capacity=ring_capacity)
        with _config.x64_scope():
            return cls(
                digest_buf=jnp.zeros((num_slots,), jnp.int64),
                kernel_kind=int(kernel_kind),
                violation_ring=jnp.zeros((ring_capacity, consts.VIOLATION_FIELDS), jnp.int64),
                violation_write_index=jnp.zeros((1,), jnp.int32),
                slot_run_counter=jnp.zeros((1,), jnp.int64),
                kernel_run_counter=jnp.zeros((1,), jnp.int64),
            )


def _check_sizes(owner: str, **sizes) -> None:
    """``allocate``'s sizes: each an int >= 0 (NumPy's integers too), refused naming it."""
    import numbers

    for name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
            raise ValueError(f"kv-canary: {owner}.allocate {name} must be an int >= 0, got "
                             f"{value!r}")
