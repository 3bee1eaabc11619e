"""Ctrl-C from the console script's first line (this module imports nothing heavy).

The console script ``kvcanary-jax`` imports ``kvcanary_jax.cli``, whose package imports JAX:
one to three seconds before the demo's own handler (:class:`kvcanary_jax.cli._StopOnInterrupt`)
is in place. A Ctrl-C there used to be lost (a KeyboardInterrupt raised inside one of JAX's
callbacks is printed and ignored, and the demo ran on) or ended in a raw traceback from inside
JAX's import. So the package installs this handler first, when the process is the console
script (or ``python -m kvcanary_jax.cli``): the first Ctrl-C records a stop request, which the
command picks up before doing anything else, and a second one aborts at once.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

EXIT_INTERRUPTED = 130  # 128 + SIGINT, what shells report

_state = {"installed": False, "requested": False, "previous": None}


def is_console_script(argv=None, orig_argv=None) -> bool:
    """Whether this process runs ``kvcanary-jax`` (the console script, or ``python -m
    kvcanary_jax.cli``): judged from the command line, before anything is imported."""
    argv = sys.argv if argv is None else argv
    orig = list(getattr(sys, "orig_argv", ()) if orig_argv is None else orig_argv)
    if argv and os.path.basename(str(argv[0])).removesuffix(".exe") == "kvcanary-jax":
        return True
    return any(a == "-m" and b == "kvcanary_jax.cli" for a, b in zip(orig, orig[1:]))


def _handle(signum, frame):
    if _state["requested"]:
        os.write(2, b"kvcanary-jax: aborted (second Ctrl-C)\n")
        os._exit(EXIT_INTERRUPTED)
    _state["requested"] = True
    os.write(2, b"\nkvcanary-jax: stopping before the first step (Ctrl-C again to abort)\n")


def install() -> None:
    """Take SIGINT (main thread only: elsewhere signal handlers cannot be set)."""
    if _state["installed"] or threading.current_thread() is not threading.main_thread():
        return
    _state["previous"] = signal.signal(signal.SIGINT, _handle)
    _state["installed"] = True


def installed() -> bool:
    return _state["installed"] and signal.getsignal(signal.SIGINT) is _handle


def requested() -> bool:
    """A Ctrl-C arrived while this handler was in place."""
    return _state["requested"]


def previous():
    """The handler this one replaced (what to restore when leaving)."""
    return _state["previous"]


def uninstall() -> None:
    """Give SIGINT its previous handler back (a command with its own Ctrl-C handling)."""
    if installed():
        prev = _state["previous"]
        signal.signal(signal.SIGINT, signal.SIG_DFL if prev is None else prev)
    _state["installed"] = False
