"""A Mosaic TPU kernel's state, declared once.

A kernel's state is what its ``pallas_call`` allocates as scratch: VMEM and SMEM buffers, int32
words in SMEM (counters, flags, the violation ring's state) and DMA semaphores. A :class:`State`
declares each piece once, by name, with its memory space and shape (for words and semaphores:
each name's span), in the order the kernel receives them, and gives both sides of the call:

* :meth:`State.scratch_shapes`: what ``pallas_call`` takes as ``scratch_shapes``;
* :meth:`State.bind`: the kernel's scratch refs (its ``*scratch`` arguments) as a view with one
  attribute per name.

The declarations (the values of ``State(name=..., ...)``):

* :func:`vmem`, :func:`smem`: one buffer; the view holds its ref;
* :func:`vmem_each`: a tuple of VMEM buffers of one role (one per real-KV source); the view holds
  the tuple of refs;
* :func:`words`: named int32 words, in one SMEM vector as long as their spans together;
* :func:`semaphores`: named DMA semaphores, in one array as long as their spans together.

A word or semaphore member spans an int (``1``: one; ``2``: one per buffer ``s``) or a shape
(``(n, 2)``: one per source ``i`` and buffer ``s``). Members are laid out in declaration order with
no gap and no overlap, so two names never share a word or a semaphore (a race the interpret
suites may not reach) and no member reaches past the allocation. In the view a one-wide member is
the thing itself: a word reads and assigns as an attribute (``st.misc.flags``,
``st.misc.flags = v``), a semaphore is its ref (``st.sems.ring``). A wider member is a
:class:`Span` indexed by its coordinates (``st.misc.runs[slot]``, ``st.sems.strips[i, slot]``);
static coordinates are checked against the span when the kernel is traced, traced ones are not.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu

__all__ = ["State", "vmem", "smem", "vmem_each", "words", "semaphores", "Span", "fill"]


def _dims(span) -> tuple[int, ...]:
    dims = (span,) if isinstance(span, int) else tuple(span)
    if not dims or any(not isinstance(d, int) or d < 0 for d in dims):
        raise ValueError(f"kv-canary: a state member's span must be an int or a shape of ints "
                         f"(non-negative; 0: a member of no source holds nothing), got {span!r}")
    return dims


@dataclasses.dataclass(frozen=True)
class _Buffer:
    space: Any  # pltpu.VMEM or pltpu.SMEM
    shape: tuple[int, ...]
    dtype: Any

    def shapes(self) -> list:
        return [self.space(self.shape, self.dtype)]

    def view(self, name: str, refs):
        return refs[0]


@dataclasses.dataclass(frozen=True)
class _Buffers:
    shapes_: tuple[tuple[int, ...], ...]
    dtype: Any

    def shapes(self) -> list:
        return [pltpu.VMEM(s, self.dtype) for s in self.shapes_]

    def view(self, name: str, refs):
        return tuple(refs)


@dataclasses.dataclass(frozen=True)
class _Members:
    """Named members in one allocation: ``(name, dims)`` pairs, laid out in order."""

    members: tuple[tuple[str, tuple[int, ...]], ...]
    semaphore: bool

    def layout(self) -> dict[str, tuple[int, tuple[int, ...]]]:
        """``name -> (offset, dims)``."""
        out, at = {}, 0
        for name, dims in self.members:
            out[name] = (at, dims)
            at += math.prod(dims)
        return out

    @property
    def size(self) -> int:
        return sum(math.prod(d) for _, d in self.members)

    def shapes(self) -> list:
        if self.semaphore:
            return [pltpu.SemaphoreType.DMA((self.size,))]
        return [pltpu.SMEM((self.size,), jnp.int32)]

    def view(self, name: str, refs):
        return (_Semaphores if self.semaphore else _Words)(name, refs[0], self.layout())


def vmem(shape, dtype=jnp.int32) -> _Buffer:
    """A VMEM buffer."""
    return _Buffer(pltpu.VMEM, tuple(shape), dtype)


def smem(shape, dtype=jnp.int32) -> _Buffer:
    """An SMEM buffer."""
    return _Buffer(pltpu.SMEM, tuple(shape), dtype)


def vmem_each(shapes, dtype=jnp.int32) -> _Buffers:
    """VMEM buffers of one role, one per shape (possibly none); the view is their tuple."""
    return _Buffers(tuple(tuple(s) for s in shapes), dtype)


def words(**spans) -> _Members:
    """Named int32 words in one SMEM vector (``name=span``, in layout order)."""
    return _Members(tuple((k, _dims(v)) for k, v in spans.items()), semaphore=False)


def semaphores(**spans) -> _Members:
    """Named DMA semaphores in one array (``name=span``, in layout order)."""
    return _Members(tuple((k, _dims(v)) for k, v in spans.items()), semaphore=True)


@dataclasses.dataclass(frozen=True)
class State:
    """A kernel's scratch, declared once: ``State(name=declaration, ...)`` in the order the
    kernel receives the refs (see the module docstring)."""

    fields: tuple[tuple[str, Any], ...]

    def __init__(self, **fields):
        object.__setattr__(self, "fields", tuple(fields.items()))

    def scratch_shapes(self) -> list:
        """What ``pallas_call`` allocates, in declaration order."""
        return [s for _, decl in self.fields for s in decl.shapes()]

    def bind(self, refs) -> "_View":
        """The kernel's scratch refs (as many as :meth:`scratch_shapes`, in its order) by name."""
        refs = tuple(refs)
        want = len(self.scratch_shapes())
        if len(refs) != want:
            raise TypeError(f"kv-canary: a kernel state of {want} scratch refs got {len(refs)}")
        named, at = {}, 0
        for name, decl in self.fields:
            n = len(decl.shapes())
            named[name] = decl.view(name, refs[at:at + n])
            at += n
        return _View(named)

    def members(self, name: str) -> dict[str, tuple[int, tuple[int, ...]]]:
        """The layout of the words or semaphores ``name``: ``member -> (offset, dims)``."""
        return dict(self.fields)[name].layout()


