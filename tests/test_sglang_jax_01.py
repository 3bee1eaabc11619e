"""What only sglang-jax 0.1.0rc0 has, through its own objects (``pip install --no-deps -r
requirements-sglang-jax-0.1.txt``; marked ``sglang_jax_01``, deselected where another version
is installed; tests/test_sglang_jax*.py run on both versions):

* data parallelism (tests/_sglang_jax_dp.py): two DP ranks, one canary each over its own slots
  and batch segment; clean steps silent, a fault reported by its rank's canary only;
* the fused decode step ``forward_and_sample`` (tests/_sglang_jax_runner.py ``--fused``): guarded
  as the ordinary step, its future-token placeholders resolved for the canary (and with the
  coverage window, every layer of its pool updates digested);
* HiCache (tests/_sglang_jax_hicache.py): the canary of a KV page backed up to host memory with
  it and restored with it on load, so an intact reload verifies clean and a corrupted one is
  reported when the page is next read; with a coverage window its digests travel with it too.

Each script runs in its own process (a 2-device CPU mesh needs XLA_FLAGS before JAX starts).
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.sglang_jax, pytest.mark.sglang_jax_01]

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent
REAL_KV = ("VERIFY_REAL_KV_HASH_MISMATCH",)


def _run(script: str, *args: str) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    proc = subprocess.run([sys.executable, str(HERE / script), *args], capture_output=True,
                          text=True, env=env, timeout=1200, cwd=ROOT)
    assert proc.returncode == 0, f"{script} {' '.join(args)} failed:\n{proc.stderr[-6000:]}"
    return json.loads(proc.stdout)


def _rows(found):
    return sorted((v["shard"], v["tag"], v["slot"], v["position"], tuple(v["reasons"]))
                  for v in found)


@pytest.fixture(scope="module", params=["feed", "full"])
def dp(request):
    return {**_run("_sglang_jax_dp.py", "--tokens", request.param), "tokens": request.param}


@pytest.fixture(scope="module")
def fused():
    return _run("_sglang_jax_runner.py", "--fused")


@pytest.fixture(scope="module")
def fused_window():
    return _run("_sglang_jax_runner.py", "--fused", "--coverage-window", "1")


@pytest.fixture(scope="module")
def hicache():
    return _run("_sglang_jax_hicache.py")


def _fault(report, name):
    (entry,) = [f for f in report["faults"] if f["fault"] == name]
    return entry["step"]


def test_dp_one_canary_per_rank_over_its_own_slots(dp):
    assert dp["kv_spec"] == "P('data', None, 'tensor', None, None)"
    assert (dp["dp_size"], dp["num_shards"], dp["axes"]) == (2, 2, ["data", "tensor"])
    assert dp["num_slots"] * 2 == dp["kv_shape"][0] * dp["kv_shape"][1]  # rank-local slots
    # Both ranks hand out the same slot numbers: one canary for both could not tell them apart.
    assert dp["r1_slots"][:5] == dp["r2_slots"] == [1, 2, 3, 4, 5]
    assert dp["r3_prefix_len"] == 8 and dp["prefixes_per_rank"] == [2, 1]
    # Rank 1's decode token sits at its segment's fixed stride (the batch padded per rank).
    assert dp["replay"]["out_cache_loc"][2] > 0 and dp["replay"]["positions"][2] > 0


def test_dp_clean_life_is_silent(dp):
    assert [step["new_violations"] for step in dp["life"]] == [[]] * len(dp["life"])
    assert dp["sweep_clean"] == [] and dp["total_violations_live"] == [0, 0]
    assert _fault(dp, "clean replay") == []


def test_dp_fault_reported_by_its_rank_only(dp):
    f0, f1 = dp["flip_r3"], dp["flip_r2"]
    assert _rows(_fault(dp, "flip K byte rank 0")) == [
        (0, "TAIL_K_FULL", f0["slot"], f0["position"], REAL_KV)]
    assert _rows(_fault(dp, "flip K byte rank 1")) == [
        (1, "TAIL_K_FULL", f1["slot"], f1["position"], REAL_KV)]
    stale = dp["stale"]  # rank 1's position 1 named a slot holding its position 3
    successor = dp["r2_slots"][2]
    want = []
    for tag in ("HEAD_K_FULL", "TAIL_K_FULL"):
        want.append((1, tag, stale["slot"], 3, ("VERIFY_CHAIN_HASH_MISMATCH",
                                                "VERIFY_POSITION_MISMATCH",
                                                "VERIFY_TOKEN_MISMATCH")))
        want.append((1, tag, successor, 2, ("VERIFY_CHAIN_HASH_MISMATCH",)))
    assert _rows(_fault(dp, "wrong cache_loc entry rank 1")) == sorted(want)
    wrong = dp["wrong_input"]
    found = _fault(dp, "input id not the request's rank 0")
    assert _rows(found) == [(0, tag, wrong["slot"], wrong["position"], ("WRITE_TOKEN_MISMATCH",))
                            for tag in ("HEAD_K_FULL", "TAIL_K_FULL")]
    assert {(v["token"], v["expected_token"]) for v in found} == {(wrong["token"],
                                                                   wrong["right"])}


def test_dp_sweep_per_rank(dp):
    sf = dp["sweep_fault"]
    assert _rows(sf["found"]) == [(1, "SWEEP_K_FULL", sf["slot"], sf["position"], REAL_KV)]


def test_fused_decode_step_is_guarded(fused):
    """``forward_and_sample`` with the hook installed: the same tokens and KV as sglang-jax
    alone (the last two steps fused, the last with future placeholders the canary resolves: its
    write input check passes), and a flipped K byte found by a fused step's TAIL verify."""
    assert fused["version"] == "0.1.0rc0" and fused["fused_guarded"]
    plain, guarded = fused["plain_steps"], fused["guarded_steps"]
    assert [s["next_ids"] for s in guarded[:4]] == [s["next_ids"] for s in plain]
    assert fused["guarded_kv"] == fused["plain_kv"]
    assert [s["violations"] for s in guarded[:4]] == [[]] * 4
    flip = fused["flip"]
    assert _rows(guarded[4]["violations"]) == [
        (0, "TAIL_K_FULL", flip["slot"], flip["position"], REAL_KV)]
    assert fused["uninstalled"]


