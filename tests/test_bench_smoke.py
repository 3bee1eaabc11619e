"""The benchmark itself, run as the README types it (``kvcanary-jax bench --quick``) through the
installed entry point on the CPU, where it falls back to its smoke mode (interpret kernels,
wall-clock timing), so it cannot rot between H200 runs: every op runs, and every result is
checked against SGLang first."""

from __future__ import annotations

import json

import pytest

import _cli
from bench import cpu

COMMAND = "kvcanary-jax bench --quick"


def test_readme_types_this_command():
    assert f"`{COMMAND}`" in _cli.README.read_text()


@pytest.mark.torch  # SGLang's references and the torch bridge
def test_bench_smoke(tmp_path):
    proc = _cli.run(COMMAND, cwd=tmp_path)
    assert "no GPU: running the smoke mode" in proc.stderr, proc.stderr[-3000:]
    out = tmp_path / "bench" / "results"  # the default --out, under the current directory
    result = json.loads((out / "results.json").read_text())
    assert proc.returncode == 0, (result["errors"], proc.stderr[-3000:])
    assert result["mode"] == "smoke"
    assert {r["op"] for r in result["rows"]} == {"scatter", "plan", "write", "verify", "bridge"}
    for row in result["rows"]:
        if row["op"] == "bridge":  # end-to-end call times through the torch bridge
            assert row["ours_call"]["median_us"] > 0
            continue
        assert row["ours_correct"] is True, row
        assert row["ours"]["median_us"] > 0
    table = (out / "results.md").read_text()
    assert "| scatter | bs=2 seq=16 |" in table
    assert table in proc.stdout


def test_cpu_bench_smoke(tmp_path):
    """bench/cpu.py (xla against pallas_interpret, every op and the demo): the two agree byte for
    byte on every case and every row has its timings."""
    assert cpu.main(["--smoke", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "results.json").read_text())
    assert {r["op"] for r in result["rows"]} == {"scatter", "plan", "write", "verify", "demo"}
    for row in result["rows"]:
        assert row["equal"] is True, row
        assert all(row[i]["median_ms"] > 0 for i in cpu.IMPLEMENTATIONS)
    assert "| demo |" in (tmp_path / "results.md").read_text()
