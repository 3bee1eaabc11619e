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

import importlib
import importlib.machinery
import importlib.util
import os
import sys
import types

__all__ = ["load", "available"]

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
