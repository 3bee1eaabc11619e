"""The demo through the runtime manager: ``kvcanary-jax demo --kv-canary {log,raise}
--real-data ... --sweep-interval N`` runs the simulated server's steps and sweeps through
``CanaryManager``, and every fault kind is still caught (in raise mode, the raise is the
detection)."""

from __future__ import annotations

import json
import warnings

import pytest

from kvcanary_jax import cli
from kvcanary_jax import sim as sm

warnings.filterwarnings("ignore", message=".*donated buffers.*")


@pytest.mark.parametrize("mode", ["log", "raise"])
def test_campaign_through_the_manager_detects_every_fault_kind(mode):
    res = sm.run_campaign(sm.SimConfig(steps=24, seed=1, kv_canary=mode, coverage_window=4),
                          injections=1)
    assert res.false_positives == 0, [str(v) for v in res.clean_violations]
    assert [f.kind for f in res.faults] == list(sm.FAULT_KINDS)
    for f in res.faults:
        assert f.injected == f.detected == 1, (f.kind, f.missed)
    by_kind = {f.kind: f for f in res.faults}
    assert any(t.startswith("SWEEP") for t in by_kind["real_kv_unused_cache"].tags)
    assert "WRITE_TOKEN_MISMATCH" in by_kind["next_token_swap"].reasons


def test_demo_flags(capsys):
    rc = cli.main(["demo", "--kv-canary", "raise", "--real-data", "partial", "--sweep-interval",
                   "2", "--steps", "6", "--faults", "real_kv_used", "--injections", "1",
                   "--json", "--no-progress"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["ok"] is True, out
    assert out["faults"][0]["kind"] == "real_kv_used" and out["faults"][0]["detected"] == 1


@pytest.mark.parametrize("argv, message", [
    (["--kv-canary", "none"], "invalid choice: 'none'"),
    (["--kv-canary", "loud"], "invalid choice: 'loud'"),
    (["--real-data", "half"], "invalid choice: 'half'"),
])
def test_demo_refuses_bad_flags(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["demo", *argv])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_sim_config_refuses_a_bad_mode():
    with pytest.raises(ValueError, match="runs --kv-canary log or raise, got 'none'"):
        sm.SimConfig(kv_canary="none")
    with pytest.raises(ValueError, match=r"real_data \(--kv-canary-real-data\) must be one of"):
        sm.SimConfig(kv_canary="log", real_kv_hash_mode="most")
