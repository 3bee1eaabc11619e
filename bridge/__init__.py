"""Torch bridge: SGLang-compatible kv-canary launchers running the package's Pallas kernels.

Code written against SGLang 0.5.23's ``sglang.kernels.ops.kv_canary`` runs unchanged against these
names: same keyword arguments, torch dtypes, checks and messages, in-place mutation of the output /
plan / context tensors, ``None`` returned. The bridge holds no kernel logic: each launcher is
declared once (:mod:`kvcanary_jax.bridge.declarations`: tensors, in-place outputs, non-tensor
arguments, contract) and run by one generic launcher (:mod:`kvcanary_jax.bridge.launcher`) on one of
two paths:

* ``triton_direct`` (CUDA tensors, the default there): the same Pallas kernels, lowered once per
  shape bucket to their Triton IR, compiled with the ``triton`` that torch ships and launched with
  the tensors' pointers on torch's current stream: no DLPack, no JAX dispatch, capturable by
  ``torch.cuda.graph`` (:mod:`kvcanary_jax.bridge.triton_direct`).
* ``dlpack`` (CPU tensors, and wherever the direct path is unavailable): tensors handed to JAX
  zero-copy over DLPack and the jitted function run by XLA (:mod:`kvcanary_jax.bridge.dlpack`,
  :mod:`kvcanary_jax.bridge.views`, :mod:`kvcanary_jax.bridge.streams`); refused under CUDA graph
  capture.

:func:`paths` says which path each launcher's last call took, and why not the direct one.

:func:`install_into_sglang` makes SGLang 0.5.23's own canary runtime (``sglang.srt.kv_canary``)
launch these kernels: it rebinds the four launcher names that runtime calls, checked against
SGLang's version and signatures first, and its handle restores them
(:mod:`kvcanary_jax.bridge.sglang_install`).

Where the bridge differs from SGLang's launchers, on purpose:

* Checks: every launcher raises SGLang's GPU-path errors (class and words, in SGLang's order)
  for CPU and CUDA tensors alike, all before anything runs. ``None`` where a tensor is required
  is a TypeError naming it; tensors on two devices are refused; a tensor on the ``meta`` device
  gets the bridge's own error.
* Values (negative or out-of-range indices, malformed offsets) are checked before launch for CPU
  tensors; on the GPU that would cost a device-to-host synchronisation per call, so it is opt-in
  there (:func:`set_value_checks`, ``KVCANARY_BRIDGE_VALUE_CHECKS=1``); the kernels stay in bounds
  either way.
* No ``bs + 1 <= 512`` cap on scatter, no ``bs <= 4096`` cap on plan.
* Views: a 2-D output or pool whose rows are strided (``pool[:, :n]``, ``pool[:, 2:6]``) works in
  place; a column slice with an offset whose rows the plan would read past its storage is refused
  with an error saying what to pass. A real-KV source may require grad and may be any row-strided
  view (``kv[:, 16:48]``). Other non-compact layouts are refused with an error naming the tensor.
* Shapes: token counts are bucketed (:mod:`kvcanary_jax.buckets`), so a serving loop whose token
  history grows every step compiles a logarithmic number of kernels; the plan's batch size is
  an operand of its kernels (:func:`kvcanary_jax.ops.plan.base.batch_lanes`), so its request
  vectors are bucketed too (``launch_canary_step``'s batch size is exact).
* :func:`launch_canary_step` (no SGLang counterpart) runs scatter + plan + verify + write of one
  endpoint in one call (one program of kernels).
* :func:`launch_kv_digest_write` / :func:`launch_kv_digest_verify` (no SGLang counterpart: the
  per-slot KV digest of docs/spec.md §16, with :class:`DigestContext`) take any number of
  real-KV sources (every layer's K and V of a pool), in SGLang's style: torch tensors in, the
  caller's tensors updated in place, on the same two paths.

Importing the bridge sets ``XLA_PYTHON_CLIENT_PREALLOCATE=false`` unless the environment sets it,
so JAX does not reserve the GPU memory the hosting torch process needs.
"""

import os as _os

if __name__ != "kvcanary_jax.bridge":
    # Imported from a checkout's root as the folder's own name (``import bridge``): its modules
    # import each other as kvcanary_jax.bridge, so a second copy under this name would split the
    # caches and the classes (a BridgeError of one is not the other's).
    raise ImportError(f"the torch bridge is kvcanary_jax.bridge, not {__name__!r}: "
                      "`import kvcanary_jax.bridge as bridge` (from a checkout, after "
                      "`pip install -e .`)")

# JAX would otherwise reserve most of the GPU's memory at its first use, starving the torch
# process hosting the bridge; an explicit setting by the user wins.
_os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

from kvcanary_jax.bridge.cache import clear_cache  # noqa: E402
from kvcanary_jax.bridge.checks import set_value_checks, value_checks  # noqa: E402
from kvcanary_jax.bridge.dlpack import BridgeError, stats  # noqa: E402
from kvcanary_jax.bridge.entry_points import (  # noqa: E402
    launch_canary_plan_kernels,
    launch_canary_step,
    launch_canary_verify_kernel,
    launch_canary_write_kernel,
    launch_kv_digest_verify,
    launch_kv_digest_write,
    launch_scatter_req_token_ids_kernel,
)
from kvcanary_jax.bridge.launcher import call_paths as _call_paths  # noqa: E402
from kvcanary_jax.bridge.launcher import direct_enabled, set_direct  # noqa: E402
from kvcanary_jax.bridge.sglang_install import SglangInstall, install_into_sglang  # noqa: E402
from kvcanary_jax.bridge.sglang_install import installed as _installed  # noqa: E402
from kvcanary_jax.bridge.streams import set_stream_sync, stream_sync  # noqa: E402
from kvcanary_jax.bridge.types import (  # noqa: E402
    CANARY_SLOT_BYTES,
    MAX_REAL_KV_SOURCES,
    CanaryLaunchTag,
    DigestContext,
    RealKvHashMode,
    RealKvSource,
    VerifyOrWriteContext,
    VerifyPlan,
    WritePlan,
)

__all__ = [
    "launch_scatter_req_token_ids_kernel",
    "launch_canary_plan_kernels",
    "launch_canary_write_kernel",
    "launch_canary_verify_kernel",
    "launch_canary_step",
    "launch_kv_digest_write",
    "launch_kv_digest_verify",
    "DigestContext",
    "VerifyPlan",
    "WritePlan",
    "VerifyOrWriteContext",
    "RealKvSource",
    "CanaryLaunchTag",
    "RealKvHashMode",
    "CANARY_SLOT_BYTES",
    "MAX_REAL_KV_SOURCES",
    "BridgeError",
    "clear_cache",
    "stats",
    "paths",
    "install_into_sglang",
    "SglangInstall",
    "set_direct",
    "direct_enabled",
    "set_stream_sync",
    "stream_sync",
    "set_value_checks",
    "value_checks",
]


def paths() -> dict[str, dict[str, str]]:
    """Per launcher: the path its last call took (``"triton_direct"`` or ``"dlpack"``; ``""``
    before its first call) and, for ``"dlpack"`` on a CUDA tensor, why the direct path was not
    taken; while :func:`install_into_sglang` is active, ``"sglang"`` names the SGLang runtime
    names each installed launcher replaces (comma-separated)."""
    out = _call_paths()
    for name, dotted in _installed().items():
        out.setdefault(name, {"path": "", "reason": "not called yet"})["sglang"] = ", ".join(dotted)
    return out
