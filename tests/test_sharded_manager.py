"""The data-parallel fault campaign (``python -m bench.sharded --manager``) stepped through the
runtime manager over a mesh of two CPU devices: the same detections as the plain sharded step,
states identical to single-device runs, no cross-shard violation."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAULTS = ["canary_token_flip", "real_kv_post_forward", "next_token_swap"]

pytestmark = pytest.mark.e2e  # whole runs in processes of their own (pyproject.toml: markers)


def test_sharded_campaign_through_the_manager(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "")
                        + " --xla_force_host_platform_device_count=2").strip()
    proc = subprocess.run(
        [sys.executable, "-m", "kvcanary_jax.bench.sharded", "--shards", "2", "--steps", "8",
         "--faults", ",".join(FAULTS), "--injections", "1", "--timing-steps", "4",
         "--timing-repeats", "1", "--json", "--no-progress", "--manager", "--out", str(tmp_path)],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert out["ok"] is True and out["config"]["manager"] is True
    clean = out["clean"]
    assert clean["false_positives"] == 0 and clean["identical_to_solo"] == [True, True]
    assert [f["kind"] for f in out["faults"]] == FAULTS
    for f in out["faults"]:
        assert f["injected"] == f["detected"] == 1, f
        assert f["cross_shard_violations"] == 0, f
