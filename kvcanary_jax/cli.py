"""``kvcanary-jax``: command line.

``kvcanary-jax [demo] [--steps N] [--seed S] [--faults a,b] [--device cpu|gpu]
[--implementation NAME] [--kv-canary log|raise] [--real-data none|partial|all]
[--sweep-interval N] [--layers N] [--coverage-window N] [--json]`` simulates a small server (a
model of ``--layers`` layers, K and V) with the canary on (run by
:class:`kvcanary_jax.runtime.CanaryManager`), then runs the fault campaign and prints, per fault
kind, how many faults were injected and detected, the first detecting step, and the clean run's
false positives; then the share of each slot's KV bytes SGLang's real-KV check reads, and the
coverage window's report (the share of live KV bytes verified in the window). ``demo`` is the
default subcommand. Ctrl-C stops the demo before its next step: it prints the partial report and
exits with status 130 (a second Ctrl-C aborts at once); the console script takes Ctrl-C from its
first line, while JAX imports (:mod:`kvcanary_jax._interrupt`).

``kvcanary-jax bench [options]`` is ``python -m kvcanary_jax.bench [options]`` (the benchmark,
installed with the package; ``python -m bench`` from a checkout's root;
``kvcanary-jax bench --help`` lists its options).

Other subcommands register themselves through :func:`register_command`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import sys
import threading
import time
import warnings
from typing import Callable

from kvcanary_jax import _interrupt
from kvcanary_jax._devices import select_device

__all__ = ["main", "register_command"]

_COMMANDS: dict[str, tuple[str, Callable | None, Callable]] = {}


def register_command(name: str, help: str, add_arguments: Callable | None,
                     run: Callable) -> None:
    """Add a subcommand: ``add_arguments(parser)`` declares its options and ``run(args) -> int``
    gets the parsed namespace; with ``add_arguments=None`` the command parses its own options:
    ``run(argv) -> int`` gets the arguments after its name, as typed."""
    _COMMANDS[name] = (help, add_arguments, run)


def _count(minimum: int, maximum: int | None = None):
    """An argparse type: an integer >= ``minimum`` (and <= ``maximum``, a power of two)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        if maximum is not None and value > maximum:
            raise argparse.ArgumentTypeError(
                f"must be <= 2**{maximum.bit_length() - 1}, got {value}")
        return value

    return parse


# ------------------------------------------------------------------------------------------ demo


def _fault_list(text: str):
    """An argparse type: ``'all'`` (None: every kind) or a comma list of known kinds. An empty
    list is refused: ``''`` meant every kind and ``','`` none."""
    from kvcanary_jax.sim import FAULT_KINDS

    if text.strip() == "all":
        return None
    kinds = [f.strip() for f in text.split(",") if f.strip()]
    if not kinds:
        raise argparse.ArgumentTypeError(
            f"no fault kind in {text!r}: name kinds (a comma list) or 'all'")
    unknown = [k for k in kinds if k not in FAULT_KINDS]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown fault kind(s) {', '.join(map(repr, unknown))}; known: {', '.join(FAULT_KINDS)}")
    return kinds


_WINDOW_ENV = "SGLANG_KV_CANARY_COVERAGE_WINDOW"  # the servers' variable (runtime.config)
_DEMO_WINDOW = 4


def _coverage_window(args) -> tuple[int, str]:
    """The demo's coverage window and where it came from: the flag, else the servers'
    environment variable (refused as the servers refuse it), else the demo's default. A window
    the demo cannot run is refused here, naming the setting that gave it."""
    from kvcanary_jax.runtime.config import env_value
    from kvcanary_jax.runtime.state import MAX_COVERAGE_WINDOW

    if args.coverage_window is not None:
        window, origin = args.coverage_window, f"--coverage-window {args.coverage_window}"
    elif (window := env_value("coverage_window")) is not None:
        origin = f"{_WINDOW_ENV}={window}"
    else:
        window, origin = _DEMO_WINDOW, f"the demo's default --coverage-window {_DEMO_WINDOW}"
    if window > MAX_COVERAGE_WINDOW:
        raise ValueError(f"{origin}: a window is at most {MAX_COVERAGE_WINDOW} steps")
    if window and args.sweep_interval == 0:
        raise ValueError(
            f"{origin} verifies the slots steps read within {window} steps and cached slots at "
            "each sweep: it needs --sweep-interval > 0 (without a sweep, cached slots no request "
            "reads would never be verified), or --coverage-window 0")
    return window, origin


