"""A compiled Triton kernel's launch without triton's Python around it.

triton launches a compiled kernel through three Python layers before its C launcher: the
``kernel[grid]`` runner (which builds the launch metadata for hooks), the backend's launcher object
(which allocates global and profile scratch where the kernel has them) and, inside the C
launcher, a call of the enter and exit hook chains, empty unless a profiler is attached. For the
bridge's kernels (no scratch, no hooks attached) all of it passes the same values on every call
but the stream and the arguments. On an H100 host that Python took about 3 us of a 7 us launch
timed alone, and 5-6 us a kernel between SGLang's launches (``bench/NOTES.md``).

:func:`runner` learns what triton passes to its C launcher by launching through a copy of the
compiled kernel whose C launcher is replaced by a recorder, with stand-in arguments (nothing
runs), and keeps that call with the stream's and the arguments' places left open. A call then
fills them and calls the C launcher itself, with the hooks left out while their chains are empty
(the C launcher calls a hook only when it is not None, and an empty chain calls nothing). While a
hook is attached (a profiler), or wherever the recording does not show that shape (another
triton, a kernel with scratch), the call goes through triton's own runner.
``KVCANARY_BRIDGE_LAUNCH=triton`` always does. The recording is made with the kernel's runner, on
its program's first call: a runner made while a hook is attached stays triton's.
"""

from __future__ import annotations

import copy
from typing import Callable

from kvcanary_jax.bridge.switches import env_choice

__all__ = ["runner", "enabled"]

_MODE = env_choice("KVCANARY_BRIDGE_LAUNCH", "direct", ("direct", "triton"))
# Stand-ins for the stream and the arguments while recording: no real launch sees them.
_STREAM = 0x5EED_0000_0001
_ARG0 = 0x5EED_1000_0000


def enabled() -> bool:
    return _MODE == "direct"


def runner(compiled, grid: tuple, nargs: int) -> Callable:
    """``run(*args, stream=...)`` launching ``compiled`` on ``grid`` with ``nargs`` arguments: the
    C launcher called directly where :func:`_recorded` finds how, else triton's runner."""
    slow = compiled[grid]
    if not enabled():
        return slow
    try:
        fast = _recorded(compiled, grid, nargs, slow)
    except Exception:  # any triton this does not know: its own runner
        fast = None
    return fast or slow


def _hooks():
    from triton import knobs

    rt = knobs.runtime
    return rt, rt.launch_enter_hook, rt.launch_exit_hook


def _idle(hook) -> bool:
    """A hook the C launcher may skip: None, or a chain with nothing in it."""
    return hook is None or (type(hook).__name__ == "HookChain" and not hook.calls)


def _recorded(compiled, grid, nargs, slow):
    launcher = compiled.run
    if (getattr(launcher, "global_scratch_size", 0) or getattr(launcher, "profile_scratch_size", 0)
            or getattr(launcher, "gsan_enabled", False) or not hasattr(launcher, "launch")
            or not hasattr(compiled, "_run")):
        return None
    rt, enter, leave = _hooks()
    if not (_idle(enter) and _idle(leave)):
        return None
    launch = launcher.launch
    calls = []
    twin = copy.copy(launcher)
    twin.launch = lambda *a, **k: calls.append((a, k))
    shadow = copy.copy(compiled)
    shadow._run = twin
    args = tuple(_ARG0 + 64 * i for i in range(nargs))
    shadow[grid](*args, stream=_STREAM)
    if len(calls) != 1 or calls[0][1]:
        return None
    rec = list(calls[0][0])
    stream_at = [i for i, x in enumerate(rec) if type(x) is int and x == _STREAM]
    if len(stream_at) != 1:
        return None
    (s,) = stream_at
    # Everything else triton passed is the launcher's own (grid, function, flags, metadata):
    # the hooks go as None (skipped), the hooks' launch metadata with them.
    for i, x in enumerate(rec):
        if x is enter or x is leave or type(x).__name__ == "LazyDict":
            rec[i] = None
    if not nargs or tuple(rec[len(rec) - nargs:]) != args or s >= len(rec) - nargs:
        return None  # the arguments not spread at the end (another triton's launcher)
    pre, mid = tuple(rec[:s]), tuple(rec[s + 1:len(rec) - nargs])
    if any(type(x) is int and x in args for x in pre + mid):
        return None
    if enter is None and leave is None:
        def run(*a, stream):
            if rt.launch_enter_hook is None and rt.launch_exit_hook is None:
                launch(*pre, stream, *mid, *a)
            else:
                slow(*a, stream=stream)
    elif type(enter).__name__ == "HookChain" and type(leave).__name__ == "HookChain":
        def run(*a, stream):
            if rt.launch_enter_hook is enter and rt.launch_exit_hook is leave and \
                    not enter.calls and not leave.calls:
                launch(*pre, stream, *mid, *a)
            else:
                slow(*a, stream=stream)
    else:
        return None
    return run