def test_fused_decode_step_with_the_coverage_window(fused_window):
    """The fused step guarded with a coverage window hands the canary every layer of its pool
    updates: tokens and KV as sglang-jax alone, and a bit flipped in the last layer's V of head
    1 reported by a fused step's digest check, on the shard holding head 1."""
    run = fused_window
    assert run["fused_guarded"] and run["flip"]["layer"] == 1
    assert [s["next_ids"] for s in run["guarded_steps"][:4]] == [
        s["next_ids"] for s in run["plain_steps"]]
    assert run["guarded_kv"] == run["plain_kv"]
    assert [s["violations"] for s in run["guarded_steps"][:4]] == [[]] * 4
    flip = run["flip"]
    assert _rows(run["guarded_steps"][4]["violations"]) == [
        (1, "TAIL_K_FULL", flip["slot"], flip["position"], ("KV_DIGEST_MISMATCH",))]


def test_hicache_reload_of_an_intact_page_is_silent(hicache):
    for name in ("intact", "dp intact"):
        run = hicache[name]
        assert run["rows_backed_up"] == run["host_ids"]
        assert run["before_load"] == [] and run["after_load"] == []
        assert run["rows_after_evict"] == []  # evicted host pages drop their rows


def test_hicache_reload_of_a_corrupted_page_is_reported(hicache):
    """A bit flipped in the host copy of the page: the TAIL verify of each step reading the
    reloaded slot reports it (on the shard holding the head, of the page's DP rank)."""
    for name, shard in (("corrupted", 0), ("dp corrupted", 1)):
        run = hicache[name]
        slot, pos = run["corrupt_slot"], run["corrupt_position"]
        assert _rows(run["after_load"]) == [(shard, "TAIL_K_FULL", slot, pos, REAL_KV)] * 2


def test_hicache_reload_without_the_hook_leaves_the_canary_behind(hicache):
    """What the hook is for: the KV moved to other slots, the canary rows did not, so every
    reloaded slot fails its verify although its bytes are intact."""
    run = hicache["no hook"]
    assert run["before_load"] == []
    flagged = {v["slot"] for v in run["after_load"]}
    assert set(run["new_slots"]) <= flagged


def test_hicache_reload_carries_the_page_s_digests(hicache):
    """With a coverage window of 2 the page's digests travel with it: an intact reload is
    silent and every reloaded slot read since is verified (no gap: the report's share is 1), and
    a bit flipped in host memory in layer 1's V strip of head 1 (bytes SGLang's fingerprint of
    layer 0's K never reads) is reported once, within the window, by the digest check of the
    shard holding head 1 (of the page's DP rank)."""
    intact = hicache["coverage intact"]
    assert intact["before_load"] == [] and intact["after_load"] == []
    assert intact["coverage"]["live"] == intact["coverage"]["verified"] > 0
    for name in ("coverage corrupted", "coverage dp corrupted"):
        run = hicache[name]
        slot, pos = run["corrupt_slot"], run["corrupt_position"]
        assert run["before_load"] == []
        assert _rows(run["after_load"]) == [(1, "TAIL_K_FULL", slot, pos,
                                             ("KV_DIGEST_MISMATCH",))], name
        assert run["coverage"]["live"] == run["coverage"]["verified"] > 0, name
