"""The demo: fault campaign (every fault kind detected, no false positives) and the CLI's JSON."""

from __future__ import annotations

import json
import re
import warnings

import pytest

from kvcanary_jax import cli
from kvcanary_jax import sim as sm

warnings.filterwarnings("ignore", message=".*donated buffers.*")


def test_campaign_detects_every_fault_kind():
    res = sm.run_campaign(sm.SimConfig(steps=24, seed=1, coverage_window=4), injections=1)
    assert res.false_positives == 0, [str(v) for v in res.clean_violations]
    assert [f.kind for f in res.faults] == list(sm.FAULT_KINDS)
    for f in res.faults:
        assert f.injected == 1, f.kind
        assert f.detected == 1, (f.kind, f.missed)
        assert f.first_step is not None
    by_kind = {f.kind: f for f in res.faults}
    # Each fault is caught where SGLang's perturbers say it should be.
    assert any(t.startswith("SWEEP") for t in by_kind["real_kv_unused_cache"].tags)
    assert "WRITE_TOKEN_MISMATCH" in by_kind["next_token_swap"].reasons
    assert "VERIFY_REAL_KV_HASH_MISMATCH" in by_kind["real_kv_used"].reasons
    assert "TAIL_K_FULL" in by_kind["real_kv_used"].tags


def test_clean_run_without_swa_has_no_violations():
    server, infos, _ = sm.run_clean(sm.SimConfig(steps=20, seed=7, swa_window_size=0))
    assert infos[-1].violations == 0
    assert sum(i.num_tokens for i in infos) > 0 and server.next_rid > 3


def test_cli_json_shape(capsys):
    rc = cli.main(["--json", "--steps", "12", "--seed", "2", "--faults",
                   "real_kv_used,req_to_token", "--injections", "1", "--no-progress"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0
    assert out["steps"] == 12 and out["false_positives"] == 0
    assert [f["kind"] for f in out["faults"]] == ["real_kv_used", "req_to_token"]
    for f in out["faults"]:
        assert {"kind", "injected", "detected", "first_step"} <= set(f)
        assert f["injected"] == f["detected"] == 1
    assert len(out["timing"]["per_step_s"]) == 12


def test_the_demo_holds_back_the_violation_logs_of_its_trials(capsys, caplog):
    """The fault trials make the manager (log mode) log the violations it finds: the demo holds
    those messages back, says how many, and leaves no filter on the manager's logger after it."""
    import logging

    from kvcanary_jax.runtime.reporting import LOGGER_NAME

    with caplog.at_level(logging.WARNING, logger=LOGGER_NAME):
        rc = cli.main(["--steps", "12", "--seed", "2", "--injections", "1", "--no-progress"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert not [r for r in caplog.records if r.getMessage().startswith("kv_canary violation:")]
    m = re.search(r"\n\((\d+) violation message\(s\) of the manager's log mode held back; "
                  r"--log-violations prints them\)\n\nOK: ", out)
    assert m and int(m.group(1)) > 0, out
    assert out.strip().splitlines()[-1].startswith("OK: ")  # the verdict, last
    assert not logging.getLogger(LOGGER_NAME).filters


@pytest.mark.parametrize("shown", [False, True])
def test_the_demo_s_violation_log_filter_holds_only_violations(caplog, shown):
    """--log-violations lets the manager's violation messages through; without it they are
    counted, not logged, and every other message of that logger still is."""
    import logging

    from kvcanary_jax.runtime.reporting import LOGGER_NAME

    log = logging.getLogger(LOGGER_NAME)
    with caplog.at_level(logging.WARNING, logger=LOGGER_NAME):
        with cli._violation_logs(shown) as held:
            log.warning("kv_canary violation: launch_tag=HEAD_K_FULL fail_reason=verify_token")
            log.warning("kv-canary: violation ring overflow on rank 0 shard 0: 3 rows lost")
        log.warning("kv_canary violation: after the demo")
    messages = [r.getMessage()[:22] for r in caplog.records]
    assert messages == (["kv_canary violation: l"] * shown + ["kv-canary: violation r",
                                                               "kv_canary violation: a"])
    assert held.held == (0 if shown else 1) and not log.filters


def test_cli_rejects_unknown_fault(capsys):
    # Refused while parsing, before anything runs (argparse's exit status 2).
    with pytest.raises(SystemExit) as e:
        cli.main(["demo", "--faults", "nope", "--steps", "2", "--no-progress"])
    assert e.value.code == 2
    assert "argument --faults: unknown fault kind(s) 'nope'" in capsys.readouterr().err
