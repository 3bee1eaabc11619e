"""Load SGLang 0.5.23's kv-canary (the oracle) without running ``sglang/__init__.py``.

``pip install --no-deps sglang==0.5.23`` ships the original launchers, their torch references and
SGLang's own test helpers. Importing them normally runs ``sglang/__init__.py``, which imports the
whole server. :func:`load` registers bare package modules for the few packages on the path
instead, then imports the kv-canary modules themselves.

Two modes:

* ``cuda_jit=False`` (default, CPU): ``sglang.kernels.jit.utils`` is replaced by a stub, so the
  references import with torch alone (the Triton launchers also need ``triton`` to import) and
  the launchers fall back to the references on CPU tensors.
* ``cuda_jit=True`` (GPU benchmark): the real JIT utilities are kept so SGLang's CUDA kernels
  compile at first use (needs ``apache-tvm-ffi`` and nvcc), with ``sglang.srt.utils.common``
  replaced by a module that answers ``is_cuda()`` and ``get_cuda_version()``.

Used by the tests, the benchmark and the bridge's compatibility checks; nothing in the kernels
depends on it.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.machinery
import importlib.util
import os
import sys
import types

__all__ = ["load", "load_runtime", "available"]

# Bare modules for packages whose __init__ imports the server; packages with light __init__ files
# (kv_canary.plan, whose __init__ re-exports the plan launcher) are imported normally.
_PACKAGES = [
    ("sglang", ""),
    ("sglang.kernels", "kernels"),
    ("sglang.kernels.ops", "kernels/ops"),
    ("sglang.kernels.ops.kv_canary", "kernels/ops/kv_canary"),
    ("sglang.kernels.jit", "kernels/jit"),
    ("sglang.test", "test"),
    ("sglang.test.kernels", "test/kernels"),
    ("sglang.test.kernels.kv_canary", "test/kernels/kv_canary"),
    ("sglang.srt", "srt"),
    ("sglang.srt.utils", "srt/utils"),
]

_MODULES = {
    "consts": "sglang.kernels.ops.kv_canary.consts",
    "verify": "sglang.kernels.ops.kv_canary.verify",
    "write": "sglang.kernels.ops.kv_canary.write",
    "plan_ref": "sglang.kernels.ops.kv_canary.plan_ref",
    "verify_ref": "sglang.kernels.ops.kv_canary.verify_ref",
    "write_ref": "sglang.kernels.ops.kv_canary.write_ref",
    "scatter_ref": "sglang.test.kernels.kv_canary.scatter_req_token_ids_reference",
}

_loaded: dict[bool, types.SimpleNamespace] = {}


def available() -> bool:
    """Whether the ``sglang`` distribution is installed (without importing it)."""
    return importlib.util.find_spec("sglang") is not None


def _root() -> str:
    spec = importlib.util.find_spec("sglang")  # finds, does not import
    if spec is None or spec.origin is None:
        raise ImportError(
            "the SGLang oracle needs `pip install --no-deps sglang==0.5.23` (kv-canary's original)"
        )
    return os.path.dirname(spec.origin)


def _register_packages(root: str) -> None:
    for name, sub in _PACKAGES:
        path = os.path.join(root, sub)
        if name in sys.modules and getattr(sys.modules[name], "__path__", None) == [path]:
            continue
        init = os.path.join(path, "__init__.py")
        spec = importlib.machinery.ModuleSpec(name, loader=None, is_package=True)
        spec.origin = init if os.path.exists(init) else None
        spec.submodule_search_locations = [path]
        module = importlib.util.module_from_spec(spec)
        module.__path__ = [path]
        module.__file__ = spec.origin
        sys.modules[name] = module


def _stub_jit_utils() -> None:
    jit_utils = types.ModuleType("sglang.kernels.jit.utils")
    jit_utils.cache_once = lambda fn: fn
    jit_utils.make_cpp_args = lambda *args: ",".join(map(str, args))

    def load_jit(*args, **kwargs):
        raise RuntimeError("SGLang's CUDA JIT kernels are not loaded in this process")

    jit_utils.load_jit = load_jit
    sys.modules["sglang.kernels.jit.utils"] = jit_utils


def _stub_srt_common() -> None:
    common = types.ModuleType("sglang.srt.utils.common")

    def is_cuda() -> bool:
        import torch

        return torch.cuda.is_available() and torch.version.cuda is not None

    def get_cuda_version():
        import torch

        return tuple(int(x) for x in (torch.version.cuda or "0.0").split(".")[:2])

    common.is_cuda = is_cuda
    common.get_cuda_version = get_cuda_version
    sys.modules["sglang.srt.utils.common"] = common


def load(*, cuda_jit: bool = False) -> types.SimpleNamespace:
    """Import SGLang's kv-canary modules; returns a namespace of them (consts, verify, write,
    plan_ref, verify_ref, write_ref, scatter_ref, plus plan_api / scatter / differential /
    invariants when their imports, which need ``triton``, succeed)."""
    if cuda_jit in _loaded:
        return _loaded[cuda_jit]
    root = _root()
    _register_packages(root)
    _stub_srt_common()
    if cuda_jit:
        sys.modules.pop("sglang.kernels.jit.utils", None)
        importlib.import_module("sglang.kernels.jit.utils")
    else:
        _stub_jit_utils()
    ns = types.SimpleNamespace(root=root)
    for key, name in _MODULES.items():
        setattr(ns, key, importlib.import_module(name))
    for key, name in [
        ("plan_api", "sglang.kernels.ops.kv_canary.plan.api"),
        ("scatter", "sglang.kernels.ops.kv_canary.scatter_req_token_ids"),
        ("differential", "sglang.test.kernels.kv_canary._differential"),
        ("invariants", "sglang.test.kernels.kv_canary._invariants"),
        ("fixtures", "sglang.test.kernels.kv_canary._fixtures"),
    ]:
        try:
            setattr(ns, key, importlib.import_module(name))
        except ImportError:  # triton missing: the references still work
            setattr(ns, key, None)
    _loaded[cuda_jit] = ns
    return ns


# --------------------------------------------------------------------------------------------
# SGLang's canary runtime (``sglang.srt.kv_canary``) without its server

# The runtime modules import a few server modules for one or two names each; without the server
# these stand-ins answer them (and nothing else). Everything else the runtime imports is SGLang's
# own code: its launchers' modules, ``sglang.srt.environ`` (standard library only), the runtime
# itself, its perturbers and its phase checker.
_RUNTIME_MODULES = {
    "manager": "sglang.srt.kv_canary.runner.canary_manager",
    "config": "sglang.srt.kv_canary.config",
    "capacities": "sglang.srt.kv_canary.capacities",
    "buffer_group": "sglang.srt.kv_canary.buffer_group",
    "perturb_config": "sglang.srt.kv_canary.perturb.config",
    "kernel_launcher": "sglang.srt.kv_canary.runner.kernel_launcher",
    "endpoint": "sglang.srt.kv_canary.endpoint",
    "expected_tokens": "sglang.srt.kv_canary.req_to_expected_token_ids_manager",
    "future_tensor": "sglang.srt.kv_canary.runner.future_tensor",
    "radix_walker": "sglang.srt.kv_canary.radix_cache_walker",
}


class _NoServer(RuntimeError):
    pass


def _server_only(name):
    def call(*args, **kwargs):
        raise _NoServer(
            f"{name}() needs SGLang's server (sglang.srt.runtime_context); build the runtime's "
            "CanaryConfig and CanaryLaunchCapacities directly instead"
        )
    call.__name__ = name
    return call


def _stub_server_modules() -> None:
    import torch

    # sglang.srt.utils: the two stream helpers the runtime imports from it (its __init__ imports
    # the whole of sglang.srt.utils.common, i.e. the server). A CPU stream takes no device.
    utils = sys.modules["sglang.srt.utils"]

    def create_device_stream(device):
        device = torch.device(device)
        module = torch.get_device_module(device)
        return module.Stream() if device.type == "cpu" else module.Stream(device=device)

    def is_device_stream_capturing(device) -> bool:
        device = torch.device(device)
        return device.type == "cuda" and torch.cuda.is_current_stream_capturing()

    utils.create_device_stream = create_device_stream
    utils.is_device_stream_capturing = is_device_stream_capturing

    # The expected-token manager's snapshot helper (compute_req_all_ids_info, called by the
    # scheduler; a caller without one fills ForwardBatch.req_all_ids_flat itself).
    def flatten_arrays_to_int64_tensor(parts, device, pin):
        flat = [int(x) for part in parts for x in part]
        return torch.tensor(flat, dtype=torch.int64).to(device)

    sys.modules["sglang.srt.utils.common"].flatten_arrays_to_int64_tensor = \
        flatten_arrays_to_int64_tensor

    # The server's argument bags: only CanaryConfig.from_env / CanaryLaunchCapacities.from_args
    # read them; a caller without a server constructs both directly.
    ctx = types.ModuleType("sglang.srt.runtime_context")
    for name in ("get_observability", "get_exec", "get_schedule", "get_spec"):
        setattr(ctx, name, _server_only(name))
    sys.modules["sglang.srt.runtime_context"] = ctx

    # The radix-cache walker imports the unified radix cache (the scheduler) to check the cache's
    # type, and its walk result's type for annotations: a stand-in class a caller can subclass
    # to hand the sweep its own walk (``tree_core.walk_for_kv_canary``).
    for name in ("sglang.srt.mem_cache", "sglang.srt.mem_cache.unified_cache"):
        if name not in sys.modules:
            module = types.ModuleType(name)
            module.__path__ = []
            sys.modules[name] = module
    radix = types.ModuleType("sglang.srt.mem_cache.unified_radix_cache")

    class UnifiedRadixCache:
        """Stand-in for SGLang's radix cache: ``tree_core.walk_for_kv_canary(unlocked_only=,
        swa_resident_only=)`` returns the slots, positions and previous slots it holds, and
        ``req_to_token_pool`` is the request-to-token pool."""

    radix.UnifiedRadixCache = UnifiedRadixCache
    sys.modules[radix.__name__] = radix
    iface = types.ModuleType("sglang.srt.mem_cache.unified_cache.unified_tree_core_interface")
    iface.RadixCacheWalkResult = types.SimpleNamespace
    sys.modules[iface.__name__] = iface


class _TorchWithoutPinnedMemory:
    """``torch`` as the runtime's device-to-host staging sees it on a machine without an
    accelerator: ``pin_memory=True`` (a transfer-speed hint, which the CPU build refuses) is
    dropped; every other name is torch's own."""

    def __init__(self, torch):
        self._torch = torch

    def __getattr__(self, name):
        return getattr(self._torch, name)

    def _unpinned(self, fn):
        def call(*args, pin_memory=False, **kwargs):
            return fn(*args, **kwargs)
        return call

    @property
    def empty(self):
        return self._unpinned(self._torch.empty)

    @property
    def zeros(self):
        return self._unpinned(self._torch.zeros)

    @property
    def tensor(self):
        return self._unpinned(self._torch.tensor)


