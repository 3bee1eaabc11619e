"""The bridge as a drop-in for SGLang 0.5.23's canary runtime (``sglang.srt.kv_canary``).

SGLang's runtime (CanaryManager, its single-forward managers, sweep and perturbers) launches the
four kv-canary kernels through four module-level names, bound when its modules were imported::

    sglang.srt.kv_canary.req_to_expected_token_ids_manager.launch_scatter_req_token_ids_kernel
    sglang.srt.kv_canary.runner.kernel_launcher.launch_canary_plan_kernels
    sglang.srt.kv_canary.endpoint.launch_canary_verify_kernel
    sglang.srt.kv_canary.endpoint.launch_canary_write_kernel

:func:`install_into_sglang` rebinds exactly these four names to the bridge's launchers (same
keywords, SGLang's dataclasses accepted as they are) and nothing else: SGLang's kernel modules,
its references and every other name of the runtime stay as they were. Before it rebinds anything
it checks, for all four at once:

* the installed ``sglang`` distribution is 0.5.23, the version whose launchers the bridge
  reproduces;
* each name still holds SGLang's own launcher (defined in ``sglang.kernels.ops.kv_canary``), not
  a launcher some other code installed;
* each launcher's signature (parameter names, kinds, defaults) is the bridge launcher's.

Any failure raises :class:`~kvcanary_jax.bridge.dlpack.BridgeError` naming the version or the name
and both signatures, with nothing rebound. The returned :class:`SglangInstall` restores SGLang's
launchers on :meth:`~SglangInstall.uninstall` or at the end of a ``with`` block;
:func:`kvcanary_jax.bridge.paths` lists, per launcher, the runtime names it is installed as.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import inspect
import threading

from kvcanary_jax.bridge import entry_points
from kvcanary_jax.bridge.dlpack import BridgeError

__all__ = ["SGLANG_VERSION", "TARGETS", "Target", "SglangInstall", "install_into_sglang",
           "installed"]

SGLANG_VERSION = "0.5.23"


@dataclasses.dataclass(frozen=True)
class Target:
    """One name SGLang's runtime launches a kernel through: ``module.name``, which holds SGLang's
    launcher defined in ``origin``; the bridge launcher of the same name replaces it."""

    module: str
    name: str
    origin: str

    @property
    def dotted(self) -> str:
        return f"{self.module}.{self.name}"


TARGETS = (
    Target("sglang.srt.kv_canary.req_to_expected_token_ids_manager",
           "launch_scatter_req_token_ids_kernel",
           "sglang.kernels.ops.kv_canary.scatter_req_token_ids"),
    Target("sglang.srt.kv_canary.runner.kernel_launcher", "launch_canary_plan_kernels",
           "sglang.kernels.ops.kv_canary.plan.api"),
    Target("sglang.srt.kv_canary.endpoint", "launch_canary_verify_kernel",
           "sglang.kernels.ops.kv_canary.verify"),
    Target("sglang.srt.kv_canary.endpoint", "launch_canary_write_kernel",
           "sglang.kernels.ops.kv_canary.write"),
)

_LOCK = threading.Lock()
_ACTIVE: list[SglangInstall] = []  # at most one


def _sglang_version() -> str | None:
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return None


def _shape(fn) -> tuple:
    """What must agree between SGLang's launcher and the bridge's: each parameter's name, kind
    and default (annotations differ: SGLang's name its own dataclasses)."""
    return tuple((p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values())


def _render(fn) -> str:
    params = inspect.signature(fn).parameters.values()
    return "(" + ", ".join(
        ("*, " if p.kind is p.KEYWORD_ONLY and i == 0 else "") + p.name
        + ("" if p.default is p.empty else f"={p.default!r}")
        for i, p in enumerate(params)) + ")"


def _replacement(target: Target):
    return getattr(entry_points, target.name)


class SglangInstall:
    """The four rebound names (:attr:`patched`) and SGLang's launchers they held; restores them
    on :meth:`uninstall` (idempotent) or when its ``with`` block ends."""

    def __init__(self, originals: dict[Target, object]):
        self._originals = originals
        self.version = SGLANG_VERSION
        self.active = True

    @property
    def patched(self) -> tuple[str, ...]:
        return tuple(t.dotted for t in self._originals)

    def uninstall(self) -> None:
        with _LOCK:
            if not self.active:
                return
            replaced = []
            for target, original in self._originals.items():
                module = importlib.import_module(target.module)
                if getattr(module, target.name) is not _replacement(target):
                    replaced.append(target.dotted)
                    continue  # someone rebound it after us: theirs stays
                setattr(module, target.name, original)
            self.active = False
            _ACTIVE.remove(self)
        if replaced:
            raise BridgeError(
                "kv-canary bridge: uninstall restored SGLang's launchers except "
                f"{', '.join(replaced)}, which other code rebound after install_into_sglang(); "
                "left as that code set them")

    def __enter__(self) -> SglangInstall:
        return self

    def __exit__(self, *exc) -> None:
        self.uninstall()

    def __repr__(self) -> str:
        state = "active" if self.active else "uninstalled"
        return f"SglangInstall(sglang {self.version}, {state}, {len(self._originals)} launchers)"


def install_into_sglang() -> SglangInstall:
    """Make SGLang 0.5.23's canary runtime launch the bridge's kernels (module docstring).

    SGLang's runtime modules are imported if they are not yet (in a server they are); that needs
    the ``sglang`` package importable with its runtime's own imports satisfied (a server, or
    :func:`kvcanary_jax.oracle.load_runtime` without one). Raises :class:`BridgeError`, rebinding
    nothing, on another SGLang version, a second install, or a launcher that is not SGLang's or
    whose signature differs from the bridge's."""
    version = _sglang_version()
    if version != SGLANG_VERSION:
        raise BridgeError(
            f"kv-canary bridge: install_into_sglang() supports SGLang {SGLANG_VERSION}'s canary "
            f"runtime, whose launchers the bridge reproduces; installed: "
            f"{'no sglang distribution' if version is None else f'sglang {version}'}")
    with _LOCK:
        if _ACTIVE:
            raise BridgeError(
                "kv-canary bridge: install_into_sglang() is already active "
                f"({_ACTIVE[0]!r}); uninstall it first")
        originals: dict[Target, object] = {}
        for target in TARGETS:
            try:
                module = importlib.import_module(target.module)
            except ImportError as e:
                raise BridgeError(
                    f"kv-canary bridge: cannot import SGLang's canary runtime module "
                    f"{target.module} ({type(e).__name__}: {e}); install_into_sglang() patches "
                    "a runtime that imports (in a server, or after "
                    "kvcanary_jax.oracle.load_runtime())") from e
            current = getattr(module, target.name, None)
            ours = _replacement(target)
            if current is None or getattr(current, "__module__", None) != target.origin:
                where = getattr(current, "__module__", None)
                raise BridgeError(
                    f"kv-canary bridge: {target.dotted} is not SGLang {SGLANG_VERSION}'s "
                    f"launcher from {target.origin} (it is {current!r}"
                    f"{f' from {where}' if where else ''}); not installed")
            if _shape(current) != _shape(ours):
                raise BridgeError(
                    f"kv-canary bridge: SGLang {version}'s {target.dotted} has signature "
                    f"{_render(current)}, the bridge's {target.name} takes {_render(ours)}; "
                    "not installed")
            originals[target] = current
        for target in TARGETS:
            setattr(importlib.import_module(target.module), target.name, _replacement(target))
        handle = SglangInstall(originals)
        _ACTIVE.append(handle)
        return handle


def installed() -> dict[str, list[str]]:
    """Per bridge launcher, the SGLang runtime names it is installed as (empty when none)."""
    out: dict[str, list[str]] = {}
    with _LOCK:
        for handle in _ACTIVE:
            for target in handle._originals:
                out.setdefault(target.name, []).append(target.dotted)
    return out
