"""Single-bit flips in every layer's K and V of live slots, used or cached, in sglang-jax's own
pools (tests/_sglang_jax_coverage.py, one process per life: the 2-device CPU mesh needs
XLA_FLAGS before JAX starts), with the coverage window on: each flip is reported at the first
check the stated rule gives it (docs/spec.md §17.3), by the KV shard holding its head, and a
clean life reports nothing with every live KV byte verified.

The lives, on the installed version (0.0.2 in the Python 3.12 leg, 0.1.0rc0 in its command):
tensor parallel over 2 devices (each shard digests its own head of every layer) in 0.0.2's
``[slots, 2H, D]`` layout and the paged ``[pages, page_size, 2H/packing, packing, D]`` one (the
stand-in on 0.0.2, the real pool on 0.1.0rc0), and on 0.1.0rc0 data parallel over 2 ranks. Each
flip's check is predicted on the host from what the steps read (each shard's verify plan) and
what the sweeps walked, with the phase rule ``slot % window == step % window`` (the paged
life tells the canary its sweep runs every window, so the steps leave it the slots it checked:
docs/spec.md §17.2), so a layer, a half, a shard or a share of the window left unchecked fails
here: the flip is missed, found by another shard, or found at another step than its first
check."""

from __future__ import annotations

import collections
import importlib.metadata
import json
import os
import pathlib
import subprocess
import sys

import pytest

import _tier

pytestmark = [pytest.mark.sglang_jax, pytest.mark.fuzz]

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent


def _installed() -> str | None:
    try:
        return importlib.metadata.version("sglang-jax")
    except importlib.metadata.PackageNotFoundError:
        return None


VERSION = _installed()
V01 = VERSION is not None and not VERSION.startswith("0.0.")
STEPS = _tier.n(56, 240)
MIN_FOUND = _tier.n(200, 800)
# name -> (arguments, canary shards, head shards per rank)
LIVES = {
    "tp2-slots-layout-page1": (("--page-size", "1", "--kv-write", "legacy", "--tokens", "feed",
                                "--window", "3", "--sweep", "5", "--seed", "7"), 2, 2),
}
if V01:
    LIVES["tp2-paged-layout-page4"] = (
        ("--page-size", "4", "--pool-size", "80", "--kv-write", "legacy", "--tokens", "full",
         "--window", "4", "--sweep", "4", "--leave-to-sweep", "--seed", "8"), 2, 2)
    LIVES["dp2-page1"] = (("--dp", "2", "--kv-write", "kernel", "--tokens", "feed",
                           "--window", "2", "--sweep", "4", "--seed", "9"), 2, 1)
else:  # 0.0.2's world with the paged layout's stand-in pool
    LIVES["tp2-paged-layout-page4"] = (
        ("--page-size", "4", "--pool-size", "80", "--layout", "head", "--kv-write", "head",
         "--tokens", "full", "--window", "4", "--sweep", "4", "--leave-to-sweep", "--seed",
         "8"), 2, 2)


@pytest.fixture(scope="module", params=list(LIVES))
def life(request):
    args, shards, head_shards = LIVES[request.param]
    _tier.seeded(f"sglang-jax coverage flips {request.param}", args[args.index("--seed") + 1],
                 STEPS)
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    proc = subprocess.run([sys.executable, str(HERE / "_sglang_jax_coverage.py"), *args,
                           "--steps", str(STEPS)], capture_output=True, text=True, env=env,
                          timeout=1200, cwd=ROOT)
    assert proc.returncode == 0, f"{request.param} failed:\n{proc.stderr[-6000:]}"
    return {**json.loads(proc.stdout), "name": request.param, "shards": shards,
            "head_shards": head_shards}


def _problems(run: dict) -> list:
    """Every way a life broke the rule, one entry each (empty: it held)."""
    out = [("false alarm", r) for r in run["false_alarms"]]
    out += [("reported by another shard", r) for r in run["wrong_shard"]]
    out += [("unexpected ring row", r) for r in run["other_rows"]]
    out += [("TAIL checked other entries than its phase's", r) for r in run["tail_checks"]]
    if run["ring_overflow"]:
        out.append(("ring overflow", None))
    for f in run["flips"]:
        if f["erased"] and f["detected"] is None:
            continue
        if f["detected"] != f["predicted"]:
            out.append(("found at another step than its first check", f))
    return out


def test_every_flip_is_found_at_its_first_check_by_its_shard(life):
    run, window = life["flips"], life["window"]
    assert (run["num_shards"], run["head_shards"], run["num_layers"]) == (
        life["shards"], life["head_shards"], 2)
    assert _problems(run) == []
    found = [f for f in run["flips"] if f["detected"] is not None]
    assert len(found) >= MIN_FOUND, (len(found), len(run["flips"]))
    # The campaign reached every layer, both halves, every shard (every head, every DP rank),
    # used and cached slots, TAIL and SWEEP checks and every phase of the window: each is a
    # place where a dropped check would show as a missed or late flip.
    assert {f["layer"] for f in found} == {0, 1}
    assert {f["half"] for f in found} == {"K", "V"}
    assert {f["shard"] for f in found} == set(range(life["shards"]))
    assert {f["kind"] for f in found} == {"used", "cached"}
    assert {f["detected"][1] for f in found} == {"TAIL", "SWEEP"}
    if life["leave_to_sweep"]:
        # The canary knows the sweep runs every window: the steps left it read slots it checked
        # (and still check the tokens decoded since, which the radix cache does not hold).
        assert life["sweep"] == window and run["left_to_sweep"] > 0
    assert {f["slot"] % window for f in found if f["detected"][1] == "TAIL"} == set(
        range(window))
    for f in found:
        # The stated bound, independently of the predictions: no run of `window` consecutive
        # reads of the slot ends before the flip is found.
        reads = set(f["reads"])
        assert not any(all(s in reads for s in range(start, start + window))
                       for start in reads if start + window - 1 < f["detected"][0]), f


def test_a_clean_life_reports_nothing_and_verifies_every_live_byte(life):
    """No flip: no ring row, nothing reported to the manager, and at every step the manager's
    coverage report (through ``observe``) has every live KV byte verified."""
    run = life["clean"]
    assert _problems(run) == [] and run["digest_rows"] == []
    assert run["manager_digest_rows"] == [] and run["manager_other_reports"] == 0
    assert len(run["shares"]) >= 10 and set(run["shares"]) == {1.0}, run["shares"]
    assert run["stats_lines"] and all("coverage_window=%d coverage=100.00%%" % life["window"]
                                      in line for line in run["stats_lines"])


def test_the_manager_reports_exactly_the_digest_rows(life):
    """The manager (``canary_manager`` observing each step, read one step late) hands
    ``on_violation`` every digest row the shards' rings hold, each once, with its shard."""
    run = life["flips"]
    ring = collections.Counter(tuple(r[:3]) for r in run["digest_rows"])
    reported = collections.Counter(tuple(r[:3]) for r in run["manager_digest_rows"])
    assert ring and reported == ring
    assert all(r[3] == ["KV_DIGEST_MISMATCH"] for r in run["manager_digest_rows"])