def _phase_checker_import():
    """Import SGLang's phase checker. Its Triton kernel keeps the forward's pre/post phases in
    order on the device's tensors; Triton's interpreter runs the same kernel on CPU tensors
    (``TRITON_INTERPRET`` is read when a kernel is decorated, so it is set for the decoration
    only). Without a GPU the module is imported interpreted; with one, compiled, and its kernel
    then runs each launch where its tensors are (:class:`_PhaseKernelByDevice`): a harness over
    a CPU pool on a GPU host runs as on a machine without one."""
    import torch

    name = "sglang.srt.utils.phase_checker"
    if name in sys.modules:
        return sys.modules[name]
    if torch.cuda.is_available():
        module = importlib.import_module(name)
        with _triton_interpret():
            import triton

            interpreted = triton.jit(debug=True)(module._phase_check_kernel.fn)
        module._phase_check_kernel = _PhaseKernelByDevice(module._phase_check_kernel, interpreted)
        return module
    with _triton_interpret():
        return importlib.import_module(name)


@contextlib.contextmanager
def _triton_interpret():
    before = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        yield
    finally:
        if before is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = before


class _PhaseKernelByDevice:
    """SGLang's phase-check kernel (``kernel[grid](phase, ...)``) on a machine with CUDA: the
    compiled kernel for CUDA tensors, the interpreted one for CPU tensors."""

    def __init__(self, compiled, interpreted):
        self.compiled, self.interpreted = compiled, interpreted
        self.fn = compiled.fn

    def __getitem__(self, grid):
        def launch(phase, *args, **kwargs):
            kernel = self.interpreted if phase.device.type == "cpu" else self.compiled
            return kernel[grid](phase, *args, **kwargs)
        return launch


