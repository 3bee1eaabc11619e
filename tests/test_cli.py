"""``kvcanary-jax`` as a user types it: the installed entry point in a subprocess (tests/_cli.py).
The README's commands run as written; bad counts are refused; Ctrl-C stops the demo between steps
with the partial report and exit status 130, and the demo never leaves its SIGINT handler
installed."""

from __future__ import annotations

import dataclasses
import json
import re
import signal
import subprocess
import threading
import os
import time

import pytest

from kvcanary_jax import cli
from kvcanary_jax import sim as sm

import _cli


@pytest.mark.e2e
def test_bench_help_lists_the_bench_options():
    proc = _cli.run("kvcanary-jax bench --help", timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "`kvcanary-jax bench --help`" in _cli.README.read_text()
    assert proc.stdout.startswith("usage: kvcanary-jax bench ")
    for option in ("--quick", "--smoke", "--ops", "--iters", "--out"):
        assert option in proc.stdout, option


@pytest.mark.e2e
@pytest.mark.torch  # the bench checks every result against SGLang's references first
def test_bench_smoke_option_through_the_entry_point(tmp_path):
    proc = _cli.run(f"kvcanary-jax bench --smoke --ops scatter --iters 1 --out {tmp_path}",
                    timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "results.json").read_text())
    assert result["mode"] == "smoke" and {r["op"] for r in result["rows"]} == {"scatter"}
    assert all(r["ours_correct"] is True for r in result["rows"])


@pytest.mark.e2e
def test_bench_refuses_unknown_options():
    proc = _cli.run("kvcanary-jax bench --fast", timeout=120)
    assert proc.returncode == 2
    assert "kvcanary-jax bench: error: unrecognized arguments: --fast" in proc.stderr