def _demo_args(p: argparse.ArgumentParser) -> None:
    from kvcanary_jax.ops._registry import IMPLEMENTATIONS
    from kvcanary_jax.sim import FAULT_KINDS

    p.add_argument("--steps", type=_count(1), default=40,
                   help="clean serving steps (default 40)")
    p.add_argument("--seed", type=_count(0), default=0, help="the simulation's seed (>= 0)")
    p.add_argument("--faults", type=_fault_list, default="all",
                   help="comma list of fault kinds, or 'all': " + ", ".join(FAULT_KINDS))
    p.add_argument("--injections", type=_count(0), default=2,
                   help="trials per fault kind (default 2; 0: the clean run only)")
    p.add_argument("--device", choices=("cpu", "gpu"), default="cpu",
                   help="where the canary runs: the host's CPU, or JAX's GPU")
    p.add_argument("--implementation", choices=IMPLEMENTATIONS, default=None,
                   help="what every op runs (default: the device's, e.g. pallas_triton on a "
                        "CUDA GPU)")
    p.add_argument("--swa-window", type=_count(0), default=8,
                   help="sliding window of the SWA buffer group; 0 = FULL group only")
    p.add_argument("--v-half", action="store_true", help="also run the V-half endpoints")
    p.add_argument("--sweep-interval", type=_count(0, 1 << 40), default=4,
                   help="steps between sweeps (default 4; 0: no sweep)")
    p.add_argument("--kv-canary", choices=("log", "raise"), default="log",
                   help="the runtime manager's mode (SGLang's --kv-canary): 'log' logs each "
                        "violation and keeps serving; 'raise' fails on the first one, so a false "
                        "positive of the clean run ends the demo (fault trials count the raise "
                        "as the detection). Default log")
    p.add_argument("--real-data", choices=("none", "partial", "all"), default="all",
                   help="check the real KV bytes (SGLang's --kv-canary-real-data): none, the "
                        "first 16 bytes of each slot, or all of them (default all; with none the "
                        "faults that only touch KV bytes go undetected)")
    p.add_argument("--layers", type=_count(1), default=4,
                   help="attention layers of the simulated model, each with a K and a V array "
                        "(default 4)")
    p.add_argument("--coverage-window", type=_count(0), default=None, metavar="N",
                   help="ours (--kv-canary-coverage-window): every layer's K and V of every live "
                        "slot verified within N steps (cached slots at each sweep); 0: off, "
                        "SGLang's check of layer 0 only, so the layer_flip faults go undetected "
                        f"(default ${_WINDOW_ENV} where set, else {_DEMO_WINDOW}; needs a sweep)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.add_argument("--log-violations", action="store_true",
                   help="let the manager log each violation of the fault trials on stderr, as "
                        "a server in log mode does (by default the demo counts them and reports "
                        "them in its table)")


class _ViolationLogs(logging.Filter):
    """Holds back the manager's per-violation log messages (log mode) while the demo runs,
    counting them: the faults the demo injects make hundreds, and its table reports them. Every
    other message of the manager's logger goes through."""

    def __init__(self):
        super().__init__()
        self.held = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if record.getMessage().startswith("kv_canary violation:"):
            self.held += 1
            return False
        return True


@contextlib.contextmanager
def _violation_logs(shown: bool):
    from kvcanary_jax.runtime.reporting import LOGGER_NAME

    held = _ViolationLogs()
    logger = logging.getLogger(LOGGER_NAME)
    if not shown:
        logger.addFilter(held)
    try:
        yield held
    finally:
        logger.removeFilter(held)


def _progress_factory(enabled: bool):
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:  # tqdm is a dev extra; the demo runs without it
        return None
    return lambda total: tqdm(total=total, desc="kv-canary demo", unit="step", file=sys.stderr,
                              leave=False, dynamic_ncols=True)


def _table(res) -> str:
    rows = [("fault", "injected", "detected", "first step", "latency", "caught by", "reasons")]
    for f in res.faults:
        rows.append((
            f.kind, str(f.injected), str(f.detected),
            "-" if f.first_step is None else str(f.first_step),
            ",".join(str(x) for x in f.latencies) or "-",
            ",".join(sorted(f.tags)) or "-",
            ",".join(r.replace("_MISMATCH", "").lower() for r in sorted(f.reasons)) or "-",
        ))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


# Exit status of a run stopped by SIGINT (128 + SIGINT, what shells report).
EXIT_INTERRUPTED = _interrupt.EXIT_INTERRUPTED