_runtime: dict[bool, types.SimpleNamespace] = {}


def load_runtime(*, cuda_jit: bool = False) -> types.SimpleNamespace:
    """Import SGLang 0.5.23's canary runtime (``sglang.srt.kv_canary``: CanaryManager, the
    single-forward manager, the kernel launcher, the endpoints, the perturbers) without its
    server, for driving it over a toy pool in tests and benchmarks.

    The server modules the runtime names are replaced by stand-ins (see ``_stub_server_modules``):
    build ``CanaryConfig``, ``PerturbConfig`` and ``CanaryLaunchCapacities`` directly, pass a
    request-to-token pool with ``req_to_token`` and ``max_context_len``, and forward batches with
    the fields the runtime reads. On CPU tensors SGLang's launchers run their torch references,
    its phase checker runs in Triton's interpreter, and device-to-host staging is unpinned.
    Returns a namespace of the runtime's modules (``manager``, ``config``, ``capacities``,
    ``buffer_group``, ``perturb_config``, ``kernel_launcher``, ``endpoint``, ``expected_tokens``,
    ``future_tensor``, ``radix_walker``) plus ``kernels`` (:func:`load`'s namespace).
    ``cuda_jit``: as :func:`load` (SGLang's CUDA kernels for its launchers on a GPU)."""
    if cuda_jit in _runtime:
        return _runtime[cuda_jit]
    import torch

    kernels = load(cuda_jit=cuda_jit)
    _stub_server_modules()
    _phase_checker_import()
    ns = types.SimpleNamespace(kernels=kernels)
    for key, name in _RUNTIME_MODULES.items():
        setattr(ns, key, importlib.import_module(name))
    if not torch.cuda.is_available():
        for module in (ns.future_tensor, ns.expected_tokens):
            module.torch = _TorchWithoutPinnedMemory(torch)
    _runtime[cuda_jit] = ns
    return ns
