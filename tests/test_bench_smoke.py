"""The benchmark itself, in its CPU smoke mode (interpret kernels, wall-clock timing), so it cannot
rot between H200 runs: every op runs, and every result is checked against SGLang first."""

from __future__ import annotations

import json

from bench import run


def test_bench_smoke(tmp_path, capsys):
    rc = run.main(["--smoke", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "results.json").read_text())
    assert rc == 0, result["errors"]
    assert {r["op"] for r in result["rows"]} == {"scatter", "plan", "write", "verify", "bridge"}
    for row in result["rows"]:
        if row["op"] == "bridge":  # end-to-end call times through the torch bridge
            assert row["ours_call"]["median_us"] > 0
            continue
        assert row["ours_correct"] is True, row
        assert row["ours"]["median_us"] > 0
    table = (tmp_path / "results.md").read_text()
    assert "| scatter | bs=2 seq=16 |" in table