def _abort() -> None:
    """A second Ctrl-C: leave now. ``os._exit`` skips the interpreter's shutdown, which can
    crash (segfault) while a JAX compilation that a KeyboardInterrupt cut into is still running
    in its threads; the message goes straight to the file descriptor (no buffer to re-enter from
    a signal handler)."""
    os.write(2, b"kvcanary-jax: aborted (second Ctrl-C)\n")
    os._exit(EXIT_INTERRUPTED)


class _StopOnInterrupt:
    """While active: the first SIGINT only sets :attr:`requested` (the demo polls it between
    steps, so an interrupt that arrives while JAX compiles or runs a step is neither lost inside
    JAX nor raised into it) and says so; a second one aborts the process at once
    (:func:`_abort`). Python runs a signal handler on the main thread between bytecodes, so
    Ctrl-Cs that all arrive during one long call into XLA (a compilation) count as one: the
    second must follow the acknowledgement. The
    handler that was installed before is restored on exit, unless ``keep_after_stop`` and a stop
    was requested: then the process is about to exit (the console script), and a further Ctrl-C
    while the report prints or the interpreter shuts down (JAX's exit hooks can wait on its
    compilation threads) still aborts at once instead of raising KeyboardInterrupt into an exit
    hook. Signal handlers can only be set from the main thread: elsewhere this does nothing and
    SIGINT keeps its handler."""

    def __init__(self, keep_after_stop: bool = False):
        self.requested = False
        self.keep_after_stop = keep_after_stop
        self._installed = False
        self._previous = None

    def _handle(self, signum, frame):
        if self.requested:
            _abort()
        self.requested = True
        os.write(2, b"\nkvcanary-jax: stopping after the current step (Ctrl-C again to abort)\n")

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            if _interrupt.installed():
                # The console script's early handler (kvcanary_jax._interrupt) took SIGINT
                # while JAX imported: a Ctrl-C it recorded is this demo's stop request, and the
                # handler to put back is the one it replaced.
                self.requested = _interrupt.requested()
                self._previous = _interrupt.previous()
                signal.signal(signal.SIGINT, self._handle)
            else:
                self._previous = signal.signal(signal.SIGINT, self._handle)
            self._installed = True
        return self

    def __exit__(self, *exc):
        if self._installed and not (self.requested and self.keep_after_stop):
            # None: the previous handler was not installed from Python; the default is all we
            # can put back.
            signal.signal(signal.SIGINT,
                          signal.SIG_DFL if self._previous is None else self._previous)
            self._installed = False
        return False


def _run_demo(args) -> int:
    # From here until the report is printed, a Ctrl-C is a request to stop before the next step
    # (backend start-up and the server's set-up included: the campaign polls before its first
    # step too), and a second one aborts.
    with _StopOnInterrupt(keep_after_stop=getattr(args, "exiting", False)) as interrupt:
        return _demo(args, interrupt)


