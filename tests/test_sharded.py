"""The data-parallel fault campaign (``python -m bench.sharded``) on two forced CPU devices."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAULTS = ["canary_token_flip", "real_kv_post_forward", "next_token_swap"]

pytestmark = pytest.mark.e2e  # whole runs in processes of their own (pyproject.toml: markers)


def _run(args, devices: int, timeout: int = 600):
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "")
                        + f" --xla_force_host_platform_device_count={devices}").strip()
    env["JAX_PLATFORMS"] = "cpu"
    return subprocess.run([sys.executable, "-m", "kvcanary_jax.bench.sharded", *args], env=env,
                          cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def test_sharded_campaign_two_cpu_devices(tmp_path):
    # Faults that replace a shard's canary state before the step (canary_token_flip), its KV
    # after the step (real_kv_post_forward) and only host-side tokens (next_token_swap); the
    # sweep-only fault must be listed as skipped.
    faults = ",".join(FAULTS + ["real_kv_unused_cache"])
    proc = _run(["--shards", "2", "--steps", "8", "--faults", faults, "--injections", "1",
                 "--timing-steps", "4", "--timing-repeats", "1", "--json", "--no-progress",
                 "--out", str(tmp_path)], devices=2)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert json.loads((tmp_path / "sharded.json").read_text())["ok"] is True

    assert out["ok"] is True
    assert out["config"]["shards"] == 2 and out["config"]["seeds"] == [10, 11]
    assert len(out["environment"]["mesh_devices"]) == 2

    clean = out["clean"]
    assert clean["false_positives"] == 0 and clean["violations_per_shard"] == [0, 0]
    assert clean["identical_to_solo"] == [True, True], clean["solo_differences"]
    assert all(c for c in clean["counters_per_shard"])  # both shards ran the canary

    assert [f["kind"] for f in out["faults"]] == FAULTS
    for f in out["faults"]:
        assert f["injected"] == f["detected"] == 1, f
        assert f["cross_shard_violations"] == 0, f
    assert out["cross_shard_violations"] == 0
    for t in out["trials"]:
        counts = t["violations_per_shard"]
        assert t["detected"] and counts[t["shard"]] > 0, t
        assert sum(counts) == counts[t["shard"]], t
    assert {t["shard"] for t in out["trials"]} == {0, 1}  # faults rotate over the shards

    assert [s["kind"] for s in out["skipped"]] == ["real_kv_unused_cache"]
    assert "SWEEP" in out["skipped"][0]["reason"]

    timing = out["timing"]
    assert timing["replay_violations"] == {"sharded": 0, "single_device": 0}
    assert timing["sharded_step_median_s"] > 0 and timing["single_device_step_median_s"] > 0
    assert timing["ratio"] > 0


def test_too_few_devices_says_how_to_get_them():
    proc = _run(["--shards", "3", "--steps", "2", "--no-progress"], devices=2, timeout=120)
    assert proc.returncode != 0
    assert "--xla_force_host_platform_device_count=3" in proc.stderr
    assert "JAX sees 2" in proc.stderr
