"""Torch bridge: SGLang-compatible kv-canary launchers over DLPack (zero-copy in, in place out).

Code written against SGLang 0.5.23's ``sglang.kernels.ops.kv_canary`` runs unchanged against
these names: same keyword arguments, torch dtypes, checks and messages, in-place mutation of the
output / plan / context tensors, ``None`` returned. The bridge holds no kernel logic: it checks the
ops' contracts on the torch tensors, hands their memory to JAX (:mod:`bridge._interop`) and calls
the package's jitted implementations.

Where the bridge differs from SGLang's launchers, on purpose:

* Checks: every launcher raises SGLang's GPU-path errors (class and words, in SGLang's order)
  for CPU and CUDA tensors alike, all before anything runs; SGLang's CPU fallbacks (its torch
  references) accept more and word some errors differently. ``None`` where a tensor is required
  is a TypeError naming it; tensors on two devices are refused.
* Values (negative or out-of-range indices, malformed offsets) are checked before launch for CPU
  tensors; on the GPU that would cost a device-to-host synchronisation per call, so it is opt-in
  there (:func:`set_value_checks`, ``KVCANARY_BRIDGE_VALUE_CHECKS=1``); the kernels stay in bounds
  either way.
* No ``bs + 1 <= 512`` cap on scatter, no ``bs <= 4096`` cap on plan.
* Views: a row-strided 2-D output (``pool[:, :n]``) works in place; anything else non-compact is
  refused with an error naming the tensor (never copied silently).
* JAX's CPU client does not write into DLPack-imported memory through donation: on CPU the
  results are copied back into the caller's tensors (counted in :func:`stats`); on the GPU the
  kernels write in place.
* The launches are not capturable into a torch CUDA graph (XLA runs them on its own streams);
  the bridge refuses to run under capture.
* Stream order on the GPU: an event wait of XLA's compute stream on torch's current stream by
  default, or a per-call fence import (:func:`set_stream_sync`,
  ``KVCANARY_BRIDGE_STREAM_SYNC=fence``); no host synchronisation either way; see
  :mod:`bridge._interop`.
* Hot path: a launcher called again with the same tensor objects (a serving loop's persistent
  buffers) replays its recorded call, skipping checks and imports (:mod:`bridge._fast`);
  :func:`clear_cache` forgets recorded calls and cached views.
* :func:`launch_canary_step` (no SGLang counterpart) runs scatter + plan + verify + write of one
  endpoint in one compiled call.

Importing the bridge sets ``XLA_PYTHON_CLIENT_PREALLOCATE=false`` unless the environment sets it,
so JAX does not reserve the GPU memory the hosting torch process needs.
"""

import os as _os

# JAX would otherwise reserve most of the GPU's memory at its first use, starving the torch
# process hosting the bridge; an explicit setting by the user wins.
_os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

from bridge._canary import (  # noqa: E402
    launch_canary_plan_kernels,
    launch_canary_step,
    launch_canary_verify_kernel,
    launch_canary_write_kernel,
)
from bridge._common import set_value_checks, value_checks  # noqa: E402
from bridge._interop import (  # noqa: E402
    BridgeError,
    clear_cache,
    set_stream_sync,
    stats,
    stream_sync,
)
from bridge._scatter import launch_scatter_req_token_ids_kernel  # noqa: E402
from bridge._types import (  # noqa: E402
    CANARY_SLOT_BYTES,
    MAX_REAL_KV_SOURCES,
    CanaryLaunchTag,
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
    "set_stream_sync",
    "stream_sync",
    "set_value_checks",
    "value_checks",
]