def _demo(args, interrupt: _StopOnInterrupt) -> int:
    t0 = time.perf_counter()
    select_device(args.device)
    from kvcanary_jax import sim as simulation

    faults = args.faults
    from kvcanary_jax.sim import campaign

    try:
        if args.injections and campaign.checkpoint_count(args.steps) == 0:
            # Our rule: without a checkpoint no trial can run, and the demo ended "FAILED: 0/0"
            # without a reason.
            raise ValueError(
                f"--steps {args.steps} leaves no clean checkpoint to inject faults on (the first "
                f"is taken at step {campaign.CHECKPOINT_WARMUP}): pass --steps "
                f"{campaign.CHECKPOINT_WARMUP + 1} or more, or --injections 0 for the clean run only")
        window, window_origin = _coverage_window(args)
        placed = [k for k in dict.fromkeys(faults or simulation.FAULT_KINDS)
                  if k in simulation.SWEEP_PLACED]
        if args.injections and placed and args.sweep_interval == 0:
            # Our rule: those trials could never be placed, and the demo failed advising more
            # --steps.
            many = len(placed) > 1
            raise ValueError(
                f"--sweep-interval 0 runs no sweep, and the fault kind{'s' if many else ''} "
                f"{', '.join(placed)} {'are' if many else 'is'} placed on a sweep step: pass "
                f"--sweep-interval > 0, or --faults without {'them' if many else 'it'}")
        if args.injections and args.sweep_interval > args.steps:
            # Our rule: the clean run would hold no sweep, and a fault trial waits up to two
            # intervals for its fault to be reported (an interval of 10,000 ran for hours).
            raise ValueError(
                f"--sweep-interval {args.sweep_interval} is longer than the clean run (--steps "
                f"{args.steps}): no sweep would run in it, and a fault trial waits up to "
                f"{campaign.default_window_steps(args.sweep_interval)} steps for its fault to "
                f"be reported: pass --sweep-interval {args.steps} or less, or --injections 0 "
                "for the clean run only")
        sim = simulation.SimConfig(
            steps=args.steps, seed=args.seed, swa_window_size=args.swa_window,
            enable_v_half=args.v_half, sweep_interval=args.sweep_interval,
            implementation=args.implementation, kv_canary=args.kv_canary,
            real_kv_hash_mode=args.real_data, num_layers=args.layers,
            coverage_window=window,
        )
        with warnings.catch_warnings(), _violation_logs(args.log_violations) as held:
            # CPU backends cannot donate every buffer the step donates; that is expected here.
            warnings.filterwarnings("ignore", message=".*donated buffers.*")
            res = simulation.run_campaign(
                sim, faults=faults, injections=args.injections,
                progress_factory=_progress_factory(not args.no_progress),
                should_stop=lambda: interrupt.requested)
    except ValueError as e:
        print(f"kvcanary-jax: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:
        from kvcanary_jax.runtime import CanaryViolationError
        if not isinstance(e, CanaryViolationError):
            raise
        # --kv-canary raise: a violation in the clean run is a false positive; it ends the demo.
        print(f"kvcanary-jax: the clean run raised (--kv-canary raise):\n{e}", file=sys.stderr)
        return 1
    wall = time.perf_counter() - t0
    out = res.as_dict()
    out["timing"]["wall_s"] = round(wall, 3)
    out["device"] = args.device
    out["seed"] = args.seed
    # Every trial that ran caught its fault, and every kind got all its trials.
    ok = not res.interrupted and res.false_positives == 0 and all(
        f.detected == f.injected == args.injections for f in res.faults)
    out["ok"] = ok
    out["coverage_window_from"] = window_origin
    out["fingerprint_share"] = _fingerprint_share(sim)
    out["failures"] = [] if ok or res.interrupted else _failures(res, args)
    rc = EXIT_INTERRUPTED if res.interrupted else 0 if ok else 1
    if res.interrupted:
        trials = sum(f.injected for f in res.faults)
        print(f"kvcanary-jax: interrupted after {res.steps} of {args.steps} clean steps and "
              f"{trials} fault trial(s); partial report below", file=sys.stderr, flush=True)
    if args.json:
        print(json.dumps(out))
        return rc
    t = out["timing"]
    print(f"kv-canary demo: {res.steps} clean steps on {args.device} "
          f"(seed {args.seed}, SWA window {args.swa_window or 'off'}, "
          f"sweep every {args.sweep_interval} steps)"
          + (" [interrupted: partial report]" if res.interrupted else ""))
    print(f"clean run: {res.false_positives} violation(s) (false positives); first step "
          f"{t['first_step_s']:.2f} s incl. compile, then median {1e3 * t['step_median_s']:.2f} ms/step")
    for v in res.clean_violations[:5]:
        print(f"  {v}")
    print()
    print(_table(res) if res.faults else "(no fault trial ran)")
    print()
    for line in _coverage_lines(sim, res, window_origin):
        print(line)
    if held.held:  # (the verdict stays the last line)
        print(f"({held.held} violation message(s) of the manager's log mode held back; "
              "--log-violations prints them)")
    print()
    verdict = "INTERRUPTED" if res.interrupted else "OK" if ok else "FAILED"
    placed = sum(f.injected for f in res.faults)
    asked = args.injections * len(res.faults)
    # A trial that could not be placed fails the run even when every placed one was caught.
    unplaced = (f", {asked - placed} of {asked} trials not placed"
                if placed < asked and not res.interrupted else "")
    print(f"{verdict}: {sum(f.detected for f in res.faults)}/{placed} injected faults "
          f"detected{unplaced}; wall {wall:.1f} s")
    for line in out["failures"]:
        print(f"  - {line}")
    return rc


def _fingerprint_share(sim) -> float:
    """The share of a slot's KV bytes (every layer's K and V) SGLang's real-KV check reads: layer
    0 of each half it runs, 16 bytes of each (partial) or all of them."""
    row = 2 * sim.kv_width  # bf16 bytes of one layer's K (or V) of a slot
    read = {"none": 0, "partial": 16, "all": row}[sim.real_kv_hash_mode]
    halves = 2 if sim.enable_v_half else 1
    return halves * read / (2 * sim.num_layers * row)


def _coverage_lines(sim, res, window_origin: str) -> list[str]:
    """The report's coverage, per mode: SGLang's check (the share of each slot it reads), ours
    (the clean run's coverage report at its end; ``window_origin``: the setting that chose the
    window)."""
    halves = "K and V" if sim.enable_v_half else "K"
    sglang = (f"  SGLang's real-KV check (--real-data {sim.real_kv_hash_mode}): layer 0's "
              f"{halves}, {100 * _fingerprint_share(sim):.1f}% of each slot's KV bytes, at every "
              "read" if sim.real_kv_hash_mode != "none" else
              "  SGLang's real-KV check: off (--real-data none)")
    cov = res.coverage
    ours = (f"  ours: off ({window_origin})" if cov is None else
            f"  ours ({window_origin}): every byte; clean run: {cov.summary()}")
    layers = f"{sim.num_layers} layer{'s' if sim.num_layers != 1 else ''}"
    return [f"real-KV coverage ({layers}, K and V):", sglang, ours]


def _failures(res, args) -> list[str]:
    """Why a finished run is FAILED, one line per reason."""
    from kvcanary_jax.sim import campaign

    out = []
    if res.false_positives:
        out.append(f"{res.false_positives} false positive(s) in the clean run")
    short = [f for f in res.faults if f.injected < args.injections]
    for f in res.faults:
        if f.detected < f.injected:
            out.append(f"{f.kind}: {f.injected - f.detected} of {f.injected} injected fault(s) "
                       "missed")
    if short:
        out.append(
            f"{', '.join(f'{f.kind} ({f.injected} of {args.injections})' for f in short)}: "
            f"fewer trials placed than asked; the {res.steps} clean steps left "
            f"{campaign.checkpoint_count(res.steps)} checkpoint(s) to place them on: run more "
            "--steps")
    return out


register_command("demo", "simulate a server with the canary on, then a fault campaign",
                 _demo_args, _run_demo)


# ----------------------------------------------------------------------------------------- bench


def _run_bench(argv: list[str]) -> int:
    try:
        from kvcanary_jax.bench import run as bench_run
    except ModuleNotFoundError as e:
        # kvcanary_jax.bench ships in the package, mapped from the checkout's bench/ folder: it is
        # missing where kvcanary_jax was put on the path without being installed.
        if e.name not in ("kvcanary_jax.bench", "kvcanary_jax.bench.run"):
            raise
        print(f"kvcanary-jax bench: {e.name} is not importable here (kvcanary_jax from "
              f"{os.path.dirname(os.path.abspath(sys.modules['kvcanary_jax'].__file__))}); "
              "install kvcanary-jax (from a checkout: pip install -e .)", file=sys.stderr)
        return 2
    return int(bench_run.main(argv, prog="kvcanary-jax bench") or 0)


if "bench" not in _COMMANDS:
    register_command("bench", "benchmarks, ours vs SGLang (python -m kvcanary_jax.bench; see "
                     "kvcanary-jax bench --help)", None, _run_bench)


# ------------------------------------------------------------------------------------------ main


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kvcanary-jax", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command")
    for name, (help_, add, _) in _COMMANDS.items():
        p = sub.add_parser(name, help=help_, add_help=add is not None)
        if add is not None:
            add(p)
    return ap


