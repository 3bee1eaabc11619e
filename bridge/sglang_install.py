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

``coverage_window=N`` (N >= 1; ours, default 0: off, SGLang's behaviour and bytes unchanged) also
covers every layer's K and V of SGLang's pool within a window of N steps
(:mod:`kvcanary_jax.bridge.sglang_coverage`): the verify and write names are then bound to the
bridge's launchers followed by the digest's launches, and four more names of the runtime are
rebound, checked the same way (each holds SGLang's own object, with the signature of the hook
that replaces it), all restored by the handle (:data:`COVERAGE_TARGETS`):

    sglang.srt.kv_canary.pool_patcher.adapters.mha.patch_buf_info_method   (the pool's layers)
    sglang.srt.kv_canary.pool_patcher.adapters.swa.patch_buf_info_method   (the pool's layers)
    sglang.srt.kv_canary.runner.canary_manager.SweepOrchestrator   (refusals at manager build)
    sglang.srt.kv_canary.runner.violation_reporter._format_violation   (the digest rows' label)

The pools are seen when SGLang attaches its canary to them, so in a server the install must come
before the model runner builds its canary (``install_canary``): in the scheduler process, e.g. from
an SGLang general plugin (entry point group ``sglang.srt.plugins``), which SGLang loads there first.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import inspect
import threading

from kvcanary_jax.bridge import entry_points
from kvcanary_jax.bridge.dlpack import BridgeError
from kvcanary_jax.bridge.sglang_coverage import SglangCoverage

__all__ = ["SGLANG_VERSION", "TARGETS", "COVERAGE_TARGETS", "Target", "SglangInstall",
           "install_into_sglang", "installed"]

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
_SCATTER_T, _PLAN_T, _VERIFY_T, _WRITE_T = TARGETS

_SPLICE = "sglang.srt.kv_canary.pool_patcher.buf_info_splice"
_MHA_T = Target("sglang.srt.kv_canary.pool_patcher.adapters.mha", "patch_buf_info_method",
                _SPLICE)
_SWA_T = Target("sglang.srt.kv_canary.pool_patcher.adapters.swa", "patch_buf_info_method",
                _SPLICE)
_SWEEP_T = Target("sglang.srt.kv_canary.runner.canary_manager", "SweepOrchestrator",
                  "sglang.srt.kv_canary.runner.sweep")
_FORMAT_T = Target("sglang.srt.kv_canary.runner.violation_reporter", "_format_violation",
                   "sglang.srt.kv_canary.runner.violation_reporter")
# The names a coverage window rebinds besides the four launchers (module docstring).
COVERAGE_TARGETS = (_MHA_T, _SWA_T, _SWEEP_T, _FORMAT_T)

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


def _replacements(coverage: SglangCoverage | None, originals: dict) -> dict:
    """What each target is rebound to: the bridge launcher of its name; with a coverage, the
    verify and write launchers followed by the digest's, and its hooks over SGLang's own
    objects (``originals``)."""
    out = {t: getattr(entry_points, t.name) for t in TARGETS}
    if coverage is not None:
        out[_VERIFY_T] = coverage.verify_launcher(entry_points.launch_canary_verify_kernel)
        out[_WRITE_T] = coverage.write_launcher(entry_points.launch_canary_write_kernel)
        out[_MHA_T] = coverage.attach_hook(originals[_MHA_T])
        out[_SWA_T] = coverage.attach_hook(originals[_SWA_T])
        out[_SWEEP_T] = coverage.manager_hook(originals[_SWEEP_T])
        out[_FORMAT_T] = coverage.formatter(originals[_FORMAT_T])
    return out


class SglangInstall:
    """The rebound names (:attr:`patched`) and SGLang's objects they held; restores them on
    :meth:`uninstall` (idempotent) or when its ``with`` block ends. :attr:`coverage`: the
    :class:`~kvcanary_jax.bridge.sglang_coverage.SglangCoverage` of ``coverage_window`` (its
    ``stats()``, its ``register(pool, group)``), ``None`` when off."""

    def __init__(self, originals: dict[Target, object], replacements: dict[Target, object],
                 coverage: SglangCoverage | None = None):
        self._originals = originals
        self._replacements = replacements
        self.coverage = coverage
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
                if getattr(module, target.name) is not self._replacements[target]:
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
        window = "" if self.coverage is None else f", coverage_window={self.coverage.window}"
        launchers = sum(t in TARGETS for t in self._originals)
        return f"SglangInstall(sglang {self.version}, {state}, {launchers} launchers{window})"


def install_into_sglang(*, coverage_window: int = 0) -> SglangInstall:
    """Make SGLang 0.5.23's canary runtime launch the bridge's kernels (module docstring);
    with ``coverage_window`` N >= 1, also verify every layer's K and V of its pool within N
    steps (:mod:`kvcanary_jax.bridge.sglang_coverage`).

    SGLang's runtime modules are imported if they are not yet (in a server they are); that needs
    the ``sglang`` package importable with its runtime's own imports satisfied (a server, or
    :func:`kvcanary_jax.oracle.load_runtime` without one). Raises :class:`BridgeError`, rebinding
    nothing, on a window that is not an int >= 0, another SGLang version, a second install, or a
    name that does not hold SGLang's own object or whose signature differs from its
    replacement's."""
    if isinstance(coverage_window, bool) or not isinstance(coverage_window, int) or \
            coverage_window < 0:
        raise BridgeError(f"kv-canary bridge: coverage_window must be an int >= 0 (0: off), got "
                          f"{coverage_window!r}")
    coverage = SglangCoverage(coverage_window) if coverage_window else None
    targets = TARGETS + (COVERAGE_TARGETS if coverage is not None else ())
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
        for target in targets:
            try:
                module = importlib.import_module(target.module)
            except ImportError as e:
                raise BridgeError(
                    f"kv-canary bridge: cannot import SGLang's canary runtime module "
                    f"{target.module} ({type(e).__name__}: {e}); install_into_sglang() patches "
                    "a runtime that imports (in a server, or after "
                    "kvcanary_jax.oracle.load_runtime())") from e
            current = getattr(module, target.name, None)
            what = "launcher" if target in TARGETS else "object"
            if current is None or getattr(current, "__module__", None) != target.origin:
                where = getattr(current, "__module__", None)
                raise BridgeError(
                    f"kv-canary bridge: {target.dotted} is not SGLang {SGLANG_VERSION}'s "
                    f"{what} from {target.origin} (it is {current!r}"
                    f"{f' from {where}' if where else ''}); not installed")
            originals[target] = current
        replacements = _replacements(coverage, originals)
        for target in targets:
            current, ours = originals[target], replacements[target]
            if _shape(current) != _shape(ours):
                raise BridgeError(
                    f"kv-canary bridge: SGLang {version}'s {target.dotted} has signature "
                    f"{_render(current)}, the bridge's {target.name} takes {_render(ours)}; "
                    "not installed")
        for target in targets:
            setattr(importlib.import_module(target.module), target.name, replacements[target])
        handle = SglangInstall(originals, replacements, coverage)
        _ACTIVE.append(handle)
        return handle


def installed() -> dict[str, list[str]]:
    """Per bridge launcher, the SGLang runtime names it is installed as (empty when none)."""
    out: dict[str, list[str]] = {}
    with _LOCK:
        for handle in _ACTIVE:
            for target in handle._originals:
                if target in TARGETS:
                    out.setdefault(target.name, []).append(target.dotted)
    return out