@pytest.mark.e2e
def test_top_level_help_lists_the_commands():
    proc = _cli.run("kvcanary-jax --help", timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "demo" in proc.stdout and "bench" in proc.stdout


@pytest.mark.e2e
@pytest.mark.parametrize("typed,message", [
    ("kvcanary-jax demo --steps -1", "argument --steps: must be >= 1, got -1"),
    ("kvcanary-jax demo --steps 0", "argument --steps: must be >= 1, got 0"),
    ("kvcanary-jax --steps -5", "argument --steps: must be >= 1, got -5"),
    ("kvcanary-jax demo --injections -2", "argument --injections: must be >= 0, got -2"),
    ("kvcanary-jax demo --sweep-interval -1", "argument --sweep-interval: must be >= 0, got -1"),
    ("kvcanary-jax demo --sweep-interval 9223372036854775808",
     "argument --sweep-interval: must be <= 2**40, got 9223372036854775808"),
    ("kvcanary-jax demo --steps two", "argument --steps: not an integer: 'two'"),
    ("kvcanary-jax demo --seed -1", "argument --seed: must be >= 0, got -1"),
])
def test_bad_counts_are_refused(typed, message):
    proc = _cli.run(typed, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.rstrip().endswith(f"kvcanary-jax demo: error: {message}"), proc.stderr


@pytest.mark.parametrize("faults,message", [
    # '' meant every kind and ',' none: both are refused now, as any list without a kind.
    ("", "argument --faults: no fault kind in '': name kinds (a comma list) or 'all'"),
    (",", "argument --faults: no fault kind in ',': name kinds (a comma list) or 'all'"),
    ("req_to_token,nope", "argument --faults: unknown fault kind(s) 'nope'; known: "
     + ", ".join(sm.FAULT_KINDS)),
])
def test_fault_lists_without_a_kind_are_refused(faults, message, capsys):
    with pytest.raises(SystemExit) as e:
        cli.build_parser().parse_args(["demo", "--faults", faults])
    assert e.value.code == 2
    assert capsys.readouterr().err.rstrip().endswith(f"kvcanary-jax demo: error: {message}")
    assert cli.build_parser().parse_args(["demo", "--faults", " all"]).faults is None
    assert cli.build_parser().parse_args(["demo", "--faults", "req_to_token, stale_row_reuse,"]
                                         ).faults == ["req_to_token", "stale_row_reuse"]


@pytest.mark.parametrize("steps", [1, 4])
def test_demo_with_too_few_steps_for_a_fault_trial_says_so(steps, capsys, monkeypatch):
    """--steps 1..4 left no checkpoint to inject on and ended "FAILED: 0/0" with no reason."""
    monkeypatch.setattr(sm, "run_campaign", lambda *a, **k: pytest.fail("ran"))
    assert cli.main(["--steps", str(steps), "--no-progress"]) == 2
    assert capsys.readouterr().err == (
        f"kvcanary-jax: --steps {steps} leaves no clean checkpoint to inject faults on (the "
        "first is taken at step 4): pass --steps 5 or more, or --injections 0 for the clean "
        "run only\n")
    assert [sm.campaign.checkpoint_count(n) for n in (1, 4, 5, 6, 7, 40)] == [0, 0, 1, 1, 2, 18]


def test_a_sweep_interval_longer_than_the_clean_run_is_refused(capsys, monkeypatch):
    """--sweep-interval 10000 with the default 40 steps: no sweep in the clean run, and a trial
    waited up to 20,001 steps for its fault to be reported; --sweep-interval 0 could never place
    the kinds placed on a sweep step (the demo failed advising more --steps)."""
    monkeypatch.setattr(sm, "run_campaign", lambda *a, **k: pytest.fail("ran"))
    assert sm.SWEEP_PLACED == ("real_kv_unused_cache", "layer_flip_cached")
    assert cli.main(["--sweep-interval", "10000", "--no-progress"]) == 2
    assert capsys.readouterr().err == (
        "kvcanary-jax: --sweep-interval 10000 is longer than the clean run (--steps 40): no "
        "sweep would run in it, and a fault trial waits up to 20001 steps for its fault to be "
        "reported: pass --sweep-interval 40 or less, or --injections 0 for the clean run "
        "only\n")
    # Whatever the kinds: a fault the configuration cannot catch waits out the whole window.
    assert cli.main(["--sweep-interval", "1000", "--steps", "12", "--faults", "req_to_token",
                     "--no-progress"]) == 2
    assert "waits up to 2001 steps" in capsys.readouterr().err
    assert cli.main(["--sweep-interval", "0", "--coverage-window", "0", "--faults",
                     "req_to_token,layer_flip_cached,layer_flip_cached", "--no-progress"]) == 2
    assert capsys.readouterr().err == (
        "kvcanary-jax: --sweep-interval 0 runs no sweep, and the fault kind layer_flip_cached "
        "is placed on a sweep step: pass --sweep-interval > 0, or --faults without it\n")
    assert cli.main(["--sweep-interval", "0", "--coverage-window", "0", "--no-progress"]) == 2
    assert capsys.readouterr().err.endswith(
        "the fault kinds real_kv_unused_cache, layer_flip_cached are placed on a sweep step: "
        "pass --sweep-interval > 0, or --faults without them\n")

    class Ran(Exception):
        pass

    def run_campaign(sim, **kw):
        raise Ran(sim.sweep_interval)

    monkeypatch.setattr(sm, "run_campaign", run_campaign)
    # The clean run alone, an interval the clean run holds, and without a sweep the faults
    # the steps catch are taken.
    for argv, interval in ((["--sweep-interval", "10000", "--injections", "0"], 10000),
                           (["--sweep-interval", "40"], 40),
                           (["--sweep-interval", "0", "--coverage-window", "0", "--faults",
                             "req_to_token"], 0)):
        with pytest.raises(Ran) as e:
            cli.main(argv + ["--no-progress"])
        assert e.value.args == (interval,)


def test_a_failed_demo_says_why(capsys, monkeypatch):
    def run_campaign(sim, **kw):
        return sm.CampaignResult(
            steps=6, false_positives=1, clean_violations=[], step_seconds=[1.0] * 6,
            first_step_seconds=1.0, campaign_seconds=0.0, counters={},
            faults=[sm.campaign.FaultReport(kind="req_to_token", injected=2, detected=1),
                    sm.campaign.FaultReport(kind="stale_row_reuse", injected=0)])

    monkeypatch.setattr(sm, "run_campaign", run_campaign)
    assert cli.main(["--steps", "6", "--no-progress"]) == 1
    lines = capsys.readouterr().out.rstrip().splitlines()
    # 2 of the 4 trials asked (2 kinds x --injections 2) placed: said on the verdict's line.
    assert lines[-4].startswith("FAILED: 1/2 injected faults detected, 2 of 4 trials not placed;")
    assert lines[-3:] == [
        "  - 1 false positive(s) in the clean run",
        "  - req_to_token: 1 of 2 injected fault(s) missed",
        "  - stale_row_reuse (0 of 2): fewer trials placed than asked; the 6 clean steps left 1 "
        "checkpoint(s) to place them on: run more --steps"]


def test_a_demo_that_placed_fewer_trials_than_asked_is_failed(capsys, monkeypatch):
    """Every placed trial caught, but 1 of the 2 asked not placed: FAILED (it read "OK: 1/1 ...,
    1 of 2 trials not placed" with status 0), with the reason."""
    def run_campaign(sim, **kw):
        return sm.CampaignResult(
            steps=5, false_positives=0, clean_violations=[], step_seconds=[1.0] * 5,
            first_step_seconds=1.0, campaign_seconds=0.0, counters={},
            faults=[sm.campaign.FaultReport(kind="canary_token_flip", injected=1, detected=1)])

    monkeypatch.setattr(sm, "run_campaign", run_campaign)
    assert cli.main(["--steps", "5", "--faults", "canary_token_flip", "--no-progress"]) == 1
    lines = capsys.readouterr().out.rstrip().splitlines()
    assert lines[-2].startswith("FAILED: 1/1 injected faults detected, 1 of 2 trials not placed;")
    assert lines[-1] == ("  - canary_token_flip (1 of 2): fewer trials placed than asked; the 5 "
                         "clean steps left 1 checkpoint(s) to place them on: run more --steps")


def test_campaign_api_refuses_negative_counts():
    with pytest.raises(ValueError, match="steps must be >= 0, got -1"):
        sm.SimConfig(steps=-1)
    with pytest.raises(ValueError, match="injections must be >= 0, got -1"):
        sm.run_campaign(sm.SimConfig(steps=1), injections=-1)


@pytest.mark.e2e
@pytest.mark.slow
def test_readme_demo_command_as_typed():
    typed = "kvcanary-jax demo"
    assert f"pip install . && {typed}\n" in _cli.README.read_text()
    proc = _cli.run(typed)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    m = re.match(r"OK: (\d+)/(\d+) injected faults detected", last)
    assert m and m.group(1) == m.group(2) and int(m.group(1)) > 0, last


# --- Ctrl-C --------------------------------------------------------------------------------------


def _read_into(stream, chunks: list):
    for chunk in iter(lambda: stream.read1(4096), b""):
        chunks.append(chunk)


@pytest.mark.e2e
@pytest.mark.slow
def test_ctrl_c_stops_the_demo_between_steps_with_a_partial_report():
    """SIGINT once some clean steps have run (the progress bar on stderr counts them): the demo
    must stop before its next step, print the partial report and exit with status 130, long
    before the 400 steps it was asked for."""
    proc = subprocess.Popen(_cli.command("kvcanary-jax demo --steps 400 --swa-window 0"),
                            env=_cli.env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    err: list = []
    reader = threading.Thread(target=_read_into, args=(proc.stderr, err), daemon=True)
    reader.start()
    deadline = time.monotonic() + 420
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            done = re.findall(rb"(\d+)/\d+ \[", b"".join(err))
            if done and int(done[-1]) >= 3:
                break
            time.sleep(0.2)
        assert proc.poll() is None, b"".join(err)[-3000:]
        assert done and int(done[-1]) >= 3, "no step ran in time"
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        out = proc.stdout.read().decode()
        proc.wait(timeout=120)
        stopped_after = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    reader.join(timeout=10)
    stderr = b"".join(err).decode()
    assert proc.returncode == cli.EXIT_INTERRUPTED, (out, stderr[-3000:])
    assert stopped_after < 60, stopped_after
    m = re.search(r"kvcanary-jax: interrupted after (\d+) of 400 clean steps and 0 fault "
                  r"trial\(s\); partial report below", stderr)
    assert m and 3 <= int(m.group(1)) < 400, stderr[-3000:]
    lines = out.strip().splitlines()
    assert lines[0] == (f"kv-canary demo: {m.group(1)} clean steps on cpu (seed 0, SWA window "
                        "off, sweep every 4 steps) [interrupted: partial report]")
    assert lines[1].startswith("clean run: 0 violation(s) (false positives)")
    assert "(no fault trial ran)" in lines
    assert lines[-1].startswith("INTERRUPTED: 0/0 injected faults detected")


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.parametrize("times", [1, 2])
def test_ctrl_c_while_jax_compiles(times):
    """SIGINT a moment after the progress bar appears, while the first step compiles (seconds
    of tracing and XLA compilation, which cannot be cut short from Python): once, the demo
    acknowledges it and stops after that step with its partial report; a second SIGINT after
    the acknowledgement aborts at once with status 130 (leaving without the interpreter's
    shutdown, which could crash while a compilation's threads still run). Two SIGINTs that both
    arrive inside one call into XLA reach Python's handler once (CPython coalesces them), so the
    second waits for the acknowledgement, as a user reads it before pressing again."""
    proc = subprocess.Popen(_cli.command("kvcanary-jax demo --steps 400 --swa-window 0"),
                            env=_cli.env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    err: list = []
    reader = threading.Thread(target=_read_into, args=(proc.stderr, err), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 300
        while not re.search(rb"\b0/\d+ \[", b"".join(err)) and time.monotonic() < deadline:
            assert proc.poll() is None, b"".join(err)[-3000:]
            time.sleep(0.05)
        # The server is set up; its first step compiles for about 2 s (CPU), then steps take
        # milliseconds: the signal must land inside that compilation.
        time.sleep(0.3)
        proc.send_signal(signal.SIGINT)
        if times == 2:
            while (b"Ctrl-C again to abort" not in b"".join(err) and proc.poll() is None
                   and time.monotonic() < deadline):
                time.sleep(0.05)
            proc.send_signal(signal.SIGINT)
        out = proc.stdout.read().decode()
        proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    reader.join(timeout=10)
    stderr = b"".join(err).decode()
    assert proc.returncode == cli.EXIT_INTERRUPTED, (proc.returncode, out, stderr[-3000:])
    # No Ctrl-C, wherever it lands (the step, the report, the interpreter's shutdown with JAX's
    # exit hooks), may leave a traceback.
    assert "Traceback" not in stderr and "Exception ignored" not in stderr, stderr[-3000:]
    if times == 2:
        # The second one aborts at once, unless the process had already printed its whole
        # partial report and exited before it arrived.
        assert (stderr.rstrip().endswith("kvcanary-jax: aborted (second Ctrl-C)")
                or out.strip().splitlines()[-1].startswith("INTERRUPTED: 0/0")), stderr[-3000:]
    else:
        assert re.search(r"interrupted after [01] of 400 clean steps", stderr), stderr[-3000:]
        assert out.strip().splitlines()[-1].startswith("INTERRUPTED: 0/0")


def _wait_until_jax_loads(proc, timeout: float = 120.0) -> None:
    """Until the child has mapped jaxlib, i.e. JAX's import has begun (the demo's early handler is
    installed before it). A fixed delay alone sent the SIGINT, on a loaded machine, while Python
    itself was still starting (importing ``site``), where only Python's own startup sees it and
    dies with "Fatal Python error". Without /proc this falls back to the delay alone."""
    maps = f"/proc/{proc.pid}/maps"
    if not os.path.exists(maps):
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with open(maps) as f:
                if "jaxlib" in f.read():
                    return
        except OSError:  # the process just ended
            return
        time.sleep(0.002)


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.parametrize("after", [0.2, 0.8])
@pytest.mark.parametrize("times", [1, 2])
def test_ctrl_c_while_jax_imports(after, times):
    """SIGINT within the first second (``after`` seconds, and not before JAX's import begins),
    while the console script imports JAX (before the demo's own handler exists): it was lost (JAX printed a KeyboardInterrupt from one of its callbacks
    and the demo ran on) or ended in a traceback from inside JAX's import. Now once: the demo
    stops before its first step with its partial report, status 130; twice: it aborts."""
    start = time.monotonic()
    proc = subprocess.Popen(_cli.command("kvcanary-jax demo --steps 400 --no-progress"),
                            env=_cli.env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        _wait_until_jax_loads(proc)
        time.sleep(max(0.0, after - (time.monotonic() - start)))
        proc.send_signal(signal.SIGINT)
        if times == 2:
            time.sleep(0.1)
            proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    out, err = out.decode(), err.decode()
    assert proc.returncode == cli.EXIT_INTERRUPTED, (proc.returncode, out, err[-3000:])
    assert "Traceback" not in err and "Exception ignored" not in err, err[-3000:]
    if times == 2:
        assert err.rstrip().endswith("kvcanary-jax: aborted (second Ctrl-C)"), err[-3000:]
        assert out == ""
    else:
        assert "interrupted after 0 of 400 clean steps" in err, err[-3000:]
        assert out.strip().splitlines()[-1].startswith("INTERRUPTED: 0/0")


def test_the_early_handler_is_for_the_console_script_only():
    from kvcanary_jax import _interrupt

    assert _interrupt.is_console_script(["/usr/bin/kvcanary-jax", "demo"], [])
    assert _interrupt.is_console_script(["C:/venv/Scripts/kvcanary-jax.exe"], [])
    assert _interrupt.is_console_script(["-m"], ["python", "-m", "kvcanary_jax.cli", "demo"])
    assert not _interrupt.is_console_script(["-m"], ["python", "-m", "pytest"])
    assert not _interrupt.is_console_script(["app.py"], ["python", "app.py"])
    # Importing the library anywhere else leaves SIGINT alone (this test process).
    assert not _interrupt.installed()


def _fake_campaign(result_for):
    """A stand-in for :func:`sim.run_campaign` that delivers SIGINT to this process between
    two of its steps and returns what the real one returns when stopped."""

    def run_campaign(sim, *, faults=None, injections=2, progress_factory=None,
                     should_stop=None):
        assert not should_stop()
        signal.raise_signal(signal.SIGINT)  # the first Ctrl-C only asks to stop
        assert should_stop()
        return result_for(sim)

    return run_campaign


def _stopped(sim):
    return sm.CampaignResult(steps=2, false_positives=0, clean_violations=[], faults=[],
                             step_seconds=[1.0, 0.01], first_step_seconds=1.0,
                             campaign_seconds=0.0, counters={}, interrupted=True)


def test_demo_restores_the_previous_sigint_handler(monkeypatch, capsys):
    calls = []
    mine = lambda signum, frame: calls.append(signum)  # noqa: E731
    previous = signal.signal(signal.SIGINT, mine)
    try:
        monkeypatch.setattr(sm, "run_campaign", _fake_campaign(_stopped))
        rc = cli.main(["--steps", "5", "--no-progress", "--json"])
        assert rc == cli.EXIT_INTERRUPTED
        out = json.loads(capsys.readouterr().out)
        assert out["interrupted"] is True and out["ok"] is False and out["steps"] == 2
        assert signal.getsignal(signal.SIGINT) is mine
        assert calls == []  # the demo's handler took the signal while it ran
        # Every way out restores it: an error inside the campaign ...
        def fails(sim, **kw):
            raise ValueError("no trial")

        monkeypatch.setattr(sm, "run_campaign", fails)
        assert cli.main(["--steps", "5", "--no-progress"]) == 2
        assert signal.getsignal(signal.SIGINT) is mine

        # ... and a second Ctrl-C, which aborts at once (os._exit, stood in for here).
        class Aborted(Exception):
            pass

        def abort():
            raise Aborted

        def twice(sim, **kw):
            signal.raise_signal(signal.SIGINT)
            signal.raise_signal(signal.SIGINT)
            raise AssertionError("not reached")

        monkeypatch.setattr(cli, "_abort", abort)
        monkeypatch.setattr(sm, "run_campaign", twice)
        with pytest.raises(Aborted):
            cli.main(["--steps", "5", "--no-progress"])
        assert signal.getsignal(signal.SIGINT) is mine
    finally:
        signal.signal(signal.SIGINT, previous)


def test_the_console_script_keeps_aborting_after_an_interrupted_demo(monkeypatch, capsys):
    """``main(exiting=True)`` (the console script, which exits right after): once a stop was
    requested, the demo's handler stays installed, so a Ctrl-C while the process shuts down
    aborts at once; a demo that was not interrupted puts the previous handler back."""
    mine = lambda signum, frame: None  # noqa: E731
    previous = signal.signal(signal.SIGINT, mine)
    try:
        monkeypatch.setattr(sm, "run_campaign", _fake_campaign(_stopped))
        assert cli.main(["--steps", "5", "--no-progress", "--json"],
                        exiting=True) == cli.EXIT_INTERRUPTED
        handler = signal.getsignal(signal.SIGINT)
        assert getattr(handler, "__self__", None).__class__ is cli._StopOnInterrupt

        class Aborted(Exception):
            pass

        def abort():
            raise Aborted

        monkeypatch.setattr(cli, "_abort", abort)
        with pytest.raises(Aborted):
            signal.raise_signal(signal.SIGINT)

        signal.signal(signal.SIGINT, mine)
        monkeypatch.setattr(sm, "run_campaign", lambda sim, **kw: dataclasses.replace(
            _stopped(sim), interrupted=False))
        assert cli.main(["--steps", "5", "--no-progress", "--json"], exiting=True) == 0
        assert signal.getsignal(signal.SIGINT) is mine
        capsys.readouterr()
    finally:
        signal.signal(signal.SIGINT, previous)


@pytest.mark.e2e
def test_campaign_stops_between_steps_with_a_partial_result():
    """``should_stop`` is polled before every step, the fault trials' included: a trial cut short
    is dropped, finished ones are kept, and the result says it is partial."""
    polls = []

    def should_stop():
        polls.append(1)
        return len(polls) > 9

    res = sm.run_campaign(sm.SimConfig(steps=6, seed=1, swa_window_size=0), injections=1,
                          faults=["canary_token_flip", "req_to_token"], should_stop=should_stop)
    assert res.interrupted and res.steps == 6
    assert [(f.kind, f.injected, f.detected) for f in res.faults] == [
        ("canary_token_flip", 1, 1)]
    assert res.as_dict()["interrupted"] is True


def _imported_modules(path) -> set[str]:
    import ast

    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


def test_bench_and_the_command_line_do_not_import_each_other():
    """The benchmarks pick their platform with kvcanary_jax._devices, not through the command
    line, whose ``bench`` command is the only side that reaches the other (for ``kvcanary-jax
    bench``, inside that command)."""
    root = _cli.README.parent
    importers = [p.name for p in sorted((root / "bench").glob("*.py"))
                 if any(m == "kvcanary_jax.cli" or m.startswith("kvcanary_jax.cli.")
                        for m in _imported_modules(p))]
    assert importers == []
    import ast

    tree = ast.parse((root / "kvcanary_jax" / "cli.py").read_text(encoding="utf-8"))
    top_level = {n.module for n in tree.body if isinstance(n, ast.ImportFrom)}
    top_level |= {a.name for n in tree.body if isinstance(n, ast.Import) for a in n.names}
    assert not any(m.split(".")[0] == "bench" or m == "kvcanary_jax.bench"
                   or m.startswith("kvcanary_jax.bench.") for m in top_level)


def test_select_device_gpu_without_a_gpu_says_so(monkeypatch):
    import jax

    from kvcanary_jax._devices import select_device

    # The same on every machine: JAX reports a CPU backend (a GPU machine would accept "gpu").
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
    with pytest.raises(SystemExit, match=r"--device gpu needs a CUDA GPU \(JAX sees '\w+'\)"):
        select_device("gpu")
