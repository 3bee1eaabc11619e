"""The benchmark itself, in its CPU smoke mode (interpret kernels, wall-clock timing), so it cannot
rot between H200 runs: every op runs, and every result is checked against SGLang first."""

from __future__ import annotations

import json

from bench import run


def test_bench_smoke(tmp_path, capsys):
    rc = run.main(["--smoke", "--ops", "scatter,plan,write,verify", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "results.json").read_text())
    assert rc == 0, result["errors"]
    assert {r["op"] for r in result["rows"]} == {"scatter", "plan", "write", "verify"}
    for row in result["rows"]:
        assert row["ours_correct"] is True, row
        assert row["ours"]["median_us"] > 0
    table = (tmp_path / "results.md").read_text()
    assert "| scatter | bs=2 seq=16 |" in table
