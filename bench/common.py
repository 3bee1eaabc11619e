"""Shared plumbing: environment, device transfer, SGLang loading."""

from __future__ import annotations

import os
import platform

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # share the GPU with torch

import jax  # noqa: E402
import numpy as np  # noqa: E402


def on_gpu() -> bool:
    return jax.default_backend() == "gpu"


# What the op modules measure as "ours": the implementation (None: the platform's default) and
# whether they also time SGLang and the other peers (the runner does that once, with its first
# implementation, when it runs several: ``python -m bench --implementations pallas_triton,xla``).
RUN = {"implementation": None, "peers": True}


def implementation():
    return RUN["implementation"]


def time_peers() -> bool:
    return on_gpu() and RUN["peers"]


def torch_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def to_torch(a: np.ndarray):
    import torch

    return torch.from_numpy(np.array(a, copy=True)).to(torch_device())


def to_jax(a: np.ndarray):
    with jax.enable_x64(True):
        return jax.device_put(np.ascontiguousarray(a))


def jax_sync(tree) -> None:
    jax.block_until_ready(tree)


def environment() -> dict:
    env = {
        "python": platform.python_version(),
        "jax": jax.__version__,
        "jax_backend": jax.default_backend(),
        "devices": [str(d) for d in jax.devices()],
    }
    try:
        import torch

        env["torch"] = torch.__version__
        if torch.cuda.is_available():
            p = torch.cuda.get_device_properties(0)
            env["gpu"] = p.name
            env["sm_count"] = p.multi_processor_count
    except ImportError:
        pass
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        pass
    return env


_SGL = {}


def sglang(cuda_jit: bool):
    """SGLang's kv-canary modules; with ``cuda_jit`` its CUDA kernels compile on first use."""
    if "mods" not in _SGL:
        from kvcanary_jax import oracle

        try:
            _SGL["mods"] = oracle.load(cuda_jit=cuda_jit)
            _SGL["cuda_jit"] = cuda_jit
        except Exception as exc:  # noqa: BLE001 - the bench reports what it could not load
            _SGL["mods"] = oracle.load(cuda_jit=False)
            _SGL["cuda_jit"] = False
            _SGL["error"] = repr(exc)
    return _SGL["mods"]


def config_key(fields: dict) -> str:
    """A launch config's fields as one line, sorted by name: the key of a tuning sweep's
    measurements."""
    return " ".join(f"{k}={fields[k]}" for k in sorted(fields))


def write_tuned_table(op: str, entries: list[dict], directory: str | None = None) -> str | None:
    """Merge a sweep's best configs into ``kvcanary_jax/tuning/<op>.<device kind>.json`` (the
    table the op's config resolution reads; ``directory`` to write elsewhere). GPU runs only: a
    CPU sweep times interpret mode, which says nothing about launch parameters."""
    if not on_gpu() or not entries:
        return None
    from kvcanary_jax.ops import _registry

    return _registry.update_tuned_table(op, "pallas_triton", _registry.device_kind(), entries,
                                        directory=directory)