def main(argv: list[str] | None = None, *, exiting: bool = False) -> int:
    """Runs one command and returns its exit status. ``exiting``: the caller ends the process
    right after (the console script, ``python -m kvcanary_jax.cli``), so an interrupted demo
    leaves its abort-on-Ctrl-C handler in place through the interpreter's shutdown."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in _COMMANDS and argv[0] not in ("-h", "--help"):
        argv = ["demo"] + argv
    help_, add, run = _COMMANDS.get(argv[0], (None, True, None))
    if add is None:  # the command parses its own options, and handles Ctrl-C its own way
        if _interrupt.requested():
            print("kvcanary-jax: interrupted", file=sys.stderr)
            return EXIT_INTERRUPTED
        _interrupt.uninstall()
        return run(argv[1:])
    try:
        args = build_parser().parse_args(argv)  # imports JAX: a Ctrl-C may land here
    except KeyboardInterrupt:
        print("kvcanary-jax: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    args.exiting = exiting
    if args.command != "demo":
        if _interrupt.requested():
            print("kvcanary-jax: interrupted", file=sys.stderr)
            return EXIT_INTERRUPTED
        _interrupt.uninstall()
    return _COMMANDS[args.command][2](args)


def run() -> None:
    """The console script ``kvcanary-jax``."""
    sys.exit(main(exiting=True))


if __name__ == "__main__":
    run()