class _View:
    """A bound :class:`State`: one attribute per declared name."""

    def __init__(self, named: dict):
        self.__dict__.update(named)


class Span:
    """A member of words or semaphores wider than one: ``span[i]`` / ``span[i, s]`` is the
    element at those coordinates (a word's value, assignable; a semaphore's ref)."""

    def __init__(self, owner: str, name: str, ref, offset: int, dims: tuple[int, ...],
                 semaphore: bool):
        self._owner, self._name, self._ref = owner, name, ref
        self._offset, self._dims, self._semaphore = offset, dims, semaphore

    @property
    def shape(self) -> tuple[int, ...]:
        return self._dims

    def index(self, at):
        """The flat index of coordinates ``at`` in the allocation: a Python int when every
        coordinate is static; else the static part plus the traced part (a zero static part is
        not added)."""
        at = at if isinstance(at, tuple) else (at,)
        if len(at) != len(self._dims):
            raise IndexError(f"kv-canary: {self._owner}.{self._name} spans {self._dims}; "
                             f"indexed with {len(at)} coordinate(s)")
        static, traced = self._offset, None
        stride = math.prod(self._dims)
        for i, n in zip(at, self._dims):
            stride //= n
            if isinstance(i, int):
                if not 0 <= i < n:
                    raise IndexError(f"kv-canary: {self._owner}.{self._name}: index {i} outside "
                                     f"its span {self._dims}")
                static += i * stride
            else:
                term = i if stride == 1 else i * stride
                traced = term if traced is None else traced + term
        if traced is None:
            return static
        return traced if static == 0 else static + traced

    def __getitem__(self, at):
        k = self.index(at)
        return self._ref.at[k] if self._semaphore else self._ref[k]

    def __setitem__(self, at, value) -> None:
        if self._semaphore:
            raise TypeError(f"kv-canary: {self._owner}.{self._name} holds semaphores")
        self._ref[self.index(at)] = value


class _MembersView:
    __slots__ = ("_owner", "_ref", "_layout")

    def __init__(self, owner: str, ref, layout: dict):
        object.__setattr__(self, "_owner", owner)
        object.__setattr__(self, "_ref", ref)
        object.__setattr__(self, "_layout", layout)

    def _member(self, name: str):
        try:
            return self._layout[name]
        except KeyError:
            raise AttributeError(f"kv-canary: {self._owner} has no member {name!r} (it has "
                                 f"{', '.join(self._layout)})") from None

    def span(self, name: str) -> Span:
        """Member ``name`` as a :class:`Span`, whatever its width (e.g. a one-wide member
        handed to code that indexes it)."""
        offset, dims = self._member(name)
        return Span(self._owner, name, self._ref, offset, dims,
                    isinstance(self, _Semaphores))

    def __getattr__(self, name: str):
        offset, dims = self._member(name)
        if dims != (1,):
            return self.span(name)
        return self._ref.at[offset] if isinstance(self, _Semaphores) else self._ref[offset]


class _Words(_MembersView):
    """Named words: a one-wide member reads and assigns as an attribute."""

    __slots__ = ()

    def __setattr__(self, name: str, value) -> None:
        offset, dims = self._member(name)
        if dims != (1,):
            raise AttributeError(f"kv-canary: {self._owner}.{name} spans {dims}: assign "
                                 f"{self._owner}.{name}[...]")
        self._ref[offset] = value


class _Semaphores(_MembersView):
    """Named semaphores: a one-wide member is its ref."""

    __slots__ = ()

    def __setattr__(self, name: str, value) -> None:
        raise TypeError(f"kv-canary: {self._owner} holds semaphores")


def fill(view: _Words, names, value) -> None:
    """Sets every word of the members ``names`` of ``view`` to ``value``."""
    for name in names:
        span = view.span(name)
        for k in range(math.prod(span.shape)):
            coords = []
            for n in reversed(span.shape):
                coords.append(k % n)
                k //= n
            span[tuple(reversed(coords))] = value
