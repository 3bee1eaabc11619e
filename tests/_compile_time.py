"""Where the suite's time goes: a pytest plugin that adds up, per test, JAX's tracing, lowering
and XLA compile time (JAX's monitoring events) beside the test's wall time.

    python -m pytest -q -n auto --dist loadfile --compile-time
    KVCANARY_COMPILE_TIME=/tmp/ct python -m pytest ... --compile-time   # where the rows go

Each process (every xdist worker) writes one JSON line per test to ``<prefix>-<worker>.jsonl``
(default prefix ``.pytest-compile-time``), and the run ends with a summary by implementation (the
test's parameters name it): tests, wall seconds, XLA compiles and their seconds. Compiles in the
subprocesses a test starts are not seen (their wall time is). Diagnostics only: no test depends on
it."""

from __future__ import annotations

import collections
import json
import os
import pathlib
import time

import pytest

_current: dict = {"id": None}
_rows: dict = collections.defaultdict(collections.Counter)
_listening = False

IMPLEMENTATIONS = ("pallas_mosaic_tpu", "pallas_interpret", "pallas_triton", "xla", "reference")


def _listener(event, duration, **_):
    if _current["id"] is None:
        return
    name = event.rsplit("/", 1)[-1].removesuffix("_duration")
    row = _rows[_current["id"]]
    row[name + "_n"] += 1
    row[name + "_s"] += duration


def _listen() -> None:
    global _listening
    if not _listening:
        import jax

        jax.monitoring.register_event_duration_secs_listener(_listener)
        _listening = True


def _implementation(nodeid: str) -> str:
    params = nodeid.partition("[")[2]
    return next((i for i in IMPLEMENTATIONS if i in params), "-")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _listen()
    _current["id"] = item.nodeid
    t = time.perf_counter()
    yield
    _rows[item.nodeid]["wall_s"] += time.perf_counter() - t
    _current["id"] = None


def _path(worker: str) -> pathlib.Path:
    prefix = os.environ.get("KVCANARY_COMPILE_TIME", ".pytest-compile-time")
    return pathlib.Path(f"{prefix}-{worker}.jsonl")


def pytest_sessionstart(session):
    if not os.environ.get("PYTEST_XDIST_WORKER"):  # the controller: drop an earlier run's rows
        for p in _path("*").parent.glob(_path("*").name):
            p.unlink(missing_ok=True)


def pytest_sessionfinish(session):
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    if _rows:
        with _path(worker).open("w") as f:
            for nodeid, row in _rows.items():
                f.write(json.dumps({"id": nodeid, **row}) + "\n")


def pytest_terminal_summary(terminalreporter):
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return
    rows = []
    for p in _path("*").parent.glob(_path("*").name):
        rows += [json.loads(line) for line in p.read_text().splitlines()]
    if not rows:
        return
    by = collections.defaultdict(collections.Counter)
    for r in rows:
        c = by[_implementation(r["id"])]
        c["tests"] += 1
        for k in ("wall_s", "backend_compile_n", "backend_compile_s", "jaxpr_trace_s",
                  "jaxpr_to_mlir_module_s"):
            c[k] += r.get(k, 0)
    w = terminalreporter.write_line
    w("compile time by implementation (wall and compile seconds summed over workers):")
    w(f"{'implementation':<20}{'tests':>7}{'wall s':>10}{'compiles':>10}{'compile s':>11}"
      f"{'trace+lower s':>15}")
    for name, c in sorted(by.items(), key=lambda kv: -kv[1]["wall_s"]):
        w(f"{name:<20}{c['tests']:>7}{c['wall_s']:>10.0f}{c['backend_compile_n']:>10}"
          f"{c['backend_compile_s']:>11.0f}{c['jaxpr_trace_s'] + c['jaxpr_to_mlir_module_s']:>15.0f}")
