"""Tensor contracts, declared once as data and evaluated on JAX arrays or torch tensors.

Every op declares a :class:`Contract`: an ordered list of checks over its tensor arguments
(dimensionality, dtype, length, contiguity, device), each with the exception class and the
message template of SGLang's launcher for the same condition. The JAX wrappers evaluate a
contract at trace time on shapes and dtypes (free under ``jax.jit``); the torch bridge evaluates
the very same contract on torch tensors, where contiguity, strides and devices also matter.

A check sees :class:`TensorMeta` records, never the framework objects, so the order of checks and
the wording of errors are identical on both sides. Dtypes print the way the caller's framework
prints them (``int64`` for JAX, ``torch.int64`` for torch), as SGLang's messages do for torch.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Sequence

__all__ = [
    "TensorMeta",
    "meta_of",
    "Check",
    "NDim",
    "DType",
    "Contiguous",
    "SameDevice",
    "Rule",
    "Contract",
]


@dataclasses.dataclass(frozen=True)
class TensorMeta:
    """What a contract may look at: shape, dtype name, strides (elements), device, framework."""

    shape: tuple[int, ...]
    dtype: str  # numpy-style name: "int64", "int32", "uint8", ...
    strides: tuple[int, ...] | None  # in elements; None when unknown (compact assumed)
    device: str | None
    framework: str  # "jax" or "torch"

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def fmt_dtype(self, name: str | None = None) -> str:
        name = self.dtype if name is None else name
        return f"torch.{name}" if self.framework == "torch" else name

    @property
    def is_contiguous(self) -> bool:
        if self.strides is None:
            return True
        expected = 1
        for size, stride in zip(reversed(self.shape), reversed(self.strides)):
            if size != 1 and stride != expected:
                return False
            expected *= size
        return True

    def stride(self, dim: int) -> int:
        if self.strides is not None:
            return self.strides[dim]
        dim %= len(self.shape)
        s = 1
        for size in self.shape[dim + 1 :]:
            s *= size
        return s


def _compact_strides(shape: Sequence[int]) -> tuple[int, ...]:
    out, s = [], 1
    for size in reversed(shape):
        out.append(s)
        s *= size
    return tuple(reversed(out))


def meta_of(x: Any) -> TensorMeta:
    """Describe a JAX array / tracer / ShapeDtypeStruct / numpy array / torch tensor."""
    mod = type(x).__module__
    if mod.startswith("torch"):
        return TensorMeta(
            shape=tuple(int(d) for d in x.shape),
            dtype=str(x.dtype).removeprefix("torch."),
            strides=tuple(int(s) for s in x.stride()),
            device=str(x.device),
            framework="torch",
        )
    shape = tuple(int(d) for d in x.shape)
    return TensorMeta(
        shape=shape,
        dtype=str(getattr(x.dtype, "name", x.dtype)),
        strides=_compact_strides(shape),
        device=None,
        framework="jax",
    )


class Check:
    """One validation step. ``run`` raises or returns None."""

    def run(self, metas: Mapping[str, TensorMeta | None], scalars: Mapping[str, Any]) -> None:
        raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class NDim(Check):
    """``name`` must have ``ndim`` dimensions. Template fields: name, shape."""

    name: str
    ndim: int
    template: str
    exc: type[Exception] = ValueError

    def run(self, metas, scalars):
        m = metas.get(self.name)
        if m is not None and m.ndim != self.ndim:
            raise self.exc(self.template.format(name=self.name, shape=m.shape, **scalars))


@dataclasses.dataclass(frozen=True)
class DType(Check):
    """``name`` must have dtype ``dtype``. Template fields: name, expected, dtype."""

    name: str
    dtype: str
    template: str
    exc: type[Exception] = TypeError

    def run(self, metas, scalars):
        m = metas.get(self.name)
        if m is not None and m.dtype != self.dtype:
            msg = self.template.format(
                name=self.name, expected=m.fmt_dtype(self.dtype), dtype=m.fmt_dtype(), **scalars
            )
            if m.framework == "jax" and self.dtype == "int64" and m.dtype == "int32":
                from kvcanary_jax import _config

                if not _config.caller_had_x64():
                    msg += _config.X64_HINT
            raise self.exc(msg)


@dataclasses.dataclass(frozen=True)
class Contiguous(Check):
    """``name`` must be contiguous (always true for JAX arrays). Template field: name."""

    name: str
    template: str = "kv-canary: {name} must be contiguous"
    exc: type[Exception] = ValueError

    def run(self, metas, scalars):
        m = metas.get(self.name)
        if m is not None and not m.is_contiguous:
            raise self.exc(self.template.format(name=self.name, **scalars))


@dataclasses.dataclass(frozen=True)
class SameDevice(Check):
    """Every named tensor must sit on the device of ``anchor`` (torch only: JAX places them)."""

    anchor: str
    names: tuple[str, ...]
    template: str = "kv-canary: {name} must be on {anchor}'s device {device}, got {got}"
    exc: type[Exception] = ValueError

    def run(self, metas, scalars):
        a = metas.get(self.anchor)
        if a is None or a.device is None:
            return
        for name in self.names:
            m = metas.get(name)
            if m is not None and m.device is not None and m.device != a.device:
                raise self.exc(
                    self.template.format(name=name, anchor=self.anchor, device=a.device, got=m.device)
                )


@dataclasses.dataclass(frozen=True)
class Rule(Check):
    """A free-form condition: ``fails(metas, scalars)`` returns a dict of template fields when the
    condition is violated (the check raises) and None when it holds."""

    fails: Callable[[Mapping[str, TensorMeta | None], Mapping[str, Any]], dict | None]
    template: str
    exc: type[Exception] = ValueError

    def run(self, metas, scalars):
        fields = self.fails(metas, scalars)
        if fields is not None:
            raise self.exc(self.template.format(**{**scalars, **fields}))


@dataclasses.dataclass(frozen=True)
class Contract:
    """The ordered checks of one op. ``validate`` evaluates them on arrays or tensors."""

    op: str
    checks: tuple[Check, ...]

    def validate_metas(self, metas: Mapping[str, TensorMeta | None], **scalars: Any) -> None:
        for check in self.checks:
            check.run(metas, scalars)

    def validate(self, tensors: Mapping[str, Any], **scalars: Any) -> dict[str, TensorMeta | None]:
        metas = {k: (None if v is None else meta_of(v)) for k, v in tensors.items()}
        self.validate_metas(metas, **scalars)
        return metas
